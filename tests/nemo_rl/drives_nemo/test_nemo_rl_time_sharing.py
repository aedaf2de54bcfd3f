"""Time-sharing mode end to end on NeMo RL's own mocks: real entry point, real hooks, real control plane on Ray.

The scenario lives in ``inside_nemo/test_rlix_async_grpo.py`` and runs inside the patched copy with NeMo RL's
pytest and fixtures (``mock_grpo_components``, ``mock_async_grpo_infrastructure``): 3 steps of
``async_grpo_train`` with validation and two checkpoints. It asserts, per step, that the scheduler holds the
training GPUs from log-prob inference through the publish of the new version, that the cache-build hook runs
before the offload, that the release comes after the publish, that the loop never refits / prepares / finishes
generation, that versions go 0, 1, 2, 3, and that the run ends unregistered with nothing allocated. A standalone
run in the same file proves the variable-unset path imports nothing of rlix_plugins.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._repo import REPO
from tests.nemo_rl._nemo_checkout import INSIDE_NEMO, report, run_inside_nemo, run_nemo_pytest

pytestmark = pytest.mark.nemo_rl

EXPECTED = {
    "test_standalone_loads_nothing_of_rlix",
    "test_time_sharing_hook_order_with_real_control_plane",
    "test_full_mode_resumed_run_progress_versions_and_logged_metrics",
    "test_full_mode_own_rollout_keeps_generating_beside_its_step",
    "test_full_mode_trainer_kept_on_the_gpu_is_never_offloaded",
}


@pytest.mark.timeout(1000)
def test_async_grpo_time_sharing_on_nemo_rl_mocks(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    run = run_inside_nemo(nemo_copies["patched"], "test_rlix_async_grpo.py", "tests/unit/algorithms",
                        tmp_path / "ts.xml", timeout_s=800, num_gpus=4)
    report(f"NeMo RL async_grpo_train time-sharing scenario: {run.summary()}")
    got = {name.rsplit("::", 1)[-1]: outcome for name, outcome in run.outcomes.items()}
    assert got == dict.fromkeys(EXPECTED, "passed"), f"{got}\noutput tail:\n{run.output_tail}"


ROUTING = INSIDE_NEMO / "test_rlix_vllm_routing.py"
ROUTING_EXPECTED = {
    "test_routes_over_active_ranks_only",
    "test_pickled_copy_sees_resizes",
    "test_blocks_while_no_rank_is_active",
    "test_waiting_for_a_rank_never_blocks_the_event_loop",
    "test_request_aborted_by_a_shrink_is_retried_on_another_active_rank",
    "test_a_shrink_drains_while_every_executor_thread_waits_for_its_grant",
    "test_a_cancelled_request_hands_its_ticket_back",
    "test_a_request_aborted_on_every_attempt_fails_and_leaves_no_ticket_out",
    "test_without_the_variable_the_seam_is_inert",
    "test_fleet_sleep_passes_the_configured_level_to_the_real_worker",
    "test_token_only_requests_where_no_stop_string_needs_text",
}


@pytest.mark.timeout(700)
def test_router_selector_on_the_real_vllm_generation(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    """Our fleet selector + router on NeMo RL's real VllmGeneration (patched; built like its shard-selection tests):
    routing over active ranks only, the collector's pickled copy, blocking when none is active, retry of a request
    a shrink aborted (patch 0004), a drain that needs no executor thread, tickets of cancelled requests and of requests out of attempts back, no retry with the variable unset; our fleet's sleep level reaching NeMo RL's
    real (patched) sleep_async per call, and token-only requests from its real generate_async (patch 0003)."""
    patched = nemo_copies["patched"]
    dst = patched / "tests" / "unit" / "models" / "generation" / ROUTING.name
    shutil.copyfile(ROUTING, dst)
    try:
        run = run_nemo_pytest(patched, [str(dst.relative_to(patched))], tmp_path / "routing.xml", timeout_s=600)
    finally:
        dst.unlink()
    report(f"NeMo RL VllmGeneration routing through the rlix router: {run.summary()}")
    got = {name.rsplit("::", 1)[-1]: outcome for name, outcome in run.outcomes.items()}
    assert got == dict.fromkeys(ROUTING_EXPECTED, "passed"), f"{got}\noutput tail:\n{run.output_tail}"


SETUP = INSIDE_NEMO / "test_rlix_setup_placement.py"
RECIPES = REPO / "recipes" / "nemo_rl"
SETUP_EXPECTED = {
    "test_standalone_setup_builds_its_own_clusters_and_static_world",
    "test_two_pipelines_share_per_gpu_groups_under_unique_names",
    "test_tensor_parallel_ranks_share_one_block_through_nemo_rls_worker_group",
}


@pytest.mark.timeout(700)
def test_setup_places_two_pipelines_in_shared_groups(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    """NeMo RL's patched setup() (patch 0002's placement seam): unset, its own clusters, default actor names and the
    static refit world; with RLIX_CONTROL_PLANE=rlix, two pipelines from our recipes in one process get the pool's
    per-GPU placement groups, fractional workers and per-pipeline actor names (real RayWorkerGroup workers)."""
    patched = nemo_copies["patched"]
    recipes = patched / "examples" / "configs" / "rlix"
    shutil.copytree(RECIPES, recipes)
    try:
        run = run_inside_nemo(patched, SETUP.name, "tests/unit/algorithms", tmp_path / "setup.xml", timeout_s=600,
                            num_gpus=4, helpers=("rlix_ray_fixtures.py",))
    finally:
        shutil.rmtree(recipes)
    report(f"NeMo RL setup() shared placement: {run.summary()}")
    got = {name.rsplit("::", 1)[-1]: outcome for name, outcome in run.outcomes.items()}
    assert got == dict.fromkeys(SETUP_EXPECTED, "passed"), f"{got}\noutput tail:\n{run.output_tail}"
