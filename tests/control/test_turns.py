"""Fair turns (``scheduling.turns``): the ledger, the planner's two rules, and the policy as a property of whole
simulated runs through the real planner (any number of pipelines and GPUs)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.control.capacity.comparison import rlix_placements
from rlix_plugins.control.capacity.fairness import fairness
from rlix_plugins.control.capacity.simulation import JobSpec, Simulation
from rlix_plugins.control.scheduling.planner import plan_cycle, validate_plan
from rlix_plugins.control.scheduling.turns import TurnLedger, owed_gpus, waiting_pipelines
from rlix_plugins.control.types import ClusterMemory, PendingRequest, Priority, TraceEvent

from ._planner_fixtures import GEN, active, gen_alloc, pipeline, snapshot, whole_alloc

TRAIN = Priority.ACTOR_TRAINING


def _one_gpu():
    """Two pipelines that train and roll out on GPU 0 (the one-GPU topology)."""
    return {**pipeline("a", [0], [0]), **pipeline("b", [0], [0])}


def test_ledger_counts_steps_watched_while_waiting_and_a_step_of_the_waiter_closes_its_window() -> None:
    c = _one_gpu()
    ledger = TurnLedger(limit=2)
    waits = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_infer", GEN, 1)], {})
    assert waiting_pipelines(waits) == {"b"}
    assert ledger.note(waits) == [("b", True)]
    ledger.step_done("a")
    assert ledger.owed(c) == {}
    ledger.step_done("a")
    assert ledger.owed(c) == {"a": frozenset({"b"})}
    # b gets a rank: it no longer waits, but a still owes it the turn until b completes a step
    running = snapshot(1, c, [gen_alloc(c["b_actor_infer"], [0])], [], {})
    assert ledger.note(running) == [("b", False)]
    assert ledger.owed(c) == {"a": frozenset({"b"})}
    ledger.step_done("b")
    assert ledger.owed(c) == {}
    # steps of a while b runs are not watched
    ledger.step_done("a")
    ledger.step_done("a")
    assert ledger.owed(c) == {}
    ledger.forget("a")
    assert ledger.windows == {} and ledger.waiting == set()


def test_a_pipeline_with_its_rollout_done_does_not_wait() -> None:
    c = _one_gpu()
    ask = PendingRequest("b_actor_infer", GEN, 1)
    assert waiting_pipelines(snapshot(1, c, [], [ask], {"b": (64, 64)})) == set()  # step complete: nothing to do
    assert waiting_pipelines(snapshot(1, c, [], [ask], {"b": (64, 10)})) == {"b"}
    assert waiting_pipelines(snapshot(1, c, [], [PendingRequest("b_actor_train", TRAIN, 2)], {})) == {"b"}


def test_a_debtor_trains_no_more_on_the_waiters_gpus_and_the_waiter_takes_its_last_rank() -> None:
    """a rolls out on GPU 0 and asks to train a third time while b, owed a turn, waits without a rank."""
    c = _one_gpu()
    asks = [PendingRequest("b_actor_infer", GEN, 1), PendingRequest("a_actor_train", TRAIN, 2)]
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], asks, {"a": (64, 0), "b": (64, 0)})
    unfair = plan_cycle(snap)
    assert [g.cluster_id for g in unfair.grants] == ["a_actor_train"], "without a debt, training wins"
    owed = replace(snap, turns_owed={"a": frozenset({"b"})})
    assert owed_gpus(owed) == {"a": frozenset({0})}
    plan = plan_cycle(owed)
    validate_plan(owed, plan)
    assert [g.cluster_id for g in plan.grants] == ["b_actor_infer"]
    assert active(plan, "b_actor_infer") == {0} and active(plan, "a_actor_infer") == set()
    assert [(op.cluster_id, op.reason) for op in plan.shrinks] == [("a_actor_infer", "rebalance")]


def test_a_debt_holds_every_gpu_of_the_waiter_even_while_it_rolls_out_elsewhere() -> None:
    """b rolls out on GPUs 1-3 and GPU 0 is free: a, which owes b a turn, still does not train on GPU 0 (b's too)
    until b's next step. A step a began there would still complete if another pipeline then took b's ranks and b
    waited again (the property found that: 3 steps watched)."""
    c = {**pipeline("a", [0], range(4)), **pipeline("b", [1], range(4))}
    snap = snapshot(4, c, [gen_alloc(c["b_actor_infer"], [1, 2, 3])], [PendingRequest("a_actor_train", TRAIN, 5)],
                    {"a": (64, 64), "b": (64, 0)})
    assert [g.cluster_id for g in plan_cycle(snap).grants] == ["a_actor_train"], "without a debt, a trains on GPU 0"
    owed = replace(snap, turns_owed={"a": frozenset({"b"})})
    assert owed_gpus(owed) == {"a": frozenset(range(4))}
    plan = plan_cycle(owed)
    validate_plan(owed, plan)
    assert plan.grants == ()


def test_a_debt_to_a_waiter_that_keeps_a_rollout_rank_holds_all_its_gpus() -> None:
    """b rolls out on GPUs 2-3 but waits: its training on GPU 1 is held back (c trains there). Its turn is not
    running on its rollout GPUs, so a, which owes b a turn, must not train a third step on GPU 0 meanwhile."""
    c = {**pipeline("a", [0], range(4)), **pipeline("b", [1], range(4)), **pipeline("c", [1], range(4))}
    allocs = [gen_alloc(c["b_actor_infer"], [2, 3]), whole_alloc(c["c_actor_train"])]
    asks = [PendingRequest("b_actor_train", TRAIN, 4), PendingRequest("a_actor_train", TRAIN, 5)]
    snap = snapshot(4, c, allocs, asks, {"a": (64, 64), "b": (64, 64), "c": (64, 64)})
    assert waiting_pipelines(snap) == {"a", "b"}
    owed = replace(snap, turns_owed={"a": frozenset({"b"})})
    assert owed_gpus(owed) == {"a": frozenset(range(4))}
    plan = plan_cycle(owed)
    validate_plan(owed, plan)
    assert plan.grants == ()


def test_validate_plan_rejects_a_grant_to_a_debtor() -> None:
    from rlix_plugins.control.scheduling.invariants import PlanInvariantError

    c = _one_gpu()
    snap = snapshot(1, c, [], [PendingRequest("a_actor_train", TRAIN, 2)], {})
    plan = plan_cycle(snap)  # planned without the debt: grants a
    with pytest.raises(PlanInvariantError, match="fair turns"):
        validate_plan(replace(snap, turns_owed={"a": frozenset({"b"})}), plan)


def test_fairness_counts_steps_inside_a_waiters_window() -> None:
    def ev(t: float, pid: str, op: str, detail: str = "", prio: int | None = None) -> TraceEvent:
        return TraceEvent(t, pid, f"{pid}_actor_train", op, (0,), prio, detail)

    events = [ev(0, "b", "wait", "begin"), ev(1, "a", "release", prio=TRAIN), ev(2, "b", "wait", "end"),
              ev(3, "a", "release", prio=TRAIN),  # b runs: not watched
              ev(4, "b", "wait", "begin"), ev(5, "a", "release", prio=TRAIN), ev(6, "b", "wait", "end"),
              ev(7, "b", "release", prio=TRAIN),  # b's own step closes its window
              ev(8, "b", "wait", "begin"), ev(9, "a", "release", prio=TRAIN)]
    f = fairness(events)
    assert f.max_steps_watched == 2 and f.worst_pair == ("b", "a")
    assert f.longest_wait_s == 2.0 and f.waits == {"b": 3} and f.steps == {"a": 4, "b": 1}


def _job(name: str, i: int, d: dict[str, float]) -> JobSpec:
    return JobSpec(name=name, train_gpus=1, step_target=int(d["target"]), traj_time_s=d["traj"], seqs_per_rank=64,
                   train_time_s=d["train"], sync_time_s=1.0, expand_time_s=d["expand"], init_time_s=d["init"],
                   steps=int(d["steps"]), max_age=int(d["age"]), start_s=i * d["admit"])


JOBS = st.fixed_dictionaries({
    "target": st.sampled_from([16, 64, 256]), "traj": st.sampled_from([1.0, 3.0, 10.0, 30.0]),
    "train": st.sampled_from([2.0, 5.0, 20.0]), "expand": st.sampled_from([0.5, 2.0]),
    "init": st.sampled_from([5.0, 20.0]), "steps": st.integers(3, 7), "age": st.sampled_from([1, 2, 4]),
    "admit": st.sampled_from([0.0, 10.0, 30.0]),
})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.sampled_from([1, 2, 4]), st.data())
def test_no_waiting_pipeline_watches_another_complete_more_than_two_steps(n: int, gpus: int, data: st.DataObject) -> None:
    """The policy as a property of whole runs: simulated async-GRPO pipelines (the real planner, every plan
    validated) on 1, 2 or 4 GPUs; each pipeline finishes, and none watched another complete > 2 steps."""
    gpus = max(gpus, n) if gpus > 1 else 1  # every pipeline needs a home GPU to train on when there are several
    jobs = [_job(f"p{i}", i, data.draw(JOBS)) for i in range(n)]
    run = Simulation(jobs, rlix_placements(jobs, gpus, 8), gpus, 8).run()
    assert run.steps == sum(j.steps for j in jobs)
    f = run.fairness()
    assert f.max_steps_watched <= 2, f.line()


#: (rollout awake, step awake) GiB on a 100 GiB GPU, asleep 1 and 3: a rollout beside its own or another's step
#: (60 + 35), two rollouts (40 + 40), two steps (35 + 35), or nothing shared (70 + 60)
FIGURES = st.sampled_from([(60.0, 35.0), (40.0, 15.0), (30.0, 35.0), (70.0, 60.0)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 4), st.sampled_from([1, 2, 4]), st.data())
def test_fair_turns_hold_with_co_residence(n: int, gpus: int, data: st.DataObject) -> None:
    """The same property with memory figures declared: phases of different pipelines share a GPU where they fit, a
    pipeline's own rollout stays beside its own step unless a co-tenant with work and no rank takes the place; each
    pipeline finishes, and none watched another complete > 2 steps."""
    gpus = max(gpus, n) if gpus > 1 else 1
    jobs = []
    for i in range(n):
        infer_gib, train_gib = data.draw(FIGURES)
        memory = (ClusterMemory(100.0, infer_gib, 1.0), ClusterMemory(100.0, train_gib, 3.0))
        jobs.append(replace(_job(f"p{i}", i, data.draw(JOBS)), memory=memory))
    run = Simulation(jobs, rlix_placements(jobs, gpus, 8), gpus, 8).run()
    assert run.steps == sum(j.steps for j in jobs)
    f = run.fairness()
    assert f.max_steps_watched <= 2, f.line()


def test_idle_co_resident_rollouts_give_their_place_to_the_pipeline_they_owe_a_turn() -> None:
    """A run the co-residence property found (2026-11-29; it made no progress before that day's fix): three pipelines
    on one 100 GiB GPU. p0's and p1's rollouts (30 and 60 GiB) had collected everything their windows allowed and
    stayed awake together; their steps waited for the turn they owed p2, whose rollout (70 GiB) fitted beside
    neither, and nothing gave way. Now ranks without work, and ranks of debtors, leave for it."""
    def job(name: str, target: int, traj: float, train: float, steps: int, age: int, start: float,
            infer_gib: float, train_gib: float) -> JobSpec:
        return JobSpec(name=name, train_gpus=1, step_target=target, traj_time_s=traj, seqs_per_rank=64,
                       train_time_s=train, sync_time_s=1.0, expand_time_s=0.5, init_time_s=20.0, steps=steps,
                       max_age=age, start_s=start,
                       memory=(ClusterMemory(100.0, infer_gib, 1.0), ClusterMemory(100.0, train_gib, 3.0)))

    jobs = [job("p0", 16, 1.0, 20.0, 6, 1, 0.0, 30.0, 35.0), job("p1", 256, 3.0, 20.0, 6, 2, 30.0, 60.0, 35.0),
            job("p2", 16, 10.0, 2.0, 5, 1, 0.0, 70.0, 60.0)]
    run = Simulation(jobs, rlix_placements(jobs, 1, 8), 1, 8, max_time_s=20_000).run()
    assert run.steps == 17 and run.fairness().max_steps_watched <= 2, run.fairness().line()


def test_without_turns_one_pipeline_trains_back_to_back_while_the_other_waits() -> None:
    """The unfair run the policy prevents (two pipelines on one GPU, deep async queues): 4 steps watched
    without turns, 2 with."""
    d = {"target": 16, "traj": 1.0, "train": 5.0, "expand": 0.5, "init": 5.0, "steps": 6, "age": 4, "admit": 10.0}
    jobs = [_job("a", 0, d), _job("b", 1, d)]
    unfair = Simulation(jobs, rlix_placements(jobs, 1, 8), 1, 8, fair_turn_steps=10_000).run().fairness()
    fair = Simulation(jobs, rlix_placements(jobs, 1, 8), 1, 8).run().fairness()
    assert unfair.max_steps_watched > 2 and fair.max_steps_watched <= 2, (unfair.line(), fair.line())


#: Four-pipeline runs on four GPUs the property found on 2026-11-29 (each watched 3 steps before that day's fixes):
#: * "waiter keeps a rank": p1 owed p0 a turn, but p0 kept a rollout rank while its training was held back by its
#:   own debt to p3, and the debt held only that rank's GPU, so p1 trained a third step on its own GPU;
#: * "third pipeline takes the rank" (2,000 examples a seed): p3 owed p1 a turn and began a step on its own GPU 3
#:   while p1 rolled out on GPU 2; p2's training then took p1's only rank, p1 waited again, and p3's step completed.
#: A debt now holds every GPU of the waiter until its next step.
_FOUND_2026_11_29 = {
    "waiter keeps a rank": [
        {"target": 256, "traj": 3.0, "train": 20.0, "expand": 0.5, "init": 20.0, "steps": 5, "age": 1, "admit": 0.0},
        {"target": 64, "traj": 3.0, "train": 20.0, "expand": 2.0, "init": 5.0, "steps": 5, "age": 2, "admit": 10.0},
        {"target": 16, "traj": 3.0, "train": 20.0, "expand": 0.5, "init": 20.0, "steps": 4, "age": 1, "admit": 10.0},
        {"target": 64, "traj": 30.0, "train": 20.0, "expand": 0.5, "init": 5.0, "steps": 3, "age": 1, "admit": 0.0},
    ],
    "third pipeline takes the rank": [
        {"target": 16, "traj": 10.0, "train": 20.0, "expand": 0.5, "init": 20.0, "steps": 3, "age": 1, "admit": 0.0},
        {"target": 16, "traj": 1.0, "train": 2.0, "expand": 0.5, "init": 20.0, "steps": 3, "age": 1, "admit": 10.0},
        {"target": 16, "traj": 30.0, "train": 5.0, "expand": 2.0, "init": 5.0, "steps": 3, "age": 2, "admit": 0.0},
        {"target": 16, "traj": 10.0, "train": 5.0, "expand": 0.5, "init": 20.0, "steps": 3, "age": 1, "admit": 0.0},
    ],
}


@pytest.mark.parametrize("case", sorted(_FOUND_2026_11_29))
def test_four_pipelines_on_four_gpus_found_by_the_property(case: str) -> None:
    jobs = [_job(f"p{i}", i, d) for i, d in enumerate(_FOUND_2026_11_29[case])]
    run = Simulation(jobs, rlix_placements(jobs, 4, 8), 4, 8).run()
    assert run.steps == sum(j.steps for j in jobs)
    assert run.fairness().max_steps_watched <= 2, run.fairness().line()
