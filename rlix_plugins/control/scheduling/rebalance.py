"""When the scheduler runs a cycle without being asked: the rebalance trigger of its poll (pure, no Ray)."""

from __future__ import annotations

import math

from rlix_plugins.control.scheduling.gap_ratio import generation_demands
from rlix_plugins.control.types import Priority, SchedulerSnapshot


def demand(snapshot: SchedulerSnapshot) -> dict[str, int]:
    """Remaining rollout work per pipeline with an eligible generation cluster: the planner's own demand
    (``gap_ratio.generation_demands``, one rule for both), keyed by pipeline instead of cluster."""
    nongen = {cid for cid, a in snapshot.allocations.items() if a.priority != Priority.GENERATION}
    active = {cid for cid, a in snapshot.allocations.items() if a.priority == Priority.GENERATION and a.active_dp_ranks}
    return {snapshot.clusters[cid].pipeline_id: d for cid, d in generation_demands(snapshot, nongen, active).items()}


def rebalance_reason(snapshot: SchedulerSnapshot, drift_threshold: float) -> str | None:
    """Why a poll-triggered cycle should run now, or None (reference: ``_central_scheduling_loop``).

    Over the pipelines the planner would serve (:func:`demand`):

    * a generation cluster with demand but no active rank (suspended: nothing else wakes it);
    * among the least-complete half of the pipelines with demand, a pipeline's active generation GPUs differ from
      its fair share (its share of remaining work x TP, times the active generation GPUs of those pipelines) by at
      least ``drift_tolerance(fair, tp, drift_threshold)`` GPUs: relative to its own share, so the rule means the
      same on 4 GPUs and on 2,048 (an absolute share of the pool would tolerate 200 GPUs of drift there).
    """
    work = demand(snapshot)
    gen_of = {s.pipeline_id: s for s in snapshot.clusters.values() if s.is_generation}
    active: dict[str, int] = {}
    for pid in work:
        alloc = snapshot.allocations.get(gen_of[pid].cluster_id)
        active[pid] = len(alloc.gpus) if alloc is not None and alloc.priority == Priority.GENERATION else 0
    for pid, w in sorted(work.items()):
        if w > 0 and not active[pid]:
            return f"{gen_of[pid].cluster_id} is suspended with {w} trajectories left"
    weights = {pid: w * gen_of[pid].tp_size for pid, w in work.items() if w > 0}
    total_w = sum(weights.values())
    total_g = sum(active[pid] for pid in weights)
    if total_w <= 0 or total_g <= 0 or len(weights) < 2:
        return None
    frac_done = {
        pid: 1.0 - (snapshot.progress[pid].remaining / max(snapshot.progress[pid].step_target, 1))
        if pid in snapshot.progress else 0.0
        for pid in weights
    }
    least = sorted(weights, key=lambda p: (frac_done[p], p))[: max(1, math.ceil(len(weights) / 2))]
    for pid in least:
        fair = weights[pid] / total_w * total_g
        drift = active[pid] - fair
        tolerance = drift_tolerance(fair, gen_of[pid].tp_size, drift_threshold)
        if abs(drift) >= tolerance:
            return (f"{pid} holds {active[pid]} rollout GPUs against a fair share of {fair:.1f} "
                    f"({drift:+.1f} GPUs, tolerance {tolerance:.1f})")
    return None


def drift_tolerance(fair_gpus: float, tp_size: int, drift_threshold: float) -> float:
    """GPUs of drift from a fair share of ``fair_gpus`` that trigger a rebalance: ``drift_threshold`` of that share,
    and at least one rank (``tp_size`` GPUs, the planner's unit: less than a rank of drift cannot be corrected)."""
    return max(float(tp_size), drift_threshold * fair_gpus)
