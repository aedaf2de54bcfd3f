"""The scheduler's state as plain JSON (``rlix status``; pure, no Ray)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from rlix_plugins.control.types import Allocation, ClusterSpec, Priority


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
                s.name: {"cluster_id": s.cluster_id, "device_mapping": list(s.device_mapping), "tp_size": s.tp_size,
                         "memory": None if s.memory is None else dataclasses.asdict(s.memory)}
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
