"""One digest of ``plan_cycle``'s decisions over fixed snapshots: a planner optimisation must not change it.

    python benchmarks/plan_digest.py    # ~10 s; prints the snapshot count and a sha256

Snapshots: the latency benchmark's random busy snapshots (both layouts, every size), converged re-plans whose
progress moved, and the snapshots of two simulated runs. Run it before and after a change to the planner: a
pure speed-up leaves the digest as it was.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import replace

import rlix_plugins.control.capacity.simulation as engine
from benchmarks.scheduler_scale import SIZES, make_clusters, random_snapshot, sim_latency
from rlix_plugins.control.scheduling.planner import plan_cycle
from rlix_plugins.control.types import CyclePlan, SchedulerSnapshot


def snapshots() -> Iterator[SchedulerSnapshot]:
    for p, g in SIZES:
        for layout in ("window", "pool"):
            rnd = random.Random(7 + 1000 * p + g)
            clusters = make_clusters(p, g, layout, rnd)
            for _ in range(80 if g >= 512 else 60):
                snap = random_snapshot(clusters, g, rnd)
                yield snap
                for _ in range(2):
                    snap = replace(snap, allocations=plan_cycle(snap).allocations, pending=())
                progress = {k: replace(v, completed=min(v.step_target, v.completed + rnd.randint(0, 64)))
                            for k, v in snap.progress.items()}
                yield replace(snap, progress=progress)
    seen: list[SchedulerSnapshot] = []
    real = engine.plan_cycle

    def record(snap: SchedulerSnapshot) -> CyclePlan:
        seen.append(snap)
        return real(snap)

    engine.plan_cycle = record  # type: ignore[assignment]
    try:
        for p, g in [(8, 64), (32, 256)]:
            sim_latency(p, g)
    finally:
        engine.plan_cycle = real
    yield from seen[::3]


def canonical(plan: CyclePlan) -> str:
    """The plan as text that equal plans share (sets sorted: their iteration order is no part of a plan)."""
    allocs = sorted((a.cluster_id, int(a.priority), sorted(a.gpus), sorted(a.active_dp_ranks))
                    for a in plan.allocations.values())
    grants = [(x.cluster_id, int(x.priority), x.seq, sorted(x.gpus)) for x in plan.grants]
    return repr((plan.shrinks, plan.expands, grants, allocs, sorted(plan.released)))


def main() -> None:
    digest = hashlib.sha256()
    n = 0
    for snap in snapshots():
        digest.update(canonical(plan_cycle(snap)).encode())
        n += 1
    print(f"{n} snapshots, plan digest {digest.hexdigest()}")


if __name__ == "__main__":
    main()
