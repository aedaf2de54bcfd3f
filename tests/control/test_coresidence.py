"""Co-residence (``scheduling.coresidence``): rollout ranks awake next to another pipeline's training step, and next to
other pipelines' rollout ranks, when their memory fits; the planner's two uses of it, the invariants that guard it,
and property tests over random pools."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.control.scheduling.invariants import PlanInvariantError, validate_plan
from rlix_plugins.control.scheduling.planner import plan_cycle
from rlix_plugins.control.types import (
    ClusterMemory,
    ClusterSpec,
    ExpandOp,
    Grant,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
)

from ._planner_fixtures import GEN, active, apply_plan, gen_alloc, pipeline, snapshot, snapshots, whole_alloc

TRAIN = Priority.ACTOR_TRAINING


def with_memory(clusters: dict[str, ClusterSpec], *, infer_awake: float = 60.0, train_awake: float = 35.0,
                gpu: float = 100.0, skip: str = "") -> dict[str, ClusterSpec]:
    """Engines 60 GiB awake / 1 asleep, trainers 35 / 3, GPUs of 100 GiB (``skip``: a cluster left without)."""
    out = {}
    for cid, s in clusters.items():
        figures = ClusterMemory(gpu, infer_awake, 1.0) if s.is_generation else ClusterMemory(gpu, train_awake, 3.0)
        out[cid] = s if cid == skip else replace(s, memory=figures)
    return out


def two_on_one_gpu(**kw: float) -> dict[str, ClusterSpec]:
    return with_memory({**pipeline("a", [0], [0]), **pipeline("b", [0], [0])}, **kw)  # type: ignore[arg-type]


def test_training_leaves_a_co_tenants_rollout_awake_when_both_fit() -> None:
    c = two_on_one_gpu()  # a rolls out (60) + b trains (35) + both asleep parts (1 + 3) = 99 <= 100
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks
    assert [g.cluster_id for g in plan.grants] == ["b_actor_train"]
    assert active(plan, "a_actor_infer") == {0} and plan.allocations["b_actor_train"].gpus == {0}


def test_changed_figures_reach_the_next_plan() -> None:
    """Each GPU's tenancy is kept from one cycle to the next while the registered specs stay the same objects; a
    re-registration with other figures (new spec objects) must be planned with the new figures, not the kept ones."""
    c = two_on_one_gpu()
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_train", TRAIN, 1)])
    assert not plan_cycle(snap).shrinks  # 99 <= 100: a stays awake
    bigger = two_on_one_gpu(infer_awake=62.0)
    snap2 = snapshot(1, bigger, [gen_alloc(bigger["a_actor_infer"], [0])], [PendingRequest("b_actor_train", TRAIN, 1)])
    assert [(s.cluster_id, s.reason) for s in plan_cycle(snap2).shrinks] == [("a_actor_infer", "preempt")]


def test_training_preempts_a_co_tenants_rollout_that_does_not_fit() -> None:
    c = two_on_one_gpu(infer_awake=62.0)  # 101 > 100
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("a_actor_infer", "preempt")]


@pytest.mark.parametrize("infer_awake", [60.0, 62.0])
def test_a_pipelines_own_rollout_stays_awake_beside_its_own_step_where_both_fit(infer_awake: float) -> None:
    """A pipeline alone on a GPU: its rollout keeps generating the next batch while it trains where the figures fit
    (60 + 35 + b's asleep parts 4 = 99 of 100 GiB), and sleeps where they do not (101). Asleep, every other step
    waited for its batch (30 steps/h for one 1.5 B pipeline, against 44-46 for stock NeMo RL: DESIGN §9)."""
    c = two_on_one_gpu(infer_awake=infer_awake)
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("a_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [g.cluster_id for g in plan.grants] == ["a_actor_train"]
    if infer_awake == 60.0:
        assert not plan.shrinks and active(plan, "a_actor_infer") == {0}
    else:
        assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("a_actor_infer", "preempt")]
    _check_holders(snap, plan.allocations)


def test_a_waiting_pipelines_rollout_takes_the_place_of_a_rank_beside_its_own_step() -> None:
    """Two pipelines on one GPU with room for one rollout beside one step: a's step keeps a's rank only while nobody
    else wants the place. b waits with work and no rank, so b's rollout takes it (the co-resident swap), as when a's
    rank slept for every step of a's: kept, b would wait two of a's steps (the fair-turn bound) and then run its
    rollout alone on the GPU."""
    c = two_on_one_gpu()
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])],
                    [PendingRequest("b_actor_infer", GEN, 1), PendingRequest("a_actor_train", TRAIN, 2)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert sorted(g.cluster_id for g in plan.grants) == ["a_actor_train", "b_actor_infer"]
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("a_actor_infer", "rebalance")]
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == [("b_actor_infer", (0,))]
    _check_holders(snap, plan.allocations)


@pytest.mark.parametrize("waiter_work", [0, 16])
def test_a_rollout_whose_batch_is_complete_takes_no_place_and_nothing_takes_turns(waiter_work: int) -> None:
    """One H200, two 1.5B pipelines, room for one rollout beside one step: b trains, its rollout fills b's next batch
    beside the step, and a asks to fill its own next batch. Both batches the trainers wait for were complete, and
    each pipeline took the place from the other on the other's "no work" (a by the swap, b back through the places
    that yield) every 1-12 s for two minutes; each take aborts the holder's requests, 16 of them ran out of attempts.
    Now a rollout whose own batch is complete takes no one's place; with work (16 trajectories left) a takes b's."""
    c = two_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["b_actor_train"]), gen_alloc(c["b_actor_infer"], [0])],
                    [PendingRequest("a_actor_infer", GEN, 1)])
    snap = replace(snap, progress={"a": Progress("a", 32, 32 - waiter_work), "b": Progress("b", 32, 32)})
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    if not waiter_work:
        assert not plan.shrinks and not plan.expands and active(plan, "b_actor_infer") == {0}
        # the other way round (a's rollout beside b's step, b's asks): b takes nothing either
        other = replace(snap, allocations={"b_actor_train": snap.allocations["b_actor_train"],
                                           "a_actor_infer": gen_alloc(c["a_actor_infer"], [0])},
                        pending=(PendingRequest("b_actor_infer", GEN, 2),))
        plan2 = plan_cycle(other)
        validate_plan(other, plan2)
        assert not plan2.shrinks and not plan2.expands and active(plan2, "a_actor_infer") == {0}
        return
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("b_actor_infer", "rebalance")]
    assert active(plan, "a_actor_infer") == {0}
    # b's rollout asks again to fill its next batch (its own batch complete): it takes nothing back
    after = replace(apply_plan(snap, plan), pending=(PendingRequest("b_actor_infer", GEN, 2),))
    plan2 = plan_cycle(after)
    validate_plan(after, plan2)
    assert not plan2.shrinks and not plan2.expands and active(plan2, "a_actor_infer") == {0}


def test_a_rank_is_not_woken_beside_its_own_pipelines_step_in_a_place_another_rollout_yields() -> None:
    """Both pipelines' steps side by side on one GPU with room for one rollout next to them, held by b's rank (its
    batch complete); a has work and no rank. Woken there, a's rank would wait for its weights until a's step ended
    (its trainer sends them after the step: 19.6 s on an H200, the place idle meanwhile, while b's rank had been
    generating), so the place stays b's until a's step ends; then a takes it."""
    c = two_on_one_gpu(infer_awake=25.0, train_awake=30.0)  # two steps + one rollout: 30 + 30 + 25 + 1 = 86 of 100
    snap = snapshot(1, c, [whole_alloc(c["a_actor_train"]), whole_alloc(c["b_actor_train"]),
                           gen_alloc(c["b_actor_infer"], [0])], [PendingRequest("a_actor_infer", GEN, 1)])
    snap = replace(snap, progress={"a": Progress("a", 32, 16), "b": Progress("b", 32, 32)})
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks and not plan.expands and active(plan, "b_actor_infer") == {0}, plan
    # a's step ends: a's rank wakes (beside b's step, next to b's rank: 30 + 25 + 25 + 3 = 83 of 100)
    after = replace(snap, allocations={k: v for k, v in snap.allocations.items() if k != "a_actor_train"})
    plan = plan_cycle(after)
    validate_plan(after, plan)
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == [("a_actor_infer", (0,))], plan
    assert active(plan, "a_actor_infer") == {0}
    _check_holders(after, plan.allocations)


@pytest.mark.parametrize("others", [False, True])
def test_room_that_opens_during_a_step_goes_to_other_pipelines_rollouts(others: bool) -> None:
    """A rank that slept for its pipeline's step does not wake beside that step: room that opens meanwhile goes to
    another pipeline's rollout (its batch is what the step holds up). On one GPU with room for one rollout, the
    pipeline's own rank took every place its co-tenant's step freed."""
    c = two_on_one_gpu()
    pending = [PendingRequest("a_actor_infer", GEN, 1)] + ([PendingRequest("b_actor_infer", GEN, 2)] if others else [])
    snap = snapshot(1, c, [whole_alloc(c["a_actor_train"])], pending)
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == ([("b_actor_infer", (0,))] if others else [])
    # the step ends: a's rank wakes (now beside b's, where it fits, or alone)
    after = replace(apply_plan(snap, plan), pending=tuple(p for p in pending if p.cluster_id == "a_actor_infer"))
    after = replace(after, allocations={k: v for k, v in after.allocations.items() if k != "a_actor_train"})
    plan2 = plan_cycle(after)
    validate_plan(after, plan2)
    assert active(plan2, "a_actor_infer") == ({0} if not others else set())  # 60 + 60 + 6 > 100: it waits for b
    _check_holders(after, plan2.allocations)


def test_a_waiting_rollout_wakes_next_to_a_training_step_and_stays_when_it_ends() -> None:
    c = two_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["b_actor_train"])], [PendingRequest("a_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == [("a_actor_infer", (0,))]
    assert [g.cluster_id for g in plan.grants] == ["a_actor_infer"]
    # b's step ends (the scheduler drops its allocation); a keeps the GPU alone, and b's next step runs beside it
    after = apply_plan(snap, plan)
    after = replace(after, allocations={k: v for k, v in after.allocations.items() if k != "b_actor_train"},
                    pending=(PendingRequest("b_actor_train", TRAIN, 2),))
    plan2 = plan_cycle(after)
    validate_plan(after, plan2)
    assert not plan2.shrinks and not plan2.expands and active(plan2, "a_actor_infer") == {0}


@pytest.mark.parametrize("case", ["initialization", "no figures", "reserved", "does not fit", "own, does not fit"])
def test_no_co_residence_where_the_rule_forbids_it(case: str) -> None:
    pipes = {**pipeline("a", [0], [0]), **pipeline("b", [0], [0]), **pipeline("c", [0], [0])}
    c = with_memory(pipes, gpu=110.0, infer_awake=68.0 if "does not fit" in case else 60.0,
                    skip="c_actor_infer" if case == "no figures" else "")
    host, priority = ("b_actor_infer", Priority.INITIALIZATION) if case == "initialization" else ("b_actor_train", TRAIN)
    if case == "own, does not fit":
        host = "a_actor_train"
    pending = [PendingRequest("a_actor_infer", GEN, 1)]
    if case == "reserved":
        pending.append(PendingRequest("c_actor_train", TRAIN, 2))
    snap = snapshot(1, c, [whole_alloc(c[host], priority)], pending)
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.expands and not active(plan, "a_actor_infer")


def test_rollouts_without_work_leave_a_gpu_to_the_pipeline_they_owe_a_turn() -> None:
    """The stall a simulated run found: p0's and p1's rollouts (30 + 60 GiB) have nothing left to collect and hold
    the GPU together, their steps wait for the turn they owe p2, whose rollout (70 GiB) fits beside neither. Both
    leave (a co-resident rank was never a gap-ratio donor, and the swap took one rank at a time and never a last
    one), and p2 wakes alone on the GPU."""
    pipes = {**pipeline("p0", [0], [0]), **pipeline("p1", [0], [0]), **pipeline("p2", [0], [0])}
    gib = {"p0": 30.0, "p1": 60.0, "p2": 70.0}
    c = {cid: replace(s, memory=ClusterMemory(100.0, gib[s.pipeline_id], 1.0) if s.is_generation
                      else ClusterMemory(100.0, 35.0, 3.0)) for cid, s in pipes.items()}
    snap = snapshot(1, c, [gen_alloc(c["p0_actor_infer"], [0]), gen_alloc(c["p1_actor_infer"], [0])],
                    [PendingRequest("p2_actor_infer", GEN, 1), PendingRequest("p0_actor_train", TRAIN, 2),
                     PendingRequest("p1_actor_train", TRAIN, 3)])
    snap = replace(snap, progress={"p0": Progress("p0", 16, 16), "p1": Progress("p1", 256, 256),
                                   "p2": Progress("p2", 16, 0)},
                   turns_owed={"p0": frozenset({"p2"}), "p1": frozenset({"p0", "p2"})})
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("p0_actor_infer", "rebalance"),
                                                                ("p1_actor_infer", "rebalance")]
    assert active(plan, "p2_actor_infer") == {0} and not plan.grants[1:]
    _check_holders(snap, plan.allocations)
    # without the debt and with work left, p1 keeps its rank: only p0 (no work) would leave, and that is not enough
    busy = replace(snap, progress={**snap.progress, "p1": Progress("p1", 256, 100)}, turns_owed={},
                   pending=snap.pending[:1])
    plan2 = plan_cycle(busy)
    validate_plan(busy, plan2)
    assert not plan2.shrinks and not active(plan2, "p2_actor_infer")


def test_a_co_resident_rank_released_leaves_the_training_step_its_gpu() -> None:
    c = two_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["b_actor_train"]), gen_alloc(c["a_actor_infer"], [0])],
                    planned_releases=["a_actor_infer"])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("a_actor_infer", "release")]
    assert set(plan.allocations) == {"b_actor_train"} and plan.allocations["b_actor_train"].gpus == {0}


# ---- several rollout ranks on one GPU (the 0.5 B shape is rollout-bound: DESIGN §9) ------------------------------
def four_on_one_gpu() -> dict[str, ClusterSpec]:
    """Four 0.5 B pipelines on one H200 as `rlix recipe --gpu-memory-utilization 0.3` declares them."""
    pipes: dict[str, ClusterSpec] = {}
    for p in "abcd":
        for cid, sp in pipeline(p, [0], [0]).items():
            pipes[cid] = replace(sp, memory=ClusterMemory(133.3, 43.7, 1.0) if sp.is_generation
                                 else ClusterMemory(133.3, 13.9, 3.0))
    return pipes


def test_a_waiting_rollout_wakes_next_to_another_pipelines_rollout_instead_of_taking_its_gpu() -> None:
    c = two_on_one_gpu(infer_awake=40.0)  # two rollouts (80) + both trainers asleep (6) = 86 <= 100
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks, "the gap ratio took a's rank although b fits beside it"
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == [("b_actor_infer", (0,))]
    assert active(plan, "a_actor_infer") == {0} and active(plan, "b_actor_infer") == {0}
    _check_holders(snap, plan.allocations)
    assert plan_cycle(apply_plan(snap, plan)).is_noop  # and it stays so


def test_rollouts_of_a_rollout_bound_pool_share_a_gpu_next_to_a_training_step_as_far_as_memory_goes() -> None:
    c = four_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["a_actor_train"])],
                    [PendingRequest(f"{p}_actor_infer", GEN, i) for i, p in enumerate("bcd", start=1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    # a's step (13.9) + two rollouts (87.4) + the rest asleep (a's and d's engines, three trainers: 11) = 112.3 GiB;
    # a third rollout would need 155
    assert [e.cluster_id for e in plan.expands] == ["b_actor_infer", "c_actor_infer"]
    assert not active(plan, "d_actor_infer")
    _check_holders(snap, plan.allocations)
    # a's step ends: d still does not fit beside b and c (three rollouts, the rest asleep: 3 x 43.7 + 1 + 4 x 3 = 144.1)
    after = apply_plan(snap, plan)
    after = replace(after, allocations={k: v for k, v in after.allocations.items() if k != "a_actor_train"})
    plan2 = plan_cycle(after)
    validate_plan(after, plan2)
    assert not plan2.shrinks and not active(plan2, "d_actor_infer")


def three_on_three_gpus() -> dict[str, ClusterSpec]:
    """Three 1.5 B pipelines on three H100s as `rlix recipe --pipelines 3 --gpus 0,1,2 --gpu-memory-utilization 0.3`
    declares them: each trains on its home GPU and rolls out on all three; two rollouts fit a GPU, three do not."""
    pipes: dict[str, ClusterSpec] = {}
    for home, p in enumerate("abc"):
        for cid, sp in pipeline(p, [home], [0, 1, 2]).items():
            pipes[cid] = replace(sp, memory=ClusterMemory(75.6, 26.1, 1.25) if sp.is_generation
                                 else ClusterMemory(75.6, 43.2, 3.0))
    return pipes


def test_the_last_pipeline_to_ask_takes_a_shared_place_instead_of_waiting_for_a_training_grant() -> None:
    """The 4x H100 start-up: a and b hold a rollout rank on every GPU (two per GPU, the memory limit) when c asks.
    The gap ratio never gives a shared GPU and the fill finds each full, so c used to wait 97 s for a's first
    training grant; now one of a's ranks sleeps for it, and the next cycle keeps that (no rank moves back)."""
    c = three_on_three_gpus()
    snap = snapshot(3, c, [gen_alloc(c["a_actor_infer"], [0, 1, 2]), gen_alloc(c["b_actor_infer"], [0, 1, 2])],
                    [PendingRequest("c_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(s.cluster_id, s.dp_ranks, s.reason) for s in plan.shrinks] == [("a_actor_infer", (0,), "rebalance")]
    assert [(e.cluster_id, e.dp_ranks) for e in plan.expands] == [("c_actor_infer", (0,))]
    assert [g.cluster_id for g in plan.grants] == ["c_actor_infer"]
    assert active(plan, "a_actor_infer") == {1, 2} and active(plan, "b_actor_infer") == {0, 1, 2}
    _check_holders(snap, plan.allocations)
    assert plan_cycle(apply_plan(snap, plan)).is_noop


def test_a_training_step_keeps_the_rollout_of_the_pipeline_with_fewest_ranks_beside_it() -> None:
    """Two rollouts on b's home GPU 1 when b's training step comes, room for one beside it: c's only rank stays and
    a, which keeps ranks on GPUs 0 and 2, sleeps there (by cluster id, a stayed and c lost its last rank)."""
    c = three_on_three_gpus()
    snap = snapshot(3, c, [gen_alloc(c["a_actor_infer"], [0, 1, 2]), gen_alloc(c["c_actor_infer"], [1])],
                    [PendingRequest("b_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(s.cluster_id, s.dp_ranks, s.reason) for s in plan.shrinks] == [("a_actor_infer", (1,), "preempt")]
    assert active(plan, "c_actor_infer") == {1} and active(plan, "a_actor_infer") == {0, 2}
    _check_holders(snap, plan.allocations)


def test_a_shared_place_is_never_taken_from_a_pipelines_last_rank() -> None:
    c = {k: v for k, v in three_on_three_gpus().items() if k[0] in "ab"}
    c.update({cid: replace(sp, memory=c["a_actor_infer"].memory if sp.is_generation else c["a_actor_train"].memory)
              for cid, sp in pipeline("c", [0], [0]).items()})
    snap = snapshot(3, c, [gen_alloc(c["a_actor_infer"], [0]), gen_alloc(c["b_actor_infer"], [0])],
                    [PendingRequest("c_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks and not active(plan, "c_actor_infer")  # a and b each keep their one rank; c waits


def test_a_training_step_keeps_the_rollouts_it_fits_beside_its_own_included() -> None:
    c = four_on_one_gpu()
    snap = snapshot(1, c, [gen_alloc(c[f"{p}_actor_infer"], [0]) for p in "bc"],
                    [PendingRequest("a_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks and [g.cluster_id for g in plan.grants] == ["a_actor_train"]
    # b's own training: b's rollout stays too (b's step 13.9 + two rollouts 87.4 + the rest asleep 11 = 112.3 GiB)
    snap2 = replace(snap, pending=(PendingRequest("b_actor_train", TRAIN, 1),))
    plan2 = plan_cycle(snap2)
    validate_plan(snap2, plan2)
    assert not plan2.shrinks and active(plan2, "b_actor_infer") == active(plan2, "c_actor_infer") == {0}
    _check_holders(snap2, plan2.allocations)


# ---- training steps side by side (the 0.5 B pool is paced by one training step at a time per GPU: DESIGN §9) ---
def test_training_steps_of_two_pipelines_run_side_by_side_with_the_rollouts_that_fit() -> None:
    """Four 0.5 B pipelines on one H200: a trains next to b's and c's rollouts when b's step comes. b trains next to
    a's step with both rollouts awake, its own included (two steps 27.8 + two rollouts 87.4 + the rest asleep 9 =
    124.2 GiB); a step used to wait for the other to end."""
    c = four_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["a_actor_train"]), *(gen_alloc(c[f"{p}_actor_infer"], [0]) for p in "bc")],
                    [PendingRequest("b_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks and [g.cluster_id for g in plan.grants] == ["b_actor_train"]
    assert plan.allocations["a_actor_train"].gpus == plan.allocations["b_actor_train"].gpus == {0}
    assert active(plan, "b_actor_infer") == active(plan, "c_actor_infer") == {0}
    _check_holders(snap, plan.allocations)
    # a's step ends while b's runs: a third rollout does not fit beside b's step (145.1 GiB), so a, which waited
    # longest, takes the place of b's own rank beside b's step (the co-resident swap); c keeps its one rank, d waits
    after = apply_plan(snap, plan)
    after = replace(after, allocations={k: v for k, v in after.allocations.items() if k != "a_actor_train"},
                    pending=(PendingRequest("a_actor_infer", GEN, 2), PendingRequest("d_actor_infer", GEN, 3)))
    plan2 = plan_cycle(after)
    validate_plan(after, plan2)
    assert [(s.cluster_id, s.reason) for s in plan2.shrinks] == [("b_actor_infer", "rebalance")]
    assert [(e.cluster_id, e.dp_ranks) for e in plan2.expands] == [("a_actor_infer", (0,))]
    assert active(plan2, "c_actor_infer") == {0} and not active(plan2, "d_actor_infer")
    assert plan2.allocations["b_actor_train"].gpus == {0}
    _check_holders(after, plan2.allocations)


def test_a_third_step_beside_two_keeps_only_the_rollouts_that_still_fit() -> None:
    c = four_on_one_gpu()
    snap = snapshot(1, c, [whole_alloc(c["a_actor_train"]), whole_alloc(c["b_actor_train"]),
                           *(gen_alloc(c[f"{p}_actor_infer"], [0]) for p in "cd")],
                    [PendingRequest("c_actor_train", TRAIN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    # c's own rollout sleeps; d's stays (three steps 41.7 + one rollout 43.7 + the rest asleep 6 = 91.4 GiB)
    assert [(s.cluster_id, s.reason) for s in plan.shrinks] == [("c_actor_infer", "preempt")]
    assert {cid for cid, a in plan.allocations.items() if a.priority == TRAIN} == \
        {"a_actor_train", "b_actor_train", "c_actor_train"}
    assert active(plan, "d_actor_infer") == {0}
    _check_holders(snap, plan.allocations)


@pytest.mark.parametrize("case", ["does not fit", "initialization", "no figures"])
def test_a_training_step_waits_where_it_may_not_run_beside_the_holder(case: str) -> None:
    c = two_on_one_gpu(train_awake=50.0 if case == "does not fit" else 35.0,  # 50 + 50 + 2 engines asleep > 100
                       skip="b_actor_train" if case == "no figures" else "")
    holder = whole_alloc(c["a_actor_infer"], Priority.INITIALIZATION) if case == "initialization" \
        else whole_alloc(c["a_actor_train"])
    snap = snapshot(1, c, [holder], [PendingRequest("b_actor_train", TRAIN, 1),
                                     PendingRequest("a_actor_infer", GEN, 2)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.grants and "b_actor_train" not in plan.allocations
    assert not plan.expands  # the waiting step reserves the GPU: no rollout wakes there meanwhile


@pytest.mark.parametrize("bad", ["does not fit", "start-up", "one pipeline"])
def test_invariants_refuse_two_non_generation_holders_the_rule_forbids(bad: str) -> None:
    c = two_on_one_gpu(train_awake=50.0 if bad == "does not fit" else 35.0)
    first = {"start-up": whole_alloc(c["a_actor_infer"], Priority.INITIALIZATION),
             "one pipeline": whole_alloc(c["a_actor_infer"], Priority.CRITIC_TRAINING),  # a's other training-type hold
             }.get(bad, whole_alloc(c["a_actor_train"]))
    second = whole_alloc(c["a_actor_train"] if bad == "one pipeline" else c["b_actor_train"])
    snap = snapshot(1, c, [first], [PendingRequest(second.cluster_id, TRAIN, 1)])
    plan = plan_cycle(snap)
    corrupt = replace(plan, allocations={first.cluster_id: first, second.cluster_id: second},
                      grants=(Grant(second.cluster_id, TRAIN, 1, second.gpus),))
    with pytest.raises(PlanInvariantError) as info:
        validate_plan(snap, corrupt)
    assert info.value.invariant == "no double allocation", str(info.value)


def test_invariants_refuse_rollouts_that_do_not_fit_together() -> None:
    c = two_on_one_gpu()  # two 60 GiB rollouts: 120 + 6 > 100
    snap = snapshot(1, c, [gen_alloc(c["a_actor_infer"], [0])], [PendingRequest("b_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not active(plan, "b_actor_infer") or not active(plan, "a_actor_infer")
    corrupt = replace(plan, allocations={"a_actor_infer": gen_alloc(c["a_actor_infer"], [0]),
                                         "b_actor_infer": gen_alloc(c["b_actor_infer"], [0])},
                      shrinks=(), expands=(_expand("b_actor_infer", 0),), grants=())
    with pytest.raises(PlanInvariantError) as info:
        validate_plan(snap, corrupt)
    assert info.value.invariant == "no double allocation" and "they need 126.0 GiB" in str(info.value)


@pytest.mark.parametrize("bad", ["does not fit", "own, does not fit", "start-up"])
def test_invariants_refuse_a_pair_the_rule_forbids(bad: str) -> None:
    c = two_on_one_gpu(infer_awake=62.0 if "does not fit" in bad else 60.0)
    host = c["a_actor_train"] if bad.startswith("own") else c["b_actor_train"]
    prio = Priority.INITIALIZATION if bad == "start-up" else TRAIN
    snap = snapshot(1, c, [whole_alloc(host, prio)], [PendingRequest("a_actor_infer", GEN, 1)])
    plan = plan_cycle(snap)
    corrupt = replace(plan, allocations={**plan.allocations, "a_actor_infer": gen_alloc(c["a_actor_infer"], [0])},
                      expands=(*plan.expands, *(() if plan.expands else (_expand("a_actor_infer", 0),))))
    with pytest.raises(PlanInvariantError) as info:
        validate_plan(snap, corrupt)
    assert info.value.invariant == "no double allocation", str(info.value)


def _expand(cid: str, rank: int) -> ExpandOp:
    return ExpandOp(cid, (rank,))


def _check_holders(snap: SchedulerSnapshot, allocations: dict) -> None:
    """Independent of the code under test: a GPU holds at most one allocation of each kind (training-type,
    GENERATION) of each pipeline; more than one holder only when every non-generation one is training-type, and then
    every tenant's figures add up within the GPU."""
    for g in snap.gpus:
        holders = [(cid, a) for cid, a in allocations.items() if g in a.gpus]
        kinds = [(snap.clusters[c].pipeline_id, a.priority == GEN) for c, a in holders]
        assert len(set(kinds)) == len(kinds), f"GPU {g}: {holders}"
        if len(holders) < 2:
            continue
        assert all(Priority.INITIALIZATION < a.priority < GEN for _, a in holders if a.priority != GEN), holders
        awake = {cid for cid, _ in holders}
        tenants = [s for s in snap.clusters.values() if g in s.device_mapping]
        assert all(s.memory is not None for s in tenants)
        load = sum(s.memory.awake_gib if s.cluster_id in awake else s.memory.asleep_gib  # type: ignore[union-attr]
                   for s in tenants)
        assert load <= min(s.memory.gpu_gib for s in tenants)  # type: ignore[union-attr]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(memory=True))
def test_random_pools_with_memory_figures_keep_every_gpu_within_its_memory(snap: SchedulerSnapshot) -> None:
    """Plan, execute, re-plan: every plan passes validation, every GPU's pair of holders fits, and re-planning with
    unchanged demand settles (no rank moves back and forth)."""
    moved = 0
    for _ in range(12):
        plan = plan_cycle(snap)
        validate_plan(snap, plan)
        _check_holders(snap, plan.allocations)
        if plan.is_noop or not (plan.shrinks or plan.expands):
            return
        moved += 1
        snap = apply_plan(snap, plan)
    pytest.fail(f"no fixed point after {moved} cycles")


@st.composite
def shared_pool_runs(draw: st.DrawFn) -> tuple[dict[str, ClusterSpec], list[tuple[str, int]]]:
    """2-4 pipelines over 1-4 GPUs with random memory figures, and a random sequence of events: a pipeline asks to
    train or to roll out, ends its training step, or the scheduler plans."""
    gpus = draw(st.integers(1, 4))
    n = draw(st.integers(2, 4))
    clusters: dict[str, ClusterSpec] = {}
    for i in range(n):
        infer = draw(st.lists(st.integers(0, gpus - 1), min_size=1, max_size=gpus, unique=True))
        train = draw(st.lists(st.sampled_from(infer), min_size=1, max_size=len(infer), unique=True))
        for cid, s in pipeline(f"p{i}", train, infer).items():
            awake = draw(st.sampled_from([10.0, 25.0, 40.0, 70.0]))
            clusters[cid] = s if not draw(st.integers(0, 9)) else replace(
                s, memory=ClusterMemory(100.0, awake, draw(st.sampled_from([1.0, 3.0]))))
    events = draw(st.lists(st.tuples(st.sampled_from(["train", "train", "rollout", "step done", "plan", "plan"]),
                                     st.integers(0, n - 1)), min_size=4, max_size=40))
    return clusters, events


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_pool_runs())
def test_pipelines_sharing_gpus_never_overfill_one(run: tuple[dict[str, ClusterSpec], list[tuple[str, int]]]) -> None:
    """Through any sequence of requests and step ends, every plan is valid and every GPU's holders fit in it."""
    clusters, events = run
    snap = snapshot(max(g for s in clusters.values() for g in s.device_mapping) + 1, clusters)
    seq = 0
    for kind, i in events:
        train, infer = f"p{i}_actor_train", f"p{i}_actor_infer"
        asked = {r.cluster_id for r in snap.pending}
        if kind == "train" and train not in asked and train not in snap.allocations:
            seq += 1
            snap = replace(snap, pending=(*snap.pending, PendingRequest(train, TRAIN, seq)))
        elif kind == "rollout" and infer not in asked:
            seq += 1
            snap = replace(snap, pending=(*snap.pending, PendingRequest(infer, GEN, seq)))
        elif kind == "step done" and train in snap.allocations:
            snap = replace(snap, allocations={k: v for k, v in snap.allocations.items() if k != train})
        elif kind == "plan":
            plan = plan_cycle(snap)
            validate_plan(snap, plan)
            _check_holders(snap, plan.allocations)
            snap = apply_plan(snap, plan)
