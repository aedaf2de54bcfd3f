"""The rebalance trigger's drift rule is relative to each pipeline's fair share: the same at 4 GPUs and at 2,048."""

from __future__ import annotations

import pytest

from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.scheduling.rebalance import drift_tolerance, rebalance_reason
from rlix_plugins.control.types import Allocation, ClusterSpec, Priority, Progress, SchedulerSnapshot
from rlix_plugins.errors import RlixConfigError


def _snapshot(pool: int, held: list[int], left: list[int], tp: int = 1) -> SchedulerSnapshot:
    """Pipelines p0..pN on the whole pool; pipeline i holds ``held[i]`` GPUs (low ranks first, packed) and has
    ``left[i]`` trajectories to go, all equally far into their step (so every one is in the least-complete half)."""
    clusters: dict[str, ClusterSpec] = {}
    allocs: dict[str, Allocation] = {}
    progress: dict[str, Progress] = {}
    start = 0
    for i, (n, work) in enumerate(zip(held, left, strict=True)):
        spec = ClusterSpec(f"p{i}_actor_infer", f"p{i}", "actor_infer", tuple(range(pool)), tp)
        clusters[spec.cluster_id] = spec
        ranks = frozenset(range(start // tp, (start + n) // tp))
        allocs[spec.cluster_id] = Allocation(spec.cluster_id, Priority.GENERATION, spec.gpus_of(ranks), ranks)
        progress[f"p{i}"] = Progress(f"p{i}", 2 * work, work)
        start += n
    return SchedulerSnapshot(gpus=frozenset(range(pool)), gpus_per_node=8, clusters=clusters, allocations=allocs,
                             progress=progress)


def test_tolerance_is_a_share_of_the_fair_share_and_at_least_one_rank() -> None:
    assert drift_tolerance(2.0, 1, 0.1) == 1.0  # small pool: one rank is the least the planner can move
    assert drift_tolerance(2.0, 4, 0.1) == 4.0
    assert drift_tolerance(256.0, 1, 0.1) == pytest.approx(25.6)


def test_small_pool_one_rank_off_triggers_a_rebalance() -> None:
    # 4 GPUs, equal work: fair share 2 each. 2+2 is balanced; 3+1 is one rank off.
    assert rebalance_reason(_snapshot(4, [2, 2], [50, 50]), 0.1) is None
    reason = rebalance_reason(_snapshot(4, [3, 1], [50, 50]), 0.1)
    assert reason is not None and "p0 holds 3 rollout GPUs against a fair share of 2.0" in reason
    # less than a rank of drift cannot be corrected: fair 2.4 vs 2 held is no reason
    assert rebalance_reason(_snapshot(4, [2, 2], [60, 40]), 0.1) is None


def test_large_pool_drift_is_relative_not_an_absolute_share_of_the_pool() -> None:
    # 2,048 GPUs, 8 pipelines with equal work: fair share 256 each, tolerance 25.6 GPUs.
    balanced = [256] * 8
    assert rebalance_reason(_snapshot(2048, balanced, [100] * 8), 0.1) is None
    within = [276, 236, 256, 256, 256, 256, 256, 256]  # 20 GPUs off: within 10% of 256
    assert rebalance_reason(_snapshot(2048, within, [100] * 8), 0.1) is None
    # 100 GPUs off (39% of its share): an absolute 10% share of the pool (205 GPUs) would never have noticed
    skew = [356, 156, 256, 256, 256, 256, 256, 256]
    assert abs(156 / 2048 - 1 / 8) < 0.10  # the old rule's view
    reason = rebalance_reason(_snapshot(2048, skew, [100] * 8), 0.1)
    assert reason is not None and "p0 holds 356" in reason


def test_large_pool_with_tp_counts_ranks() -> None:
    # tp 4 on 2,048 GPUs, 2 pipelines: fair 1,024 each; 110 GPUs off is over 10%, 100 is not
    assert rebalance_reason(_snapshot(2048, [1024 + 100, 1024 - 100], [10, 10], tp=4), 0.1) is None
    assert rebalance_reason(_snapshot(2048, [1024 + 104, 1024 - 104], [10, 10], tp=4), 0.1) is not None


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, float("nan"), True, "0.1", None])
def test_drift_threshold_is_validated_with_a_clear_error(bad: object) -> None:
    with pytest.raises(RlixConfigError, match=r"SchedulerConfig\.drift_threshold=.* must be in \(0, 1\): the fraction"):
        SchedulerConfig(drift_threshold=bad)  # type: ignore[arg-type]
