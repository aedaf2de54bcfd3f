"""NemoRLHooks against the real control plane on the session's Ray cluster, and the real seam file (taken from
patch 0001) loading it through the installed entry point. Runs in CI: no NeMo RL checkout needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.errors import RlixConfigError, RlixError
from rlix_plugins.nemo_rl.config import load_run_config
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from tests.nemo_rl._nemo_checkout import seam_from_patch


class FakePolicy:
    """Stands in for NeMo RL's Policy (cannot exist here); records what the hooks ask of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def offload_after_refit(self) -> None:
        self.calls.append("offload_after_refit")


def _config(**rlix: Any) -> dict[str, Any]:
    """A config that passes the topology check (async GRPO, non-colocated async vLLM, IS correction)."""
    section = {"train_devices": [2], "infer_devices": [2, 3], "request_timeout_s": 60, **rlix}
    return {
        "rlix": section,
        "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {"megatron_cfg": {"enabled": True}, "generation": {
            "backend": "vllm", "colocated": {"enabled": False},
            "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
    }


def _train_allocated(cp: Any, pid: str) -> bool:
    return any(a["pipeline_id"] == pid and c.endswith("actor_train") for c, a in cp.status()["allocations"].items())


def test_step_cycle_on_real_control_plane(ray_cluster: dict[str, float]) -> None:
    from rlix_plugins.control import client

    cp = client.connect()
    hooks, policy = NemoRLHooks(), FakePolicy()
    hooks.rlix_pipeline_start(master_config=_config(), policy=policy, policy_generation=object(), start_step=0)
    pid = hooks.pipeline_id
    assert pid is not None and cp.status()["pipelines"][pid]["admitted"]
    hooks.on_trajectory_collector_created(collector=object(), replay_buffer=None)
    try:
        for step in range(2):
            assert not _train_allocated(cp, pid)
            hooks.before_training(step=step)
            assert _train_allocated(cp, pid) and hooks.holds_training_gpus
            hooks.before_weight_sync(step=step)
            assert hooks.after_training(step=step) == step + 1  # the version rule: N + 1, never -1
            assert _train_allocated(cp, pid), "released before the version was published"
            hooks.on_weight_version_published(step=step, weight_version=step + 1)
            assert not _train_allocated(cp, pid)
        hooks.before_checkpoint(step=1)
        assert _train_allocated(cp, pid)
        hooks.after_checkpoint(step=1)
    finally:
        hooks.on_pipeline_end()
    hooks.on_pipeline_end()  # idempotent
    assert policy.calls == ["offload_after_refit"] * 2
    assert pid not in cp.status()["pipelines"]
    names = [e.name for e in hooks.history]
    assert names[0] == "registered" and names[-1] == "ended"
    assert [e.name for e in hooks.history if e.step == 0] == [
        "train_granted", "weights_on_gpu", "offloaded", "published", "train_released"]


def test_end_while_holding_releases_and_unregisters(ray_cluster: dict[str, float]) -> None:
    """A run that fails mid-step (the finally calls on_pipeline_end) leaves nothing allocated."""
    from rlix_plugins.control import client

    cp = client.connect()
    hooks = NemoRLHooks()
    hooks.rlix_pipeline_start(master_config=_config(), policy=FakePolicy(), policy_generation=None, start_step=3)
    pid = hooks.pipeline_id
    assert pid is not None
    hooks.before_training(step=3)
    hooks.on_pipeline_end()
    status = cp.status()
    assert pid not in status["pipelines"] and not _train_allocated(cp, pid)
    with pytest.raises(RlixError, match="before rlix_pipeline_start"):
        hooks.before_training(step=4)


def test_weight_sync_without_training_gpus_is_an_error(ray_cluster: dict[str, float]) -> None:
    hooks = NemoRLHooks()
    hooks.rlix_pipeline_start(master_config=_config(), policy=FakePolicy(), policy_generation=None, start_step=0)
    try:
        with pytest.raises(RlixError, match="without the training GPUs"):
            hooks.before_weight_sync(step=0)
    finally:
        hooks.on_pipeline_end()


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({}, "has no 'rlix' section"),
        ({"rlix": {"infer_devices": [0]}}, r"rlix\.train_devices is missing"),
        ({"rlix": {"train_devices": [0], "infer_devices": "0,1"}}, "non-empty list of GPU ids"),
        ({"rlix": {"train_devices": [0], "infer_devices": [0], "infer_tp": 0}}, "positive int"),
        ({"rlix": {"train_devices": [0], "infer_devices": [0], "trian": 1}}, r"unknown rlix keys \['trian'\]"),
    ],
)
def test_config_errors_name_the_key(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(RlixConfigError, match=match):
        load_run_config(cfg)


def test_config_reads_pydantic_extra_and_vllm_tp() -> None:
    class Master:  # NeMo RL's MasterConfig keeps unknown sections in model_extra
        policy = {"generation": {"vllm_cfg": {"tensor_parallel_size": 2}}}
        model_extra = {"rlix": {"train_devices": [0, 1], "infer_devices": [0, 1, 2, 3]}}

    cfg = load_run_config(Master())
    assert (cfg.train_devices, cfg.infer_devices, cfg.infer_tp) == ((0, 1), (0, 1, 2, 3), 2)


_LOAD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("rlix_hooks", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
hooks = mod.load_rlix_hooks()
if hooks is None:
    print("NONE", sorted(m for m in sys.modules if m.startswith(("rlix_plugins", "pluggy"))))
else:
    pm = hooks.plugin_manager
    pm.check_pending()
    print("PLUGIN", type(pm.get_plugin("rlix")).__module__, sorted(h for h in vars(mod.RLixHookSpec) if not h.startswith("_")) == sorted(mod.HOOK_NAMES))
    print("FIRSTRESULT", sorted(n for n in mod.HOOK_NAMES if getattr(pm.hook, n).spec.opts["firstresult"]))
    print("PLACEMENT_IMPLS", [type(i.plugin).__module__ for i in pm.hook.rlix_placement.get_hookimpls()])
    import pluggy
    impl = pluggy.HookimplMarker(mod.PROJECT_NAME)
    class Bootstrap:
        @impl(tryfirst=True)
        def after_training(self, step):
            return -1
    pm.register(Bootstrap())
    try:
        hooks.after_training(step=6)
    except RuntimeError as e:
        print("REJECTED", "never the bootstrap version -1" in str(e))
"""


@pytest.mark.parametrize("value", ["rlix", None])
def test_real_seam_loads_our_hooks_through_the_entry_point(tmp_path: Path, value: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RLIX_CONTROL_PLANE"}
    if value is not None:
        env["RLIX_CONTROL_PLANE"] = value
    # cwd=tmp_path: a stale rlix_plugins.egg-info in the repo root would shadow the installed entry points.
    out = subprocess.run([sys.executable, "-c", _LOAD, str(seam_from_patch(tmp_path))], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if value is None:
        assert out.stdout.strip() == "NONE []"
    else:
        assert "PLUGIN rlix_plugins.nemo_rl.hooks True" in out.stdout
        assert "REJECTED True" in out.stdout  # the seam never lets -1 reach the collector
        # setup()'s placement hook: first result (one answer), answered by our implementation
        assert "FIRSTRESULT ['after_training', 'rlix_placement']" in out.stdout
        assert "PLACEMENT_IMPLS ['rlix_plugins.nemo_rl.hooks']" in out.stdout


def test_run_that_raises_is_listed_as_failed_with_its_error(ray_cluster: dict[str, float]) -> None:
    """The loop raised: ``on_pipeline_end`` runs in its ``finally`` while the exception propagates, so the pipeline
    leaves as failed and ``rlix status`` names the error; nothing stays allocated."""
    from rlix_plugins.control import client

    cp = client.connect()
    hooks = NemoRLHooks()
    hooks.rlix_pipeline_start(master_config=_config(), policy=FakePolicy(), policy_generation=None, start_step=0)
    pid = hooks.pipeline_id
    assert pid is not None
    hooks.before_training(step=0)
    with pytest.raises(ValueError, match="loss is NaN"):
        try:
            raise ValueError("loss is NaN at step 0")
        finally:
            hooks.on_pipeline_end()
    status = cp.status()
    assert pid not in status["pipelines"] and not _train_allocated(cp, pid)
    assert "ValueError: loss is NaN at step 0" in status["failed"][pid]["reason"]
