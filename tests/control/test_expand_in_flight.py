"""Expands run outside the cycle: a slow wake-up of one pipeline holds back no other pipeline's grant, and no plan
shrinks, releases or grants a cluster whose expand is still in flight (planner, invariants, the real actor on Ray)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.scheduling.invariants import PlanInvariantError
from rlix_plugins.control.scheduling.planner import plan_cycle, validate_plan
from rlix_plugins.control.types import CyclePlan, PendingRequest, Priority, ShrinkOp
from tests.control._planner_fixtures import gen_alloc, snapshot, spec
from tests.control._ray_helpers import control_plane, make_pipeline, wait_for

__all__ = ["control_plane"]  # the fixture, imported for pytest

GEN = Priority.GENERATION
TRAIN = Priority.ACTOR_TRAINING
#: A grant that needs no resize must come within this while another pipeline's 2 s expand runs.
PROMPT_S = 1.0


def _spans(handler: object) -> list[tuple[float, float, list[int], list[int]]]:
    return ray.get(handler.spans.remote(), timeout=10)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------- planner
def _frozen_snapshot(**kw: object):  # type: ignore[no-untyped-def]
    """A's rollout ranks 0,1 on GPUs 0,1 are waking (expand in flight); B trains on GPU 1 and C on GPU 3."""
    a = spec("a", "actor_infer", [0, 1])
    b = spec("b", "actor_train", [1])
    c = spec("c", "actor_train", [3])
    clusters = {s.cluster_id: s for s in (a, b, c)}
    snap = snapshot(4, clusters, [gen_alloc(a, [0, 1])], **kw)  # type: ignore[arg-type]
    return replace(snap, expanding={a.cluster_id: frozenset({0, 1})}), a, b, c


def test_planner_leaves_a_cluster_with_an_expand_in_flight_alone() -> None:
    pending = (PendingRequest("b_actor_train", TRAIN, 1), PendingRequest("c_actor_train", TRAIN, 2),
               PendingRequest("a_actor_infer", GEN, 3, None, 64))
    snap, a, b, c = _frozen_snapshot(pending=pending, progress={"a": (64, 0)})
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks, "a rank of a cluster whose expand is in flight was shrunk"
    assert [g.cluster_id for g in plan.grants] == [c.cluster_id]  # C's GPU is idle: granted at once
    assert plan.allocations[a.cluster_id] == snap.allocations[a.cluster_id]  # B waits for A's expand; A's grant too
    # the same snapshot without the expand in flight preempts A's rank 1 for B and grants A
    plan = plan_cycle(replace(snap, expanding={}))
    assert plan.shrinks == (ShrinkOp(a.cluster_id, (1,), "preempt"),)
    assert {g.cluster_id for g in plan.grants} == {a.cluster_id, b.cluster_id, c.cluster_id}


def test_planner_defers_a_planned_release_until_the_expand_returns() -> None:
    snap, a, _, _ = _frozen_snapshot(planned_releases=["a_actor_infer"])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.released and not plan.shrinks
    assert plan_cycle(replace(snap, expanding={})).released == {a.cluster_id}


def test_invariants_refuse_moving_a_cluster_in_transit() -> None:
    snap, a, _, _ = _frozen_snapshot(planned_releases=["a_actor_infer"])
    free = replace(snap, expanding={})
    with pytest.raises(PlanInvariantError, match=r"in transit.*shrinks ranks"):
        validate_plan(snap, plan_cycle(free))  # the release shrinks both ranks
    grant = replace(snap, planned_releases=frozenset(), pending=(PendingRequest(a.cluster_id, GEN, 1, None, 8),))
    with pytest.raises(PlanInvariantError, match=r"in transit.*granted GENERATION"):
        validate_plan(grant, plan_cycle(replace(grant, expanding={})))
    with pytest.raises(PlanInvariantError, match=r"in transit.*not among its active"):
        validate_plan(replace(snap, allocations={}), CyclePlan((), (), (), {}, frozenset()))


# ---------------------------------------------------------------------------------------------------- real actor
def test_training_grant_does_not_wait_for_another_pipelines_expand(control_plane: client.ControlPlane) -> None:
    """A's rollout wake takes 2 s. B asks for training on a GPU nobody holds while it runs: granted at once (the
    old cycle waited for A's expand before the next cycle could run). A's own GENERATION grant returns only after its
    ranks woke."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=None, infer=[0, 1], delay_s=2.0)
    b, _ = make_pipeline(cp, train=[2], infer=[2, 3])
    with ThreadPoolExecutor(1) as ex:
        a_rollout = ex.submit(lambda: (a.request_gpus("actor_infer", GEN, step_target_estimate=64, timeout_s=30),
                                       time.time()))
        wait_for(lambda: ray.get(ha.running.remote(), timeout=10), what="A's expand running")
        expanding = cp.status().get("expanding")
        asked = time.time()
        assert b.request_gpus("actor_train", TRAIN, step=0, timeout_s=10) == [2]
        granted = time.time()
        gpus, a_granted_at = a_rollout.result(timeout=30)
    ((start, end, _, added),) = _spans(ha)
    assert added == [0, 1] and gpus == [0, 1]
    assert start < asked and granted < end, "B's training grant waited for A's expand"
    assert granted - asked < PROMPT_S, granted - asked
    assert a_granted_at >= end, "A's GENERATION grant returned before its ranks woke"
    assert [e["cluster_id"] for e in expanding or ()] == [a.cluster_id("actor_infer")]  # `rlix status` shows it
    st = cp.status()
    assert not st["expanding"] and not st["invariant_violations"]
    b.release_gpus("actor_train", step=0)
    assert a.release_gpus("actor_infer", timeout_s=10) == [0, 1]


def test_a_rank_still_waking_is_not_preempted_and_others_go_on(control_plane: client.ControlPlane) -> None:
    """B's training needs GPU 1, where A's rank is still waking: B waits for that expand (no shrink of a rank in
    transit), and meanwhile C's training on GPU 3 is granted at once (the cycle is not stuck behind A's
    coordinator). Then A's rank 1 is preempted for B."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=None, infer=[0, 1], delay_s=2.0)
    b, _ = make_pipeline(cp, train=[1], infer=[1, 2])
    c, _ = make_pipeline(cp, train=[3], infer=[2, 3])
    with ThreadPoolExecutor(2) as ex:
        a_rollout = ex.submit(a.request_gpus, "actor_infer", GEN, step_target_estimate=64, timeout_s=30)
        wait_for(lambda: ray.get(ha.running.remote(), timeout=10), what="A's expand running")
        b_train = ex.submit(lambda: (b.request_gpus("actor_train", TRAIN, step=0, timeout_s=30), time.time()))
        wait_for(lambda: any(p["cluster_id"] == b.cluster_id("actor_train") for p in cp.status()["pending"]),
                 what="B's training request pending")
        asked = time.time()
        assert c.request_gpus("actor_train", TRAIN, step=0, timeout_s=10) == [3]
        c_granted = time.time()
        assert b_train.result(timeout=30)[0] == [1]
        b_granted = b_train.result()[1]
        assert a_rollout.result(timeout=30) == [0, 1]
    spans = _spans(ha)
    (expand_end,) = [end for _, end, _, added in spans if added]
    assert c_granted < expand_end and c_granted - asked < PROMPT_S, "C's grant waited for A's expand"
    assert b_granted >= expand_end
    assert [(removed, added) for _, _, removed, added in spans] == [([], [0, 1]), ([1], [])]
    assert not cp.status()["invariant_violations"]
    b.release_gpus("actor_train", step=0)
    c.release_gpus("actor_train", step=0)
