"""Scheduler actor scenarios on a real Ray cluster (4 declared GPUs) with real coordinator actors.

Each pipeline's resize handler is a real Ray actor that records ``resize_infer`` calls (see ``_ray_helpers``).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.scheduling.cycle import apply_shrink, merge_ops
from rlix_plugins.control.scheduling.gap_ratio import cluster_demands
from rlix_plugins.control.scheduling.plan_state import PlanState
from rlix_plugins.control.scheduling.rebalance import demand, rebalance_reason
from rlix_plugins.control.trace import TraceRecorder
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
    ShrinkOp,
)
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, RlixTimeoutError, SchedulerError
from tests.control._ray_helpers import FAST_SCHEDULER, control_plane, make_pipeline, wait_for

__all__ = ["control_plane"]  # the fixture, imported for pytest

GEN = Priority.GENERATION


def active_gpus(cp: client.ControlPlane, cid: str) -> list[int]:
    """GPUs of the cluster's awake rollout ranks: none while an expand of it is in flight (its allocation already
    counts the ranks being woken)."""
    st = cp.status()
    alloc = st["allocations"].get(cid)
    if not alloc or alloc["priority"] != "GENERATION" or any(e["cluster_id"] == cid for e in st["expanding"]):
        return []
    return alloc["gpus"]


def calls(handler: object) -> list[tuple[float, list[int], list[int]]]:
    return ray.get(handler.calls.remote(), timeout=10)  # type: ignore[attr-defined]


def test_training_preempts_other_pipelines_rank_and_it_comes_back(control_plane: client.ControlPlane) -> None:
    """B's training takes GPU 1 from A's rollout rank (A slept before B's grant returns); A gets it back later."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[1], infer=[1, 2, 3])
    assert a.request_gpus("actor_infer", GEN, step_target_estimate=64, timeout_s=10) == [0, 1]
    assert b.request_gpus("actor_infer", GEN, step_target_estimate=1, timeout_s=10)
    assert active_gpus(cp, a.cluster_id("actor_infer")) == [0, 1]

    assert b.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10) == [1]
    returned = time.time()
    shrink = [c for c in calls(ha) if c[1] == [1]]
    assert shrink and shrink[0][0] <= returned, "grant returned before the donor rank was put to sleep"
    st = cp.status()
    assert st["allocations"][b.cluster_id("actor_train")]["gpus"] == [1]
    assert 1 not in active_gpus(cp, a.cluster_id("actor_infer"))

    b.release_gpus("actor_train", step=0)
    wait_for(lambda: active_gpus(cp, a.cluster_id("actor_infer")) == [0, 1], what="A's rank 1 woken again")
    assert calls(ha)[-1][1:] == ([], [1])
    ops = [e.op for e in cp.trace() if e.cluster_id == a.cluster_id("actor_infer")]
    assert ops.count("shrink") >= 1 and ops.count("expand") >= 2


def test_rollout_capacity_follows_remaining_work(control_plane: client.ControlPlane) -> None:
    """Idle rollout GPUs go to the pipeline with most work left; progress reports move them."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=None, infer=[0, 1, 2, 3], delay_s=0.05)
    b, hb = make_pipeline(cp, train=None, infer=[0, 1, 2, 3], delay_s=0.05)
    a.report_progress(collected=10, step_target=100, step=0, new_batch=True)
    b.report_progress(collected=90, step_target=100, step=0, new_batch=True)
    a.request_gpus("actor_infer", GEN, timeout_s=10)
    b.request_gpus("actor_infer", GEN, timeout_s=10)
    ca, cb = a.cluster_id("actor_infer"), b.cluster_id("actor_infer")
    wait_for(lambda: len(active_gpus(cp, ca)) == 3 and len(active_gpus(cp, cb)) == 1, what="3:1 split for A")

    # A nearly done, B starts a new large batch: capacity moves to B (coordinator → scheduler progress path).
    t_flip = time.time()
    a.report_progress(collected=99, step_target=100, step=0)
    b.report_progress(collected=0, step_target=100, step=1, new_batch=True)
    wait_for(lambda: len(active_gpus(cp, cb)) == 3 and len(active_gpus(cp, ca)) == 1, what="capacity moved to B")
    # Shrinks run before expands: B's first wake after the flip starts after A's first sleep ended.
    first_shrink_end = min(s[1] for s in ray.get(ha.spans.remote()) if s[2] and s[0] > t_flip)
    first_expand_start = min(s[0] for s in ray.get(hb.spans.remote()) if s[3] and s[0] > t_flip)
    assert first_expand_start >= first_shrink_end
    assert any(e.op == "shrink" and "rebalance" in e.detail for e in cp.trace() if e.pipeline_id == a.pipeline_id)
    assert not set(active_gpus(cp, ca)) & set(active_gpus(cp, cb))


def test_suspended_pipeline_is_woken_again_without_asking(control_plane: client.ControlPlane) -> None:
    """Starvation: A's rollout is preempted to zero by B's init; when B releases, A wakes with no new request.

    C (disjoint GPUs) keeps serving throughout: three pipelines, one scheduler.
    """
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[0, 1], infer=[0, 1])
    c, hc = make_pipeline(cp, train=[2], infer=[2, 3])
    a.report_progress(0, 50, step=0, new_batch=True)
    assert a.request_gpus("actor_infer", GEN, timeout_s=10) == [0, 1]
    assert c.request_gpus("actor_infer", GEN, step_target_estimate=4, timeout_s=10) == [2, 3]
    assert b.request_gpus("actor_train", Priority.INITIALIZATION, step=-1, timeout_s=10) == [0, 1]
    assert a.cluster_id("actor_infer") not in cp.status()["allocations"]  # suspended: no active rank
    assert calls(ha)[-1][1:] == ([0, 1], [])
    time.sleep(0.5)
    assert len(calls(ha)) == 2  # nothing can wake while B holds both GPUs
    b.release_gpus("actor_train", step=-1)
    wait_for(lambda: active_gpus(cp, a.cluster_id("actor_infer")) == [0, 1], what="A re-expanded by the scheduler")
    assert calls(ha)[-1][1:] == ([], [0, 1])
    assert calls(hc) and all(call[1] == [] for call in calls(hc))  # C was never shrunk
    # A's batch is done: its ranks stay but it is no longer owed more.
    a.report_progress(50, 50, step=0)
    assert c.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10) == [2]


def test_donor_shrinks_run_concurrently(control_plane: client.ControlPlane) -> None:
    """C's training needs GPUs of A's and B's rollout ranks: both shrinks run at once, the grant follows them."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=None, infer=[0], delay_s=1.5)
    b, hb = make_pipeline(cp, train=None, infer=[1], delay_s=1.5)
    c, _ = make_pipeline(cp, train=[0, 1], infer=[0, 1])
    a.request_gpus("actor_infer", GEN, timeout_s=20)
    b.request_gpus("actor_infer", GEN, timeout_s=20)
    t0 = time.time()
    assert c.request_gpus("actor_train", Priority.INITIALIZATION, timeout_s=20) == [0, 1]
    took = time.time() - t0
    (sa,), (sb,) = ([s for s in ray.get(h.spans.remote()) if s[2]] for h in (ha, hb))
    assert max(sa[1], sb[1]) <= t0 + took  # both donors slept before the grant returned
    assert sa[0] < sb[1] and sb[0] < sa[1], "the two shrinks did not overlap in time"
    assert took < 2 * 1.5, f"shrinks ran one after another ({took:.2f} s)"


def test_planned_shrink_to_zero(control_plane: client.ControlPlane) -> None:
    """await_release sleeps every active rank, returns the freed GPUs, and the cluster stays asleep."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10)
    assert a.await_release("actor_infer", timeout_s=10) == [0, 1]
    assert calls(ha)[-1][1:] == ([0, 1], [])
    assert a.cluster_id("actor_infer") not in cp.status()["allocations"]
    assert a.get_active_ranks() == []
    time.sleep(0.6)  # several poll periods: no re-expansion of a released cluster
    assert len(calls(ha)) == 2
    assert a.await_release("actor_infer", timeout_s=5) == []  # idempotent
    # A new GENERATION request re-opens it.
    assert a.request_gpus("actor_infer", GEN, timeout_s=10) == [0, 1]


def test_unregister_wakes_waiters_with_error(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10)
    ref = cp.scheduler.request_gpus.remote(b.cluster_id("actor_train"), int(Priority.ACTOR_TRAINING), 0, None, 30.0)
    wait_for(lambda: cp.status()["pending"], what="B's request pending")
    t0 = time.monotonic()
    assert b.unregister() is True
    with pytest.raises(PipelineUnregisteredError, match="unregistered"):
        client.call(ref, "request", 10)
    assert time.monotonic() - t0 < 5
    assert b.unregister() is False  # idempotent
    st = cp.status()
    assert b.pipeline_id not in st["pipelines"] and st["pending"] == []
    assert a.release_gpus("actor_train") == [0]
    assert cp.status()["idle_gpus"] == [0, 1, 2, 3]


def test_request_timeout_names_the_blocker(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(RlixTimeoutError, match=rf"not granted within 0.5 s.*{a.cluster_id('actor_train')}"):
        b.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    assert cp.status()["pending"] == []  # the timed-out request left no trace in the queue
    a.release_gpus("actor_train")
    assert b.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10) == [0]


def test_release_then_request_and_request_rules(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    assert a.request_gpus("actor_train", Priority.INITIALIZATION, step=-1, timeout_s=10) == [0]
    # Same priority again: returns at once; another priority while holding: clear error.
    assert a.request_gpus("actor_train", Priority.INITIALIZATION, timeout_s=10) == [0]
    with pytest.raises(SchedulerError, match="release them"):
        a.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10)
    with pytest.raises(SchedulerError, match="only generation clusters"):
        a.request_gpus("actor_train", GEN, timeout_s=1)
    with pytest.raises(RlixConfigError, match="unknown priority"):
        client.call(cp.scheduler.request_gpus.remote(a.cluster_id("actor_train"), 9), "request")
    got = a.release_then_request("actor_train", "actor_infer", Priority.INITIALIZATION, timeout_s=10)
    assert got == [0, 1]
    st = cp.status()
    assert list(st["allocations"]) == [a.cluster_id("actor_infer")]
    assert st["allocations"][a.cluster_id("actor_infer")]["priority"] == "INITIALIZATION"
    assert a.release_gpus("actor_infer") == [0, 1]
    with pytest.raises(PipelineUnregisteredError):
        client.call(cp.scheduler.request_gpus.remote("nope_actor_train", 1), "request")


def test_status_lists_pipelines_allocations_pending_idle(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=3, timeout_s=10)
    ref = cp.scheduler.request_gpus.remote(b.cluster_id("actor_train"), 1, 3, None, 20.0)
    wait_for(lambda: cp.status()["pending"], what="pending request")
    st = cp.status()
    assert set(st["pipelines"]) == {a.pipeline_id, b.pipeline_id}
    assert st["allocations"][a.cluster_id("actor_train")] == {
        "pipeline_id": a.pipeline_id, "priority": "ACTOR_TRAINING", "gpus": [0], "active_dp_ranks": []}
    assert [p["cluster_id"] for p in st["pending"]] == [b.cluster_id("actor_train")]
    assert st["idle_gpus"] == [1, 2, 3]
    a.release_gpus("actor_train")
    assert client.call(ref, "request", 10) == [0]


def test_trace_recorder_is_bounded() -> None:
    rec = TraceRecorder(capacity=3)
    for i in range(5):
        rec.record("allocate", cluster_id=f"c{i}", gpus=[2, 1])
    assert [e.cluster_id for e in rec.events()] == ["c2", "c3", "c4"]
    assert rec.dropped == 2 and rec.events()[0].gpus == (1, 2)
    assert [e.cluster_id for e in rec.events(limit=1)] == ["c4"]
    with pytest.raises(ValueError):
        TraceRecorder(0)


def _spec(pid: str, mapping: tuple[int, ...], tp: int = 1) -> ClusterSpec:
    return ClusterSpec(f"{pid}_actor_infer", pid, "actor_infer", mapping, tp)


def test_pure_helpers_merge_shrink_and_rebalance_trigger() -> None:
    s = _spec("p", (0, 1, 2, 3), tp=2)
    alloc = Allocation(s.cluster_id, GEN, frozenset({0, 1, 2, 3}), frozenset({0, 1}))
    assert apply_shrink(alloc, s, [1]) == Allocation(s.cluster_id, GEN, frozenset({0, 1}), frozenset({0}))
    ops = [ShrinkOp(s.cluster_id, (1,), "preempt"), ShrinkOp(s.cluster_id, (0,), "rebalance")]
    assert merge_ops(ops) == {s.cluster_id: (0, 1)}

    a, b = _spec("a", (0, 1, 2, 3)), _spec("b", (0, 1, 2, 3))
    base = dict(gpus=frozenset(range(4)), gpus_per_node=4, clusters={a.cluster_id: a, b.cluster_id: b})
    # A suspended cluster with demand (a standing GENERATION request) triggers a poll cycle.
    snap = SchedulerSnapshot(**base, allocations={}, pending=(PendingRequest(a.cluster_id, GEN, 0, None, 4),))
    # Shares in line with demand: nothing to do; badly off: drift.
    fair = {a.cluster_id: Allocation(a.cluster_id, GEN, frozenset({0, 1}), frozenset({0, 1})),
            b.cluster_id: Allocation(b.cluster_id, GEN, frozenset({2, 3}), frozenset({2, 3}))}
    prog = {"a": Progress("a", 10, 5), "b": Progress("b", 10, 5)}
    assert rebalance_reason(SchedulerSnapshot(**base, allocations=fair, progress=prog), 0.1) is None
    skew = {"a": Progress("a", 100, 0), "b": Progress("b", 100, 90)}
    assert "share" in (rebalance_reason(SchedulerSnapshot(**base, allocations=fair, progress=skew), 0.1) or "")
    assert snap.pending  # the loop runs a cycle whenever requests (real or standing) are pending


def test_scheduler_validates_specs_once_at_registration() -> None:
    """Pool bounds and TP bundles are refused at registration (cycles never re-check the frozen specs)."""
    from rlix_plugins.control.scheduling.scheduler import Scheduler

    async def register(*specs: ClusterSpec) -> None:
        sched = Scheduler(4, 2)
        try:
            await sched.register_pipeline(specs[0].pipeline_id, list(specs))
        finally:
            await sched.shutdown()

    with pytest.raises(RlixConfigError, match=r"GPU\(s\) \[5\] are not in the pool \[0..3\]"):
        asyncio.run(register(_spec("p", (0, 5))))
    with pytest.raises(RlixConfigError, match="crosses a node boundary"):
        asyncio.run(register(_spec("p", (1, 2), tp=2)))
    asyncio.run(register(_spec("p", (0, 1, 2, 3), tp=2)))


def test_rebalance_trigger_and_planner_share_one_demand_rule() -> None:
    """Progress says 0 left while a GENERATION request waits: the trigger and the planner both see its estimate."""
    a, b = _spec("a", (0, 1, 2, 3)), _spec("b", (0, 1, 2, 3))
    snap = SchedulerSnapshot(
        gpus=frozenset(range(4)), gpus_per_node=4, clusters={a.cluster_id: a, b.cluster_id: b},
        allocations={b.cluster_id: Allocation(b.cluster_id, GEN, frozenset(range(4)), frozenset(range(4)))},
        pending=(PendingRequest(a.cluster_id, GEN, 0, None, 4),),
        progress={"a": Progress("a", 8, 8), "b": Progress("b", 8, 0)},
    )
    planner_view = cluster_demands(PlanState.from_snapshot(snap))
    assert planner_view == {a.cluster_id: 4, b.cluster_id: 8}
    assert demand(snap) == {"a": 4, "b": 8}
    # a is owed rollout GPUs but holds none: the trigger sees the demand the planner will act on (it saw 0)
    assert rebalance_reason(snap, 0.1) == "a_actor_infer is suspended with 4 trajectories left"


def _check_exclusive_occupancy(events: list, pids: set[str]) -> int:
    """Replay the trace: a GPU is never allocated/expanded while another cluster holds it. Returns #occupy ops."""
    owner: dict[int, str] = {}
    n = 0
    for e in events:
        if e.pipeline_id not in pids:
            continue
        if e.op in ("allocate", "expand"):
            n += 1
            for g in e.gpus:
                assert owner.get(g, e.cluster_id) == e.cluster_id, f"GPU {g} double-allocated: {owner[g]} and {e}"
                owner[g] = e.cluster_id
        elif e.op in ("release", "shrink"):
            for g in e.gpus:
                if owner.get(g) == e.cluster_id:
                    del owner[g]
        elif e.op in ("unregister", "fail"):
            for g in [g for g, c in owner.items() if c.startswith(e.pipeline_id + "_")]:
                del owner[g]
    return n


def test_four_pipelines_concurrently_never_double_allocate(control_plane: client.ControlPlane) -> None:
    """4 pipelines (train on GPU i, rollout on all 4) run steps concurrently from threads; the trace replay shows
    every GPU held by one cluster at a time, and every pipeline finishes."""
    import threading

    cp = control_plane
    pipes = [make_pipeline(cp, train=[i], infer=[0, 1, 2, 3])[0] for i in range(4)]
    errors: list[BaseException] = []
    waits: list[float] = []

    def run(p: client.PipelineHandle, i: int) -> None:
        try:
            p.request_gpus("actor_infer", GEN, step_target_estimate=8 + i, timeout_s=30)
            for step in range(3):
                p.report_progress(step * 3, 10, step=step, new_batch=True)
                t0 = time.monotonic()
                assert p.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=step, timeout_s=30) == [i]
                waits.append(time.monotonic() - t0)
                time.sleep(0.05)
                p.release_gpus("actor_train", step=step)
            p.await_release("actor_infer", timeout_s=30)
            p.unregister("done")
        except BaseException as exc:  # collected, asserted in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p, i)) for i, p in enumerate(pipes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(waits) == 12
    st = cp.status()
    assert st["pipelines"] == {} and st["allocations"] == {} and st["idle_gpus"] == [0, 1, 2, 3]
    occupy = _check_exclusive_occupancy(cp.trace(), {p.pipeline_id for p in pipes})
    assert occupy >= 12 + 4  # 12 training allocations + at least one expand per pipeline


def test_occupancy_replay_detects_double_allocation() -> None:
    """The replay used above is able to fail."""
    from rlix_plugins.control.types import TraceEvent

    ok = [TraceEvent(1.0, "a", "a_actor_infer", "expand", (0,)), TraceEvent(2.0, "a", "a_actor_infer", "shrink", (0,)),
          TraceEvent(3.0, "b", "b_actor_train", "allocate", (0,), 1)]
    assert _check_exclusive_occupancy(ok, {"a", "b"}) == 2
    with pytest.raises(AssertionError, match="double-allocated"):
        _check_exclusive_occupancy([ok[0], ok[2]], {"a", "b"})


def test_back_to_back_training_keeps_its_gpu_and_idle_gpu_is_lent_after_grace(
    control_plane: client.ControlPlane,
) -> None:
    """A released training GPU is not lent to rollout during the grace window (no wake+sync+shrink per step when
    the next step asks again at once); once the window ends, the idle GPU goes back to rollout."""
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, hb = make_pipeline(cp, train=[1], infer=[0, 1])
    assert b.request_gpus("actor_infer", GEN, step_target_estimate=64, timeout_s=10) == [0, 1]
    for step in range(3):
        assert a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=step, timeout_s=10) == [0]
        a.release_gpus("actor_train", step=step)
    b_calls = calls(hb)
    expands_of_rank0 = [c for c in b_calls if 0 in c[2]]
    assert len(expands_of_rank0) == 1, f"B's rank 0 was re-woken between A's back-to-back steps: {b_calls}"
    released = time.time()
    wait_for(lambda: active_gpus(cp, b.cluster_id("actor_infer")) == [0, 1], what="B's rank 0 lent again")
    assert calls(hb)[-1][1:] == ([], [0])
    assert calls(hb)[-1][0] >= released + FAST_SCHEDULER.release_grace_s - 0.5, "lent before the grace window ended"


#: Engines 60 GiB awake, trainers 35 GiB per step, of 100 GiB: one pipeline's rollout fits next to another's step.
_FITS = {"actor_infer": {"gpu_gib": 100, "awake_gib": 60, "asleep_gib": 1},
         "actor_train": {"gpu_gib": 100, "awake_gib": 35, "asleep_gib": 3}}


def test_rollout_runs_next_to_another_pipelines_training_when_memory_fits(control_plane: client.ControlPlane) -> None:
    """Co-residence through the real scheduler: B's training leaves A's rank awake on GPU 3, A's step then runs next
    to B's (A's own rank sleeps), B's rollout wakes next to A's step, and the figures the pipelines registered are in
    `rlix status`."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[3], infer=[3], memory=_FITS)
    b, _ = make_pipeline(cp, train=[3], infer=[3], memory=_FITS)
    assert a.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    assert b.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10) == [3]
    st = cp.status()
    assert st["allocations"][a.cluster_id("actor_infer")]["gpus"] == [3], "A's rank was preempted"
    assert not [c for c in calls(ha) if c[1]], "A's rank was shrunk"
    assert st["pipelines"][a.pipeline_id]["clusters"]["actor_train"]["memory"] == {
        "gpu_gib": 100.0, "awake_gib": 35.0, "asleep_gib": 3.0}
    # A's step comes while B's runs: A's own rank sleeps, A trains beside B (two steps + two engines asleep: 72 GiB)
    assert a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10) == [3]
    st = cp.status()
    assert st["allocations"][a.cluster_id("actor_train")]["gpus"] == st["allocations"][b.cluster_id("actor_train")][
        "gpus"] == [3]
    assert a.cluster_id("actor_infer") not in st["allocations"] and not st["invariant_violations"]
    # B's step ends; B's rollout wakes next to A's step (60 + 35 + 1 + 3 = 99 GiB)
    b.release_gpus("actor_train", step=0)
    assert b.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    st = cp.status()
    assert st["allocations"][a.cluster_id("actor_train")]["gpus"] == [3]
    assert st["allocations"][b.cluster_id("actor_infer")]["gpus"] == [3]
    a.release_gpus("actor_train", step=0)


#: Engines 30 GiB awake, trainers 35 GiB per step, of 100 GiB: two rollouts fit beside one step only when one of
#: three pipelines' rollouts sleeps (30 + 30 + 35 + 1 + 3 x 3 = 105 GiB with both awake).
_TWO_OF_THREE = {"actor_infer": {"gpu_gib": 100, "awake_gib": 30, "asleep_gib": 1},
                 "actor_train": {"gpu_gib": 100, "awake_gib": 35, "asleep_gib": 3}}


def test_the_rollouts_that_sleep_beside_steps_take_turns(control_plane: client.ControlPlane) -> None:
    """Three pipelines on GPU 3 through the real scheduler: A and B roll out, C's steps have room beside them for one
    of the two. The rank kept at C's second step is the one put to sleep at its first: the ranks that sleep take
    turns. In a fixed order, two of four 0.5B pipelines on one H200 slept through every step and waited 22-35 s for
    each batch while the other two waited 0.4 s."""
    cp = control_plane
    a, _ = make_pipeline(cp, train=[3], infer=[3], memory=_TWO_OF_THREE)
    b, _ = make_pipeline(cp, train=[3], infer=[3], memory=_TWO_OF_THREE)
    c, _ = make_pipeline(cp, train=[3], infer=[3], memory=_TWO_OF_THREE)
    rollouts = {a.cluster_id("actor_infer"), b.cluster_id("actor_infer")}
    assert a.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    assert b.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    slept = []
    for step in range(2):
        assert c.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=step, timeout_s=10) == [3]
        awake = {cid for cid in rollouts if active_gpus(cp, cid)}
        assert len(awake) == 1, f"step {step}: awake beside C's step {awake}"
        slept.append(next(iter(rollouts - awake)))
        c.release_gpus("actor_train", step=step)
        wait_for(lambda: all(active_gpus(cp, cid) for cid in rollouts), what="both rollouts awake again")
    assert slept[0] != slept[1], f"the same rank slept beside both of C's steps: {slept}"
    assert not cp.status()["invariant_violations"]


def test_a_pipelines_own_rollout_keeps_generating_beside_its_step(control_plane: client.ControlPlane) -> None:
    """A pipeline alone on GPU 3 through the real scheduler: its training grant leaves its own rank awake where the
    figures fit (60 + 35 = 95 of 100 GiB), so async GRPO makes the next batch during the step; with figures that do
    not fit the rank sleeps."""
    cp = control_plane
    big = {**_FITS, "actor_train": {**_FITS["actor_train"], "awake_gib": 45.0}}  # 60 + 45 > 100
    for memory, stays in ((_FITS, True), (big, False)):
        a, ha = make_pipeline(cp, train=[3], infer=[3], memory=memory)
        assert a.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
        assert a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10) == [3]
        st = cp.status()
        assert (a.cluster_id("actor_infer") in st["allocations"]) is stays and not st["invariant_violations"]
        assert bool([c for c in calls(ha) if c[1]]) is not stays, calls(ha)
        a.release_gpus("actor_train", step=0)
        a.unregister()


def test_two_pipelines_rollouts_share_a_gpu_when_memory_fits(control_plane: client.ControlPlane) -> None:
    """Several rollout ranks on a GPU through the real scheduler: B's rollout wakes next to A's on GPU 3 instead of
    taking it (no shrink of A's rank), and C's training step then keeps both awake beside it."""
    cp = control_plane
    small = {"actor_infer": {"gpu_gib": 100, "awake_gib": 30, "asleep_gib": 1},
             "actor_train": {"gpu_gib": 100, "awake_gib": 30, "asleep_gib": 3}}  # 2 rollouts + a step + 7 asleep: 97
    a, ha = make_pipeline(cp, train=[3], infer=[3], memory=small)
    b, _ = make_pipeline(cp, train=[3], infer=[3], memory=small)
    c, _ = make_pipeline(cp, train=[3], infer=[3], memory=small)
    assert a.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    assert b.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [3]
    assert c.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10) == [3]
    st = cp.status()
    assert {cid: al["gpus"] for cid, al in st["allocations"].items()} == {
        a.cluster_id("actor_infer"): [3], b.cluster_id("actor_infer"): [3], c.cluster_id("actor_train"): [3]}
    assert not [call for call in calls(ha) if call[1]], "A's rank was shrunk"
    assert not st["invariant_violations"]
    c.release_gpus("actor_train", step=0)


def test_a_training_grant_does_not_wait_for_another_pipelines_slow_expand(control_plane: client.ControlPlane) -> None:
    """One cycle grants A's training and wakes B's rollout rank next to it (co-residence); B's wake takes 2 s. A's
    grant returns once the shrinks are done, before B's expand ends: one pipeline's slow expand never holds back
    another pipeline's training."""
    from concurrent.futures import ThreadPoolExecutor

    cp = control_plane
    fits = {name: {**figures, "gpu_gib": 110} for name, figures in _FITS.items()}
    c, _ = make_pipeline(cp, train=[3], infer=[3], memory=fits)
    b, hb = make_pipeline(cp, train=[3], infer=[3], memory=fits, delay_s=2.0)
    a, _ = make_pipeline(cp, train=[3], infer=[3], memory=fits)
    assert c.request_gpus("actor_infer", Priority.INITIALIZATION, step=-1, timeout_s=10) == [3]
    with ThreadPoolExecutor(2) as ex:
        b_rollout = ex.submit(b.request_gpus, "actor_infer", GEN, step_target_estimate=8, timeout_s=20)
        wait_for(lambda: len(cp.status()["pending"]) == 1, what="B's rollout request pending")
        a_train = ex.submit(lambda: (a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=20),
                                     time.time()))
        wait_for(lambda: len(cp.status()["pending"]) == 2, what="A's training request pending")
        c.release_gpus("actor_infer", step=-1)
        gpus, a_granted_at = a_train.result(timeout=30)
        assert gpus == [3] and b_rollout.result(timeout=30) == [3]
    ((start, end, _, added),) = ray.get(hb.spans.remote(), timeout=10)
    assert added == [0] and a_granted_at < end, (a_granted_at, start, end)
    a.release_gpus("actor_train", step=0)
