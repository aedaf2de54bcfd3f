"""Pure helpers of the scheduler actor (no Ray): config, resize bookkeeping, rebalance trigger, status.

Kept apart from ``scheduler.py`` so they can be unit-tested without a cluster and so the actor module stays
a thin shell that executes plans.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlix_plugins.control.scheduling.gap_ratio import generation_demands
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    ExpandOp,
    Priority,
    SchedulerSnapshot,
    ShrinkOp,
)
from rlix_plugins.errors import RlixConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    """Timeouts and cadence of the scheduler actor. Only used when the actor is created."""

    #: One coordinator ``resize_infer`` call (lock wait + sleep/wake + weight sync) must return within this.
    #: Must exceed the coordinator's ``lock_timeout_s + handler_timeout_s``.
    resize_timeout_s: float = 400.0
    #: Background rebalance poll (debug #32: a suspended pipeline with demand must not starve).
    poll_interval_s: float = 1.0
    #: Liveness probe of every registered pipeline's coordinator (a dead one frees its pipeline's GPUs).
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    #: Default wait of ``request_gpus`` / ``await_release`` when the caller gives none.
    default_request_timeout_s: float = 1800.0
    #: Demand share vs GPU share difference (0..1) among the least-complete half that triggers a poll cycle.
    drift_threshold: float = 0.10
    #: After a non-generation cluster releases GPUs, rollout ranks are not woken on them for this long. Back-to-back
    #: training steps then keep their GPUs instead of paying a wake + weight sync + shrink per step (0 disables).
    release_grace_s: float = 2.0
    #: Consecutive non-empty cycles run back to back before falling back to the poll cadence.
    max_busy_cycles: int = 20
    trace_capacity: int = 100_000

    def __post_init__(self) -> None:
        for key in ("resize_timeout_s", "poll_interval_s", "health_interval_s", "health_timeout_s",
                    "default_request_timeout_s"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise RlixConfigError(f"SchedulerConfig.{key}={value!r} must be a positive finite number of seconds")
        if not (isinstance(self.release_grace_s, (int, float)) and 0 <= self.release_grace_s < math.inf):
            raise RlixConfigError(f"SchedulerConfig.release_grace_s={self.release_grace_s!r} must be >= 0 seconds")
        if not 0 < self.drift_threshold < 1:
            raise RlixConfigError(f"SchedulerConfig.drift_threshold={self.drift_threshold} must be in (0, 1)")
        if self.max_busy_cycles < 1 or self.trace_capacity < 1:
            raise RlixConfigError("SchedulerConfig.max_busy_cycles and trace_capacity must be >= 1")


def check_timeout(timeout_s: float | None, default: float, what: str) -> float:
    if timeout_s is None:
        return default
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise RlixConfigError(f"{what}: timeout_s={timeout_s!r} must be a positive finite number of seconds")
    return float(timeout_s)


def to_priority(priority: Any) -> Priority:
    try:
        return Priority(int(priority))
    except (TypeError, ValueError):
        names = ", ".join(f"{p.name}={p.value}" for p in Priority)
        raise RlixConfigError(f"unknown priority {priority!r}; valid: {names}") from None


def merge_ops(ops: Iterable[ShrinkOp | ExpandOp]) -> dict[str, tuple[int, ...]]:
    """DP ranks per cluster, merged over several ops of one kind (one ``resize_infer`` call per cluster)."""
    merged: dict[str, set[int]] = {}
    for op in ops:
        merged.setdefault(op.cluster_id, set()).update(op.dp_ranks)
    return {cid: tuple(sorted(ranks)) for cid, ranks in merged.items()}


def apply_shrink(alloc: Allocation, spec: ClusterSpec, ranks: Iterable[int]) -> Allocation:
    """``alloc`` after the given DP ranks went to sleep (used when only part of a plan was executed)."""
    ranks = frozenset(ranks)
    return Allocation(
        cluster_id=alloc.cluster_id,
        priority=alloc.priority,
        gpus=alloc.gpus - spec.gpus_of(ranks),
        active_dp_ranks=alloc.active_dp_ranks - ranks,
    )


def demand(snapshot: SchedulerSnapshot) -> dict[str, int]:
    """Remaining rollout work per pipeline with an eligible generation cluster: the planner's own demand
    (``_gap_ratio.generation_demands``, one rule for both), keyed by pipeline instead of cluster."""
    nongen = {cid for cid, a in snapshot.allocations.items() if a.priority != Priority.GENERATION}
    active = {cid for cid, a in snapshot.allocations.items() if a.priority == Priority.GENERATION and a.active_dp_ranks}
    return {snapshot.clusters[cid].pipeline_id: d for cid, d in generation_demands(snapshot, nongen, active).items()}


def rebalance_reason(snapshot: SchedulerSnapshot, drift_threshold: float) -> str | None:
    """Why a poll-triggered cycle should run now, or None (reference: ``_central_scheduling_loop``).

    Over the pipelines the planner would serve (:func:`demand`):

    * a generation cluster with demand but no active rank (suspended, debug #32);
    * among the least-complete half of the pipelines with demand, the share of remaining work x TP differs from
      the share of active generation GPUs by more than ``drift_threshold``.
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
        drift = weights[pid] / total_w - active[pid] / total_g
        if abs(drift) > drift_threshold:
            return f"{pid} demand share differs from its GPU share by {drift:+.0%}"
    return None


def status_dict(
    *,
    gpus: frozenset[int],
    gpus_per_node: int,
    pipelines: Mapping[str, Mapping[str, Any]],
    clusters: Mapping[str, ClusterSpec],
    allocations: Mapping[str, Allocation],
    pending: Iterable[tuple[Any, float]],
    progress: Mapping[str, Any],
    planned_releases: Iterable[str],
    now: float,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """Plain-JSON view of the scheduler (``rlix status``). ``pending`` = (PendingRequest, since) pairs."""
    used: set[int] = set()
    for a in allocations.values():
        used |= a.gpus
    pipes: dict[str, Any] = {}
    for pid, info in sorted(pipelines.items()):
        prog = progress.get(pid)
        pipes[pid] = {
            **dict(info),
            "clusters": {
                s.name: {"cluster_id": s.cluster_id, "device_mapping": list(s.device_mapping), "tp_size": s.tp_size}
                for s in clusters.values() if s.pipeline_id == pid
            },
            "progress": None if prog is None else {
                "step": prog.step, "step_target": prog.step_target, "completed": prog.completed,
                "remaining": prog.remaining,
            },
        }
    return {
        "gpus": sorted(gpus),
        "gpus_per_node": gpus_per_node,
        "idle_gpus": sorted(gpus - used),
        "pipelines": pipes,
        "allocations": {
            cid: {
                "pipeline_id": clusters[cid].pipeline_id if cid in clusters else "",
                "priority": Priority(a.priority).name,
                "gpus": sorted(a.gpus),
                "active_dp_ranks": sorted(a.active_dp_ranks),
            }
            for cid, a in sorted(allocations.items())
        },
        "pending": [
            {
                "cluster_id": r.cluster_id, "priority": Priority(r.priority).name, "seq": r.seq, "step": r.step,
                "step_target_estimate": r.step_target_estimate, "waiting_s": round(max(now - since, 0.0), 3),
            }
            for r, since in sorted(pending, key=lambda x: (x[0].priority, x[0].seq))
        ],
        "planned_releases": sorted(planned_releases),
        **dict(extra),
    }
