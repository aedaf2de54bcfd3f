"""Gap-ratio division of rollout GPUs between generation clusters (pure; called by ``planner.plan_cycle``).

Model (after the reference ``plan_generation_gap_ratio``, with its starvation gap closed):

* **Eligible** receivers: registered generation clusters that are not being released this cycle, do not hold a
  non-GENERATION allocation (e.g. INITIALIZATION), and have a pending GENERATION request or active ranks.
* **Demand** of a cluster (:func:`rollout_demand`, shared with the scheduler's rebalance trigger):
  ``progress.remaining`` of its pipeline when progress is known and positive;
  otherwise, with a pending GENERATION request, the request's ``step_target_estimate`` (1 when absent, so a
  pipeline with neither progress nor an estimate is never skipped: its ranks would never wake and its collector
  would stall); otherwise 0.
  Progress wins over the estimate, so a standing request (re-issued by the scheduler while work is left) never
  masks how much work is really left.
* ``weight = demand x tp``; ``budget`` = idle GPUs that no waiting non-generation request reserves and that
  some eligible cluster may use, plus all active generation GPUs.
* ``target = max(round_half_up(weight / Σweight x budget / tp) x tp, tp)`` capped at the mapping size: every
  eligible receiver is owed at least one bundle.
* Iteration (one activation per iteration, capped): the acceptor furthest below target (clusters with no active
  rank first, then normalised gap, among clusters with no active rank the one waiting longest
  (``snapshot.generation_waiting_since``), gap, pipeline id) takes one bundle. Candidates prefer no shrink, then donors
  with more remaining work (protecting nearly finished pipelines), then the lower DP rank. Donors are clusters
  above target and shrink at most down to ``max(1 bundle, target)`` ("donors keep their target"); an acceptor
  with **no** active rank may also take from a donor at target that keeps ≥1 rank (anti-starvation), and, when
  its pipeline really has rollout work (progress unknown or ``remaining > 0``), the LAST rank of a donor whose
  pipeline reported its step's rollout complete and asks for nothing: an idle pipeline never keeps a GPU that
  a pipeline without any rank waits for (with more pipelines than bundles the waiter would otherwise wait until
  the idle one trains, and a host that trains only once every pipeline is up never does). Fair turns
  (``scheduling.turns``): an acceptor with no rank that another pipeline owes a turn goes first and may take that
  pipeline's last rank. A shrink
  search scores at most ``MAX_CANDIDATES`` bundles (bounded latency on fragmented pools).
* Finally a work-conserving fill: idle, unreserved bundles go to eligible clusters with demand > 0 (least GPUs
  per unit of weight first). It never shrinks anybody.

Ranks woken in this cycle are protected (never shrunk again in the same cycle), so a plan never both removes
and adds the same rank.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Container, Iterable, Iterator

from rlix_plugins.control.scheduling.plan_state import (
    PlanState,
    bundles,
    mappings_overlap,
    rank_index,
    shape_id,
)
from rlix_plugins.control.types import PendingRequest, Priority, Progress, SchedulerSnapshot

#: Caps per cycle. An activation (a donor search, its shrinks and a wake) costs ~0.1 ms at 2,048 GPUs without
#: memory figures and 0.4-1.3 ms with them, so one decision activates at most 32 ranks (13-43 ms); the scheduler runs
#: the next cycle at once after one that changed something, and those activate the rest (a random busy pool of 256
#: pipelines asked ~500 activations of one decision: 50-110 ms).
MAX_ITERATIONS = 10_000
MAX_ACTIVATIONS = 32
#: Candidate bundles scored per activation that needs a shrink (bounds the cost on fragmented pools; the
#: best of those scored is taken).
MAX_CANDIDATES = 16


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def rollout_demand(progress: Progress | None, request: PendingRequest | None) -> int:
    """THE demand rule (trajectories) of one generation cluster; the planner and the scheduler's rebalance
    trigger (``rebalance.rebalance_reason``) both get their demand from here, so they never disagree.

    ``progress.remaining`` when positive; otherwise, with a pending GENERATION request, the request's
    ``step_target_estimate`` (>= 1: a pipeline that asks is never skipped, even when its last progress report says
    its step is complete; skipped, its ranks would never wake); otherwise 0.
    """
    demand = progress.remaining if progress is not None else 0
    if request is not None and demand == 0:
        demand = max(request.step_target_estimate or 1, 1)
    return demand


def generation_demands(snap: SchedulerSnapshot, nongen: Container[str], gen_active: Container[str]) -> dict[str, int]:
    """Demand of every ELIGIBLE generation cluster, by cluster id (see the module docstring).

    Eligible: registered generation cluster, not released this cycle, not holding a non-GENERATION allocation
    (``nongen``), with a pending GENERATION request or active ranks (``gen_active``).
    """
    pending_gen: dict[str, PendingRequest] = {}
    for req in snap.pending:
        if req.priority == Priority.GENERATION and req.cluster_id not in pending_gen:
            pending_gen[req.cluster_id] = req
    demands: dict[str, int] = {}
    for cid, spec in snap.clusters.items():
        if not spec.is_generation or cid in snap.planned_releases or cid in nongen:
            continue
        preq = pending_gen.get(cid)
        if preq is None and cid not in gen_active:
            continue
        demands[cid] = rollout_demand(snap.progress.get(spec.pipeline_id), preq)
    return demands


def note_generation_waits(waiting_since: dict[str, int], snap: SchedulerSnapshot, clock: Iterator[int]) -> None:
    """Update ``waiting_since`` (cluster id -> logical time it started waiting) for ``snap``: a generation cluster
    with a pending GENERATION request (a waiter or a standing one) and no active rank keeps the time it was first
    seen so; any other cluster is dropped (it got a rank, stopped asking, or left). The scheduler and the
    simulator call this on every snapshot they build and pass a copy as ``snapshot.generation_waiting_since``."""
    asking = {r.cluster_id for r in snap.pending if r.priority == Priority.GENERATION}
    for cid in sorted(asking):
        alloc = snap.allocations.get(cid)
        if alloc is not None and alloc.priority == Priority.GENERATION and alloc.active_dp_ranks:
            asking.discard(cid)
        elif cid not in waiting_since:
            waiting_since[cid] = next(clock)
    for cid in [c for c in waiting_since if c not in asking]:
        del waiting_since[cid]


def cluster_demands(state: PlanState) -> dict[str, int]:
    """Demand of every eligible generation cluster in the planner's working state, by cluster id."""
    return generation_demands(state.snap, state.nongen, state.gen_active)


def _targets(state: PlanState, demands: dict[str, int]) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """(eligible cluster ids, weights, target GPUs) for the current working state."""
    clusters = state.snap.clusters
    eligible = sorted(demands)
    # Usable idle GPUs in some eligible mapping: each mapping is asked about the GPUs not found yet only (at 2,048
    # GPUs an intersection per whole mapping cost 10 ms a cycle), and the search ends once every one is found.
    unreached = state.free - state.reserved
    usable = len(unreached)
    for cid in eligible:
        if not unreached:
            break
        idx = rank_index(clusters[cid])
        unreached = {g for g in unreached if g not in idx}
    budget = usable - len(unreached) + sum(state.active_gpus(cid) for cid in eligible)
    weights = {cid: demands[cid] * clusters[cid].tp_size for cid in eligible}
    total_w = sum(weights.values())
    targets: dict[str, int] = {}
    for cid in eligible:
        spec = clusters[cid]
        tp = spec.tp_size
        t = round_half_up(weights[cid] / total_w * budget / tp) * tp if total_w > 0 else tp
        targets[cid] = min(max(t, tp), len(spec.device_mapping))
    return eligible, weights, targets


def generation_targets(snapshot: SchedulerSnapshot) -> dict[str, int]:
    """Target GPUs per eligible generation cluster for ``snapshot`` as it stands (before any phase runs).

    For observability (``rlix status``) and tests; ``plan_cycle`` computes its targets after the planned
    releases and non-generation grants of the same cycle.
    """
    state = PlanState.from_snapshot(snapshot)
    return _targets(state, cluster_demands(state))[2]


def plan_gap_ratio(state: PlanState) -> None:
    """Mutate ``state`` with rebalance shrinks and expands for the eligible generation clusters."""
    clusters = state.snap.clusters
    demands = cluster_demands(state)
    if not demands or state.wakes_left <= 0:
        return
    eligible, weights, targets = _targets(state, demands)
    donors_info = _Donors(state, eligible, targets, demands)

    waiting_since = state.snap.generation_waiting_since
    owed = set().union(*state.snap.turns_owed.values()) if state.snap.turns_owed else set()

    def key(cid: str) -> tuple[bool, bool, float, int, int, str, str] | None:
        a = state.active_gpus(cid)
        t = targets[cid]
        if a >= t:
            return None
        gap = t - a
        # Among clusters with no active rank a pipeline owed a turn goes first, then the longest waiter (turns on
        # a contended bundle).
        waited = waiting_since.get(cid, -1) if a == 0 else 0
        pid = clusters[cid].pipeline_id
        return (a > 0, a > 0 or pid not in owed, -gap / t, waited, -gap, pid, cid)

    # Lazy heap of acceptors: an entry is re-checked against the current key when popped.
    heap = [(k, cid) for cid in eligible if (k := key(cid)) is not None]
    heapq.heapify(heap)
    stuck: set[str] = set()
    activations = 0
    for _ in range(MAX_ITERATIONS):
        if activations >= MAX_ACTIVATIONS or not heap or state.wakes_left <= 0:
            break
        k, cid = heapq.heappop(heap)
        if cid in stuck:
            continue
        cur = key(cid)
        if cur is None:
            continue
        if cur != k:
            heapq.heappush(heap, (cur, cid))
            continue
        donors = _activate_one(state, cid, targets, demands, donors_info)
        if donors is None:
            stuck.add(cid)
            continue
        activations += 1
        for c in (cid, *donors):
            donors_info.update(c)
            if demands[c] == 0:
                continue  # an idle donor that gave its last rank away does not want one back
            kc = key(c)
            if kc is not None:
                heapq.heappush(heap, (kc, c))

    _fill_idle(state, eligible, weights, demands, targets, min(MAX_ACTIVATIONS - activations, state.wakes_left))


class _Donors:
    """Per-cycle donor bookkeeping of the gap ratio (keeps each shrink search off the whole cluster list).

    ``order``: eligible clusters as ``(-demand, cluster id)``, sorted (donors are visited by decreasing demand);
    ``floors``: max(1, target bundles), the rank count a donor keeps for a non-starving acceptor; ``surplus``:
    clusters holding more ranks than their floor (the only donors of a non-starving acceptor). The budgets (ranks
    a donor may give up now, none when <= 0) by kind of acceptor: ``spare`` down to its floor (an acceptor with
    ranks), ``spare_starving`` down to one rank (an acceptor without any), ``spare_idle`` as that but down to none
    for a donor whose pipeline reported its rollout complete and asks for nothing (an acceptor without any rank
    and with rollout work). All kept current by ``update`` after every activation; ``.get(d, 0)``: a cluster
    that is no donor has no budget.

    Two indexes keep the candidate scan (``_activate_one``) off per-candidate lookups and sorts; both are kept
    current by ``moved`` after every activation of the gap-ratio loop (the only place ``state`` changes while they
    live): ``ranks``: each eligible cluster's active ranks that may be shrunk (not protected), sorted (the scan
    visits a donor's ranks in that order; sorting its set on every visit cost more than the scan at 2,048 GPUs);
    ``holder``: GPU -> (cluster, DP rank) of the one generation rank that holds it alone, for GPUs that are not
    fenced, hold no co-resident rank and no non-GENERATION allocation, and whose rank is not protected: exactly the
    busy GPUs whose holder a candidate may shrink. A GPU outside it is idle, or one no candidate may take.

    ``epoch`` counts the activations (every change of ``state`` in the loop); ``failed``: (mapping shape
    (``plan_state.shape_id``), budget kind) -> the epoch in which an acceptor of that shape with no rank shrunk this
    cycle found no candidate, where the budget kind is ``floor`` for an acceptor with ranks and not above its floor,
    ``idle`` / ``starving`` for one without ranks (with rollout work or not) that no pipeline owes a turn. Another
    such acceptor of the same key in the same epoch finds none either: it sees the same donors with the same budgets
    over the same bundles (a starving acceptor is nobody's donor; one at its floor is no donor of another such), and
    the only candidates the two score differently, each one's own active ranks, fail for the other (held by a
    cluster at its floor; a starving acceptor has none). In the pool layout a failed search of a TP-4 acceptor with
    ranks scored ~90 candidates, a starving one's walked every awake rank of the pool (~1.5 ms at 2,048 GPUs, ~440
    of them in two random busy decisions), and most acceptors that fail follow one that failed, with nothing changed
    in between.
    """

    def __init__(self, state: PlanState, eligible: list[str], targets: dict[str, int], demands: dict[str, int]) -> None:
        clusters = state.snap.clusters
        self._state = state
        self.order = sorted((-demands[c], c) for c in eligible)
        self.floors = {c: max(1, targets[c] // clusters[c].tp_size) for c in eligible}
        self.rank_of = {c: rank_index(clusters[c]) for c in eligible}
        self.bundles = {c: bundles(clusters[c]) for c in eligible}
        self._idle = {c for c in eligible if demands[c] == 0 and _reported_idle(state, c)}
        self.surplus: set[str] = set()
        self.spare: dict[str, int] = {}
        self.spare_starving: dict[str, int] = {}
        self.spare_idle: dict[str, int] = {}
        for c in eligible:
            self.update(c)
        protected = state.protected
        self.ranks = {c: [r for r in sorted(rs) if (c, r) not in protected]
                      for c, rs in state.gen_active.items() if c in self.floors}
        self.holder: dict[int, tuple[str, int]] = {}
        self._refresh(state.owner)
        self.epoch = 0
        self.failed: dict[tuple[int, str], int] = {}

    def _refresh(self, gpus: Iterable[int]) -> None:
        """Recompute ``holder`` for ``gpus`` from the state's owner, co-resident, non-generation and fence maps."""
        state = self._state
        owner, coresident, nongen, fenced = state.owner, state.coresident, state.nongen, state.snap.fenced_gpus
        clusters, protected, rank_of = state.snap.clusters, state.protected, self.rank_of
        holder = self.holder
        for g in gpus:
            o = owner.get(g)
            if o is None or o in nongen or g in coresident or g in fenced:
                holder.pop(g, None)
                continue
            ranks = rank_of.get(o)
            victim = (o, (ranks if ranks is not None else rank_index(clusters[o]))[g])
            if victim in protected:
                holder.pop(g, None)
            else:
                holder[g] = victim

    def moved(self, victims: list[tuple[str, int]], cid: str, rank: int) -> None:
        """``victims`` were shrunk and ``rank`` of ``cid`` woken."""
        self.epoch += 1
        holder, owner = self.holder, self._state.owner
        for d, dr in victims:
            lst = self.ranks.get(d)
            if lst is not None:
                i = bisect.bisect_left(lst, dr)
                if i < len(lst) and lst[i] == dr:
                    del lst[i]
            gpus = self.bundles[d][dr] if d in self.bundles else self._state.snap.clusters[d].bundle(dr)
            for g in gpus:
                holder.pop(g, None)  # idle now, or held by a co-resident rank that stayed (looked up again)
            self._refresh([g for g in gpus if g in owner])
        for g in self.bundles[cid][rank]:
            holder.pop(g, None)  # woken this cycle: protected, never a victim (and never in ``ranks``)

    def update(self, cid: str) -> None:
        n = len(self._state.gen_active.get(cid, ()))
        spare = self.spare[cid] = n - self.floors[cid]
        self.spare_starving[cid] = n - 1
        self.spare_idle[cid] = n if cid in self._idle else n - 1
        if spare > 0:
            self.surplus.add(cid)
        else:
            self.surplus.discard(cid)


def _free_candidate(state: PlanState, cid: str) -> int | None:
    """Lowest inactive DP rank of ``cid`` whose whole bundle is idle and unreserved, if any."""
    spec = state.snap.clusters[cid]
    idx = rank_index(spec)
    free, reserved = state.free, state.reserved
    # Visit the smaller side: a full pool has few idle GPUs, an idle pool small mappings.
    hits = {g for g in free if g in idx} if len(free) < len(idx) else idx.keys() & free
    if reserved:
        hits -= reserved
    shrunk = state.shrunk.get(cid, ())
    tp = spec.tp_size
    # Mappings are sorted and bundles contiguous, so increasing GPU ids visit the ranks in increasing order.
    for g in sorted(hits):
        r = idx[g]
        if r in shrunk:
            continue
        if tp == 1 or all(g in free and g not in reserved for g in spec.bundle(r)):
            return r
    return None


def has_rollout_work(state: PlanState, cid: str) -> bool:
    """Whether the pipeline of ``cid`` reported work left in its step, or has reported nothing yet (new, or back
    after a planned release). A request whose progress says "step complete" (a watchdog re-request while the
    batch waits for training, or an async collector filling its next batch while the step trains) does not count:
    it must not take another pipeline's rank (the gap ratio's last-rank rule, the co-resident swap, the places that
    yield): two pipelines whose batches were complete took one GPU's only rollout place from each other every few
    seconds, each taking on the other's "no work" (one H200, two 1.5B pipelines)."""
    progress = state.snap.progress.get(state.snap.clusters[cid].pipeline_id)
    return progress is None or progress.remaining > 0


def _owers(state: PlanState, pipeline_id: str) -> set[str]:
    """Pipelines that owe ``pipeline_id`` a turn (``SchedulerSnapshot.turns_owed``)."""
    return {x for x, waiters in state.snap.turns_owed.items() if pipeline_id in waiters}


def _reported_idle(state: PlanState, cid: str) -> bool:
    """Whether the pipeline of ``cid`` reported its step's rollout complete (a cluster that reported nothing is
    never called idle: its demand is unknown, not zero)."""
    progress = state.snap.progress.get(state.snap.clusters[cid].pipeline_id)
    return progress is not None and progress.remaining == 0


def _activate_one(
    state: PlanState,
    cid: str,
    targets: dict[str, int],
    demands: dict[str, int],
    donors_info: _Donors | None = None,
) -> list[str] | None:
    """Wake one bundle of ``cid``; returns the donors shrunk for it (maybe none), or None if impossible.

    Without ``donors_info`` only an idle bundle is taken.
    """
    r = _free_candidate(state, cid)
    if r is not None:
        state.expand(cid, r)
        if donors_info is not None:
            donors_info.moved([], cid, r)
        return []
    if donors_info is None:
        return None
    clusters = state.snap.clusters
    spec = clusters[cid]
    gen_active = state.gen_active
    starving = cid not in gen_active
    active = gen_active.get(cid, set())
    shrunk = state.shrunk.get(cid, set())
    memo: tuple[int, str] | None = None  # (shape, budget kind) when the search is the same for every such acceptor
    if not starving:
        budget = donors_info.spare
        if cid not in donors_info.surplus and not shrunk:
            memo = (shape_id(spec), "floor")
    else:
        work = has_rollout_work(state, cid)
        budget = donors_info.spare_idle if work else donors_info.spare_starving
        owers = _owers(state, spec.pipeline_id)
        if owers:  # fair turns: a donor that owes this pipeline a turn gives its last rank too
            budget = {**budget, **{d: len(r) for d, r in gen_active.items() if clusters[d].pipeline_id in owers}}
        elif not shrunk:
            memo = (shape_id(spec), "idle" if work else "starving")
    if memo is not None and donors_info.failed.get(memo) == donors_info.epoch:
        return None  # an acceptor of this shape and budget found no candidate in this very state (``_Donors.failed``)
    # Candidates are bundles touching a rank of a donor with budget left (no free bundle exists). Donors are
    # visited by decreasing demand (``donor_order``) and their ranks by increasing GPU id (= increasing acceptor
    # rank, mappings being sorted and bundles contiguous), so the scan stops at the first single-victim candidate.
    idx = donors_info.rank_of[cid]
    my_bundles = donors_info.bundles[cid]
    free, reserved = state.free, state.reserved
    owner, donor_ranks = state.owner, donors_info.ranks
    # bound methods: the loops below run ~10^4 times per cycle at 2,048 GPUs
    holder_of, budget_of, rank_in = donors_info.holder.get, budget.get, idx.get
    best: tuple[int, int, int] | None = None
    best_victims: list[tuple[str, int]] = []
    seen: set[int] = set()
    capped = False  # MAX_CANDIDATES scored with a best: no later candidate is scored, so the scan ends
    # Any active donor may give to a starving acceptor (down to one rank, or none when idle), only donors above
    # their floor to the others. Keep those holding a GPU of the acceptor's mapping: by scanning the mapping when
    # it is small, else by a (cached) mapping-overlap test per donor.
    pool = gen_active if starving else donors_info.surplus
    holders = {owner[g] for g in spec.device_mapping if g in owner} if len(spec.device_mapping) <= 4 * len(pool) else None
    # A non-starving acceptor's pool (clusters above their floor) is small: visit it alone, in the same order.
    order = donors_info.order if starving else sorted((-demands[d], d) for d in pool)
    for neg_demand, donor in order:
        if capped or (best is not None and best[0] == 1 and best[1] < neg_demand):
            break
        if donor not in pool or donor == cid or (holders is not None and donor not in holders):
            continue
        if budget_of(donor, 0) <= 0:
            continue
        if holders is None and not mappings_overlap(spec, clusters[donor]):
            continue
        dbundles = donors_info.bundles[donor]
        done = False
        for dr0 in donor_ranks.get(donor, ()):  # its active, unprotected ranks, sorted
            if done:
                break
            for g0 in dbundles[dr0]:
                r = rank_in(g0)
                if r is None or r in seen:
                    continue
                seen.add(r)
                if r in active or r in shrunk:
                    continue
                if len(seen) > MAX_CANDIDATES and best is not None:
                    capped = done = True
                    break
                # g0 is in the candidate: where nobody may give it and it is not an unreserved idle GPU (a
                # co-resident guest's, a fenced or non-generation holder's, a rank woken this cycle), the candidate
                # is invalid, as the walk below would find first thing there (the walk has no other effect). With
                # memory figures most are: ~99% of 137,000 candidates over 12 converging pool decisions.
                if holder_of(g0) is None and (g0 not in free or g0 in reserved):
                    continue
                # The donor ranks this candidate would shrink (a bundle holds few GPUs: a list), and the lowest
                # demand among their donors; invalid (break) on a reserved idle GPU, a fenced GPU (``fences``), a
                # GPU of a cluster that may not give (no budget: non-generation holders included), a rank woken
                # this cycle (not in ``holder``, like the others), or more ranks of one donor than its budget.
                victims: list[tuple[str, int]] = []
                min_donor_demand = -1
                for g in my_bundles[r]:
                    victim = holder_of(g)
                    if victim is None:  # idle, or fenced, co-resident (never given: coresidence) or non-generation
                        if g in free and g not in reserved:
                            continue
                        break
                    d = victim[0]
                    b = budget_of(d, 0)
                    if b <= 0:
                        break
                    if victim in victims:
                        continue
                    if b <= len(victims) and sum(v[0] == d for v in victims) >= b:
                        break
                    victims.append(victim)
                    dd = demands[d]
                    if min_donor_demand < 0 or dd < min_donor_demand:
                        min_donor_demand = dd
                else:
                    key = (len(victims), -min_donor_demand, r)
                    if best is None or key < best:
                        best, best_victims = key, victims
                    if best[0] == 1 and best[1] <= neg_demand:
                        done = True  # later ranks of this donor map to higher acceptor ranks: they cannot beat it
                        break
    if best is None:
        if memo is not None:
            donors_info.failed[memo] = donors_info.epoch
        return None
    for d, dr in best_victims:
        state.shrink(d, dr, "rebalance")
    state.expand(cid, best[2])
    donors_info.moved(best_victims, cid, best[2])
    return sorted({d for d, _ in best_victims})


def _fill_idle(
    state: PlanState,
    eligible: list[str],
    weights: dict[str, int],
    demands: dict[str, int],
    targets: dict[str, int],
    cap: int,
) -> None:
    """Give idle, unreserved bundles to clusters with demand (fewest GPUs per weight first). Never shrinks."""
    if not state.free:
        return
    heap = [(state.active_gpus(cid) / weights[cid], cid) for cid in eligible if demands[cid] > 0]
    heapq.heapify(heap)
    while cap > 0 and heap and state.free:
        _, cid = heapq.heappop(heap)
        if _activate_one(state, cid, targets, demands) is not None:
            cap -= 1
            heapq.heappush(heap, (state.active_gpus(cid) / weights[cid], cid))
