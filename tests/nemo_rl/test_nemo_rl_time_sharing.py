"""Time-sharing mode end to end on NeMo RL's own mocks: real entry point, real hooks, real control plane on Ray.

The scenario lives in ``nemo_side/test_rlix_async_grpo.py`` and runs inside the patched copy with NeMo RL's
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
from _nemo_checkout import report, run_nemo_pytest

pytestmark = pytest.mark.nemo_rl

NEMO_SIDE = Path(__file__).parent / "nemo_side" / "test_rlix_async_grpo.py"
EXPECTED = {
    "test_standalone_loads_nothing_of_rlix",
    "test_time_sharing_hook_order_with_real_control_plane",
}


@pytest.mark.timeout(1000)
def test_async_grpo_time_sharing_on_nemo_rl_mocks(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    patched = nemo_copies["patched"]
    dst = patched / "tests" / "unit" / "algorithms" / NEMO_SIDE.name
    shutil.copyfile(NEMO_SIDE, dst)
    try:
        run = run_nemo_pytest(patched, [str(dst.relative_to(patched))], tmp_path / "ts.xml", timeout_s=800,
                              num_gpus=4)
    finally:
        dst.unlink()
    report(f"NeMo RL async_grpo_train time-sharing scenario: {run.summary()}")
    got = {name.rsplit("::", 1)[-1]: outcome for name, outcome in run.outcomes.items()}
    assert got == dict.fromkeys(EXPECTED, "passed"), f"{got}\noutput tail:\n{run.output_tail}"
