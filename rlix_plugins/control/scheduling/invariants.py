"""Invariants of snapshots and plans (pure). The scheduler calls ``validate_plan`` every cycle before executing.

Each failure raises ``PlanInvariantError(invariant, message)``; ``invariant`` is one of ``INVARIANTS``.
"""

from __future__ import annotations

from rlix_plugins.control.scheduling.coresidence import Tenants, gpu_tenants, sharing_problem
from rlix_plugins.control.scheduling.plan_state import is_generation_alloc, rank_index
from rlix_plugins.control.scheduling.turns import deferred, owed_gpus
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    CyclePlan,
    Priority,
    SchedulerSnapshot,
)
from rlix_plugins.errors import SchedulerError

INVARIANTS = (
    "existence",
    "mapping bounds",
    "allocation shape",
    "no double allocation",
    "gpu conservation",
    "generation-only shrink",
    "generation-only expand",
    "op uniqueness",
    "shrink targets active ranks",
    "expand targets inactive ranks",
    "allocation transition",
    "grant consistency",
    "priority order",
    "planned release",
    "fence",
    "in transit",
)


class PlanInvariantError(SchedulerError):
    """A snapshot or plan breaks a control-plane invariant. This is a scheduler bug: the plan must not run."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"invariant '{invariant}' broken: {message}")
        self.invariant = invariant


def _check_alloc(cid: str, alloc: Allocation, specs: dict[str, ClusterSpec], pool: frozenset[int], where: str) -> None:
    spec = specs.get(cid)
    if spec is None:
        raise PlanInvariantError("existence", f"{where}: allocation of unregistered cluster {cid!r}")
    if alloc.cluster_id != cid:
        raise PlanInvariantError("existence", f"{where}: allocation keyed {cid!r} names {alloc.cluster_id!r}")
    if not alloc.gpus <= pool:
        raise PlanInvariantError("mapping bounds", f"{where}: {cid} holds GPUs {sorted(alloc.gpus - pool)} outside the pool")
    mapping = rank_index(spec)  # the mapping as a cached dict: a set of it per allocation cost 20 ms at 2,048 GPUs
    outside = alloc.gpus.difference(mapping)
    if outside:
        raise PlanInvariantError(
            "mapping bounds", f"{where}: {cid} holds GPUs {sorted(outside)} outside its device mapping"
        )
    if is_generation_alloc(alloc):
        if not spec.is_generation:
            raise PlanInvariantError("allocation shape", f"{where}: non-generation cluster {cid} has a GENERATION allocation")
        if not alloc.active_dp_ranks:
            raise PlanInvariantError("allocation shape", f"{where}: GENERATION allocation of {cid} has no active rank")
        bad = sorted(r for r in alloc.active_dp_ranks if not 0 <= r < spec.num_dp_ranks)
        if bad:
            raise PlanInvariantError("mapping bounds", f"{where}: {cid} has DP ranks {bad} outside 0..{spec.num_dp_ranks - 1}")
        expected = spec.gpus_of(alloc.active_dp_ranks)
        if expected != alloc.gpus:
            raise PlanInvariantError(
                "allocation shape",
                f"{where}: {cid} GPUs {sorted(alloc.gpus)} are not the bundles of its active ranks {sorted(expected)}",
            )
    else:
        if alloc.active_dp_ranks:
            raise PlanInvariantError("allocation shape", f"{where}: non-GENERATION allocation of {cid} lists DP ranks")
        if len(alloc.gpus) != len(mapping):  # a subset of the mapping (checked above) of its size is all of it
            raise PlanInvariantError(
                "allocation shape", f"{where}: {alloc.priority.name} allocation of {cid} is not its whole device mapping"
            )


def _holders(allocs: dict[str, Allocation], specs: dict[str, ClusterSpec], where: str,
             tenants: Tenants | None = None) -> tuple[dict[int, frozenset[str]], dict[int, frozenset[str]]]:
    """(GPU -> generation holders, GPU -> non-generation holders). A GPU has more than one holder only where they
    may co-reside (``coresidence.sharing_problem``: training steps and rollout ranks of different pipelines)."""
    gen: dict[int, set[str]] = {}
    other: dict[int, set[str]] = {}
    for cid, alloc in allocs.items():
        into = gen if is_generation_alloc(alloc) else other
        for g in alloc.gpus:
            into.setdefault(g, set()).add(cid)
    shared = sorted(g for g in gen.keys() | other.keys() if len(gen.get(g, ())) + len(other.get(g, ())) > 1)
    if shared:
        tenants = gpu_tenants(specs.values()) if tenants is None else tenants
        for g in shared:
            hosts = sorted(other.get(g, ()))
            problem = sharing_problem(tenants, g, [specs[c] for c in sorted(gen.get(g, ()))],
                                      [(specs[h], Priority(allocs[h].priority)) for h in hosts])
            if problem is not None:
                held = sorted(gen.get(g, ())) + hosts
                raise PlanInvariantError("no double allocation",
                                         f"{where}: GPU {g} held by {' and '.join(held)}: {problem}")
    return {g: frozenset(c) for g, c in gen.items()}, {g: frozenset(c) for g, c in other.items()}


def validate_snapshot(snap: SchedulerSnapshot) -> None:
    """Check that a snapshot is self-consistent (allocations, pending requests, planned releases).

    The cluster specs themselves (pool bounds, TP bundles) are NOT re-checked here: they are frozen and were
    validated once, when their pipeline registered (``validate_cluster_specs``, called by the scheduler and the
    simulator), so a cycle only checks what changes between cycles.
    """
    pool = snap.gpus
    for cid, alloc in snap.allocations.items():
        _check_alloc(cid, alloc, snap.clusters, pool, "snapshot")
    _holders(snap.allocations, snap.clusters, "snapshot")
    seen: set[str] = set()
    for req in snap.pending:
        rspec = snap.clusters.get(req.cluster_id)
        if rspec is None:
            raise PlanInvariantError("existence", f"pending request of unregistered cluster {req.cluster_id!r}")
        if req.cluster_id in seen:
            raise PlanInvariantError("existence", f"two pending requests for {req.cluster_id}")
        seen.add(req.cluster_id)
        if req.priority == Priority.GENERATION and not rspec.is_generation:
            raise PlanInvariantError("existence", f"GENERATION request of non-generation cluster {req.cluster_id}")
    for cid in snap.planned_releases:
        pspec = snap.clusters.get(cid)
        if pspec is None or not pspec.is_generation:
            raise PlanInvariantError("planned release", f"planned release of non-generation/unknown cluster {cid!r}")
    for cid, ranks in snap.expanding.items():
        held = snap.allocations.get(cid)
        if held is None or not is_generation_alloc(held) or not ranks or not ranks <= held.active_dp_ranks:
            raise PlanInvariantError("in transit", f"{cid} expands ranks {sorted(ranks)} in flight that are not among "
                                     "its active GENERATION ranks (an expand in flight keeps its GPUs allocated)")


def validate_plan(snapshot: SchedulerSnapshot, plan: CyclePlan) -> None:
    """Raise ``PlanInvariantError`` unless ``plan`` is a legal successor of ``snapshot``."""
    validate_snapshot(snapshot)
    specs = snapshot.clusters
    pool = snapshot.gpus
    before, after = snapshot.allocations, plan.allocations
    for cid, alloc in after.items():
        _check_alloc(cid, alloc, specs, pool, "plan")
    tenants = gpu_tenants(specs.values())
    gen_before, other_before = _holders(before, specs, "snapshot", tenants)
    gen_after, other_after = _holders(after, specs, "plan", tenants)

    # --- ops ---------------------------------------------------------------------------------------------
    shrunk: dict[str, set[int]] = {}
    expanded: dict[str, set[int]] = {}
    for kind, ops, dest in (("shrink", plan.shrinks, shrunk), ("expand", plan.expands, expanded)):
        for op in ops:
            spec = specs.get(op.cluster_id)
            if spec is None or not spec.is_generation:
                raise PlanInvariantError(f"generation-only {kind}", f"{kind} of non-generation cluster {op.cluster_id!r}")
            if op.cluster_id in dest:
                raise PlanInvariantError("op uniqueness", f"two {kind} ops for {op.cluster_id}")
            ranks = set(op.dp_ranks)
            if len(ranks) != len(op.dp_ranks) or not ranks:
                raise PlanInvariantError("op uniqueness", f"{kind} of {op.cluster_id} lists ranks {op.dp_ranks}")
            dest[op.cluster_id] = ranks
    for op in plan.shrinks:
        if op.reason not in ("preempt", "rebalance", "release"):
            raise PlanInvariantError("generation-only shrink", f"shrink of {op.cluster_id} has reason {op.reason!r}")
    for cid, spec in specs.items():
        if not spec.is_generation:
            continue
        b = before.get(cid)
        a = after.get(cid)
        act_b = set(b.active_dp_ranks) if b is not None and is_generation_alloc(b) else set()
        act_a = set(a.active_dp_ranks) if a is not None and is_generation_alloc(a) else set()
        s, e = shrunk.get(cid, set()), expanded.get(cid, set())
        if not s <= act_b:
            raise PlanInvariantError("shrink targets active ranks", f"{cid} shrinks inactive ranks {sorted(s - act_b)}")
        if e & act_b:
            raise PlanInvariantError("expand targets inactive ranks", f"{cid} expands active ranks {sorted(e & act_b)}")
        if s & e:
            raise PlanInvariantError("op uniqueness", f"{cid} both shrinks and expands ranks {sorted(s & e)}")
        bad = sorted(r for r in e if not 0 <= r < spec.num_dp_ranks)
        if bad:
            raise PlanInvariantError("mapping bounds", f"{cid} expands ranks {bad} outside 0..{spec.num_dp_ranks - 1}")
        if (act_b - s) | e != act_a:
            raise PlanInvariantError(
                "allocation transition",
                f"{cid}: active {sorted(act_b)} - shrink {sorted(s)} + expand {sorted(e)} != planned {sorted(act_a)}",
            )

    # --- grants ------------------------------------------------------------------------------------------
    pending = {(r.cluster_id, r.seq): r for r in snapshot.pending}
    granted: dict[str, Priority] = {}
    for gr in plan.grants:
        req = pending.get((gr.cluster_id, gr.seq))
        if req is None or req.priority != gr.priority:
            raise PlanInvariantError("grant consistency", f"grant {gr.cluster_id}#{gr.seq} matches no pending request")
        if gr.cluster_id in granted:
            raise PlanInvariantError("grant consistency", f"{gr.cluster_id} granted twice")
        granted[gr.cluster_id] = gr.priority
        a = after.get(gr.cluster_id)
        if a is None or a.priority != gr.priority or a.gpus != gr.gpus:
            raise PlanInvariantError(
                "grant consistency", f"grant of {gr.cluster_id} does not match its planned allocation"
            )
        if gr.priority == Priority.GENERATION and gr.cluster_id in snapshot.planned_releases:
            raise PlanInvariantError("planned release", f"{gr.cluster_id} granted GENERATION while being released")

    # non-generation allocations change only through grants (the planner never frees them)
    for cid, b in before.items():
        if not is_generation_alloc(b) and after.get(cid) != b and cid not in granted:
            raise PlanInvariantError("allocation transition", f"{b.priority.name} allocation of {cid} changed without a grant")
    for cid, a in after.items():
        if not is_generation_alloc(a) and before.get(cid) != a and cid not in granted:
            raise PlanInvariantError("allocation transition", f"{a.priority.name} allocation of {cid} appeared without a grant")

    # --- GPU conservation: every ownership change is explained by an op or a grant -------------------------
    for g in pool:
        gb, ga = gen_before.get(g, frozenset()), gen_after.get(g, frozenset())
        for c in sorted(gb - ga):
            if rank_index(specs[c])[g] not in shrunk.get(c, ()):
                raise PlanInvariantError("gpu conservation", f"GPU {g} left {c} rank {rank_index(specs[c])[g]} "
                                         "without a shrink")
        for c in sorted(ga - gb):
            if rank_index(specs[c])[g] not in expanded.get(c, ()):
                raise PlanInvariantError("gpu conservation", f"GPU {g} joined {c} rank {rank_index(specs[c])[g]} "
                                         "without an expand")
        ob, oa = other_before.get(g, frozenset()), other_after.get(g, frozenset())
        for c in sorted(oa - ob):
            if c not in granted:
                raise PlanInvariantError("gpu conservation", f"GPU {g} joined {c} without a grant")
            if ob - oa:
                left = min(ob - oa)
                raise PlanInvariantError("gpu conservation",
                                         f"GPU {g} moved from {left} ({before[left].priority.name}) to {c}")

    # --- priority order: no grant takes GPUs that an earlier-ordered waiting request needs ------------------
    owed = owed_gpus(snapshot)
    by_seq = {r.seq: r for r in reversed(snapshot.pending)}  # the first request of a seq, as a scan would find
    for gr in plan.grants:
        req = by_seq.get(gr.seq)
        before_gr = before.get(gr.cluster_id)
        if req is not None and deferred(snapshot, owed, req) and not (before_gr is not None and before_gr.gpus == gr.gpus):
            raise PlanInvariantError("fair turns", f"{gr.cluster_id} was granted {gr.priority.name} while its "
                                     "pipeline owes a waiting pipeline a turn on those GPUs")
    # requests held back by fair turns wait without reserving (scheduling.turns)
    waiting = [
        r for r in snapshot.pending
        if r.priority != Priority.GENERATION and r.cluster_id not in granted and not deferred(snapshot, owed, r)
    ]
    if waiting:
        reserved: set[int] = set()
        for w in waiting:
            reserved.update(specs[w.cluster_id].device_mapping)
        for gr in plan.grants:
            if gr.priority == Priority.GENERATION:
                continue
            b = before.get(gr.cluster_id)
            if b is not None and b.gpus == gr.gpus:
                continue  # it already held them
            for w in waiting:
                if (w.priority, w.seq) < (gr.priority, gr.seq) and gr.gpus & set(specs[w.cluster_id].device_mapping):
                    raise PlanInvariantError(
                        "priority order",
                        f"{gr.cluster_id} ({gr.priority.name}#{gr.seq}) was granted GPUs that the waiting "
                        f"{w.cluster_id} ({Priority(w.priority).name}#{w.seq}) needs",
                    )
        for cid, ranks in expanded.items():
            for rank in ranks:
                for g in specs[cid].bundle(rank):
                    if g in reserved and not gen_before.get(g):
                        raise PlanInvariantError(
                            "priority order", f"{cid} rank {rank} woke on idle GPU {g} that a waiting request reserves"
                        )

    # --- fences: no allocation newly takes a GPU a failed pipeline's processes may still hold -------------------
    for cid, a in after.items():
        b = before.get(cid)
        taken = (a.gpus - (b.gpus if b is not None else frozenset())) & snapshot.fenced_gpus
        if taken:
            raise PlanInvariantError("fence", f"{cid} newly holds fenced GPUs {sorted(taken)}")

    # --- expands in flight: their cluster's coordinator is busy; nothing of it moves until they return ---------
    for cid in snapshot.expanding:
        if cid in shrunk:
            raise PlanInvariantError("in transit", f"{cid} shrinks ranks {sorted(shrunk[cid])} while an expand of "
                                     f"ranks {sorted(snapshot.expanding[cid])} is in flight")
        if cid in plan.released:
            raise PlanInvariantError("in transit", f"{cid} is released while an expand of it is in flight")
        if granted.get(cid) == Priority.GENERATION:
            raise PlanInvariantError("in transit", f"{cid} granted GENERATION before its expand in flight returned")

    # --- planned releases --------------------------------------------------------------------------------
    if not plan.released <= snapshot.planned_releases:
        raise PlanInvariantError("planned release", f"released {sorted(plan.released - snapshot.planned_releases)} unasked")
    for cid in plan.released:
        a = after.get(cid)
        if a is not None and is_generation_alloc(a):
            raise PlanInvariantError("planned release", f"{cid} still has active ranks after its planned release")
