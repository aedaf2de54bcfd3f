"""Targeted planner scenarios: preemption, planned release, reservations, TP bundles, initialization."""

from __future__ import annotations

import pytest

from rlix_plugins.control.scheduling.planner import PlanInvariantError, plan_cycle, validate_plan
from rlix_plugins.control.types import PendingRequest, Priority

from ._planner_fixtures import GEN, active, apply_plan, gen_alloc, pipeline, snapshot, spec, whole_alloc

TRAIN = Priority.ACTOR_TRAINING


def _two_pipelines():
    return {**pipeline("a", [0, 1], range(4)), **pipeline("b", [2, 3], range(4))}


def test_training_preempts_other_pipelines_rollout_and_gets_it_back_later() -> None:
    c = _two_pipelines()
    progress = {"a": (64, 64), "b": (64, 0)}
    # b generates on 0..2, a on 3; a's buffer is full and it asks to train on 0,1
    snap = snapshot(
        4,
        c,
        [gen_alloc(c["b_actor_infer"], [0, 1, 2]), gen_alloc(c["a_actor_infer"], [3])],
        [PendingRequest("a_actor_train", TRAIN, 7)],
        progress,
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(op.cluster_id, op.dp_ranks, op.reason) for op in plan.shrinks] == [("b_actor_infer", (0, 1), "preempt")]
    assert [(g.cluster_id, sorted(g.gpus)) for g in plan.grants] == [("a_actor_train", [0, 1])]
    assert active(plan, "b_actor_infer") == {2} and active(plan, "a_actor_infer") == {3}
    # training done: a releases; b (most work left) gets the GPUs back in the next cycle
    after = apply_plan(snap, plan)
    allocs = {k: v for k, v in after.allocations.items() if k != "a_actor_train"}
    snap2 = snapshot(4, c, allocs.values(), [], progress)
    plan2 = plan_cycle(snap2)
    validate_plan(snap2, plan2)
    assert active(plan2, "b_actor_infer") == {0, 1, 2} and not plan2.shrinks


def test_gpus_in_release_grace_are_not_lent_to_rollout_but_training_may_take_them() -> None:
    """Back-to-back steps: GPUs a's training just released stay idle for rollout, a's next request takes them."""
    from dataclasses import replace

    c = _two_pipelines()
    progress = {"a": (64, 64), "b": (64, 0)}
    snap = snapshot(4, c, [gen_alloc(c["b_actor_infer"], [2]), gen_alloc(c["a_actor_infer"], [3])], [], progress)
    graced = replace(snap, release_grace_gpus=frozenset({0, 1}))
    plan = plan_cycle(graced)
    validate_plan(graced, plan)
    assert plan.is_noop, "rollout was woken on GPUs inside their release grace window"
    assert active(plan_cycle(snap), "b_actor_infer") == {0, 1, 2}, "without grace the idle GPUs are lent"
    again = replace(graced, pending=(PendingRequest("a_actor_train", TRAIN, 8),))
    plan = plan_cycle(again)
    validate_plan(again, plan)
    assert [(g.cluster_id, sorted(g.gpus)) for g in plan.grants] == [("a_actor_train", [0, 1])] and not plan.shrinks


def test_training_preempts_own_overlap_ranks_and_spares_the_rest() -> None:
    c = _two_pipelines()
    snap = snapshot(4, c, [gen_alloc(c["a_actor_infer"], [0, 1, 2, 3])], [PendingRequest("a_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert active(plan, "a_actor_infer") == {2, 3}  # partial overlap: the non-overlap ranks keep generating
    assert plan.shrinks[0].reason == "preempt"


def test_planned_release_shrinks_to_zero_and_frees_gpus_for_others() -> None:
    c = _two_pipelines()
    snap = snapshot(
        4,
        c,
        [gen_alloc(c["a_actor_infer"], [0, 1]), gen_alloc(c["b_actor_infer"], [2, 3])],
        progress={"a": (64, 64), "b": (64, 10)},
        planned_releases=["a_actor_infer"],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert plan.released == {"a_actor_infer"}
    assert [(op.cluster_id, op.reason) for op in plan.shrinks] == [("a_actor_infer", "release")]
    assert "a_actor_infer" not in plan.allocations
    assert active(plan, "b_actor_infer") == {0, 1, 2, 3}
    # releasing a cluster that has nothing active completes at once
    snap = snapshot(4, c, [], planned_releases=["a_actor_infer"])
    plan = plan_cycle(snap)
    assert plan.released == {"a_actor_infer"} and not plan.shrinks


def test_planned_release_of_a_training_cluster_is_refused() -> None:
    c = _two_pipelines()
    with pytest.raises(PlanInvariantError, match="await_release accepts only"):
        plan_cycle(snapshot(4, c, [], planned_releases=["a_actor_train"]))


def test_waiting_request_reserves_its_gpus_and_preempts_nothing() -> None:
    c = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [1, 2], range(4))}
    # b trains on 1,2; a must wait for GPU 1. a generates on 0 and 3: no preemption while a waits,
    # and the idle... nothing idle here; c wants rollout GPUs but GPU 0 is reserved
    snap = snapshot(
        4,
        c,
        [whole_alloc(c["b_actor_train"]), gen_alloc(c["a_actor_infer"], [3])],
        [PendingRequest("a_actor_train", TRAIN, 1), PendingRequest("b_actor_infer", GEN, 2, step_target_estimate=10)],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks, "a waiting request must not preempt anybody"
    assert "a_actor_train" not in {g.cluster_id for g in plan.grants}
    assert 0 not in plan.allocations.get("b_actor_infer", whole_alloc(spec("x", "actor_infer", [3]))).gpus
    assert not active(plan, "b_actor_infer"), "GPU 0 is idle but reserved by the waiting training request"


def test_lower_priority_waits_behind_reserved_gpus_but_others_proceed() -> None:
    c = {
        **pipeline("a", [0, 1], range(6)),
        **pipeline("b", [1], range(6)),
        **pipeline("c", [4, 5], range(6)),
    }
    snap = snapshot(
        6,
        c,
        [whole_alloc(c["b_actor_train"])],
        [
            PendingRequest("a_actor_train", TRAIN, 3),
            PendingRequest("c_actor_train", Priority.REF_LOG_PROBS, 4),
        ],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [g.cluster_id for g in plan.grants] == ["c_actor_train"]  # disjoint from the reservation: proceeds


def test_priority_then_fifo_order() -> None:
    c = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [0, 1], range(4))}
    for a_prio, a_seq, b_prio, b_seq, winner in (
        (TRAIN, 5, Priority.OLD_LOG_PROBS, 1, "a_actor_train"),  # priority beats FIFO
        (TRAIN, 5, TRAIN, 2, "b_actor_train"),  # FIFO within a priority
    ):
        snap = snapshot(4, c, [], [PendingRequest("a_actor_train", a_prio, a_seq), PendingRequest("b_actor_train", b_prio, b_seq)])
        plan = plan_cycle(snap)
        validate_plan(snap, plan)
        assert [g.cluster_id for g in plan.grants] == [winner]


def test_tp2_preemption_frees_the_rest_of_the_bundle_for_others() -> None:
    c = {**pipeline("a", [1], range(4), tp=2), **pipeline("b", None, range(4), tp=1)}
    snap = snapshot(
        4,
        c,
        [gen_alloc(c["a_actor_infer"], [0, 1])],
        [PendingRequest("a_actor_train", TRAIN, 1), PendingRequest("b_actor_infer", GEN, 2, step_target_estimate=5)],
        progress={"a": (10, 0)},
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert active(plan, "a_actor_infer") == {1}  # bundle {0,1} slept for training on GPU 1
    assert plan.allocations["b_actor_infer"].gpus == {0}  # the idle half of the slept bundle goes to b
    assert {g.cluster_id for g in plan.grants} == {"a_actor_train", "b_actor_infer"}


def test_initialization_of_an_infer_cluster_takes_its_whole_mapping() -> None:
    c = _two_pipelines()
    snap = snapshot(4, c, [gen_alloc(c["b_actor_infer"], [0, 1, 2, 3])], [PendingRequest("a_actor_infer", Priority.INITIALIZATION, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert plan.allocations["a_actor_infer"].priority == Priority.INITIALIZATION
    assert plan.allocations["a_actor_infer"].gpus == {0, 1, 2, 3}
    assert "b_actor_infer" not in plan.allocations
    # holding its mapping, a re-request at another non-generation priority is granted at once
    held = apply_plan(snap, plan)
    snap2 = snapshot(4, c, held.allocations.values(), [PendingRequest("a_actor_infer", Priority.OLD_LOG_PROBS, 2)])
    plan2 = plan_cycle(snap2)
    validate_plan(snap2, plan2)
    assert plan2.allocations["a_actor_infer"].priority == Priority.OLD_LOG_PROBS and not plan2.shrinks


def test_generation_request_is_granted_partially() -> None:
    c = _two_pipelines()
    # b trains on 2,3 and a on 0,1: nothing for a's rollout... then a finishes training: a gets 2 of 4 ranks at once
    snap = snapshot(4, c, [whole_alloc(c["b_actor_train"])], [PendingRequest("a_actor_infer", GEN, 1, step_target_estimate=32)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(g.cluster_id, sorted(g.gpus)) for g in plan.grants] == [("a_actor_infer", [0, 1])]


def test_stable_state_is_a_noop() -> None:
    c = _two_pipelines()
    snap = snapshot(
        4,
        c,
        [gen_alloc(c["a_actor_infer"], [0, 1]), gen_alloc(c["b_actor_infer"], [2, 3])],
        progress={"a": (64, 0), "b": (64, 0)},
    )
    assert plan_cycle(snap).is_noop


def test_one_gpu_co_tenants_take_turns_longest_waiter_first() -> None:
    """Two pipelines with train = infer = [0] (the one-GPU topology). After one trains, both wait for the only
    bundle; the one that has waited longer gets it (b here, although the pipeline-id order prefers a)."""
    from dataclasses import replace

    from rlix_plugins.control.scheduling.gap_ratio import note_generation_waits

    c = {**pipeline("a", [0], [0]), **pipeline("b", [0], [0])}
    progress = {"a": (64, 0), "b": (64, 0)}
    asks = [PendingRequest("b_actor_infer", GEN, 3), PendingRequest("a_actor_infer", GEN, 9)]
    clock = iter(range(100))
    waiting: dict[str, int] = {}
    # a rolls out while b waits; then a's training preempts a's own rank
    note_generation_waits(waiting, snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], asks[:1], progress), clock)
    training = snapshot(1, c, [whole_alloc(c["a_actor_train"])], asks, progress)
    note_generation_waits(waiting, training, clock)
    assert waiting == {"b_actor_infer": 0, "a_actor_infer": 1}
    released = replace(snapshot(1, c, [], asks, progress), generation_waiting_since=dict(waiting))
    plan = plan_cycle(released)
    validate_plan(released, plan)
    assert active(plan, "b_actor_infer") == {0} and active(plan, "a_actor_infer") == frozenset()
    assert active(plan_cycle(snapshot(1, c, [], asks, progress)), "a_actor_infer") == {0}, "without waits: id order"
    # b got its rank: it no longer waits; a keeps its place
    note_generation_waits(waiting, apply_plan(released, plan), clock)
    assert waiting == {"a_actor_infer": 1}


@pytest.mark.parametrize("memory", [False, True])
def test_one_decision_wakes_at_most_its_budget_and_the_next_ones_wake_the_rest(
        memory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision wakes at most ``plan_state.MAX_WAKES`` rollout ranks by its own choice (the gap ratio, the fills,
    the swap): ~1,500 wakes in one decision at 2,048 GPUs took 110-170 ms of planner time. The scheduler runs the
    next cycle at once after one that changed something; those cycles wake the rest, and end where one unbounded
    decision would have: every GPU used."""
    from dataclasses import replace

    from rlix_plugins.control.types import ClusterMemory, Progress

    clusters = {}
    for i in range(10):
        for cid, s in pipeline(f"p{i}", [i % 4], list(range(16))).items():
            figures = ClusterMemory(100.0, 30.0, 1.0) if s.is_generation else ClusterMemory(100.0, 35.0, 3.0)
            clusters[cid] = replace(s, memory=figures) if memory else s
    pending = [PendingRequest(f"p{i}_actor_infer", GEN, i + 1) for i in range(10)]
    # every pipeline's batch still to collect (its progress): the demand that outlives the first grant
    snap = replace(snapshot(16, clusters, [], pending), progress={f"p{i}": Progress(f"p{i}", 32, 0) for i in range(10)})

    def awake(plan_or_snap: object) -> int:
        return sum(len(active(plan_or_snap, f"p{i}_actor_infer")) for i in range(10))  # type: ignore[arg-type]

    unbounded = plan_cycle(snap)
    assert awake(unbounded) > 4
    monkeypatch.setattr("rlix_plugins.control.scheduling.plan_state.MAX_WAKES", 4)
    cycles, state = 0, snap
    while True:
        plan = plan_cycle(state)
        validate_plan(state, plan)
        assert sum(len(e.dp_ranks) for e in plan.expands) <= 4, plan.expands
        if not plan.expands:
            break
        state, cycles = apply_plan(state, plan), cycles + 1
        assert cycles < 50
    assert cycles >= awake(unbounded) // 4 and awake(state) == awake(unbounded), (cycles, awake(state))
    used = set().union(*(a.gpus for a in state.allocations.values()))
    assert used == set(range(16))
