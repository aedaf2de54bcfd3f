"""Plan invariants: every plan of a random snapshot passes them, and each corruption of a plan is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.control.registration import validate_spec
from rlix_plugins.control.scheduling.planner import (
    PlanInvariantError,
    plan_cycle,
    validate_cluster_specs,
    validate_plan,
)
from rlix_plugins.control.types import Allocation, ExpandOp, Grant, PendingRequest, Priority, ShrinkOp
from rlix_plugins.errors import RlixConfigError, SchedulerError

from ._planner_fixtures import GEN, gen_alloc, pipeline, snapshot, snapshots, spec, whole_alloc

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(snapshots())
def test_random_plans_pass_validation_and_basic_properties(snap) -> None:
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert plan_cycle(snap) == plan  # deterministic
    # independent checks (not via validate_plan): conservation and no double allocation
    seen: set[int] = set()
    for cid, alloc in plan.allocations.items():
        assert alloc.gpus <= snap.gpus
        assert not alloc.gpus & seen, f"GPU double allocated to {cid}"
        seen |= alloc.gpus
        s = snap.clusters[cid]
        assert alloc.gpus <= set(s.device_mapping)
        if alloc.priority == GEN:
            # TP alignment: the GPUs are exactly whole bundles, each contiguous and on one node
            for r in alloc.active_dp_ranks:
                b = s.bundle(r)
                assert list(b) == list(range(b[0], b[0] + s.tp_size))
                assert b[0] // snap.gpus_per_node == b[-1] // snap.gpus_per_node
            assert alloc.gpus == {g for r in alloc.active_dp_ranks for g in s.bundle(r)}
        else:
            assert alloc.gpus == set(s.device_mapping)
    for op in (*plan.shrinks, *plan.expands):
        assert snap.clusters[op.cluster_id].is_generation
    # every pending GENERATION request of a cluster that ends with active ranks is granted
    granted = {g.cluster_id for g in plan.grants}
    for r in snap.pending:
        if r.priority == GEN and r.cluster_id not in snap.planned_releases:
            a = plan.allocations.get(r.cluster_id)
            assert (a is not None and a.priority == GEN) == (r.cluster_id in granted)
    assert plan.released == snap.planned_releases


@SETTINGS
@given(snapshots())
def test_priority_order_on_random_snapshots(snap) -> None:
    """A non-generation request is never granted GPUs that an earlier-ordered waiting request needs."""
    plan = plan_cycle(snap)
    granted = {g.cluster_id: g for g in plan.grants}
    waiting = [r for r in snap.pending if r.priority != GEN and r.cluster_id not in granted]
    for g in plan.grants:
        if g.priority == GEN:
            continue
        held = snap.allocations.get(g.cluster_id)
        if held is not None and held.gpus == g.gpus:
            continue
        for w in waiting:
            if (w.priority, w.seq) < (g.priority, g.seq):
                assert not g.gpus & set(snap.clusters[w.cluster_id].device_mapping)


def _base():
    clusters = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [2, 3], range(4))}
    return clusters


def _bad(snap, plan, invariant: str) -> None:
    with pytest.raises(PlanInvariantError) as info:
        validate_plan(snap, plan)
    assert info.value.invariant == invariant, str(info.value)
    assert isinstance(info.value, SchedulerError)


def test_corrupted_plans_are_rejected() -> None:
    c = _base()
    ai, bi, at = c["a_actor_infer"], c["b_actor_infer"], c["a_actor_train"]
    snap = snapshot(4, c, [gen_alloc(ai, [0, 1]), gen_alloc(bi, [2, 3])], [PendingRequest(at.cluster_id, Priority.ACTOR_TRAINING, 1)])
    good = plan_cycle(snap)
    validate_plan(snap, good)
    assert good.grants and good.grants[0].cluster_id == "a_actor_train"

    # double allocation: b keeps GPU 0 while training holds it
    allocs = dict(good.allocations)
    allocs["b_actor_infer"] = gen_alloc(bi, [0, 2, 3])
    _bad(snap, replace(good, allocations=allocs), "no double allocation")
    # shrink of a training cluster
    _bad(snap, replace(good, shrinks=(*good.shrinks, ShrinkOp("a_actor_train", (0,), "preempt"))), "generation-only shrink")
    # expand of an already active rank
    _bad(snap, replace(good, expands=(ExpandOp("b_actor_infer", (2,)),)), "expand targets inactive ranks")
    # GPUs moved without ops: drop the shrinks
    _bad(snap, replace(good, shrinks=()), "allocation transition")
    # grant that matches no pending request
    bogus = Grant("b_actor_train", Priority.ACTOR_TRAINING, 99, frozenset({2, 3}))
    _bad(snap, replace(good, grants=(*good.grants, bogus)), "grant consistency")
    # allocation outside the device mapping
    allocs = dict(good.allocations)
    allocs["a_actor_train"] = Allocation("a_actor_train", Priority.ACTOR_TRAINING, frozenset({0, 1, 2}))
    _bad(snap, replace(good, allocations=allocs), "mapping bounds")
    # GPU conservation: a GPU silently disappears from b (rank shrunk without an op)
    allocs = dict(good.allocations)
    allocs["b_actor_infer"] = gen_alloc(bi, [3])
    _bad(snap, replace(good, allocations=allocs), "allocation transition")


def test_priority_order_violation_is_rejected() -> None:
    c = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [1, 2], range(4))}
    # b trains on GPU 1..2; a (priority 1, seq 1) waits for GPU 1; a's reference-free variant: c's
    c.update({"c_actor_train": spec("c", "actor_train", [0]), "c_actor_infer": spec("c", "actor_infer", [0, 3])})
    snap = snapshot(
        4,
        c,
        [whole_alloc(c["b_actor_train"])],
        [PendingRequest("a_actor_train", Priority.ACTOR_TRAINING, 1), PendingRequest("c_actor_train", Priority.OLD_LOG_PROBS, 2)],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.grants, "c must wait: GPU 0 is reserved by the waiting higher-priority a_actor_train"
    # a plan that grants c anyway is rejected
    allocs = dict(plan.allocations)
    allocs["c_actor_train"] = whole_alloc(c["c_actor_train"], Priority.OLD_LOG_PROBS)
    bad = replace(plan, allocations=allocs, grants=(Grant("c_actor_train", Priority.OLD_LOG_PROBS, 2, frozenset({0})),))
    _bad(snap, bad, "priority order")


def test_bad_snapshot_is_rejected() -> None:
    c = _base()
    snap = snapshot(4, c, [gen_alloc(c["a_actor_infer"], [0]), gen_alloc(c["b_actor_infer"], [0])])
    _bad(snap, plan_cycle(snap), "no double allocation")
    with pytest.raises(PlanInvariantError, match="unregistered"):
        plan_cycle(snapshot(4, c, [], [PendingRequest("zz_actor_train", Priority.ACTOR_TRAINING, 1)]))


# ---- registration ------------------------------------------------------------------------------------------


def _specs(**kw):
    train = kw.pop("train", [0, 1])
    infer = kw.pop("infer", [0, 1, 2, 3])
    tp = kw.pop("tp", 1)
    return list(pipeline("ft_1", train, infer, tp).values())


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([spec("p", "actor_infer", [], 1)], "empty"),
        ([spec("p", "actor_infer", [0, 0, 1], 1)], "more than once"),
        ([spec("p", "actor_infer", [0, 1, 2], 2)], "multiple of tp_size=2"),
        ([spec("p", "actor_infer", [0, 2], 2)], "not contiguous"),
        ([spec("p", "actor_infer", [2, 3, 4, 5], 4)], "crosses a node"),
        ([spec("p", "actor_infer", [1, 2], 2)], "not aligned"),
        ([spec("p", "actor_infer", [0, 1, 9], 1)], "not in the pool"),
        ([spec("p", "actor_infer", [0, 1]), spec("p", "critic2", [0])], "unknown cluster name"),
        ([spec("p", "actor_train", [0])], "no 'actor_infer'"),
        ([spec("p", "actor_infer", [0, 1]), spec("p", "actor_train", [1, 2])], "not in the actor_infer mapping"),
        ([spec("p", "actor_infer", [0, 1]), spec("p", "actor_train", [0, 1], 2)], "tp_size must be 1"),
        ([spec("p:x", "actor_infer", [0, 1])], "must not contain ':'"),
        ([spec("p", "actor_infer", [0, 1]), spec("p", "actor_infer", [2, 3])], "registered twice"),
    ],
)
def test_validate_cluster_specs_rejects(specs, match) -> None:
    with pytest.raises(RlixConfigError, match=match):
        validate_cluster_specs(specs, range(8), gpus_per_node=4)


def test_validate_cluster_specs_accepts_partial_overlap() -> None:
    validate_cluster_specs(_specs(tp=2), range(8), gpus_per_node=4)
    validate_cluster_specs(_specs(train=[4], infer=[4, 5, 6, 7]) + list(pipeline("ft_2", [6, 7], [4, 5, 6, 7], 2).values()), range(8), 4)


def test_validate_spec_checks_one_spec_without_pipeline_rules() -> None:
    """The simulator's per-spec check: pool and bundles are refused, a training-only spec is fine on its own."""
    validate_spec(spec("p", "actor_train", [0, 1]), range(8), 4)
    with pytest.raises(RlixConfigError, match="crosses a node"):
        validate_spec(spec("p", "actor_infer", [2, 3, 4, 5], 4), range(8), 4)
    with pytest.raises(RlixConfigError, match="not in the pool"):
        validate_spec(spec("p", "actor_infer", [7, 8]), range(8), 4)


def test_more_invariants_are_named() -> None:
    # (TP bundles and pool bounds of the frozen specs are checked once, at registration: see
    # test_validate_cluster_specs_rejects and test_scheduler_validates_specs_once_at_registration.)
    # a rank woken on an idle GPU that a waiting training request reserves
    c = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [1, 2], range(4))}
    snap = snapshot(
        4,
        c,
        [whole_alloc(c["b_actor_train"])],
        [PendingRequest("a_actor_train", Priority.ACTOR_TRAINING, 1), PendingRequest("a_actor_infer", GEN, 2, step_target_estimate=4)],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert plan.allocations["a_actor_infer"].gpus == {3}  # GPU 0 is idle but reserved for a's training
    allocs = dict(plan.allocations)
    allocs["a_actor_infer"] = gen_alloc(c["a_actor_infer"], [0, 3])
    grant = Grant("a_actor_infer", GEN, 2, frozenset({0, 3}))
    _bad(snap, replace(plan, allocations=allocs, expands=(ExpandOp("a_actor_infer", (0, 3)),), grants=(grant,)), "priority order")
    # a planned release that leaves ranks active
    snap = snapshot(4, c, [gen_alloc(c["a_actor_infer"], [0, 3])], planned_releases=["a_actor_infer"])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    _bad(snap, replace(plan, shrinks=(), allocations=dict(snap.allocations)), "planned release")


@SETTINGS
@given(snapshots(), st.data())
def test_fenced_gpus_are_never_newly_allocated(snap, data) -> None:
    """GPUs a failed pipeline's processes may still hold (``scheduling.fences``): any subset of the pool, held or
    idle. No plan newly allocates one (holders keep theirs); the plan passes the invariants."""
    fenced = frozenset(data.draw(st.lists(st.sampled_from(sorted(snap.gpus)), unique=True)))
    snap = replace(snap, fenced_gpus=fenced, release_grace_gpus=snap.release_grace_gpus - fenced)
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    for cid, alloc in plan.allocations.items():
        before = snap.allocations.get(cid)
        assert not (alloc.gpus - (before.gpus if before else frozenset())) & fenced, cid


def test_a_plan_that_takes_a_fenced_gpu_is_refused() -> None:
    c = pipeline("a", [0], range(2))
    unfenced = snapshot(2, c, [], [PendingRequest("a_actor_train", Priority.ACTOR_TRAINING, 1)])
    plan = plan_cycle(unfenced)
    assert plan.allocations["a_actor_train"].gpus == {0}
    fenced = replace(unfenced, fenced_gpus=frozenset({0}))
    _bad(fenced, plan, "fence")
    assert "a_actor_train" not in plan_cycle(fenced).allocations  # it waits for GPU 0
    woken = plan_cycle(replace(fenced, pending=(PendingRequest("a_actor_infer", GEN, 2, step_target_estimate=4),)))
    assert woken.allocations["a_actor_infer"].gpus == {1}  # no rank wakes on the fenced GPU
