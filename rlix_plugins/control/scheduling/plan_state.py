"""Mutable working state of one planning cycle (private to the planner; pure Python).

``PlanState`` is built from a frozen ``SchedulerSnapshot``, mutated by the planner phases (planned releases →
non-generation grants → gap ratio → generation grants) and turned back into a frozen ``CyclePlan``. Nothing
here is shared between cycles except the per-spec GPU→rank index cache (specs are frozen, so it is safe).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rlix_plugins.control.scheduling.coresidence import GpuTenancy, Host, gpu_tenants
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    CyclePlan,
    ExpandOp,
    Grant,
    Priority,
    SchedulerSnapshot,
    ShrinkOp,
)

#: The most rollout ranks one decision wakes by its own choice (the fills, the gap ratio, the swap). The scheduler runs
#: the next cycle at once after one that changed something, so the rest wake there; each decision stays short (a
#: decision that woke ~1,500 ranks at 2,048 GPUs took ~110-170 ms of planner time). Places that yield and grants to
#: waiting requests are not bounded: a pipeline owed a turn never waits for the budget.
MAX_WAKES: int = 128

_RANK_INDEX: dict[int, tuple[ClusterSpec, dict[int, int]]] = {}
_RANK_INDEX_MAX = 4096


def rank_index(spec: ClusterSpec) -> dict[int, int]:
    """GPU id -> DP rank of ``spec``. Cached by object identity (hashing a spec walks its whole mapping)."""
    hit = _RANK_INDEX.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_RANK_INDEX) >= _RANK_INDEX_MAX:
        _RANK_INDEX.clear()
    tp = spec.tp_size
    idx = {g: i // tp for i, g in enumerate(spec.device_mapping)}
    _RANK_INDEX[id(spec)] = (spec, idx)  # keeps spec alive, so its id is not reused while cached
    return idx


_BUNDLES: dict[int, tuple[ClusterSpec, tuple[tuple[int, ...], ...]]] = {}


def bundles(spec: ClusterSpec) -> tuple[tuple[int, ...], ...]:
    """GPU ids of every DP rank of ``spec`` (``bundles(spec)[r] == spec.bundle(r)``), cached like
    :func:`rank_index` (the planner's candidate scan reads bundles in its innermost loop)."""
    hit = _BUNDLES.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_BUNDLES) >= _RANK_INDEX_MAX:
        _BUNDLES.clear()
    out = tuple(spec.bundle(r) for r in range(spec.num_dp_ranks))
    _BUNDLES[id(spec)] = (spec, out)
    return out


_SHAPE: dict[int, tuple[ClusterSpec, int]] = {}
_SHAPE_IDS: dict[tuple[tuple[int, ...], int], int] = {}
_SHAPE_COUNTER = itertools.count()


def shape_id(spec: ClusterSpec) -> int:
    """One int per (device mapping, TP size): clusters with equal ids have the same DP ranks on the same GPUs.
    Cached by object identity like :func:`rank_index` (a mapping's hash walks all of it)."""
    hit = _SHAPE.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_SHAPE) >= _RANK_INDEX_MAX or len(_SHAPE_IDS) >= _RANK_INDEX_MAX:
        _SHAPE.clear()
        _SHAPE_IDS.clear()  # ids come from a counter: one handed out before the clear never names another shape
    key = (spec.device_mapping, spec.tp_size)
    sid = _SHAPE_IDS.get(key)
    if sid is None:
        sid = _SHAPE_IDS[key] = next(_SHAPE_COUNTER)
    _SHAPE[id(spec)] = (spec, sid)
    return sid


_OVERLAP: dict[tuple[int, int], tuple[ClusterSpec, ClusterSpec, bool]] = {}


def mappings_overlap(a: ClusterSpec, b: ClusterSpec) -> bool:
    """Whether the device mappings of ``a`` and ``b`` share a GPU. Cached by object identity like
    :func:`rank_index` (a planning cycle asks for every acceptor/donor pair; mappings hold hundreds of GPUs)."""
    hit = _OVERLAP.get((id(a), id(b)))
    if hit is not None and hit[0] is a and hit[1] is b:
        return hit[2]
    if len(_OVERLAP) >= _RANK_INDEX_MAX * 4:
        _OVERLAP.clear()
    result = not rank_index(a).keys().isdisjoint(b.device_mapping)
    _OVERLAP[(id(a), id(b))] = (a, b, result)  # keeps both alive, so their ids are not reused while cached
    return result


def is_generation_alloc(alloc: Allocation) -> bool:
    return alloc.priority == Priority.GENERATION


#: When a cluster is shrunk for several reasons in one cycle, the op carries the most important one.
_REASON_RANK = {"release": 0, "preempt": 1, "rebalance": 2}


@dataclass
class PlanState:
    snap: SchedulerSnapshot
    #: allocated GPU → cluster id (a non-generation holder if any, else one generation rank)
    owner: dict[int, str]
    gen_active: dict[str, set[int]]  #: generation cluster → active DP ranks (GENERATION allocations only)
    nongen: dict[str, Allocation]  #: non-GENERATION allocations
    free: set[int]  #: idle GPUs
    reserved: set[int] = field(default_factory=set)  #: GPUs that waiting non-generation requests need (``reserve``)
    shrunk: dict[str, set[int]] = field(default_factory=dict)
    shrink_reason: dict[str, str] = field(default_factory=dict)
    expanded: dict[str, set[int]] = field(default_factory=dict)
    #: ranks never shrunk this cycle: woken this cycle, or of a cluster with an expand in flight
    protected: set[tuple[str, int]] = field(default_factory=set)
    grants: list[Grant] = field(default_factory=list)
    released: set[str] = field(default_factory=set)
    #: GPU → clusters awake there next to its ``owner`` (``coresidence``): generation ranks, and training steps of
    #: other pipelines when the owner is one; never empty
    coresident: dict[int, set[str]] = field(default_factory=dict)
    #: GPU → clusters mapped on it; empty when no cluster declared memory figures (``coresidence.gpu_tenants``)
    tenants: Mapping[int, GpuTenancy] = field(default_factory=dict)
    #: GPU → :meth:`room`, kept current by every change of its holders below (the fills and the swap ask for every
    #: GPU's room; computing it afresh in each phase cost ~10 ms a decision at 2,048 GPUs)
    _rooms: dict[int, int | None] = field(default_factory=dict)
    #: ranks one decision may still wake (:data:`MAX_WAKES`): the rest wake in the cycles that follow
    wakes_left: int = 0

    @classmethod
    def from_snapshot(cls, snap: SchedulerSnapshot) -> PlanState:
        owner: dict[int, str] = {}
        coresident: dict[int, set[str]] = {}
        gen_active: dict[str, set[int]] = {}
        nongen: dict[str, Allocation] = {}
        for cid, alloc in snap.allocations.items():
            gen = is_generation_alloc(alloc)
            if not gen:
                nongen[cid] = alloc
            elif alloc.active_dp_ranks:
                gen_active[cid] = set(alloc.active_dp_ranks)
            for g in alloc.gpus:
                prev = owner.get(g)
                if prev is None:
                    owner[g] = cid
                elif gen:  # another holder came first: this rank co-resides with it
                    coresident.setdefault(g, set()).add(cid)
                else:  # the non-generation holder owns the GPU; the rank that came first co-resides
                    coresident.setdefault(g, set()).add(prev)
                    owner[g] = cid
        free = set(snap.gpus)
        free.difference_update(owner)
        free.difference_update(snap.fenced_gpus)  # neither idle nor lendable (``fences``)
        # Clusters with an expand in flight: their coordinator is busy waking ranks, so none of their ranks is
        # shrunk (a shrink would wait for that expand and hold the cycle back).
        protected = {(cid, r) for cid in snap.expanding for r in gen_active.get(cid, ())}
        return cls(snap=snap, owner=owner, gen_active=gen_active, nongen=nongen, free=free, coresident=coresident,
                   tenants=gpu_tenants(snap.clusters.values()), protected=protected, wakes_left=MAX_WAKES)

    # ---- co-residence --------------------------------------------------------------------------------
    def room(self, gpu: int) -> int | None:
        """``coresidence`` units left on ``gpu`` with its holders awake; None where no rollout rank may wake next to
        them (no holder, reserved, fenced, a tenant without memory figures)."""
        try:
            return self._rooms[gpu]
        except KeyError:
            pass
        owner = self.owner.get(gpu)
        tenancy = self.tenants.get(gpu)
        if owner is None or tenancy is None or not tenancy.complete or gpu in self.reserved \
                or gpu in self.snap.fenced_gpus:
            room = None
        else:  # awake there: the owner (a training step, or a rollout rank) and the steps and rollout ranks beside it
            room = tenancy.cap - tenancy.load({owner, *self.coresident.get(gpu, ())})
        self._rooms[gpu] = room
        return room

    def reserve(self, gpus: Iterable[int]) -> None:
        """Keep ``gpus`` for a waiting non-generation request: no rollout rank wakes there this cycle."""
        for g in gpus:
            self._rooms.pop(g, None)
        self.reserved.update(gpus)

    # ---- generation ops -------------------------------------------------------------------------------
    def shrink(self, cid: str, rank: int, reason: str) -> None:
        spec = self.snap.clusters[cid]
        active = self.gen_active[cid]
        active.remove(rank)
        if not active:
            del self.gen_active[cid]
        rooms = self._rooms
        for g in spec.bundle(rank):
            rooms.pop(g, None)
            guests = self.coresident.get(g)
            if guests is not None and cid in guests:
                guests.discard(cid)  # the owner keeps the GPU
            elif guests:
                self.owner[g] = min(guests)  # a rank that stays awake there holds it now
                guests.discard(self.owner[g])
            else:
                del self.owner[g]
                if g not in self.snap.fenced_gpus:
                    self.free.add(g)
            if guests is not None and not guests:
                del self.coresident[g]
        self.shrunk.setdefault(cid, set()).add(rank)
        old = self.shrink_reason.get(cid)
        if old is None or _REASON_RANK[reason] < _REASON_RANK[old]:
            self.shrink_reason[cid] = reason

    def expand(self, cid: str, rank: int, *, coresident: bool = False) -> None:
        """Wake ``rank`` of ``cid`` on idle GPUs, or (``coresident``) next to the holders of its GPUs (the caller
        checked ``coresidence.sharing_problem``)."""
        spec = self.snap.clusters[cid]
        rooms, owner, guests_of = self._rooms, self.owner, self.coresident  # (a few thousand wakes a decision)
        for g in spec.bundle(rank):
            if coresident:
                guests = guests_of.get(g)
                if guests is None:
                    guests = guests_of[g] = set()
                room = rooms.get(g)
                if room is not None and cid not in guests and cid != owner.get(g):
                    rooms[g] = room - self.tenants[g].extra.get(cid, 0)  # a load is a sum: exact
                else:
                    rooms.pop(g, None)
                guests.add(cid)
            else:
                rooms.pop(g, None)
                self.free.remove(g)
                owner[g] = cid
        self.gen_active.setdefault(cid, set()).add(rank)
        self.expanded.setdefault(cid, set()).add(rank)
        self.protected.add((cid, rank))
        self.wakes_left -= 1

    def generation_holders(self, gpu: int) -> list[str]:
        """The generation clusters awake on ``gpu`` (sorted)."""
        nongen = self.nongen
        held = {c for c in self.coresident.get(gpu, ()) if c not in nongen}
        owner = self.owner.get(gpu)
        if owner is not None and owner not in nongen:
            held.add(owner)
        return sorted(held)

    def hosts(self, gpu: int) -> list[Host]:
        """The non-generation allocations on ``gpu`` (cluster, priority), by cluster id: none, one, or training
        steps of different pipelines side by side (``coresidence``)."""
        nongen, clusters = self.nongen, self.snap.clusters
        owner = self.owner.get(gpu)
        if owner is None or owner not in nongen:
            return []  # a non-generation holder is always the owner (``allocate``, ``from_snapshot``)
        held = sorted({owner, *(c for c in self.coresident.get(gpu, ()) if c in nongen)})
        return [(clusters[c], Priority(nongen[c].priority)) for c in held]

    def active_gpus(self, cid: str) -> int:
        ranks = self.gen_active.get(cid)
        return len(ranks) * self.snap.clusters[cid].tp_size if ranks else 0

    # ---- non-generation --------------------------------------------------------------------------------
    def allocate(self, cid: str, priority: Priority, gpus: frozenset[int]) -> None:
        """Grant ``gpus`` to ``cid``: idle ones, and ones whose generation ranks stay awake next to it (the caller
        shrank every rank that may not)."""
        for g in gpus:
            self._rooms.pop(g, None)
            held = self.owner.get(g)
            if held is None:
                self.free.remove(g)
            else:
                self.coresident.setdefault(g, set()).add(held)
            self.owner[g] = cid
        self.nongen[cid] = Allocation(cluster_id=cid, priority=priority, gpus=gpus)

    # ---- output ------------------------------------------------------------------------------------------
    def to_plan(self) -> CyclePlan:
        clusters = self.snap.clusters
        allocations: dict[str, Allocation] = dict(self.nongen)
        for cid, ranks in self.gen_active.items():
            allocations[cid] = Allocation(
                cluster_id=cid,
                priority=Priority.GENERATION,
                gpus=clusters[cid].gpus_of(ranks),
                active_dp_ranks=frozenset(ranks),
            )
        shrinks = tuple(
            ShrinkOp(cluster_id=cid, dp_ranks=tuple(sorted(ranks)), reason=self.shrink_reason[cid])
            for cid, ranks in sorted(self.shrunk.items())
        )
        expands = tuple(
            ExpandOp(cluster_id=cid, dp_ranks=tuple(sorted(ranks))) for cid, ranks in sorted(self.expanded.items())
        )
        return CyclePlan(
            shrinks=shrinks,
            expands=expands,
            grants=tuple(self.grants),
            allocations=allocations,
            released=frozenset(self.released),
        )
