"""Ray-side helpers for the control-plane tests: a recording resize handler and a fresh control plane per test.

The handler is a REAL Ray actor implementing the coordinator's ``ResizeHandler`` protocol; it only records the
calls (the pipeline side that sleeps and wakes vLLM is tested elsewhere) and can be told to fail, hang or die.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rlix_plugins.control.client import ControlPlane, PipelineHandle, call, connect
from rlix_plugins.control.coordinator import CoordinatorConfig
from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.types import ORCHESTRATOR_NAME, RLIX_NAMESPACE, SCHEDULER_NAME
from rlix_plugins.errors import RlixError

#: Short timeouts so failure tests finish in seconds.
FAST_SCHEDULER = SchedulerConfig(
    resize_timeout_s=6.0, poll_interval_s=0.2, health_interval_s=0.5, health_timeout_s=2.0,
    default_request_timeout_s=20.0, init_hold_timeout_s=8.0,
)
FAST_COORDINATOR = CoordinatorConfig(lock_timeout_s=2.5, handler_timeout_s=2.5, lock_lease_s=30.0)


@ray.remote(num_cpus=0, max_concurrency=4)
class RecordingHandler:
    """``resize_infer(remove, add)`` recorder. Modes: ok | fail | hang | die (applies to the next calls)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self._calls: list[tuple[float, list[int], list[int]]] = []
        self._spans: list[tuple[float, float, list[int], list[int]]] = []
        self._mode = "ok"
        self._delay_s = delay_s
        self._lock = threading.Lock()
        self._inflight = 0

    def recycle(self, delay_s: float) -> bool:
        """Reset for reuse by another test; False when it is broken (mode changed) or still busy."""
        with self._lock:
            if self._mode != "ok" or self._inflight:
                return False
            self._calls.clear()
            self._spans.clear()
            self._delay_s = delay_s
            return True

    def set_mode(self, mode: str) -> None:
        self._mode = mode

    def resize_infer(self, dp_ranks_to_remove: list[int], dp_ranks_to_add: list[int]) -> None:
        start = time.time()
        with self._lock:
            self._inflight += 1
        try:
            self._resize(start, dp_ranks_to_remove, dp_ranks_to_add)
        finally:
            with self._lock:
                self._inflight -= 1

    def _resize(self, start: float, dp_ranks_to_remove: list[int], dp_ranks_to_add: list[int]) -> None:
        if self._mode == "fail":
            raise RuntimeError("test handler told to fail")
        if self._mode == "hang":
            time.sleep(60)
        if self._mode == "die":
            os._exit(1)
        time.sleep(self._delay_s)
        with self._lock:
            self._calls.append((time.time(), list(dp_ranks_to_remove), list(dp_ranks_to_add)))
            self._spans.append((start, time.time(), list(dp_ranks_to_remove), list(dp_ranks_to_add)))

    def running(self) -> int:
        """Calls in progress now (an expand that is still waking its ranks)."""
        with self._lock:
            return self._inflight

    def calls(self) -> list[tuple[float, list[int], list[int]]]:
        """(end time, removed, added) of every completed call."""
        with self._lock:
            return list(self._calls)

    def spans(self) -> list[tuple[float, float, list[int], list[int]]]:
        """(start, end, removed, added) of every completed call."""
        with self._lock:
            return list(self._spans)


def kill_control_plane() -> None:
    """Kill every rlix actor (control plane + pipeline namespaces) and wait until the names are free."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        ns = entry.get("namespace") or ""
        if ns == RLIX_NAMESPACE or ns.startswith("pipeline_"):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(entry["name"], namespace=ns), no_restart=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        names = {(e.get("namespace"), e["name"]) for e in ray.util.list_named_actors(all_namespaces=True)}
        if (RLIX_NAMESPACE, ORCHESTRATOR_NAME) not in names and (RLIX_NAMESPACE, SCHEDULER_NAME) not in names:
            return
        time.sleep(0.1)
    raise RuntimeError("control plane actors did not go away within 20 s")


#: The control plane shared by tests (starting one costs two Ray worker processes, ~2 s on a 2-core CI box).
_SHARED: dict[str, Any] = {}
#: Handler actors handed out by ``make_pipeline`` in the current test, and healthy ones kept for reuse
#: (every actor is a process: starting one costs ~0.5 s of CPU on a 2-core CI box).
_HANDLERS: list[Any] = []
_HANDLER_POOL: list[Any] = []


def _shared_control_plane() -> ControlPlane:
    cp = _SHARED.get("cp")
    if cp is not None:
        try:
            call(cp.orchestrator.ping.remote(), "ping", 10)
            call(cp.scheduler.ping.remote(), "ping", 10)
            return cp
        except RlixError:
            pass
    try:
        cp = connect(create_if_missing=False)
        fresh = cp.config != FAST_SCHEDULER  # made by another test with other timeouts
    except RlixError:
        fresh = True
    if fresh:
        kill_control_plane()
        cp = connect(scheduler_config=FAST_SCHEDULER)
    _SHARED["cp"] = cp
    return cp


def reset_control_plane(cp: ControlPlane) -> None:
    """Unregister every pipeline, lift the fences of the ones failed (their job, this test process, lives on), and
    kill every pipeline-namespace actor and test handler."""
    for pid in cp.status()["pipelines"]:
        cp.unregister_pipeline(pid, reason="test cleanup")
    cp.lift_fences()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        ns = entry.get("namespace") or ""
        if ns.startswith("pipeline_"):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(entry["name"], namespace=ns), no_restart=True)
    while _HANDLERS:
        handler = _HANDLERS.pop()
        try:
            reusable = bool(ray.get(handler.recycle.remote(0.0), timeout=5))
        except Exception:
            reusable = False
        if reusable:
            _HANDLER_POOL.append(handler)
        else:
            ray.kill(handler, no_restart=True)


def _end_of_module() -> None:
    _SHARED.clear()
    kill_control_plane()


@pytest.fixture
def control_plane(ray_cluster: Any, request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """The control plane shared within a test module (short timeouts, no pipelines); cleaned after each test.

    It is killed when the module ends, so later modules' ``connect()`` get a control plane with default timeouts.
    """
    module = request.node.getparent(pytest.Module)
    if module is not None and _SHARED.get("module") is not module:
        _SHARED["module"] = module
        module.addfinalizer(_end_of_module)
    cp = _shared_control_plane()
    reset_control_plane(cp)
    yield cp
    reset_control_plane(_shared_control_plane())


def make_pipeline(cp: ControlPlane, train: list[int] | None, infer: list[int], tp: int = 1,
                  delay_s: float = 0.0, memory: dict[str, dict[str, float]] | None = None,
                  ) -> tuple[PipelineHandle, Any]:
    """Register + admit a pipeline with a recording handler; returns (handle, handler actor)."""
    tps = {"actor_infer": tp}
    maps = {"actor_infer": infer}
    if train is not None:
        tps["actor_train"] = 1
        maps["actor_train"] = train
    pipe = cp.register_pipeline(tps, maps, coordinator_config=FAST_COORDINATOR, cluster_memory=memory)
    handler = None
    while _HANDLER_POOL and handler is None:
        candidate = _HANDLER_POOL.pop()
        with contextlib.suppress(Exception):
            if ray.get(candidate.recycle.remote(delay_s), timeout=5):
                handler = candidate
    if handler is None:
        handler = RecordingHandler.remote(delay_s)
        ray.get(handler.calls.remote(), timeout=60)  # started: a cold actor start must not eat the resize timeout
    _HANDLERS.append(handler)
    pipe.set_resize_handler(handler)
    return pipe, handler


def wait_for(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


class Sleeper:
    """An actor whose one call blocks for as long as asked (a remote call that is still running)."""

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds
