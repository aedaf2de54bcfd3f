"""Gap-ratio division of rollout GPUs: proportionality, gap closing over cycles, no starvation, protection."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.control.scheduling.gap_ratio import generation_targets
from rlix_plugins.control.scheduling.planner import plan_cycle, validate_plan
from rlix_plugins.control.types import PendingRequest, Priority, SchedulerSnapshot

from ._planner_fixtures import GEN, active, apply_plan, gen_alloc, pipeline, snapshot, snapshots, whole_alloc

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run_to_fixed_point(snap: SchedulerSnapshot, max_cycles: int = 40) -> tuple[SchedulerSnapshot, int]:
    for n in range(max_cycles):
        plan = plan_cycle(snap)
        validate_plan(snap, plan)
        if plan.is_noop:
            return snap, n
        snap = apply_plan(snap, plan)
    raise AssertionError(f"no fixed point after {max_cycles} cycles: the planner oscillates")


@st.composite
def full_overlap(draw: st.DrawFn) -> SchedulerSnapshot:
    """Generation-only pipelines that all may use the whole pool (tp=1), with random demand and state."""
    g = draw(st.sampled_from([4, 8, 16]))
    n = draw(st.integers(2, 5))
    clusters = {}
    for i in range(n):
        clusters.update(pipeline(f"p{i}", None, range(g)))
    owned: set[int] = set()
    allocs = []
    for i in draw(st.permutations(list(range(n)))):
        s = clusters[f"p{i}_actor_infer"]
        ranks = [r for r in range(g) if r not in owned and draw(st.integers(0, n)) == 0]
        owned |= set(ranks)
        if ranks:
            allocs.append(gen_alloc(s, ranks))
    held = {a.cluster_id for a in allocs}
    pending = [
        PendingRequest(cid, GEN, k, step_target_estimate=draw(st.integers(1, 64)))
        for k, cid in enumerate(sorted(clusters))
        if cid not in held
    ]
    progress = {}
    for i in range(n):
        t = draw(st.integers(1, 200))
        progress[f"p{i}"] = (t, draw(st.integers(0, t)))
    return snapshot(g, clusters, allocs, pending, progress)


@SETTINGS
@given(full_overlap())
def test_gap_closes_to_a_stable_fixed_point(snap) -> None:
    final, cycles = _run_to_fixed_point(snap)
    targets = generation_targets(final)
    act = {cid: len(active(final, cid)) for cid in targets}
    free = len(final.gpus) - sum(act.values())
    demand = {cid: final.progress[final.clusters[cid].pipeline_id].remaining for cid in targets}
    below = [c for c in targets if act[c] < targets[c]]
    donors = [c for c in targets if act[c] > targets[c] and act[c] >= 2]
    assert not (below and donors), f"gap left open: below={below} donors={donors} act={act} targets={targets}"
    if any(d > 0 for d in demand.values()):
        assert free == 0, f"idle GPUs left while pipelines have demand: act={act}"
    if len(final.gpus) >= len(targets):
        assert all(a >= 1 for a in act.values()), f"an eligible pipeline has no rank: {act}"
    assert cycles <= 3, f"took {cycles} cycles"


def test_rollout_capacity_follows_remaining_work() -> None:
    clusters = {**pipeline("a", None, range(16)), **pipeline("b", None, range(16))}
    snap = snapshot(
        16,
        clusters,
        pending=[PendingRequest("a_actor_infer", GEN, 1, step_target_estimate=8), PendingRequest("b_actor_infer", GEN, 2, step_target_estimate=8)],
        progress={"a": (400, 100), "b": (400, 300)},  # a: 300 left, b: 100 left
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert (len(active(plan, "a_actor_infer")), len(active(plan, "b_actor_infer"))) == (12, 4)
    # progress moves on: b now has the most work left; the gap closes by shrinking a, growing b
    snap2 = apply_plan(snap, plan)
    snap2 = snapshot(16, clusters, snap2.allocations.values(), progress={"a": (400, 390), "b": (400, 100)})
    plan2 = plan_cycle(snap2)
    validate_plan(snap2, plan2)
    assert {op.reason for op in plan2.shrinks} == {"rebalance"}
    # a keeps its (new) target: 10 left of 310 -> 16 * 10 / 310 ~ 0.5 -> rounds to 1 bundle, never zero
    assert (len(active(plan2, "a_actor_infer")), len(active(plan2, "b_actor_infer"))) == (1, 15)


def test_tp_weighting_and_bundles() -> None:
    clusters = {**pipeline("a", None, range(8), tp=2), **pipeline("b", None, range(8), tp=1)}
    snap = snapshot(
        8,
        clusters,
        pending=[PendingRequest("a_actor_infer", GEN, 1, step_target_estimate=10), PendingRequest("b_actor_infer", GEN, 2, step_target_estimate=10)],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    # weights 10*2 : 10*1 -> a gets round(8*2/3/2)*2 = 6 GPUs (3 bundles), b gets the other 2
    assert plan.allocations["a_actor_infer"].gpus | plan.allocations["b_actor_infer"].gpus == set(range(8))
    assert len(plan.allocations["a_actor_infer"].gpus) == 6


def test_prefers_no_shrink_and_donors_keep_target() -> None:
    clusters = {**pipeline("a", None, range(8)), **pipeline("b", None, range(8)), **pipeline("c", None, range(8))}
    a, b = clusters["a_actor_infer"], clusters["b_actor_infer"]

    def snap_with(c_demand: int) -> SchedulerSnapshot:
        return snapshot(
            8,
            clusters,
            [gen_alloc(a, [0, 1, 2, 3]), gen_alloc(b, [4, 5])],
            [PendingRequest("c_actor_infer", GEN, 1, step_target_estimate=c_demand)],
            # the scheduler seeds c's progress from its request's estimate (demand survives the grant)
            progress={"a": (100, 0), "b": (100, 50), "c": (c_demand, 0)},
        )

    # weights a 100, b 50, c 50 -> targets 4/2/2: c takes the 2 idle GPUs, nobody shrinks
    snap = snap_with(50)
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not plan.shrinks
    assert active(plan, "c_actor_infer") == {6, 7}
    # weights 100/50/150 -> targets 3/1/4: c takes the idle pair, then one rank from each donor, down to target
    snap = snap_with(150)
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert [(op.cluster_id, len(op.dp_ranks)) for op in plan.shrinks] == [("a_actor_infer", 1), ("b_actor_infer", 1)]
    assert [len(active(plan, c)) for c in ("a_actor_infer", "b_actor_infer", "c_actor_infer")] == [3, 1, 4]
    assert plan_cycle(apply_plan(snap, plan)).is_noop


def test_nearly_finished_pipeline_is_protected() -> None:
    """The acceptor takes its bundle from the donor with MORE remaining work, sparing the nearly finished one."""
    clusters = {**pipeline("near", None, range(8)), **pipeline("far", None, range(8)), **pipeline("new", None, range(8))}
    snap = snapshot(
        8,
        clusters,
        [gen_alloc(clusters["near_actor_infer"], [0, 1, 2, 3]), gen_alloc(clusters["far_actor_infer"], [4, 5, 6, 7])],
        [PendingRequest("new_actor_infer", GEN, 1, step_target_estimate=600)],
        # weights near 3, far 100, new 600 -> targets: near 1 (min bundle), far 1, new 7 (capped by budget use)
        progress={"near": (100, 97), "far": (100, 0)},
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    first = plan.shrinks
    assert first, "new must get GPUs from the donors"
    # "far" (more remaining) gives first: it is shrunk to its target before "near" gives anything beyond it
    far_left = len(active(plan, "far_actor_infer"))
    near_left = len(active(plan, "near_actor_infer"))
    assert far_left == 1 and near_left == 1
    # with only one bundle to move (both donors at target 4: remaining 45 vs 55, new 1), it comes from "far"
    snap_b = snapshot(
        8,
        {**clusters},
        [gen_alloc(clusters["near_actor_infer"], [0, 1, 2, 3]), gen_alloc(clusters["far_actor_infer"], [4, 5, 6, 7])],
        [PendingRequest("new_actor_infer", GEN, 1, step_target_estimate=1)],
        progress={"near": (100, 55), "far": (100, 45)},
    )
    plan_b = plan_cycle(snap_b)
    validate_plan(snap_b, plan_b)
    assert [op.cluster_id for op in plan_b.shrinks] == ["far_actor_infer"]
    assert len(active(plan_b, "new_actor_infer")) == 1


def test_no_starvation_anti_starvation_donor_and_when_gpus_free_up() -> None:
    clusters = {**pipeline("a", [0, 1], range(4)), **pipeline("b", [2, 3], range(4))}
    bi = clusters["b_actor_infer"]
    # b holds every GPU with 4 ranks at its target; a (no estimate, no progress: never skipped) still gets one
    snap = snapshot(4, clusters, [gen_alloc(bi, [0, 1, 2, 3])], [PendingRequest("a_actor_infer", GEN, 1)], progress={"b": (1000, 0)})
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert len(active(plan, "a_actor_infer")) == 1 and any(g.cluster_id == "a_actor_infer" for g in plan.grants)
    # b trains on GPUs 2-3 and keeps one rank on GPU 0: the starving a takes the idle GPU 1
    snap = snapshot(4, clusters, [whole_alloc(clusters["b_actor_train"]), gen_alloc(bi, [0])], [PendingRequest("a_actor_infer", GEN, 5)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert active(plan, "a_actor_infer") == {1}
    snap = snapshot(4, clusters, [whole_alloc(clusters["b_actor_train"]), gen_alloc(bi, [0, 1])], [PendingRequest("a_actor_infer", GEN, 5)])
    plan = plan_cycle(snap)
    validate_plan(snap, plan)  # b has 2 ranks: one goes to the starving a
    assert len(active(plan, "a_actor_infer")) == 1 and len(active(plan, "b_actor_infer")) == 1
    # all 4 GPUs held by b's training and a single b rank: a cannot get one until the training releases
    snap = snapshot(
        4,
        {**clusters, "b_actor_train": pipeline("b", [1, 2, 3], range(4))["b_actor_train"]},
        [whole_alloc(pipeline("b", [1, 2, 3], range(4))["b_actor_train"]), gen_alloc(bi, [0])],
        [PendingRequest("a_actor_infer", GEN, 5)],
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert not active(plan, "a_actor_infer") and not plan.grants
    released = snapshot(4, snap.clusters, [gen_alloc(bi, [0])], [PendingRequest("a_actor_infer", GEN, 5)])
    plan = plan_cycle(released)
    validate_plan(released, plan)
    assert active(plan, "a_actor_infer") and plan.grants[0].cluster_id == "a_actor_infer"


@SETTINGS
@given(snapshots(allow_release=False))
def test_no_usable_idle_bundle_left_while_generation_waits(snap) -> None:
    """After a plan, a pending GENERATION cluster without ranks has no bundle that is idle and unreserved."""
    plan = plan_cycle(snap)
    granted = {g.cluster_id for g in plan.grants}
    used = set().union(*(a.gpus for a in plan.allocations.values())) if plan.allocations else set()
    free = snap.gpus - used
    reserved: set[int] = set()
    for r in snap.pending:
        if r.priority != Priority.GENERATION and r.cluster_id not in granted:
            reserved.update(snap.clusters[r.cluster_id].device_mapping)
    for r in snap.pending:
        if r.priority == GEN and not active(plan, r.cluster_id):
            s = snap.clusters[r.cluster_id]
            for k in range(s.num_dp_ranks):
                assert not set(s.bundle(k)) <= free - reserved, f"{r.cluster_id} left bundle {s.bundle(k)} idle"


def test_standing_request_does_not_mask_progress() -> None:
    """The scheduler re-issues a standing GENERATION request while work is left; progress still decides."""
    clusters = {**pipeline("a", None, range(8)), **pipeline("b", None, range(8))}
    snap = snapshot(
        8,
        clusters,
        [gen_alloc(clusters["a_actor_infer"], [0, 1, 2, 3]), gen_alloc(clusters["b_actor_infer"], [4, 5, 6, 7])],
        [PendingRequest("a_actor_infer", GEN, 1, step_target_estimate=512), PendingRequest("b_actor_infer", GEN, 2, step_target_estimate=512)],
        progress={"a": (512, 502), "b": (512, 0)},
    )
    plan = plan_cycle(snap)
    validate_plan(snap, plan)
    assert (len(active(plan, "a_actor_infer")), len(active(plan, "b_actor_infer"))) == (1, 7)
    assert {g.cluster_id for g in plan.grants} == {"a_actor_infer", "b_actor_infer"}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots())
def test_any_snapshot_reaches_a_fixed_point(snap) -> None:
    """Re-planning with unchanged demand settles (no ping-pong of ranks between pipelines)."""
    _run_to_fixed_point(snap, max_cycles=12)
