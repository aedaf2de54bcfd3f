"""The scheduling decision, as pure functions over frozen records (no Ray, no torch).

``plan_cycle(snapshot) -> CyclePlan`` is one scheduling cycle. Phases, in order:

1. **Planned releases** (``await_release``): every active rank of each cluster in ``snapshot.planned_releases``
   is shrunk (reason ``"release"``); the cluster is listed in ``plan.released`` and takes no part in the gap
   ratio this cycle.
2. **Non-generation requests** (priorities 0-5), by ``(priority, seq)``. Each needs its cluster's *whole* device
   mapping. GPUs held by GENERATION ranks (of any pipeline, including its own) are taken by preempting every
   rank whose bundle overlaps the mapping (reason ``"preempt"``); the rest of such a bundle becomes idle.
   A training-type request runs next to other pipelines' training steps on its GPUs where they all fit
   (co-residence, 4.). A request that cannot be satisfied now (a GPU is held by another non-generation allocation
   it may not run beside, or is needed by an earlier request that is still waiting) **waits and reserves its whole
   mapping**: no later request (lower priority, or same priority with a larger ``seq``) is granted any of those
   GPUs, and the gap ratio does not wake ranks on idle reserved GPUs. A waiting request preempts nothing (its generation neighbours keep working
   until it can really start). A request whose cluster already holds its whole mapping is granted at once.
   Fair turns (``scheduling.turns``): a training-type request of a pipeline that owes a waiting pipeline a turn
   waits, without reserving, while it needs a GPU of that waiter.
3. **Gap ratio** (``gap_ratio.plan_gap_ratio``): divides rollout GPUs by remaining work x TP. Idle GPUs in
   ``snapshot.release_grace_gpus`` (released by a training cluster moments ago) are not lent to rollout yet. Before
   it, the co-resident fill (4.) runs for the rollout clusters with no active rank and no idle GPU to take: one that
   fits next to a GPU's holders wakes there, instead of the gap ratio shrinking another pipeline's rank for it
   (which would then wake next to it in the next cycle).
4. **Co-resident fill** (``scheduling.coresidence``): rollout ranks that want GPUs wake next to a GPU's holders
   (another pipeline's training-type allocation, other pipelines' rollout ranks) where memory fits (never on a
   reserved GPU).
5. **Co-resident swap** (anti-starvation on shared GPUs): a rollout cluster with work (its progress reports some, or
   nothing yet: ``gap_ratio.has_rollout_work``) that still has no active rank
   takes the place of one co-resident rollout rank of a pipeline that keeps another rank awake (reason
   ``"rebalance"``). Without it a pipeline that asks last, when every GPU of its mapping already holds as many
   rollouts as memory allows, waits for a training grant to free a place: the gap ratio never gives a shared GPU
   and the fill finds it full (97 s on 4x H100 with three 1.5B pipelines, DESIGN §9).
6. **Generation grants**: each pending GENERATION request whose cluster has ≥1 active rank after this plan is
   granted (partial grants; the wake-only signal of the reference that fixed its deadlock).

Fenced GPUs (``snapshot.fenced_gpus``, ``scheduling.fences``: a failed pipeline's processes may still hold their
memory) are neither idle nor lendable in any phase: a request that needs one waits (and reserves), no rank wakes on
one, and a rank shrunk there leaves it unheld.

Expands in flight (``snapshot.expanding``, launched by an earlier cycle): their ranks hold their GPUs, and their
cluster is left alone: none of its ranks is shrunk (a request that would preempt one waits and reserves, the gap
ratio takes no donor rank from it, a planned release of it waits) and no GENERATION request of it is granted.

The scheduler executes a plan as: all shrinks → commit ``plan.allocations`` → signal the grants and releases →
launch the expands (not awaited; a GENERATION grant of a cluster the plan wakes is signalled when its expand
returns). ``validate_plan`` (re-exported here) checks a plan against its snapshot and must pass first.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Iterator

from rlix_plugins.control.registration import validate_cluster_specs
from rlix_plugins.control.scheduling.coresidence import COTENANT_PRIORITIES, fits, sharing_problem
from rlix_plugins.control.scheduling.gap_ratio import cluster_demands, has_rollout_work, plan_gap_ratio
from rlix_plugins.control.scheduling.invariants import PlanInvariantError, validate_plan, validate_snapshot
from rlix_plugins.control.scheduling.plan_state import PlanState, bundles, rank_index, shape_id
from rlix_plugins.control.scheduling.turns import deferred, owed_gpus
from rlix_plugins.control.types import Allocation, ClusterSpec, CyclePlan, Grant, Priority, SchedulerSnapshot

__all__ = [
    "PlanInvariantError",
    "note_preemptions",
    "plan_cycle",
    "validate_cluster_specs",
    "validate_plan",
    "validate_snapshot",
]


def plan_cycle(snapshot: SchedulerSnapshot) -> CyclePlan:
    """One scheduling decision. Pure and deterministic: the same snapshot always gives the same plan.

    Raises ``PlanInvariantError`` when the snapshot references unknown clusters (a scheduler bookkeeping bug).
    """
    clusters = snapshot.clusters
    for req in snapshot.pending:
        if req.cluster_id not in clusters:
            raise PlanInvariantError(
                "existence", f"pending request of unregistered cluster {req.cluster_id!r}; drop it on unregister"
            )
    for cid in snapshot.allocations:
        if cid not in clusters:
            raise PlanInvariantError(
                "existence", f"allocation of unregistered cluster {cid!r}; free its GPUs on unregister"
            )
    state = PlanState.from_snapshot(snapshot)
    _planned_releases(state)
    _non_generation(state)
    state.reserve(snapshot.release_grace_gpus & state.free)
    _coresident_fill(state, starving_only=True)
    plan_gap_ratio(state)
    _coresident_fill(state)
    _coresident_swap(state)
    _yield_places(state)
    _generation_grants(state)
    return state.to_plan()


def _planned_releases(state: PlanState) -> None:
    clusters = state.snap.clusters
    for cid in sorted(state.snap.planned_releases):
        spec = clusters.get(cid)
        if spec is None or not spec.is_generation:
            raise PlanInvariantError(
                "generation-only shrink",
                f"planned release of {cid!r}, which is not a registered generation cluster; "
                "await_release accepts only '<pipeline>_actor_infer'",
            )
        if cid in state.snap.expanding:
            continue  # its coordinator is busy with an expand: released once that returns (the return starts a cycle)
        for r in sorted(state.gen_active.get(cid, ())):
            state.shrink(cid, r, "release")
        state.released.add(cid)


def _non_generation(state: PlanState) -> None:
    snap = state.snap
    clusters = snap.clusters
    requests = sorted(
        (r for r in snap.pending if r.priority != Priority.GENERATION), key=lambda r: (r.priority, r.seq)
    )
    owed = owed_gpus(snap)
    for req in requests:
        spec = clusters[req.cluster_id]
        need = frozenset(spec.device_mapping)
        held = state.nongen.get(req.cluster_id)
        if held is not None and held.gpus == need:
            state.nongen[req.cluster_id] = Allocation(req.cluster_id, Priority(req.priority), need)
            state.grants.append(Grant(req.cluster_id, Priority(req.priority), req.seq, need))
            continue
        if deferred(snap, owed, req):
            continue  # fair turns: it owes a waiter these GPUs; it waits without reserving them
        # (isdisjoint, not a union per request: hundreds of requests, reserved sets of hundreds of GPUs at scale)
        blocked = not need.isdisjoint(state.reserved) or not need.isdisjoint(snap.fenced_gpus) or \
            not _side_by_side(state, spec, Priority(req.priority), need)
        victims = [] if blocked else _preemptions(state, spec, Priority(req.priority), need)
        # A rank of a cluster with an expand in flight cannot be put to sleep now: wait for that expand to return.
        if blocked or any(cid in snap.expanding for cid, _ in victims):
            state.reserve(need)
            continue
        for gen_cid, rank in victims:
            state.shrink(gen_cid, rank, "preempt")
        state.allocate(req.cluster_id, Priority(req.priority), need)
        state.grants.append(Grant(req.cluster_id, Priority(req.priority), req.seq, need))


def _side_by_side(state: PlanState, spec: ClusterSpec, priority: Priority, need: frozenset[int]) -> bool:
    """Whether a grant of ``need`` to ``spec`` may run next to the non-generation allocations on those GPUs: True where
    there are none, else where every one of them and this one are training steps of different pipelines that fit
    together with the GPU's generation ranks asleep (``coresidence``; which ranks stay is ``_preemptions``'s)."""
    owner, nongen = state.owner, state.nongen
    for g in need:
        o = owner.get(g)
        if o is None or o not in nongen:
            continue
        if not state.tenants or sharing_problem(state.tenants, g, (), [*state.hosts(g), (spec, priority)]) is not None:
            return False
    return True


def _preemptions(state: PlanState, spec: ClusterSpec, priority: Priority,
                 need: frozenset[int]) -> list[tuple[str, int]]:
    """The generation ranks (cluster, rank) a grant of ``need`` to ``spec`` puts to sleep: every rank that overlaps
    the mapping (its own pipeline's included), unless it may stay awake next to this work and the ranks kept before
    it (co-residence; the grantee's own rank too). Reads ``state`` only."""
    clusters = state.snap.clusters
    kept: dict[int, list[ClusterSpec]] = {}
    victims: list[tuple[str, int]] = []
    # Where not every co-tenant fits, the pipelines with the fewest awake ranks stay first (kept in cluster-id
    # order, the same pipeline lost its rank to every training step on three GPUs and stepped 132 s instead of 75),
    # then the ranks a grant put to sleep most recently (kept in a fixed order, two of four 0.5B pipelines on one
    # H200 slept through every step of theirs and waited 22-35 s for each batch while the other two waited 0.4 s),
    # then other pipelines' ranks before the grantee's own (its step is progress already; theirs is what the step
    # holds up). DESIGN §9.
    slept = state.snap.rollout_slept_at

    def keep_order(c: str) -> tuple[int, int, bool, str]:
        return (len(state.gen_active.get(c, ())), -slept.get(c, -1), clusters[c].pipeline_id == spec.pipeline_id, c)

    for g in sorted(need):
        for gen_cid in sorted(state.generation_holders(g), key=keep_order):
            gen_spec = clusters[gen_cid]
            if gen_spec in kept.get(g, ()):
                continue  # kept for an earlier GPU of its bundle
            rank = rank_index(gen_spec)[g]
            if (gen_cid, rank) in victims:
                continue  # put to sleep for an earlier GPU of its bundle
            if _may_stay(state, gen_spec, rank, spec, priority, need, kept):
                for h in gen_spec.bundle(rank):
                    if h in need:
                        kept.setdefault(h, []).append(gen_spec)
            else:
                victims.append((gen_cid, rank))
    return victims


def note_preemptions(slept_at: dict[str, int], plan: CyclePlan, clock: Iterator[int]) -> None:
    """Record in ``slept_at`` (cluster id -> logical time) the clusters whose ranks ``plan``'s training grants put
    to sleep. The scheduler and the simulator call this for every plan they carry out and pass a copy as
    ``snapshot.rollout_slept_at``, which ``_preemptions`` reads."""
    for op in plan.shrinks:
        if op.reason == "preempt":
            slept_at[op.cluster_id] = next(clock)


def _may_stay(state: PlanState, spec: ClusterSpec, rank: int, host: ClusterSpec, priority: Priority,
              need: frozenset[int], kept: dict[int, list[ClusterSpec]]) -> bool:
    """Whether ``spec``'s ``rank`` may stay awake on the GPUs of ``need`` that ``host`` is granted now, next to the
    ranks ``kept`` there so far."""
    if not state.tenants:
        return False
    return all(sharing_problem(state.tenants, g, [*kept.get(g, ()), spec], [*state.hosts(g), (host, priority)]) is None
               for g in spec.bundle(rank) if g in need)


def _coresident_fill(state: PlanState, *, starving_only: bool = False) -> None:
    """Wake rollout ranks that want a GPU next to the GPU's holders where they fit (``coresidence``).

    Clusters with no active rank go first (the longest waiter first), then the others, by pipeline id; a cluster
    takes every rank it can. Never on a GPU a waiting request reserves, never one of its ranks shrunk this cycle,
    never beside its own pipeline's training step: a rank awake when its pipeline's step is granted may stay there
    (``_preemptions``), but room that opens during a step goes to other pipelines' rollouts, whose batches the step
    holds up (on one GPU with room for one rollout, the pipeline's own rank took every place its co-tenant's step
    freed).
    ``starving_only``: only clusters with no active rank and no idle, unreserved GPU in their mapping.
    """
    if not state.tenants:
        return
    snap = state.snap
    clusters = snap.clusters
    demands = cluster_demands(state)
    waiting = snap.generation_waiting_since
    usable = state.free - state.reserved

    def usable_in(spec: ClusterSpec) -> bool:  # (from the smaller side: a busy pool has few idle GPUs)
        index = rank_index(spec)
        return any(g in index for g in usable) if len(usable) < len(index) else not usable.isdisjoint(index)

    order = sorted((c for c, d in demands.items() if d > 0 and not (
                       starving_only and (c in state.gen_active or usable_in(clusters[c])))),
                   key=lambda c: (c in state.gen_active, waiting.get(c, -1), clusters[c].pipeline_id, c))
    rooms = _Rooms(state)
    room = state.room
    joinable = _Joinable(state)
    floor = min((_extra(state, clusters[c]) for c in order), default=0)
    for cid in order:
        if state.wakes_left <= 0:
            return
        spec = clusters[cid]
        pid = spec.pipeline_id
        active = state.gen_active.get(cid, set())
        shrunk = state.shrunk.get(cid, set())
        need = _extra(state, spec)
        if not rooms.any_has(need):  # no GPU has room for one more of its ranks (the fill only takes room)
            continue
        if spec.num_dp_ranks > _FEW_RANKS:  # a large mapping: only its GPUs with room
            index = rank_index(spec)
            ranks: Iterable[int] = sorted({index[g] for g in rooms.with_room(need, floor) if g in index})
        else:
            ranks = range(spec.num_dp_ranks)
        theirs = bundles(spec)
        for r in ranks:  # (plain loops, not all() over generators: ~10,000 ranks a decision at 2,048 GPUs)
            if r in active or r in shrunk:
                continue
            if state.wakes_left <= 0:
                return
            bundle = theirs[r]
            for g in bundle:
                left = room(g)
                if left is None or left < need or not joinable(g, pid):
                    break
            else:
                state.expand(cid, r, coresident=True)
                joinable.woke(bundle, pid)


class _Joinable:
    """Whether a rollout rank of a pipeline may wake on a GPU next to its holders by the rules alone, never beside
    its own pipeline's training step: ``coresidence.sharing_problem``'s rules without its memory sum (the fill's
    ``PlanState.room`` is that sum) and ``not _own_step_on``, for a GPU with room (it has a holder), from each GPU's
    host and rollout pipelines, worked out once per fill (the fill only wakes ranks: its hosts stay, its rollout
    pipelines only grow). Asking ``sharing_problem`` per rank and GPU built both lists again for every check."""

    def __init__(self, state: PlanState) -> None:
        self._state = state
        #: GPU -> (its hosts' pipelines, its awake rollout ranks' pipelines); None: no rank may join (a host that is
        #: no training-type work, two hosts or two ranks of one pipeline)
        self._gpu: dict[int, tuple[frozenset[str], set[str]] | None] = {}

    def _rules(self, gpu: int) -> tuple[frozenset[str], set[str]] | None:
        state = self._state
        clusters, nongen = state.snap.clusters, state.nongen
        hosts: list[str] = []
        rollout: list[str] = []
        for c in {state.owner[gpu], *state.coresident.get(gpu, ())}:  # (the holders: ``hosts``, ``generation_holders``)
            held = nongen.get(c)
            if held is None:
                rollout.append(clusters[c].pipeline_id)
            elif held.priority in COTENANT_PRIORITIES:
                hosts.append(clusters[c].pipeline_id)
            else:
                return None
        host_pipelines = frozenset(hosts)
        if len(host_pipelines) != len(hosts) or len(set(rollout)) != len(rollout):
            return None
        return host_pipelines, set(rollout)

    def __call__(self, gpu: int, pipeline_id: str) -> bool:
        if gpu in self._gpu:
            rules = self._gpu[gpu]
        else:
            rules = self._gpu[gpu] = self._rules(gpu)
        return rules is not None and pipeline_id not in rules[0] and pipeline_id not in rules[1]

    def woke(self, gpus: Iterable[int], pipeline_id: str) -> None:
        for g in gpus:
            rules = self._gpu.get(g)
            if rules is not None:
                rules[1].add(pipeline_id)


#: up to this many ranks a cluster's ranks are checked one by one (on each GPU's room first); above it, only the
#: ranks on GPUs with room (the list by room costs a pass over every GPU: in a window layout it only costs)
_FEW_RANKS = 64


class _Rooms:
    """The GPUs with room for one more awake rollout rank next to their holders (``PlanState.room``), for the
    co-resident fill and swap: a rank is checked only on GPUs with room for it, not every rank of every cluster
    with work (~500,000 checks a decision at 256 pipelines x 2,048 GPUs in the pool layout). During the fill only
    expands happen, so a GPU's room only shrinks (:meth:`any_has`, :meth:`with_room` rely on it)."""

    def __init__(self, state: PlanState) -> None:
        self._state = state
        self.fresh = state.room  # room on a GPU now; None where no rank may wake next to its holders at all
        self._alive: list[int] | None = None  # GPUs that had room for the least need when last asked
        self._hint: int | None = None  # the GPU that last had the room any_has asked for
        self._none_from: int | None = None  # no GPU has this much room (or more): any_has found none

    def has(self, gpu: int, need: int) -> bool:
        room = self.fresh(gpu)
        return room is not None and room >= need

    def any_has(self, need: int) -> bool:
        """Whether some GPU has ``need`` room now: the first found ends the walk (a busy pool has many; computing
        every GPU's room for a max-heap cost ~2,000 room computations a fill at 2,048 GPUs). During the fill a GPU's
        room only shrinks, so the GPU found last is asked first, and a need none had stays unmet."""
        if self._none_from is not None and need >= self._none_from:
            return False
        fresh = self.fresh
        if self._hint is not None and (room := fresh(self._hint)) is not None and room >= need:
            return True
        for g in self._state.tenants:
            room = fresh(g)
            if room is not None and room >= need:
                self._hint = g
                return True
        self._none_from = need if self._none_from is None else min(self._none_from, need)
        return False

    def with_room(self, need: int, floor: int) -> list[int]:
        """The GPUs with at least ``need`` room now. ``floor``: no caller needs less (the least need of the fill's
        clusters), so a GPU with less room leaves the list for good: the fill only takes room, and walks only the
        GPUs that still have some (walking every GPU that had room at the start, most of it taken by the clusters
        before, cost ~20,000 rank checks a decision at 2,048 GPUs)."""
        alive: list[int] = []
        out: list[int] = []
        fresh = self.fresh
        for g in self._state.tenants if self._alive is None else self._alive:
            room = fresh(g)
            if room is None or room < floor:
                continue
            alive.append(g)
            if room >= need:
                out.append(g)
        self._alive = alive
        return out


def _coresident_swap(state: PlanState) -> None:
    """Give each rollout cluster that has work and still no active rank one rank on a shared GPU, in place of a
    co-resident rollout rank of another pipeline that keeps at least one other rank, or that runs beside its own
    pipeline's training step (the longest waiter first). The second kind: a pipeline's own rollout may stay awake
    beside its own step where nobody else wants the room (alone on a GPU, that is what lets async GRPO overlap
    generation with training), but a co-tenant with work and no rank goes first, as it did when the rank slept for
    every step of its own pipeline; keeping it instead, two pipelines on one GPU would take turns of two steps
    each (the fair-turn bound), and the GPU would run the newcomer's rollout alone at every turn.

    Only where the GPUs of the rank stay held by someone else after the swap (an idle GPU is the gap ratio's), the
    donor rank covers the same GPUs, is not protected (woken this cycle, or an expand in flight) and the newcomer
    fits next to the holders that stay (``coresidence.sharing_problem``). The donor with the most awake ranks gives,
    ties to the lowest demand. The newcomer's rank is co-resident, so no gap ratio takes it back; it leaves like
    any other rank (preemption, release)."""
    if not state.tenants or state.wakes_left <= 0:
        return
    snap = state.snap
    clusters = snap.clusters
    demands = cluster_demands(state)
    starving = _starving(state, demands)
    rooms = _Rooms(state)
    protected = state.protected
    training = {clusters[c].pipeline_id for c in state.nongen}
    # donor -> (the most room all GPUs of one of its unprotected ranks have, that rank), None without such a rank;
    # computed when first asked and kept up to date at each swap: a donor none of whose ranks has the room a
    # newcomer needs is skipped without a scan of its ranks. In a pool where every pipeline rolls out everywhere a
    # donor holds hundreds of ranks, and the scans of every starving cluster over every donor cost a decision
    # ~200 ms at 256 pipelines x 2,048 GPUs.
    best_room: dict[str, tuple[int, int] | None] = {}

    def rank_room(donor: str, drank: int) -> int | None:
        """The least room on the GPUs of ``donor``'s ``drank`` (None: not a rank to give, or a GPU without room)."""
        if drank not in state.gen_active.get(donor, ()) or (donor, drank) in protected:
            return None
        low: int | None = None
        for g in bundles(clusters[donor])[drank]:
            room = rooms.fresh(g)
            if room is None:
                return None
            low = room if low is None else min(low, room)
        return low

    def most_room(donor: str) -> int | None:
        if donor not in best_room:
            best: tuple[int, int] | None = None
            for drank in state.gen_active[donor]:
                low = rank_room(donor, drank)
                if low is not None and (best is None or low > best[0]):
                    best = (low, drank)
            best_room[donor] = best
        hit = best_room[donor]
        return None if hit is None else hit[0]

    def swapped(gave: str, gpus: tuple[int, ...]) -> None:
        """``gave`` put a rank on ``gpus`` to sleep, and rooms there changed: update the cached best of every donor
        with a rank there (a rank not awake is nobody's best, but the one that just went to sleep may be)."""
        affected = {gave}.union(*(state.generation_holders(g) for g in gpus))
        for donor in affected:
            if donor not in best_room:
                continue
            index = rank_index(clusters[donor])
            for drank in {index[g] for g in gpus if g in index}:
                hit, low = best_room.get(donor), rank_room(donor, drank)
                if hit is not None and hit[1] == drank and (low is None or low < hit[0]):
                    best_room.pop(donor, None)  # its best rank lost room: recompute when next asked
                elif low is not None and (hit is None or low > hit[0]):
                    best_room[donor] = (low, drank)

    # Mapping shape -> (swaps so far, the least need) of a newcomer that found no rank to take, that had none of
    # its ranks shrunk this cycle and whose pipeline trains nowhere: a later newcomer of that shape needing as much
    # finds none either while no swap happened in between. It sees the same donors (a pipeline's one rollout
    # cluster is the newcomer itself), the same ranks of them, and needs as much room; its own shrunk ranks and
    # its own pipeline's steps only rule more out. In a pool where every pipeline rolls out everywhere, two in
    # three newcomers found nothing, each after a walk over every donor (~25 ms a decision at 2,048 GPUs).
    failed: dict[int, tuple[int, int]] = {}
    swaps = 0
    donors = _SwapDonors(state, demands, training)
    for cid in starving:
        if state.wakes_left <= 0:
            return
        if not has_rollout_work(state, cid):
            continue  # its batch is complete: it takes no one's place (``gap_ratio.has_rollout_work``)
        spec = clusters[cid]
        shrunk = state.shrunk.get(cid, set())
        index = rank_index(spec)
        mine = bundles(spec)
        need = _extra(state, spec)
        shape = shape_id(spec)
        seen = failed.get(shape)
        if seen is not None and seen[0] == swaps and seen[1] <= need:
            continue
        # The donor with the best key that has a rank to give: the most awake ranks, then the lowest demand. Only
        # donors of the newcomer's TP size: a rank's GPUs must be one of the newcomer's bundles.
        for *_, donor in donors.of(spec.tp_size):
            dspec = clusters[donor]
            if dspec.pipeline_id == spec.pipeline_id:
                continue
            room_needed = need - _extra(state, dspec)  # what the GPU must have left once the donor's rank sleeps
            most = most_room(donor)
            if most is None or most < room_needed:
                continue  # no rank of this donor has the room (``rooms.has`` below would refuse every one)
            theirs = bundles(dspec)
            take: tuple[int, int] | None = None  # (acceptor rank, donor rank): the acceptor's lowest rank
            last = len(state.gen_active[donor]) < 2  # its last rank gives only beside its own pipeline's step
            # Sorted mappings, contiguous bundles: the donor's ranks in order cover the acceptor's in order, so the
            # first that may give is the acceptor's lowest.
            for drank in sorted(state.gen_active[donor]):
                bundle = theirs[drank]
                r = index.get(bundle[0])
                if (r is None or r in shrunk or mine[r] != bundle or (donor, drank) in protected
                        or (last and not all(_own_step_on(state, g, dspec) for g in bundle))):
                    continue
                if all(rooms.has(g, room_needed) for g in bundle) and \
                        all(_coresidable(state, g, spec, (donor,)) and not _own_step_on(state, g, spec)
                            for g in bundle):
                    take = (r, drank)
                    break
            if take is not None:
                state.shrink(donor, take[1], "rebalance")
                state.expand(cid, take[0], coresident=True)
                swapped(donor, spec.bundle(take[0]))
                donors.moved(donor, cid)
                swaps += 1
                break
        else:
            if not shrunk and spec.pipeline_id not in training and (seen is None or seen[0] != swaps or need < seen[1]):
                failed[shape] = (swaps, need)


class _SwapDonors:
    """The rollout clusters that may give a rank in the co-resident swap (at least two awake ranks, or a pipeline
    that trains), per TP size, in the order they give: the most awake ranks, then the lowest demand. Sorted once
    per TP size and kept in order at each swap (sorting every donor for every newcomer cost ~10 ms a decision at
    256 pipelines)."""

    def __init__(self, state: PlanState, demands: dict[str, int], training: set[str]) -> None:
        self._state, self._demands, self._training = state, demands, training
        self._by_tp: dict[int, list[tuple[int, int, str]]] = {}
        self._key: dict[str, tuple[int, int, str]] = {}  # each listed donor's entry

    def _entry(self, cid: str) -> tuple[int, int, str] | None:
        kept = self._state.gen_active.get(cid)
        if not kept or (len(kept) < 2 and self._state.snap.clusters[cid].pipeline_id not in self._training):
            return None
        return -len(kept), self._demands.get(cid, 0), cid

    def of(self, tp: int) -> list[tuple[int, int, str]]:
        """The donors of TP size ``tp``, in order: (-awake ranks, demand, cluster id). Read, never kept: a swap
        reorders it."""
        listed = self._by_tp.get(tp)
        if listed is None:
            clusters = self._state.snap.clusters
            listed = self._by_tp[tp] = sorted(e for c in self._state.gen_active
                                              if clusters[c].tp_size == tp and (e := self._entry(c)) is not None)
            self._key.update((e[2], e) for e in listed)
        return listed

    def moved(self, *cids: str) -> None:
        """The awake ranks of ``cids`` changed."""
        clusters = self._state.snap.clusters
        for cid in cids:
            listed = self._by_tp.get(clusters[cid].tp_size)
            if listed is None:
                continue
            old = self._key.pop(cid, None)
            if old is not None:
                del listed[bisect.bisect_left(listed, old)]
            new = self._entry(cid)
            if new is not None:
                bisect.insort(listed, new)
                self._key[cid] = new


def _own_step_on(state: PlanState, gpu: int, spec: ClusterSpec) -> bool:
    """Whether ``spec``'s pipeline holds a training-type allocation on ``gpu``."""
    return any(host.pipeline_id == spec.pipeline_id for host, _ in state.hosts(gpu))


def _yield_places(state: PlanState) -> None:
    """Give each rollout cluster that has work and still no rank a place that rollout ranks of other pipelines leave
    when they have no work (their progress reports nothing left to collect) or their pipeline owes it a turn: as
    many of them on one rank's GPUs as it takes to fit, a pipeline's last rank too (the longest waiter first; the
    lowest rank with room).

    Without it, co-residence could stall: two rollout ranks without work held a GPU together (a co-resident rank is
    never a gap-ratio donor, and the swap takes one rank at a time and never a last one), their pipelines' training
    waited for the turn they owed a third pipeline, and that pipeline's rollout fitted beside neither (simulated
    runs of three and four pipelines on one GPU made no progress; ``tests/control/test_turns.py``). Ranks without
    work go first, then those of debtors; only ranks of the newcomer's TP size that cover its rank's GPUs exactly.
    A newcomer whose own batch is complete (it asks to fill its next one) takes only a debtor's place: taking
    another's on its "no work" made two such pipelines take one place from each other every few seconds. Never a
    place beside the newcomer's own pipeline's training step (as the fill and the swap): a woken rank first
    receives its pipeline's weights, which its trainer sends only once that step has ended, so it would hold the
    place idle through the step (19.6 s on an H200, while the rank it displaced had been generating)."""
    if not state.tenants:
        return
    snap = state.snap
    clusters = snap.clusters
    demands = cluster_demands(state)
    starving = _starving(state, demands)
    # no work: its progress says its batches are complete (a cluster that has not reported yet is not idle)
    done = {d for d in state.gen_active
            if snap.progress.get(clusters[d].pipeline_id) is not None and demands.get(d, 0) <= 0}
    for cid in starving:
        spec = clusters[cid]
        owed = {d for d, creditors in snap.turns_owed.items() if spec.pipeline_id in creditors}
        # bundle -> the ranks there that yield to this cluster, those without work first
        yielding: dict[tuple[int, ...], list[tuple[bool, str, int]]] = {}
        debtors = {c for c in state.gen_active if clusters[c].pipeline_id in owed} if owed else set()
        # a cluster whose batch is complete takes only a debtor's place (``gap_ratio.has_rollout_work``)
        givers = (done | debtors) if has_rollout_work(state, cid) else debtors
        for d in sorted(givers):
            active = state.gen_active.get(d)
            dspec = clusters[d]
            if not active or dspec.pipeline_id == spec.pipeline_id or dspec.tp_size != spec.tp_size:
                continue
            no_work = d in done
            theirs = bundles(dspec)
            for drank in active:
                if (d, drank) not in state.protected:
                    yielding.setdefault(theirs[drank], []).append((not no_work, d, drank))
        if not yielding:
            continue
        index, mine, shrunk = rank_index(spec), bundles(spec), state.shrunk.get(cid, set())
        for bundle in sorted(yielding, key=lambda b: index.get(b[0], len(mine))):
            r = index.get(bundle[0])
            if r is None or r in shrunk or mine[r] != bundle or any(_own_step_on(state, g, spec) for g in bundle):
                continue
            cands = sorted(yielding[bundle])
            k = next((k for k in range(1, len(cands) + 1)
                      if all(_coresidable(state, g, spec, {d for _, d, _ in cands[:k]}, alone=True) for g in bundle)),
                     None)
            if k is None:
                continue
            left = {d for _, d, _ in cands[:k]}
            idle = [not state.hosts(g) and set(state.generation_holders(g)) <= left for g in bundle]
            if any(idle) and not all(idle):
                continue  # some of its GPUs left idle, some still held: not one place (the gap ratio's, next cycle)
            for _, d, drank in cands[:k]:
                state.shrink(d, drank, "rebalance")
            state.expand(cid, r, coresident=not all(idle))
            break


def _starving(state: PlanState, demands: dict[str, int]) -> list[str]:
    """Rollout clusters with work and no active rank (none waking, none released this cycle), the longest waiter
    first."""
    snap, clusters = state.snap, state.snap.clusters
    waiting = snap.generation_waiting_since
    return sorted((c for c, d in demands.items() if d > 0 and c not in state.gen_active
                   and c not in snap.expanding and c not in state.released),
                  key=lambda c: (waiting.get(c, -1), clusters[c].pipeline_id, c))


def _extra(state: PlanState, spec: ClusterSpec) -> int:
    """What waking a rank of ``spec`` adds to a GPU's load (``coresidence`` units; the same on each of its GPUs)."""
    return state.tenants[spec.device_mapping[0]].extra.get(spec.cluster_id, 0) if spec.device_mapping else 0


def _coresidable(state: PlanState, gpu: int, spec: ClusterSpec, leaving: Collection[str] = (), *,
                 alone: bool = False) -> bool:
    """Whether a rank of ``spec`` may wake on ``gpu`` next to its holders, once the ranks of ``leaving`` there sleep
    (the co-resident swap, the yield phase). An idle GPU is the gap ratio's: where no holder stays, only with
    ``alone`` (the yield phase), and then where its figures fit."""
    owner = state.owner.get(gpu)
    if owner is None or gpu in state.reserved or gpu in state.snap.fenced_gpus:
        return False
    clusters = state.snap.clusters
    hosts = state.hosts(gpu)
    generation = [clusters[c] for c in state.generation_holders(gpu) if c not in leaving]
    if not hosts and not generation:
        return alone and fits(state.tenants, gpu, [spec.cluster_id])
    return sharing_problem(state.tenants, gpu, [*generation, spec], hosts) is None


def _generation_grants(state: PlanState) -> None:
    snap = state.snap
    seen: set[str] = set()
    for req in sorted((r for r in snap.pending if r.priority == Priority.GENERATION), key=lambda r: r.seq):
        cid = req.cluster_id
        if cid in seen or cid in snap.planned_releases or cid not in state.gen_active or cid in snap.expanding:
            continue  # (with an expand in flight, the grant waits for its ranks to wake: the return starts a cycle)
        seen.add(cid)
        gpus = snap.clusters[cid].gpus_of(state.gen_active[cid])
        state.grants.append(Grant(cid, Priority.GENERATION, req.seq, gpus))
