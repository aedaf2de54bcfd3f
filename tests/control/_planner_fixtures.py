"""Builders and hypothesis strategies for planner tests (pure Python; no Ray)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from hypothesis import strategies as st

from rlix_plugins.control.registration import pipeline_clusters as pipeline
from rlix_plugins.control.types import (
    Allocation,
    ClusterMemory,
    ClusterSpec,
    CyclePlan,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
)

GEN = Priority.GENERATION


def spec(pid: str, name: str, mapping: Iterable[int], tp: int = 1) -> ClusterSpec:
    return ClusterSpec(f"{pid}_{name}", pid, name, tuple(sorted(mapping)), tp)


def gen_alloc(s: ClusterSpec, ranks: Iterable[int]) -> Allocation:
    ranks = frozenset(ranks)
    gpus = frozenset(g for r in ranks for g in s.bundle(r))
    return Allocation(s.cluster_id, GEN, gpus, ranks)


def whole_alloc(s: ClusterSpec, priority: Priority = Priority.ACTOR_TRAINING) -> Allocation:
    return Allocation(s.cluster_id, priority, frozenset(s.device_mapping))


def snapshot(
    num_gpus: int,
    clusters: Mapping[str, ClusterSpec],
    allocations: Iterable[Allocation] = (),
    pending: Sequence[PendingRequest] = (),
    progress: Mapping[str, tuple[int, int]] | None = None,
    planned_releases: Iterable[str] = (),
    gpus_per_node: int = 8,
) -> SchedulerSnapshot:
    return SchedulerSnapshot(
        gpus=frozenset(range(num_gpus)),
        gpus_per_node=gpus_per_node,
        clusters=dict(clusters),
        allocations={a.cluster_id: a for a in allocations},
        pending=tuple(pending),
        progress={pid: Progress(pid, t, c) for pid, (t, c) in (progress or {}).items()},
        planned_releases=frozenset(planned_releases),
    )


def apply_plan(snap: SchedulerSnapshot, plan: CyclePlan) -> SchedulerSnapshot:
    """What the scheduler's state is after executing ``plan``: new allocations, granted/released requests gone."""
    granted = {(g.cluster_id, g.seq) for g in plan.grants}
    return replace(
        snap,
        allocations=dict(plan.allocations),
        pending=tuple(r for r in snap.pending if (r.cluster_id, r.seq) not in granted),
        planned_releases=snap.planned_releases - plan.released,
    )


def active(snap_or_plan: SchedulerSnapshot | CyclePlan, cid: str) -> frozenset[int]:
    a = snap_or_plan.allocations.get(cid)
    return a.active_dp_ranks if a is not None and a.priority == GEN else frozenset()


# ---- hypothesis -----------------------------------------------------------------------------------------


@st.composite
def snapshots(draw: st.DrawFn, max_pipelines: int = 4, allow_release: bool = True,
              memory: bool = False) -> SchedulerSnapshot:
    """A random, self-consistent scheduler snapshot: partial overlap, TP bundles, allocations, requests; with
    ``memory``, most clusters declare memory figures (co-residence), some do not."""
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = draw(st.integers(1, 2))
    g = gpn * nodes
    n = draw(st.integers(1, max_pipelines))
    clusters: dict[str, ClusterSpec] = {}
    for i in range(n):
        pid = f"p{i}"
        tp = draw(st.sampled_from([t for t in (1, 2, 4) if gpn % t == 0]))
        starts = list(range(0, g, tp))
        chosen = draw(st.lists(st.sampled_from(starts), min_size=1, max_size=len(starts), unique=True))
        infer = sorted(x for s0 in chosen for x in range(s0, s0 + tp))
        train = None
        if draw(st.booleans()):
            train = draw(st.lists(st.sampled_from(infer), min_size=1, max_size=min(len(infer), 4), unique=True))
        clusters.update(pipeline(pid, train, infer, tp))
    if memory:
        for cid in sorted(clusters):
            if draw(st.integers(0, 5)):
                figures = ClusterMemory(100.0, draw(st.sampled_from([5.0, 20.0, 40.0, 90.0])),
                                        draw(st.sampled_from([1.0, 4.0])))
                clusters[cid] = replace(clusters[cid], memory=figures)
    # allocations, consistent: walk clusters in a random order, take what is free
    owned: set[int] = set()
    allocs: list[Allocation] = []
    order = draw(st.permutations(sorted(clusters)))
    for cid in order:
        s = clusters[cid]
        if not s.is_generation:
            if draw(st.integers(0, 2)) == 0 and not owned & set(s.device_mapping):
                allocs.append(whole_alloc(s, draw(st.sampled_from(list(Priority)[:6]))))
                owned |= set(s.device_mapping)
            continue
        ranks = []
        for r in range(s.num_dp_ranks):
            b = set(s.bundle(r))
            if not b & owned and draw(st.booleans()):
                ranks.append(r)
                owned |= b
        if ranks:
            allocs.append(gen_alloc(s, ranks))
    allocated = {a.cluster_id for a in allocs}
    pending: list[PendingRequest] = []
    seqs = draw(st.permutations(list(range(len(clusters)))))
    releases: list[str] = []
    for k, cid in enumerate(sorted(clusters)):
        s = clusters[cid]
        if cid in allocated:
            if s.is_generation and allow_release and draw(st.integers(0, 7)) == 0:
                releases.append(cid)
            continue
        if not draw(st.booleans()):
            continue
        if s.is_generation:
            if draw(st.integers(0, 9)) == 0:
                pending.append(PendingRequest(cid, Priority.INITIALIZATION, seqs[k]))
            else:
                est = draw(st.one_of(st.none(), st.integers(1, 128)))
                pending.append(PendingRequest(cid, GEN, seqs[k], step_target_estimate=est))
        else:
            pending.append(PendingRequest(cid, draw(st.sampled_from(list(Priority)[:6])), seqs[k]))
    progress: dict[str, tuple[int, int]] = {}
    for i in range(n):
        if draw(st.booleans()):
            target = draw(st.integers(1, 256))
            progress[f"p{i}"] = (target, draw(st.integers(0, target + 8)))
    return snapshot(g, clusters, allocs, pending, progress, releases, gpus_per_node=gpn)
