"""Two time-shared NeMo RL runs on one control plane (issue #6 conformance): real ``async_grpo_train`` (patched)
on NeMo RL's own mocks, our hooks through the real entry point, one real control plane, one Ray cluster.

The scenario lives in ``inside_nemo/test_rlix_two_pipelines.py`` and runs inside the patched copy with NeMo RL's
pytest and fixtures; it starts each pipeline's driver as its own process (NeMo RL's pytest on ``test_driver``),
joined to the private Ray head (4 GPUs declared) of this run. Topology = the 2-GPU recipe pair (A trains on
GPU 0, B on GPU 1, both generate on GPUs 0 and 1). The mocks carry stand-in worker groups (no vLLM / Megatron in
the conformance venv), so the FULL runtime runs: rollout ranks slept and woken, weights cached, sent over the real
transport and verified. It asserts:

* ``test_two_pipelines_time_share``: a training grant of one pipeline preempts (shrinks) the other's GENERATION
  ranks (control-plane trace), never two clusters on one GPU, each pipeline's versions published in order with
  no double bump (and the engines hold exactly the synced weights), both finish, nothing allocated at the end;
* ``test_killed_driver_leaves_the_other_finishing``: B's driver SIGKILLed mid-step while holding its training
  GPU: B's GPUs are returned, A's rollout retakes GPU 1, A finishes, nothing allocated at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nemo_rl._nemo_checkout import report, run_inside_nemo

pytestmark = [pytest.mark.nemo_rl, pytest.mark.slow]

EXPECTED = {
    "test_driver": "skipped",  # only as a driver subprocess (its spec in the environment)
    "test_two_pipelines_time_share": "passed",
    "test_killed_driver_leaves_the_other_finishing": "passed",
}


@pytest.mark.timeout(1000)
def test_two_async_grpo_pipelines_share_gpus(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    measured = tmp_path / "measured.txt"  # the scenarios' one-line summaries (preemptions, recovery times)
    run = run_inside_nemo(nemo_copies["patched"], "test_rlix_two_pipelines.py", "tests/unit/algorithms",
                        tmp_path / "two.xml", timeout_s=900, num_gpus=4, extra_env={"RLIX_MEASURED": str(measured)})
    lines = measured.read_text().strip().replace("\n", "; ") if measured.exists() else "no measurements"
    report(f"NeMo RL two time-shared async_grpo_train pipelines: {run.summary()} ({lines})")
    got = {name.rsplit("::", 1)[-1]: outcome for name, outcome in run.outcomes.items()}
    assert got == EXPECTED, f"{got}\noutput tail:\n{run.output_tail}"
