"""Standalone NeMo RL is unchanged: its own CPU unit tests pass identically on the pristine and the patched copy.

``RLIX_CONTROL_PLANE`` is unset in both runs. Pass/fail sets are compared test by test, so a test the patch
breaks (or one that only passes with it) fails this suite even when totals match.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nemo_rl._nemo_checkout import report, run_nemo_pytest

pytestmark = pytest.mark.nemo_rl

#: Async GRPO, vLLM DP-shard routing, fleet health, weight sync: the code the patch touches or relies on.
QUICK_TARGETS = [
    "tests/unit/algorithms/test_grpo.py",
    "tests/unit/models/generation/test_vllm_shard_selection.py",
    "tests/unit/models/generation/test_fleet_health.py",
    "tests/unit/weight_sync/",
]
#: The loops of the second patch part (``loops/``): the SingleController and the TransferQueue data plane
#: (``grpo_train_sync`` itself runs in ``test_grpo.py`` above). Without TransferQueue installed some of them fail the
#: same way on both copies (2026-11-24: 489 passed, 12 failed, 6 skipped each); outcomes are compared test by test.
#: ``test_watchdog_pump.py::TestEnvHealthCheck::test_a_healthy_environment_passes`` (1 ms ticks) hangs now and then
#: on a loaded machine on either copy (3 runs each: pristine failed 1, patched 2): ``_compare`` reruns what differs.
LOOPS_TARGETS = ["tests/unit/single_controller/", "tests/unit/data_plane/"]
#: The async utilities (trajectory collector, replay buffer): ~8 minutes per run on 2 cores.
SLOW_TARGETS = ["tests/unit/algorithms/test_async_utils.py"]


def _compare(nemo_copies: dict[str, Path], targets: list[str], tmp_path: Path, timeout_s: float) -> None:
    absent = [t for t in targets if not (nemo_copies["pristine"] / t).exists()]
    if absent:  # code this NeMo RL version does not have (v0.7.0: no SingleController, no fleet health)
        report(f"NeMo RL at this version has no {absent}: not compared")
    targets = [t for t in targets if t not in absent]
    if not targets:
        pytest.skip(f"this NeMo RL version has none of {absent}")
    runs = {
        name: run_nemo_pytest(nemo_copies[name], targets, tmp_path / f"{name}.xml", timeout_s=timeout_s)
        for name in ("pristine", "patched")
    }
    pristine, patched = runs["pristine"], runs["patched"]
    report(f"NeMo RL {targets}: pristine {pristine.summary()} | patched {patched.summary()}")
    assert pristine.outcomes, f"no tests collected; pristine output:\n{pristine.output_tail}"
    seen = {name: {t: {o} for t, o in run.outcomes.items()} for name, run in runs.items()}
    differ = sorted(t for t in set(pristine.outcomes) | set(patched.outcomes)
                    if pristine.outcomes.get(t) != patched.outcomes.get(t))
    # A test that differs runs twice more on each copy; it is the patch's doing only if the copies never agree.
    nodes = {t: node for t in differ if (node := _node_id(nemo_copies["pristine"], t)) is not None}
    for attempt in range(2 if nodes else 0):
        for name in ("pristine", "patched"):
            rerun = run_nemo_pytest(nemo_copies[name], sorted(set(nodes.values())),
                                    tmp_path / f"{name}-rerun{attempt}.xml", timeout_s=timeout_s)
            for t, o in rerun.outcomes.items():
                seen[name].setdefault(t, set()).add(o)
    flaky = [t for t in differ if seen["pristine"].get(t, set()) & seen["patched"].get(t, set())]
    if flaky:
        report(f"NeMo RL {targets}: flaky on both copies (outcomes over 3 runs each): "
               + "; ".join(f"{t}: pristine {sorted(seen['pristine'][t])}, patched {sorted(seen['patched'][t])}"
                           for t in flaky))
    differ = [f"{t}: pristine={pristine.outcomes.get(t, 'absent')} patched={patched.outcomes.get(t, 'absent')}"
              for t in differ if t not in flaky]
    assert not differ, "standalone NeMo RL changed under the patch:\n" + "\n".join(differ) + (
        f"\npatched output tail:\n{patched.output_tail}"
    )


def _node_id(copy: Path, test: str) -> str | None:
    """``tests.unit.pkg.test_mod.Class::name`` (a junit id) -> ``tests/unit/pkg/test_mod.py::Class::name``."""
    dotted, _, name = test.partition("::")
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (copy / module).is_file():
            return "::".join([str(module), *parts[cut:], name])
    return None


@pytest.mark.timeout(2600)
def test_quick_unit_tests_identical(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    _compare(nemo_copies, QUICK_TARGETS, tmp_path, timeout_s=1200)


@pytest.mark.slow
@pytest.mark.timeout(3700)
def test_async_utils_identical(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    _compare(nemo_copies, SLOW_TARGETS, tmp_path, timeout_s=1800)


@pytest.mark.timeout(2600)
def test_loops_unit_tests_identical(nemo_copies: dict[str, Path], tmp_path: Path) -> None:
    _compare(nemo_copies, LOOPS_TARGETS, tmp_path, timeout_s=1200)
