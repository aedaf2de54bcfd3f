"""Coordinator actor: resize forwarding and validation, the resize lock, progress aggregation (real Ray)."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.coordinator import Coordinator, CoordinatorConfig, _ResizeLock
from rlix_plugins.control.types import Priority
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, SchedulerError
from tests.control._ray_helpers import RecordingHandler, control_plane, make_pipeline, wait_for

__all__ = ["control_plane"]


def test_resize_forwarding_validation_and_active_ranks(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1, 2, 3], tp=2)
    coord = a.coordinator
    assert client.call(coord.resize_infer.remote([], [1]), "resize") == [1]
    assert a.get_active_ranks() == [1]
    assert ray.get(ha.calls.remote())[-1][1:] == ([], [1])
    for remove, add, match in [
        ([0], [1], "exactly one"),
        ([], [], "exactly one"),
        ([], [2], "outside 0..1"),
        (["x"], [], "list of DP ranks"),
        ([0], [], "conflicts with the active ranks"),  # rank 0 is not active
        ([], [1], "conflicts with the active ranks"),  # rank 1 already active
    ]:
        with pytest.raises((RlixConfigError, SchedulerError), match=match):
            client.call(coord.resize_infer.remote(remove, add), "resize")
    assert a.get_active_ranks() == [1]  # a rejected call changes nothing
    assert client.call(coord.resize_infer.remote([1], []), "resize") == []


def test_no_handler_is_a_clear_error(control_plane: client.ControlPlane) -> None:
    pipe = control_plane.register_pipeline({"actor_infer": 1}, {"actor_infer": [0]})
    with pytest.raises(SchedulerError, match="set_resize_handler"):
        client.call(pipe.coordinator.resize_infer.remote([], [0]), "resize")
    with pytest.raises(RlixConfigError, match="resize_infer"):
        pipe.set_resize_handler("not an actor")


def test_resize_lock_blocks_expand_until_released(control_plane: client.ControlPlane) -> None:
    """An in-flight refresh holding the lock delays the scheduler's expand; the grant comes after release."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=None, infer=[0, 1])
    released_at: list[float] = []
    with a.resize_lock(timeout_s=5) as active:
        assert active == []
        ref = cp.scheduler.request_gpus.remote(a.cluster_id("actor_infer"), int(Priority.GENERATION), None, 4, 20.0)
        time.sleep(0.5)
        assert ray.get(ha.calls.remote()) == []  # the expand waits for the lock
        released_at.append(time.time())
    assert client.call(ref, "request", 10) == [0, 1]
    assert ray.get(ha.calls.remote())[0][0] >= released_at[0]


def test_resize_lock_timeout_fails_the_resize(control_plane: client.ControlPlane) -> None:
    a, ha = make_pipeline(control_plane, train=None, infer=[0, 1])
    token, _ = client.call(a.coordinator.acquire_resize_lock.remote(1.0, 30.0), "lock")
    with pytest.raises(RlixTimeoutError, match="resize lock not acquired"):
        client.call(a.coordinator.resize_infer.remote([], [0]), "resize")
    client.call(a.coordinator.release_resize_lock.remote(token), "unlock")
    with pytest.raises(SchedulerError, match="does not hold the lock"):
        client.call(a.coordinator.release_resize_lock.remote(token), "unlock")
    assert ray.get(ha.calls.remote()) == []


def test_resize_lock_lease_expires() -> None:
    lock = _ResizeLock()
    t1 = lock.acquire(1.0, lease_s=0.2, holder="crashed refresh")
    t0 = time.monotonic()
    t2 = lock.acquire(2.0, lease_s=5.0, holder="resize")
    assert 0.1 < time.monotonic() - t0 < 1.5 and t2 != t1
    with pytest.raises(SchedulerError):
        lock.release(t1)
    # Contended acquire wakes up as soon as the holder releases.
    got: list[float] = []
    th = threading.Thread(target=lambda: (lock.acquire(5.0, 5.0, "waiter"), got.append(time.monotonic())))
    th.start()
    time.sleep(0.2)
    released = time.monotonic()
    lock.release(t2)
    th.join(5)
    assert got and got[0] - released < 0.5


def test_progress_is_clamped_and_forwarded_per_2_percent_bucket(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=None, infer=[0, 1])
    assert a.report_progress(0, 100, step=0, new_batch=True) is True
    assert a.report_progress(1, 100, step=0) is False  # same 2 % bucket
    assert a.report_progress(2, 100, step=0) is True
    assert a.report_progress(3, 100, step=0) is False
    assert a.report_progress(3, 100, step=1, new_batch=True) is True  # a new batch always goes through
    assert a.report_progress(250, 100, step=1) is True  # overshoot: clamped to completed = target
    assert a.report_progress(4, 100, step=2) is True  # a new step number always goes through
    # Reports that run out of order on the threaded coordinator (issue 17: a late "3 of 4" kept an idle pipeline
    # "busy" forever): an earlier step, or fewer trajectories of the same step, never replace a newer report.
    assert a.report_progress(3, 100, step=2) is False
    assert a.report_progress(90, 100, step=1, new_batch=True) is False

    def at_scheduler() -> dict | None:
        return cp.status()["pipelines"][a.pipeline_id]["progress"]

    wait_for(lambda: (p := at_scheduler()) and p["step"] == 2, what="last progress at the scheduler")
    assert at_scheduler() == {"step": 2, "step_target": 100, "completed": 4, "remaining": 96}
    # Out-of-order delivery (several coordinator threads): an older report_seq never overwrites a newer one.
    client.call(cp.scheduler.report_progress.remote(a.pipeline_id, 100, 100, 1, report_seq=1), "stale report")
    assert at_scheduler()["step"] == 2
    client.call(cp.scheduler.report_progress.remote(a.pipeline_id, 100, 250, 3), "unsequenced report")
    assert at_scheduler() == {"step": 3, "step_target": 100, "completed": 100, "remaining": 0}
    with pytest.raises(RlixConfigError):
        a.report_progress(-1, 100)


def test_config_validation_and_direct_construction() -> None:
    with pytest.raises(RlixConfigError, match="lock_timeout_s"):
        CoordinatorConfig(lock_timeout_s=0)
    coord = Coordinator("ft_000000000000", num_dp_ranks=2)
    assert coord.get_active_ranks() == [] and coord.ping() == "ok"
    assert isinstance(RecordingHandler, ray.actor.ActorClass)
