"""The scheduling decision, as pure functions over frozen records (no Ray, no torch).

``plan_cycle(snapshot) -> CyclePlan`` is one scheduling cycle. Phases, in order:

1. **Planned releases** (``await_release``): every active rank of each cluster in ``snapshot.planned_releases``
   is shrunk (reason ``"release"``); the cluster is listed in ``plan.released`` and takes no part in the gap
   ratio this cycle.
2. **Non-generation requests** (priorities 0-5), by ``(priority, seq)``. Each needs its cluster's *whole* device
   mapping. GPUs held by GENERATION ranks (of any pipeline, including its own) are taken by preempting every
   rank whose bundle overlaps the mapping (reason ``"preempt"``); the rest of such a bundle becomes idle.
   A request that cannot be satisfied now (a GPU is held by another non-generation allocation, or is needed by
   an earlier request that is still waiting) **waits and reserves its whole mapping**: no later request (lower
   priority, or same priority with a larger ``seq``) is granted any of those GPUs, and the gap ratio does not
   wake ranks on idle reserved GPUs. A waiting request preempts nothing (its generation neighbours keep working
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
5. **Co-resident swap** (anti-starvation on shared GPUs): a rollout cluster with work that still has no active rank
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

from rlix_plugins.control.registration import validate_cluster_specs
from rlix_plugins.control.scheduling.coresidence import sharing_problem
from rlix_plugins.control.scheduling.gap_ratio import cluster_demands, plan_gap_ratio
from rlix_plugins.control.scheduling.invariants import PlanInvariantError, validate_plan, validate_snapshot
from rlix_plugins.control.scheduling.plan_state import PlanState, rank_index
from rlix_plugins.control.scheduling.turns import deferred, owed_gpus
from rlix_plugins.control.types import Allocation, ClusterSpec, CyclePlan, Grant, Priority, SchedulerSnapshot

__all__ = [
    "PlanInvariantError",
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
    state.reserved |= snapshot.release_grace_gpus & state.free
    _coresident_fill(state, starving_only=True)
    plan_gap_ratio(state)
    _coresident_fill(state)
    _coresident_swap(state)
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
        blocked = not need.isdisjoint(state.reserved) or not need.isdisjoint(snap.fenced_gpus) or any(
            (o := state.owner.get(g)) is not None and o in state.nongen for g in need
        )
        victims = [] if blocked else _preemptions(state, spec, Priority(req.priority), need)
        # A rank of a cluster with an expand in flight cannot be put to sleep now: wait for that expand to return.
        if blocked or any(cid in snap.expanding for cid, _ in victims):
            state.reserved |= need
            continue
        for gen_cid, rank in victims:
            state.shrink(gen_cid, rank, "preempt")
        state.allocate(req.cluster_id, Priority(req.priority), need)
        state.grants.append(Grant(req.cluster_id, Priority(req.priority), req.seq, need))


def _preemptions(state: PlanState, spec: ClusterSpec, priority: Priority,
                 need: frozenset[int]) -> list[tuple[str, int]]:
    """The generation ranks (cluster, rank) a grant of ``need`` to ``spec`` puts to sleep: every rank that overlaps
    the mapping (its own pipeline's included), unless it may stay awake next to this work and the ranks kept before
    it (co-residence). Reads ``state`` only."""
    clusters = state.snap.clusters
    kept: dict[int, list[ClusterSpec]] = {}
    victims: list[tuple[str, int]] = []
    # Where not every co-tenant fits, the pipelines with the fewest awake ranks stay first: kept in cluster-id order,
    # the same pipeline lost its rank to every training step on three GPUs and stepped 132 s instead of 75 (DESIGN §9).
    def keep_order(c: str) -> tuple[int, str]:
        return len(state.gen_active.get(c, ())), c

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


def _may_stay(state: PlanState, spec: ClusterSpec, rank: int, host: ClusterSpec, priority: Priority,
              need: frozenset[int], kept: dict[int, list[ClusterSpec]]) -> bool:
    """Whether ``spec``'s ``rank`` may stay awake on the GPUs of ``need`` that ``host`` is granted now, next to the
    ranks ``kept`` there so far."""
    if not state.tenants:
        return False
    return all(sharing_problem(state.tenants, g, [*kept.get(g, ()), spec], host, priority) is None
               for g in spec.bundle(rank) if g in need)


def _coresident_fill(state: PlanState, *, starving_only: bool = False) -> None:
    """Wake rollout ranks that want a GPU next to the GPU's holders where they fit (``coresidence``).

    Clusters with no active rank go first (the longest waiter first), then the others, by pipeline id; a cluster
    takes every rank it can. Never on a GPU a waiting request reserves, never one of its ranks shrunk this cycle.
    ``starving_only``: only clusters with no active rank and no idle, unreserved GPU in their mapping.
    """
    if not state.tenants:
        return
    snap = state.snap
    clusters = snap.clusters
    demands = cluster_demands(state)
    waiting = snap.generation_waiting_since
    usable = state.free - state.reserved
    order = sorted((c for c, d in demands.items() if d > 0 and not (
                       starving_only and (c in state.gen_active or not usable.isdisjoint(clusters[c].device_mapping)))),
                   key=lambda c: (c in state.gen_active, waiting.get(c, -1), clusters[c].pipeline_id, c))
    for cid in order:
        spec = clusters[cid]
        active = state.gen_active.get(cid, set())
        shrunk = state.shrunk.get(cid, set())
        for r in range(spec.num_dp_ranks):
            if r in active or r in shrunk:
                continue
            if all(_coresidable(state, g, spec) for g in spec.bundle(r)):
                state.expand(cid, r, coresident=True)


def _coresident_swap(state: PlanState) -> None:
    """Give each rollout cluster that has work and still no active rank one rank on a shared GPU, in place of a
    co-resident rollout rank of another pipeline that keeps at least one other rank (the longest waiter first).

    Only where the GPUs of the rank stay held by someone else after the swap (an idle GPU is the gap ratio's), the
    donor rank covers the same GPUs, is not protected (woken this cycle, or an expand in flight) and the newcomer
    fits next to the holders that stay (``coresidence.sharing_problem``). The donor with the most awake ranks gives,
    ties to the lowest demand. The newcomer's rank is co-resident, so no gap ratio takes it back; it leaves like
    any other rank (preemption, release)."""
    if not state.tenants:
        return
    snap = state.snap
    clusters = snap.clusters
    waiting = snap.generation_waiting_since
    demands = cluster_demands(state)
    starving = sorted((c for c, d in demands.items() if d > 0 and c not in state.gen_active
                       and c not in snap.expanding and c not in state.released),
                      key=lambda c: (waiting.get(c, -1), clusters[c].pipeline_id, c))
    for cid in starving:
        spec = clusters[cid]
        shrunk = state.shrunk.get(cid, set())
        best: tuple[tuple[int, int, str], str, int, int] | None = None  # (key, donor, its rank, acceptor rank)
        for r in range(spec.num_dp_ranks):
            if r in shrunk:
                continue
            bundle = spec.bundle(r)
            for donor in state.generation_holders(bundle[0]):
                dspec = clusters[donor]
                drank = rank_index(dspec)[bundle[0]]
                kept = state.gen_active.get(donor, set())
                if (dspec.pipeline_id == spec.pipeline_id or len(kept) < 2 or (donor, drank) in state.protected
                        or tuple(dspec.bundle(drank)) != tuple(bundle)):
                    continue
                if not all(_coresidable(state, g, spec, leaving=donor) for g in bundle):
                    continue
                key = (-len(kept), demands.get(donor, 0), donor)
                if best is None or key < best[0]:
                    best = (key, donor, drank, r)
        if best is not None:
            _, donor, drank, r = best
            state.shrink(donor, drank, "rebalance")
            state.expand(cid, r, coresident=True)


def _coresidable(state: PlanState, gpu: int, spec: ClusterSpec, leaving: str | None = None) -> bool:
    """Whether a rank of ``spec`` may wake on ``gpu`` next to its holders (an idle GPU is the gap ratio's), once
    ``leaving``'s rank there sleeps (the co-resident swap; someone must still hold the GPU then)."""
    owner = state.owner.get(gpu)
    if owner is None or gpu in state.reserved or gpu in state.snap.fenced_gpus:
        return False
    clusters = state.snap.clusters
    host = state.nongen.get(owner)
    generation = [clusters[c] for c in state.generation_holders(gpu) if c != leaving]
    if host is None and not generation:
        return False  # idle once ``leaving`` sleeps: the gap ratio's
    return sharing_problem(state.tenants, gpu, [*generation, spec], clusters[owner] if host else None,
                           Priority(host.priority) if host else None) is None


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
