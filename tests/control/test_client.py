"""Client: find-or-start (also when two drivers race), typed errors, attaching to a pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.rpc import actor_death_reason
from rlix_plugins.control.types import Priority
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, SchedulerError
from tests.control._ray_helpers import FAST_SCHEDULER, control_plane, kill_control_plane, make_pipeline

__all__ = ["control_plane"]

_DRIVER = """
import sys
from rlix_plugins.control.client import connect
cp = connect(sys.argv[1], timeout_s=60)
print("IDS", cp.orchestrator._actor_id.hex(), cp.scheduler._actor_id.hex(), cp.pool()["num_gpus"], flush=True)
"""


@pytest.fixture
def no_control_plane(ray_cluster: Any) -> Iterator[None]:
    kill_control_plane()
    yield
    kill_control_plane()


def test_two_drivers_racing_to_create_get_the_same_control_plane(no_control_plane: None) -> None:
    """Two separate driver processes call connect() at once on a cluster without a control plane."""
    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # the token is found, no flag needed
    procs = [subprocess.Popen([sys.executable, "-c", _DRIVER, address], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    ids = [next(line.split()[1:] for line in out.splitlines() if line.startswith("IDS")) for out, _ in outs]
    assert ids[0] == ids[1] and ids[0][2] == "4"
    cp = client.connect(create_if_missing=False)
    assert cp.orchestrator._actor_id.hex() == ids[0][0]


def test_threads_racing_in_one_driver(no_control_plane: None) -> None:
    results: list[Any] = []
    errors: list[BaseException] = []

    def go() -> None:
        try:
            results.append(client.connect(scheduler_config=FAST_SCHEDULER).scheduler._actor_id.hex())
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(set(results)) == 1 and len(results) == 3


def test_connect_without_control_plane_and_create_if_missing_false(no_control_plane: None) -> None:
    with pytest.raises(SchedulerError, match="rlix up"):
        client.connect(create_if_missing=False)


def test_pipeline_handle_attach_and_errors(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    again = cp.pipeline(a.pipeline_id)
    assert again.clusters == a.clusters
    assert again.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10) == [0]
    assert a.cluster_id(a.cluster_id("actor_train")) == a.cluster_id("actor_train")
    with pytest.raises(SchedulerError, match="has no cluster 'critic'"):
        a.cluster_id("critic")
    with pytest.raises(SchedulerError, match="no coordinator"):
        cp.pipeline("ft_ffffffffffff")
    # A wrapper's own RPC bound: a request that cannot be granted comes back as RlixTimeoutError.
    b, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    with pytest.raises(RlixTimeoutError):
        b.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=0.3)
    with pytest.raises(RlixConfigError, match="timeout_s=-1"):
        b.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=-1)
    # Re-registering an id whose coordinator is still alive is refused and leaves nothing registered.
    a.unregister()
    with pytest.raises(SchedulerError, match="already exists"):
        cp.register_pipeline({"actor_infer": 1}, {"actor_infer": [0]}, pipeline_id=a.pipeline_id)
    assert a.pipeline_id not in cp.status()["pipelines"]


def test_call_maps_ray_errors(control_plane: client.ControlPlane) -> None:
    @ray.remote(num_cpus=0)
    class Slow:
        def wait(self) -> None:
            import time

            time.sleep(5)

    slow = Slow.remote()
    with pytest.raises(RlixTimeoutError, match="no answer within"):
        client.call(slow.wait.remote(), "slow call", timeout_s=0.2)
    ray.kill(slow)
    with pytest.raises(SchedulerError, match="dead"):
        client.call(slow.wait.remote(), "dead call", timeout_s=10)


def test_actor_death_reason_surfaces_the_rlix_error() -> None:
    msg = ("The actor died because of an error raised in its creation task, ray::Orchestrator.__init__()\n"
           '  File "orchestrator.py", line 42, in discover_pool\n'
           "rlix_plugins.errors.RlixConfigError: the Ray cluster has no GPUs; start it with GPUs")
    assert actor_death_reason(RuntimeError(msg)) == "RlixConfigError: the Ray cluster has no GPUs; start it with GPUs"
    assert actor_death_reason(RuntimeError("plain death\nmore")) == "plain death"


def test_connect_restarts_a_dead_scheduler_like_rlix_up(ray_cluster: Any) -> None:
    """The scheduler actor died (its pipelines failed with it): ``connect(create_if_missing=True)`` (what ``rlix up``
    calls) starts a new, empty one through the orchestrator; without it, connect names the fix."""
    from rlix_plugins.control.types import RLIX_NAMESPACE, SCHEDULER_NAME

    kill_control_plane()
    try:
        cp = client.connect()
        cp.register_pipeline({"actor_infer": 1}, {"actor_infer": [0]})
        ray.kill(cp.scheduler, no_restart=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            names = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                     if e.get("namespace") == RLIX_NAMESPACE}
            if SCHEDULER_NAME not in names:
                break
            time.sleep(0.1)
        with pytest.raises(SchedulerError, match="rlix up"):
            client.connect(create_if_missing=False)
        again = client.connect()
        assert again.status()["pipelines"] == {} and again.pool()["num_gpus"] >= 1
    finally:
        kill_control_plane()
