"""Failure isolation: a dead, failing or hanging pipeline is failed alone; the scheduler keeps serving the others.

Real Ray actors throughout; the Ray cluster must survive every test (checked at the end of each).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.types import Priority
from rlix_plugins.errors import PipelineUnregisteredError
from tests.control._ray_helpers import control_plane, make_pipeline, wait_for

__all__ = ["control_plane"]

GEN = Priority.GENERATION
TRAIN = Priority.ACTOR_TRAINING


def _ops(cp: client.ControlPlane, pid: str) -> list[str]:
    return [e.op for e in cp.trace() if e.pipeline_id == pid]


def _still_serving(cp: client.ControlPlane, pipe: client.PipelineHandle) -> None:
    """The survivor can still get and give back GPUs; the cluster and control plane are alive."""
    pipe.release_gpus("actor_train")
    assert pipe.request_gpus("actor_train", TRAIN, timeout_s=10)
    pipe.release_gpus("actor_train")
    assert ray.is_initialized() and cp.status()["pipelines"].get(pipe.pipeline_id)


@pytest.mark.parametrize("mode", ["kill_coordinator", "handler_fails", "handler_hangs", "handler_dies"])
def test_broken_donor_fails_alone_and_training_is_granted(control_plane: client.ControlPlane, mode: str) -> None:
    """B's training must preempt A's rollout rank; A's side is broken → A is failed, B is granted, B keeps going."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[1], infer=[1, 2, 3])
    a.request_gpus("actor_infer", GEN, step_target_estimate=64, timeout_s=10)
    if mode == "kill_coordinator":
        ray.kill(a.coordinator, no_restart=True)
    else:
        ray.get(ha.set_mode.remote({"handler_fails": "fail", "handler_hangs": "hang", "handler_dies": "die"}[mode]))

    t0 = time.monotonic()
    assert b.request_gpus("actor_train", TRAIN, step=0, timeout_s=20) == [1]
    assert time.monotonic() - t0 < 12  # bounded by the (short) coordinator/scheduler timeouts
    st = cp.status()
    assert a.pipeline_id not in st["pipelines"]
    assert not any(cid.startswith(a.pipeline_id) for cid in st["allocations"])
    assert "fail" in _ops(cp, a.pipeline_id)
    with pytest.raises(PipelineUnregisteredError):
        a.request_gpus("actor_infer", GEN, timeout_s=2)
    assert a.unregister() is False  # the pipeline's own unregister, racing the auto-fail, is a no-op
    assert _ops(cp, a.pipeline_id).count("fail") == 1
    _still_serving(cp, b)


def test_dead_coordinator_holding_training_gpus_is_reaped(control_plane: client.ControlPlane) -> None:
    """A pipeline whose coordinator died while holding GPUs (no resize needed) is failed by the health probe."""
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", TRAIN, timeout_s=10)
    time.sleep(0.7)  # let one health round see (and cache) A's coordinator
    ray.kill(a.coordinator, no_restart=True)
    assert b.request_gpus("actor_train", TRAIN, timeout_s=15) == [0]
    assert "fail" in _ops(cp, a.pipeline_id)
    _still_serving(cp, b)
    # A's GPU is fenced for other jobs (this test process, A's job, lives on), not for B: one job is trusted with its
    # own memory. An operator may lift the fence.
    fences = cp.status()["fences"]
    assert [f["gpus"] for k, f in fences.items() if k.startswith(a.pipeline_id)] == [[0]], fences
    assert cp.lift_fences(a.pipeline_id) and not cp.status()["fences"]
    assert cp.lift_fences(a.pipeline_id) == []


def test_driver_dead_before_its_coordinator_was_ever_probed_is_reaped(control_plane: client.ControlPlane) -> None:
    """A driver died before the scheduler ever found its coordinator (it never existed under its name): a pipeline
    that holds GPUs with no coordinator past the grace is failed, so its GPUs return to the others."""
    cp = control_plane
    pid = cp.allocate_pipeline_id()
    client.call(cp.orchestrator.register_pipeline.remote(pid, {"actor_train": 1, "actor_infer": 1},
                                                         {"actor_train": [0], "actor_infer": [0, 1]}), "register")
    client.call(cp.orchestrator.admit_pipeline.remote(pid), "admit")
    assert client.call(cp.scheduler.request_gpus.remote(f"{pid}_actor_train", int(TRAIN), 0, None, 10), "req") == [0]
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    assert b.request_gpus("actor_train", TRAIN, timeout_s=30) == [0]
    assert "fail" in _ops(cp, pid)
    _still_serving(cp, b)


def test_driver_dead_before_it_asked_for_gpus_is_reaped_too(control_plane: client.ControlPlane) -> None:
    """A driver killed between its registration and its first request (the demo's deadline at start-up) holds
    nothing and never had a coordinator under its name: after twice the grace it is failed, not left registered
    for ever; a live pipeline beside it is untouched."""
    cp = control_plane
    pid = cp.allocate_pipeline_id()
    client.call(cp.orchestrator.register_pipeline.remote(pid, {"actor_train": 1, "actor_infer": 1},
                                                         {"actor_train": [0], "actor_infer": [0, 1]}), "register")
    client.call(cp.orchestrator.admit_pipeline.remote(pid), "admit")
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    wait_for(lambda: pid not in cp.status()["pipelines"], timeout_s=30, what="the coordinator-less pipeline failed")
    assert "fail" in _ops(cp, pid) and "fail" not in _ops(cp, b.pipeline_id)
    _still_serving(cp, b)


def test_failed_expand_fails_only_that_pipeline(control_plane: client.ControlPlane) -> None:
    """A GENERATION request whose expand raises gets PipelineUnregisteredError; the other pipeline is served."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[2], infer=[2, 3])
    ray.get(ha.set_mode.remote("fail"))
    with pytest.raises(PipelineUnregisteredError, match=r"expand of .* failed"):
        a.request_gpus("actor_infer", GEN, timeout_s=10)
    assert b.request_gpus("actor_infer", GEN, timeout_s=10) == [2, 3]
    assert cp.status()["idle_gpus"] == [0, 1]
    b.request_gpus("actor_train", TRAIN, timeout_s=10)
    _still_serving(cp, b)


def test_hanging_handler_fails_planned_release_of_that_pipeline_only(control_plane: client.ControlPlane) -> None:
    """A hanging handler: await_release gets a clear error once the bounded shrink fails; B is untouched."""
    cp = control_plane
    a, ha = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[2], infer=[2, 3])
    a.request_gpus("actor_infer", GEN, timeout_s=10)
    b.request_gpus("actor_infer", GEN, timeout_s=10)
    ray.get(ha.set_mode.remote("hang"))
    with pytest.raises(PipelineUnregisteredError, match=r"shrink of .* failed"):
        a.await_release("actor_infer", timeout_s=10)
    st = cp.status()
    assert a.pipeline_id not in st["pipelines"] and b.pipeline_id in st["pipelines"]
    assert set(st["allocations"]) == {b.cluster_id("actor_infer")}
    reason = st["failed"][a.pipeline_id]["reason"]  # says what happened, not a call the driver never missed
    assert "were active" in reason and "await_release" not in reason, reason
    b.await_release("actor_infer", timeout_s=10)
    assert cp.status()["idle_gpus"] == [0, 1, 2, 3]
    wait_for(lambda: ray.is_initialized() and ray.cluster_resources().get("GPU") == 4, what="cluster alive")


def test_rlix_status_names_failed_pipelines_and_why(control_plane: client.ControlPlane) -> None:
    """A pipeline the scheduler failed is listed by status (and ``rlix status``) with the reason and GPUs freed;
    the state committed by every changing cycle was checked against the invariants."""
    from rlix_plugins.control.admin.commands import format_status

    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", TRAIN, timeout_s=10)
    time.sleep(0.7)
    ray.kill(a.coordinator, no_restart=True)
    wait_for(lambda: a.pipeline_id in cp.status()["failed"], 15, "A failed")
    st = cp.status()
    failed = st["failed"][a.pipeline_id]
    assert "coordinator died" in failed["reason"] and failed["gpus_freed"] == [0]
    text = format_status(st)
    assert "FAILED PIPELINE" in text and a.pipeline_id in text and "coordinator died" in text
    assert st["invariant_checks"] >= 1 and st["invariant_violations"] == []
    assert cp.fail_pipeline(a.pipeline_id, "again") is False  # already gone: the first reason stays
    assert cp.status()["failed"][a.pipeline_id]["reason"] == failed["reason"]


def test_driver_that_stops_renewing_its_lease_is_failed_and_its_gpus_return(control_plane: client.ControlPlane) -> None:
    """A driver that holds a training grant and stops responding (no heartbeat within the lease) is failed by the
    health probe; another pipeline then gets the GPU. A pipeline that never beat has no lease (old drivers)."""
    from dataclasses import replace

    from tests.control._ray_helpers import FAST_COORDINATOR

    cp = control_plane
    a = cp.register_pipeline({"actor_train": 1, "actor_infer": 1}, {"actor_train": [0], "actor_infer": [0, 1]},
                             coordinator_config=replace(FAST_COORDINATOR, heartbeat_lease_s=1.0))
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    a.request_gpus("actor_train", TRAIN, timeout_s=10)
    time.sleep(1.5)
    assert a.pipeline_id in cp.status()["pipelines"]  # no heartbeat yet: no lease to expire
    ray.get(a.coordinator.heartbeat.remote(), timeout=10)  # one beat, then silence (a stopped driver)
    assert b.request_gpus("actor_train", TRAIN, timeout_s=15) == [0]
    assert "lease expired" in cp.status()["failed"][a.pipeline_id]["reason"]
    _still_serving(cp, b)


def test_a_start_that_hangs_under_its_initialization_grant_is_failed_and_the_gpus_return(
        control_plane: client.ControlPlane) -> None:
    """A driver stuck in its start (worker creation, say) keeps its heartbeat thread beating, so only a bound on the
    INITIALIZATION hold frees the GPUs: A holds it past ``init_hold_timeout_s`` (8 s here) and is failed; B, which
    waited for the same GPU, gets it."""
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[1], infer=[0, 1])
    a.keep_alive()  # its lease is renewed all along: the lease does not catch this
    try:
        assert a.request_gpus("actor_infer", Priority.INITIALIZATION, step=-1, timeout_s=10) == [0, 1]
        t0 = time.monotonic()
        assert b.request_gpus("actor_infer", Priority.INITIALIZATION, step=-1, timeout_s=30) == [0, 1]
        assert 7 < time.monotonic() - t0 < 25
        failed = [e for e in cp.trace() if e.op == "fail" and e.pipeline_id == a.pipeline_id]
        assert failed and "init_hold_timeout_s" in failed[0].detail, failed
        b.release_gpus("actor_infer", step=-1)
    finally:
        a.stop_keep_alive()


_HUNG_DRIVER = """
import sys, time
import ray
from dataclasses import replace
from rlix_plugins.control.client import connect
from rlix_plugins.control.types import Priority
from tests.control._ray_helpers import FAST_COORDINATOR

cp = connect(sys.argv[1], timeout_s=60)
pipe = cp.register_pipeline({"actor_train": 1, "actor_infer": 1}, {"actor_train": [0], "actor_infer": [0, 1]},
                            coordinator_config=replace(FAST_COORDINATOR, heartbeat_lease_s=1.0))
pipe.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=30)


@ray.remote(num_cpus=0)
class Worker:  # stands for a training worker that still holds the GPU's memory
    def pid(self):
        import os
        return os.getpid()


worker = Worker.remote()
worker_pid = ray.get(worker.pid.remote(), timeout=60)
ray.get(pipe.coordinator.heartbeat.remote(), timeout=10)  # one beat, then the driver hangs
with open(sys.argv[2], "w") as f:
    f.write(f"{pipe.pipeline_id} {worker_pid}")
time.sleep(600)
"""


def test_a_hung_drivers_gpus_are_not_granted_until_its_processes_are_gone(
        control_plane: client.ControlPlane, tmp_path: Any) -> None:
    """A driver in its own Ray job holds GPU 0 for training and hangs with a live worker: its lease expires and it
    is failed, but GPU 0 stays fenced (its worker may still hold the memory): another job's training waits for it and
    no rollout rank wakes there; ``rlix status`` names the worker. Once the driver is stopped its worker dies, the
    fence lifts and the waiting training gets GPU 0."""
    import os
    import subprocess
    import sys

    from rlix_plugins.control.admin.commands import format_status
    from rlix_plugins.errors import RlixTimeoutError

    cp = control_plane
    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    driver = subprocess.Popen([sys.executable, "-c", _HUNG_DRIVER, ray.get_runtime_context().gcs_address, str(ready)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ready.exists() and ready.read_text(), 90, "the hung driver holding GPU 0")
        hung_pid, worker_pid = ready.read_text().split()
        b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
        wait_for(lambda: hung_pid in cp.status()["failed"], 15, "the hung driver's lease to expire")
        assert "lease expired" in cp.status()["failed"][hung_pid]["reason"]

        assert b.request_gpus("actor_infer", GEN, step_target_estimate=8, timeout_s=10) == [1]  # GPU 0 is not lent
        b.release_gpus("actor_infer")
        with pytest.raises(RlixTimeoutError):
            b.request_gpus("actor_train", TRAIN, timeout_s=4)
        fence = wait_for(lambda: next((f for f in cp.status().get("fences", {}).values() if f["processes"]), None),
                         10, "the fence's process check")
        assert fence["gpus"] == [0] and any(f"pid {worker_pid}" in p for p in fence["processes"]), fence
        assert "FENCED GPUS" in format_status(cp.status()) and f"pid {worker_pid}" in format_status(cp.status())

        driver.kill()
        driver.wait(30)
        assert b.request_gpus("actor_train", TRAIN, timeout_s=60) == [0]
        assert not cp.status().get("fences")
        assert "unfence" in _ops(cp, hung_pid)
        _still_serving(cp, b)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
