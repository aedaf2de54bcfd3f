"""The pipeline runtime, router and resize handler on real Ray and the real control plane.

The host seams are recording stand-ins (tests/pipeline/standins.py); the vLLM-backed ones run in tests/demo.
Regression tests are named after the failures they guard.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray

from rlix_plugins.control.client import ControlPlane
from rlix_plugins.control.types import Priority
from rlix_plugins.errors import RlixError, SchedulerError, TransportError
from rlix_plugins.pipeline.config import RuntimeConfig
from rlix_plugins.pipeline.resizer import FleetResizer
from rlix_plugins.pipeline.router import RolloutRouter
from rlix_plugins.pipeline.runtime import PipelineRuntime
from rlix_plugins.pipeline.versions import VersionLedger
from tests.control._ray_helpers import FAST_COORDINATOR, control_plane, make_pipeline, wait_for
from tests.pipeline.standins import (
    Recorder,
    RecordingFleet,
    RecordingPublisher,
    RecordingWeights,
    SlowStartCollector,
    ops,
)

__all__ = ["control_plane"]

CFG = RuntimeConfig(watchdog_interval_s=0.3, request_timeout_s=20, init_timeout_s=20, sync_timeout_s=5,
                    drain_timeout_s=5, release_timeout_s=20, resize_lock_timeout_s=5)


def _runtime(cp: ControlPlane, train: list[int], infer: list[int]) -> tuple[PipelineRuntime, Any]:
    rec = Recorder.remote()
    rt = PipelineRuntime.register(cp, train, infer, config=CFG, coordinator_config=FAST_COORDINATOR)
    rt.start(RecordingWeights(rec), lambda: RecordingFleet(rec, len(infer)))
    return rt, rec


def _active(rt: PipelineRuntime) -> list[int]:
    return list(ray.get(rt.router.active.remote()))


def test_runtime_step_in_hook_order(control_plane: ControlPlane) -> None:
    rt, rec = _runtime(control_plane, [0], [0, 1])
    assert ops(rec)[:4] == [("build", -1), ("wake", [0, 1]), ("sync", [0, 1]), ("sleep", ([0, 1], 2))], \
        "init: cache v-1, prewarm (wake, warm-up sync), sleep"
    assert _active(rt) == []
    rt.attach_collector(RecordingPublisher(rec))
    assert _active(rt), "attach_collector returned before a rank was routed"
    first = ops(rec)[4:]
    expand_sync = ("sync", (_active(rt), ["kv_cache"]))  # the KV cache wakes while the weights are copied in
    assert ("publish", 0) in first and first.index(expand_sync) < first.index(("publish", 0))
    assert first.index(("wake", (_active(rt), ["weights"]))) < first.index(expand_sync), "expand: weights woken first"

    n = len(ops(rec))
    rt.before_training(0)
    assert 0 not in _active(rt), "training grant returned while the donor rank was still routed"
    after_grant = ops(rec)[n:]
    if after_grant:  # rank 0 was active: it was aborted, drained and slept before the grant returned
        assert [o[0] for o in after_grant[:2]] == ["abort", "sleep"]

    with pytest.raises(RlixError, match="reads empty storage"):  # built after offload: refused, not stale
        rt.after_training(0)
    assert rt.before_weight_sync(0) == 1
    version = rt.after_training(0)
    assert version == 1
    assert ("sync", _active(rt)) in ops(rec)[n:], "the active rank was not refreshed in flight"
    rt.on_published(0, version)
    wait_for(lambda: _active(rt) == [0, 1], timeout_s=10, what="rank 0 expanded after training")
    publishes = [a for o, a in ops(rec) if o == "publish"]
    assert publishes[-1] == 1 and max(publishes) == 1, f"expand bumped the version: {publishes}"

    assert rt.end() == []
    assert _status_allocs(control_plane, rt.pipeline_id) == {}
    assert rt.pipeline_id not in control_plane.status()["pipelines"]


def _status_allocs(cp: ControlPlane, pid: str) -> dict[str, Any]:
    return {c: a for c, a in cp.status()["allocations"].items() if c.startswith(pid)}


def test_starvation_after_preemption_ranks_come_back(control_plane: ControlPlane) -> None:
    """Starvation: another pipeline's INITIALIZATION preempts every rank; GENERATION must come back by itself."""
    rt, _rec = _runtime(control_plane, [0], [0, 1])
    rt.attach_collector(RecordingPublisher(_rec))
    other, _ = make_pipeline(control_plane, train=[0, 1], infer=[0, 1, 2])
    other.request_gpus("actor_train", Priority.INITIALIZATION, timeout_s=20)
    assert _active(rt) == [], "INITIALIZATION of the other pipeline left a rank of this one routed"
    other.release_gpus("actor_train")
    wait_for(lambda: _active(rt), timeout_s=15, what="rollout ranks re-expanded after the preemption")
    rt.end()


def test_first_expand_does_not_wait_for_the_collector_to_start(control_plane: ControlPlane) -> None:
    """The first expand publishes to the collector while it holds a GPU grant: attach_collector waits for the
    collector's actor to answer first (on one H100 a demo pipeline's first expand spent 4.0 s in activate)."""
    from rlix_plugins.pipeline.publisher import CollectorPublisher

    rt, _rec = _runtime(control_plane, [0], [0, 1])
    collector = ray.remote(SlowStartCollector).options(num_cpus=0).remote()
    t0 = time.perf_counter()
    rt.attach_collector(CollectorPublisher(collector))
    assert time.perf_counter() - t0 >= 2.5, "attach_collector returned before the collector could have started"
    first = next(e for e in rt.resize_history() if e["op"] == "expand")
    assert first["activate_s"] < 1.0, f"the first expand waited for the collector: {first}"
    rt.end()
    ray.kill(collector)


def _resizer_of(tp: int) -> tuple[Any, Any, Any]:
    """A resizer actor over two recorded ranks of ``tp`` GPUs each, its router and its recorder."""
    rec = Recorder.remote()
    router = ray.remote(RolloutRouter).options(num_cpus=0, max_concurrency=16).remote(2)
    actor = ray.remote(FleetResizer).options(num_cpus=0, max_concurrency=4).remote(
        "test_pipe", RecordingFleet(rec, 2, tp), RecordingWeights(rec), router, CFG)
    ray.get(rec.set.remote("cache_version", 4))
    ray.get(actor.set_publisher.remote(RecordingPublisher(rec)))
    ray.get(actor.set_versions.remote(VersionLedger(cache=4, published=3)))
    return actor, router, rec


@pytest.fixture
def resizer(ray_cluster: Any) -> Any:
    parts = _resizer_of(1)
    yield parts
    for a in parts:
        ray.kill(a)


def test_expand_is_atomic_a_failed_sync_never_activates(resizer: Any) -> None:
    actor, router, rec = resizer
    ray.get(rec.set.remote("fail_sync", True))
    with pytest.raises(TransportError, match="told to fail"):
        ray.get(actor.resize_infer.remote([], [1]), timeout=30)
    assert ray.get(router.active.remote()) == []
    assert ray.get(actor.dirty.remote()) == [1]
    assert [o for o, _ in ops(rec)] == ["wake", "sync", "sleep"], "failed rank not put back to sleep / published"
    ray.get(rec.set.remote("fail_sync", False))
    ray.get(actor.resize_infer.remote([], [1]), timeout=30)
    assert ray.get(router.active.remote()) == [1] and ray.get(actor.dirty.remote()) == []
    assert ops(rec)[-1] == ("publish", 3), "expand must publish the current version (3), not the cache's (4)"


def test_shrink_order_and_memory_check(resizer: Any) -> None:
    """Shrink = abort → sleep → ONE memory probe, after the sleep (reported; above the limit it fails)."""
    actor, router, rec = resizer
    ray.get(actor.resize_infer.remote([], [0, 1]), timeout=30)
    n = len(ops(rec, memory=True))
    ray.get(rec.set.remote("memory_after_sleep", 5 << 20))
    ray.get(actor.resize_infer.remote([1], []), timeout=30)
    assert ops(rec, memory=True)[n:] == [("abort", [1]), ("sleep", ([1], 2)), ("memory", [1])]
    assert ray.get(router.active.remote()) == [0]
    shrink = ray.get(actor.history.remote())[-1]
    assert shrink["op"] == "shrink" and shrink["memory_after"] == {1: 5 << 20} and "memory_before" not in shrink
    # What a healthy slept engine kept on an H100 once it had received weights over NCCL (two real pipelines failed
    # on it under a 1 GiB limit): a shrink, not a failure.
    ray.get(actor.resize_infer.remote([], [1]), timeout=30)
    ray.get(rec.set.remote("memory_after_sleep", 1268776960))
    ray.get(actor.resize_infer.remote([1], []), timeout=30)
    assert ray.get(actor.history.remote())[-1]["memory_after"] == {1: 1268776960}
    ray.get(rec.set.remote("memory_after_sleep", 8 << 30))  # a sleep that kept a 1.5B engine's weights and KV cache
    with pytest.raises(RlixError, match="still hold"):
        ray.get(actor.resize_infer.remote([0], []), timeout=30)
    with pytest.raises(SchedulerError, match="exactly one"):
        ray.get(actor.resize_infer.remote([0], [1]), timeout=30)


def test_shrink_memory_limit_allows_a_tp_ranks_communicators(ray_cluster: Any) -> None:
    """A slept rank of TP 2 keeps its TP communicators on each GPU: 2.22 GiB measured under NeMo RL on an H200,
    which a 2 GiB TP-1 limit failed at the first shrink of both pipelines; a healthy TP-1 engine of 1,024 sequences
    read 2.33 GiB (2026-11-30). Both shrink; a TP-1 rank holding what a TP-2 rank may (3.5 GiB) fails, and so does a
    TP-2 rank that kept a 1.5B engine's weights and KV cache."""
    tp2_held = 2382364672  # what each TP-2 rank of the 2026-11-29 NeMo RL run held on its fullest GPU after the sleep
    tp1_held = 2506096640  # what a TP-1 rank of 1,024 sequences with CUDA graphs held (2026-11-30)
    tp2 = _resizer_of(2)
    tp1 = _resizer_of(1)
    try:
        for (actor, _router, rec), held in ((tp2, tp2_held), (tp1, tp1_held)):
            ray.get(actor.resize_infer.remote([], [0, 1]), timeout=30)
            ray.get(rec.set.remote("memory_after_sleep", held))
        ray.get(tp2[0].resize_infer.remote([1], []), timeout=30)
        assert ray.get(tp2[0].history.remote())[-1]["memory_after"] == {1: tp2_held}
        ray.get(tp1[0].resize_infer.remote([1], []), timeout=30)
        assert ray.get(tp1[0].history.remote())[-1]["memory_after"] == {1: tp1_held}
        ray.get(tp1[2].set.remote("memory_after_sleep", 3584 << 20))
        with pytest.raises(RlixError, match=r"still hold .*limit \{0: 3221225472\}.*post_sleep_max_bytes, in bytes"):
            ray.get(tp1[0].resize_infer.remote([0], []), timeout=30)
        ray.get(tp2[2].set.remote("memory_after_sleep", 8 << 30))
        with pytest.raises(RlixError, match=r"still hold .*limit \{0: 4294967296\}"):
            ray.get(tp2[0].resize_infer.remote([0], []), timeout=30)
    finally:
        for a in (*tp2, *tp1):
            ray.kill(a)


def test_watchdog_rerequests_generation_when_no_rank_is_active(control_plane: ControlPlane) -> None:
    """Starvation, the runtime's half: after a planned shrink to zero the scheduler forgets the pipeline's rollout
    demand; the watchdog notices that no rank is routed and asks for GENERATION again."""
    rt, rec = _runtime(control_plane, [0], [0, 1])
    rt.attach_collector(RecordingPublisher(rec))
    rt.pipe.await_release("actor_infer", timeout_s=10)
    before = rt.watchdog_requests
    wait_for(lambda: _active(rt), timeout_s=15, what="GENERATION re-requested by the watchdog")
    assert rt.watchdog_requests > before
    rt.end()
    assert rt._watchdog is not None and not rt._watchdog.is_alive(), "end() must stop the watchdog first"


def test_progress_of_the_current_step_reaches_the_scheduler_clamped(control_plane: ControlPlane) -> None:
    """Progress (miles wire format): the collector reports RAW counts; the scheduler sees them clamped."""
    rt, _rec = _runtime(control_plane, [0], [0, 1])
    reporter = rt.progress_reporter()
    reporter.report(3, 8, step=0, new_batch=True)
    wait_for(lambda: (control_plane.status()["pipelines"][rt.pipeline_id]["progress"] or {}).get("completed") == 3,
             what="progress 3/8 at the scheduler")
    reporter.report(11, 8, step=0)  # overshoot (age-window extras): clamped, never negative remaining
    wait_for(lambda: control_plane.status()["pipelines"][rt.pipeline_id]["progress"]["remaining"] == 0,
             what="clamped progress at the scheduler")
    rt.end()


def test_failed_in_flight_refresh_unroutes_its_ranks(resizer: Any) -> None:
    actor, router, rec = resizer
    ray.get(actor.resize_infer.remote([], [0, 1]), timeout=30)
    assert ray.get(actor.refresh_active.remote(), timeout=30)["verified"]
    ray.get(rec.set.remote("fail_sync", True))
    with pytest.raises(TransportError):
        ray.get(actor.refresh_active.remote(), timeout=30)
    assert ray.get(router.active.remote()) == [] and ray.get(actor.dirty.remote()) == [0, 1]


def test_one_gpu_two_pipelines_take_turns_on_gpu_0(control_plane: ControlPlane) -> None:
    """The one-GPU topology on the real runtime and scheduler: two pipelines with train = infer = [0]. Each
    training grant sleeps the GPU's rollout (its own rank or the co-tenant's), the in-flight refresh has no
    active rank to update, and after training the GPU goes back to rollout: each pipeline's expands sync the
    version it published last. Both finish their steps (no deadlock), and rollout alternates between them."""
    import threading

    pipes = [_runtime(control_plane, [0], [0]) for _ in range(2)]
    errors: list[BaseException] = []
    steps = 3

    def loop(rt: PipelineRuntime, rec: Any) -> None:
        try:
            # the second pipeline's first rank comes only once the first one trains: no start-up barrier
            rt.attach_collector(RecordingPublisher(rec))
            for step in range(steps):
                rt.before_training(step)
                assert not any(_active(p) for p, _ in pipes), "a rollout rank on GPU 0 served during training"
                rt.before_weight_sync(step)
                rt.on_published(step, rt.after_training(step))
                # the next step starts only after the GPU went back to rollout (of either pipeline) at least once
                wait_for(lambda: any(_active(p) for p, _ in pipes), timeout_s=15, what="GPU 0 back to rollout")
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=pipe) for pipe in pipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads), "a pipeline is stuck (deadlock on the one GPU)"
    for rt, rec in pipes:
        assert rt.published == steps
        history = rt.resize_history()
        refreshes = [e for e in history if e["op"] == "refresh"]
        assert len(refreshes) == steps and all(e["ranks"] == [] for e in refreshes), refreshes
        expands = [e for e in history if e["op"] == "expand"]
        assert expands and all(e["published"] == max(e["version"], 0) for e in expands), expands  # synced = published
        assert max(e["version"] for e in expands) >= 1, "no expand synced a trained version"
        publishes = [a for o, a in ops(rec) if o == "publish"]
        assert publishes == sorted(publishes), f"an expand published an older version: {publishes}"
    # turns: both pipelines had rollout between steps, not one of them only after the other finished
    assert all(sum(e["op"] == "expand" for e in rt.resize_history()) >= 2 for rt, _ in pipes)
    for rt, _ in pipes:
        assert rt.end() == []
        assert _status_allocs(control_plane, rt.pipeline_id) == {}


def test_end_logs_and_returns_what_failed_with_the_pipeline_id(control_plane: ControlPlane,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """end() never raises, and never swallows: a dead resize actor (its history unreadable) is logged with the
    pipeline id and returned; the pipeline is still unregistered."""
    rt = PipelineRuntime.register(control_plane, [0], [0, 1], config=CFG, coordinator_config=FAST_COORDINATOR)
    rt.resizer = Recorder.remote()  # any actor, then dead: reading the history fails
    ray.kill(rt.resizer)
    with caplog.at_level("WARNING", logger="rlix_plugins.pipeline.runtime"):
        errors = rt.end()
    assert len(errors) == 1 and errors[0].startswith("read the resize history: "), errors
    assert any(rt.pipeline_id in r.getMessage() and "read the resize history" in r.getMessage() for r in caplog.records)
    assert rt.pipeline_id not in control_plane.status()["pipelines"]


def test_an_expand_between_the_cache_build_and_the_publish_waits_and_publishes_the_new_version(
        control_plane: ControlPlane) -> None:
    """A GPU frees up after before_weight_sync(0) built version 1 but before after_training(0) published it: the expand
    of a rank there must not label version 1's weights as version 0. It waits for the publish instead."""
    rt, rec = _runtime(control_plane, [0], [0, 1, 2])
    other, _ = make_pipeline(control_plane, train=[2], infer=[2])
    assert other.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=20) == [2]
    rt.attach_collector(RecordingPublisher(rec))
    rt.before_training(0)
    assert rt.before_weight_sync(0) == 1
    other.release_gpus("actor_train", step=0)  # GPU 2 is free: the scheduler expands rank 2 of rt
    time.sleep(3)  # an expand that does not wait for the publish happens meanwhile
    assert 2 not in _active(rt), "rank 2 was routed before its version was published"
    rt.on_published(0, rt.after_training(0))
    wait_for(lambda: 2 in _active(rt), timeout_s=15, what="rank 2 expanded after the publish")
    expands = [e for e in ray.get(rt.resizer.history.remote(), timeout=10) if e["op"] == "expand"]
    assert expands and all(e["published"] == max(e["version"], 0) for e in expands), expands
    rt.end()
    other.unregister("test over")
