"""Driver-side API of the control plane: find-or-start it, register pipelines, request and release GPUs.

Typical pipeline side (NeMo RL hooks, the demo host)::

    from rlix_plugins.control import client
    from rlix_plugins.control.types import Priority

    cp = client.connect()                       # joins the current Ray cluster (ray.init(address="auto") if needed)
    pipe = cp.register_pipeline(                # allocate id → register → admit → create the coordinator
        cluster_tp_configs={"actor_train": 1, "actor_infer": 1},
        cluster_device_mappings={"actor_train": [0], "actor_infer": [0, 1]},
    )
    pipe.set_resize_handler(my_actor)           # a Ray actor with resize_infer(remove, add) (coordinator.ResizeHandler)
    pipe.request_gpus("actor_train", Priority.INITIALIZATION, timeout_s=600)
    ...; pipe.release_gpus("actor_train")
    pipe.request_gpus("actor_infer", Priority.GENERATION, step_target_estimate=64)   # ≥ 1 rank woken
    pipe.report_progress(collected=10, step_target=64, step=0, new_batch=True)
    pipe.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0)             # donors slept before return
    with pipe.resize_lock(timeout_s=180) as active_ranks:                         # in-flight refresh
        refresh(active_ranks)
    pipe.release_gpus("actor_train", step=0)
    pipe.await_release("actor_infer")                                            # planned shrink to zero
    pipe.unregister()

Every call is bounded: ``timeout_s`` is the scheduler-side wait, the RPC itself gets that plus
``ControlPlane.rpc_margin_s`` (a grant already being executed when the wait expires still completes). Errors
arrive as rlix errors (``RlixTimeoutError``, ``PipelineUnregisteredError``, ``SchedulerError``,
``RlixConfigError``), never as raw ``RayTaskError``.

``connect`` is safe when several drivers race: actors are created with ``get_if_exists=True`` and the loser of a
creation race looks the winner up.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import ray

from rlix_plugins import envs
from rlix_plugins.control.admin import ray_auth
from rlix_plugins.control.coordinator import Coordinator, CoordinatorConfig
from rlix_plugins.control.nodes import NodeTable
from rlix_plugins.control.orchestrator import Orchestrator
from rlix_plugins.control.rpc import ray_get
from rlix_plugins.control.scheduling.config import SchedulerConfig, to_priority
from rlix_plugins.control.timeouts import CONTROL_RPC_TIMEOUT_S
from rlix_plugins.control.types import (
    GENERATION_CLUSTER,
    ORCHESTRATOR_NAME,
    RLIX_NAMESPACE,
    SCHEDULER_NAME,
    ClusterMemory,
    ClusterSpec,
    Priority,
    TraceEvent,
    cluster_id,
    coordinator_name,
    pipeline_namespace,
)
from rlix_plugins.errors import RlixError, SchedulerError

#: Default wait of request_gpus / await_release.
DEFAULT_WAIT_S: Final = 1800.0
#: A Ray GCS at an explicit address must answer within this (``ray.init`` alone retries ~20 s or waits forever).
CONNECT_TIMEOUT_S: Final = 5.0

#: HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 section 3.4).
_H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
#: A cheap GCS call every Ray version answers (``ray start``, ``ray.init`` make it first).
_GCS_PROBE: Final = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _h2_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why no gRPC server answers at ``host:port`` (None: one does): its HTTP/2 preface starts with SETTINGS."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            conn.sendall(_H2_PREFACE)
            head = conn.recv(9)
    except TimeoutError:
        return f"nothing answered within {timeout_s:.0f} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None if len(head) >= 4 and head[3] == 0x04 else "not a gRPC server"


#: What ``_gcs_problem`` returns for a GCS that answered but wants a (different) auth token.
_UNAUTHENTICATED: Final = "unauthenticated"


def _gcs_problem(host: str, port: int, timeout_s: float, token: str | None = None) -> str | None:
    """Why no Ray GCS answers at ``host:port`` (None: one does and accepted ``token``; ``_UNAUTHENTICATED``: one
    does but demands a token, or another one): a GetClusterId call with a deadline."""
    import grpc

    down = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED}
    metadata = None if token is None else [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(f"{host}:{port}", options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            channel.unary_unary(_GCS_PROBE)(b"", timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return _UNAUTHENTICATED
            if code in down:  # anything else is a GCS answering
                detail = (exc.details() or "").splitlines()[0][:120]
                return f"{code.name.lower()} within {timeout_s:.0f} s: {detail}"
    return None


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, in one line, unless a Ray GCS answers at a ``host:port`` address; prepare this process's auth.

    ``ray.init`` retries a refused port for ~20 s and waits without bound on a port that accepts but never
    answers; here both take at most ``timeout_s``. A GCS that demands Ray's auth token gets this process's
    (``ray_auth``): token mode is turned on, or a one-line error says the token is missing or not this cluster's.
    Without grpcio only the HTTP/2 handshake is checked and token mode is on whenever a token exists.
    Other addresses ("auto", "ray://...") and TLS clusters pass."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address or not host or envs.ray_use_tls():
        return
    host = host.strip("[]")
    try:
        import grpc  # noqa: F401  (an optional Ray dependency)
    except ImportError:
        problem = _h2_problem(host, int(port), timeout_s)
        if problem is None:
            ray_auth.enable_if_token_exists()
    else:
        problem = _gcs_problem(host, int(port), timeout_s)
        if problem == _UNAUTHENTICATED:
            if _gcs_problem(host, int(port), timeout_s, ray_auth.token_for(address)) == _UNAUTHENTICATED:
                raise ray_auth.refused(address)
            ray_auth.enable_token_mode()
            return
    if problem is not None:
        raise SchedulerError(
            f"no Ray cluster reachable at {address!r} ({problem}); start one with `rlix up` or fix --address / "
            "RAY_ADDRESS"
        )


def ensure_ray(address: str | None = None) -> None:
    """Connect this process to Ray if it is not yet (``address`` or ``RAY_ADDRESS`` or ``"auto"``).

    An explicit ``host:port`` is probed first (``check_reachable``), so an unreachable cluster fails within
    ``CONNECT_TIMEOUT_S`` with a one-line error."""
    if ray.is_initialized():
        return
    target = address or envs.ray_address() or "auto"
    check_reachable(target)
    try:
        ray.init(address=target, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.AuthenticationError) as exc:
        raise SchedulerError(
            f"no Ray cluster reachable at {target!r} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "start one with `rlix up` or pass --address / RAY_ADDRESS"
        ) from None


#: What a call to a dead scheduler says (its pipelines fail with it; ``rlix up`` starts a new one).
SCHEDULER_DEAD: Final = "the rlix scheduler actor is dead; restart the control plane with `rlix up`"


def call(ref: Any, what: str, timeout_s: float = CONTROL_RPC_TIMEOUT_S, *, dead: str = "the actor serving it is dead") -> Any:
    """``ray.get`` with a timeout; control-plane errors come back as rlix errors."""
    return ray_get(ref, what, timeout_s, unwrap=RlixError, dead=dead,
                   hint=" (is the control plane overloaded or hung? `rlix status`)")


def _lookup(name: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def connect(
    address: str | None = None,
    *,
    create_if_missing: bool = True,
    timeout_s: float = 120.0,
    scheduler_config: SchedulerConfig | None = None,
) -> ControlPlane:
    """Find (or start) the control plane on the current Ray cluster. ``scheduler_config`` applies on creation only."""
    ensure_ray(address)
    orch = _lookup(ORCHESTRATOR_NAME, RLIX_NAMESPACE)
    if orch is None:
        if not create_if_missing:
            raise SchedulerError("no rlix control plane runs on this Ray cluster; start it with `rlix up`")
        actor: Any = ray.remote(Orchestrator)
        try:
            orch = actor.options(
                name=ORCHESTRATOR_NAME, namespace=RLIX_NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=0, max_concurrency=16,
            ).remote(scheduler_config)
        except ValueError:  # another driver won the creation race
            orch = _lookup(ORCHESTRATOR_NAME, RLIX_NAMESPACE)
            if orch is None:
                raise SchedulerError(
                    "the control plane was being created by another driver and vanished; retry"
                ) from None
    call(orch.ping.remote(), "starting the rlix orchestrator", timeout_s)
    sched = _lookup(SCHEDULER_NAME, RLIX_NAMESPACE)
    if sched is None and create_if_missing:  # the scheduler died (its pipelines failed with it): start a new one
        call(orch.restart_scheduler.remote(scheduler_config), "restarting the scheduler", timeout_s)
        sched = _lookup(SCHEDULER_NAME, RLIX_NAMESPACE)
    if sched is None:
        raise SchedulerError("the orchestrator runs but the scheduler actor is missing (it died); run `rlix up`")
    config = call(sched.get_config.remote(), "scheduler config", timeout_s)
    return ControlPlane(orch, sched, config)


@dataclass
class ControlPlane:
    """Handles to the singleton actors plus typed wrappers."""

    orchestrator: Any
    scheduler: Any
    config: SchedulerConfig
    rpc_margin_s: float = field(default=0.0)

    def __post_init__(self) -> None:
        if not self.rpc_margin_s:
            # A grant being executed when the scheduler-side wait expires still completes (bounded by resizes).
            self.rpc_margin_s = 2 * self.config.resize_timeout_s + 30.0

    def pool(self) -> dict[str, int]:
        return dict(call(self.orchestrator.pool.remote(), "pool"))

    def node_table(self) -> NodeTable:
        """Which node and node-local GPU each pool GPU id names (``control.nodes``; owned by the orchestrator)."""
        table = call(self.orchestrator.node_table.remote(), "node_table")
        assert isinstance(table, NodeTable)
        return table

    def status(self) -> dict[str, Any]:
        return dict(call(self.scheduler.status.remote(), "status", dead=SCHEDULER_DEAD))

    def trace(self, since: float | None = None) -> list[TraceEvent]:
        return list(call(self.scheduler.get_trace.remote(since), "get_trace", dead=SCHEDULER_DEAD))

    def allocate_pipeline_id(self, kind: str = "ft") -> str:
        return str(call(self.orchestrator.allocate_pipeline_id.remote(kind), "allocate_pipeline_id"))

    def register_pipeline(
        self,
        cluster_tp_configs: dict[str, int],
        cluster_device_mappings: dict[str, list[int]],
        *,
        pipeline_id: str | None = None,
        kind: str = "ft",
        coordinator_config: CoordinatorConfig | None = None,
        detached_coordinator: bool = False,
        cluster_memory: dict[str, dict[str, float]] | None = None,
    ) -> PipelineHandle:
        """allocate id → register (validated) → admit → create the coordinator; returns a handle.

        ``cluster_memory``: memory figures by cluster name (``{"gpu_gib", "awake_gib", "asleep_gib"}``); with them a
        rollout rank may stay awake next to another pipeline's training step on a GPU (co-residence, DESIGN §4).

        The coordinator is owned by this process unless ``detached_coordinator``: if this process dies, the
        coordinator dies and the scheduler frees the pipeline's GPUs.
        """
        pid = pipeline_id or self.allocate_pipeline_id(kind)
        specs: dict[str, ClusterSpec] = call(
            self.orchestrator.register_pipeline.remote(pid, cluster_tp_configs, cluster_device_mappings,
                                                       cluster_memory, ray.get_runtime_context().get_job_id()),
            "register_pipeline",
        )
        try:
            call(self.orchestrator.admit_pipeline.remote(pid), "admit_pipeline")
            coord_cls: Any = ray.remote(Coordinator)
            try:
                coord = coord_cls.options(
                    name=coordinator_name(pid), namespace=pipeline_namespace(pid), num_cpus=0, max_restarts=0,
                    max_concurrency=8, lifetime="detached" if detached_coordinator else None,
                ).remote(pid, specs[GENERATION_CLUSTER].num_dp_ranks, coordinator_config)
            except ValueError:
                raise SchedulerError(
                    f"a coordinator {coordinator_name(pid)!r} already exists (an earlier run with pipeline id {pid} "
                    "is still alive); end it with `kill_pipeline` or register under a new id"
                ) from None
            call(coord.ping.remote(), "starting the coordinator")
        except BaseException:
            with contextlib.suppress(Exception):
                self.unregister_pipeline(pid, reason="registration did not complete")
            raise
        return PipelineHandle(pid, specs, coord, self)

    def pipeline(self, pipeline_id: str) -> PipelineHandle:
        """Attach to an already registered pipeline (e.g. from another process of the same run)."""
        coord = _lookup(coordinator_name(pipeline_id), pipeline_namespace(pipeline_id))
        if coord is None:
            raise SchedulerError(f"pipeline {pipeline_id} has no coordinator; register it with register_pipeline")
        st = self.status()
        info = st["pipelines"].get(pipeline_id)
        if info is None:
            raise SchedulerError(f"pipeline {pipeline_id} is not registered; registered: {sorted(st['pipelines'])}")
        specs = {
            name: ClusterSpec(c["cluster_id"], pipeline_id, name, tuple(c["device_mapping"]), c["tp_size"],
                              None if c.get("memory") is None else ClusterMemory(**c["memory"]))
            for name, c in info["clusters"].items()
        }
        return PipelineHandle(pipeline_id, specs, coord, self)

    def unregister_pipeline(self, pipeline_id: str, reason: str = "unregistered by its pipeline") -> bool:
        return bool(call(self.orchestrator.unregister_pipeline.remote(pipeline_id, reason), "unregister_pipeline"))

    def fail_pipeline(self, pipeline_id: str, reason: str) -> bool:
        """Unregister a pipeline as failed: ``rlix status`` lists it with ``reason``. False when not registered."""
        return bool(call(self.scheduler.fail_pipeline.remote(pipeline_id, reason), "fail_pipeline", dead=SCHEDULER_DEAD))

    def lift_fences(self, pipeline_id: str | None = None) -> list[str]:
        """Lift the fences of a failed pipeline (all fences when None) once you know its processes' GPU memory is
        free (e.g. they were killed outside Ray); returns the fences lifted. The health check lifts a fence by itself
        when the failed driver's Ray job has no live process left."""
        return list(call(self.scheduler.lift_fences.remote(pipeline_id), "lift_fences", dead=SCHEDULER_DEAD))

    def kill_pipeline(self, pipeline_id: str) -> list[str]:
        return list(call(self.orchestrator.kill_pipeline.remote(pipeline_id), "kill_pipeline", 90.0))

    def shutdown(self) -> None:
        """Stop the control plane (waiters get errors) and kill its two actors. Ray keeps running."""
        with contextlib.suppress(RlixError):
            call(self.scheduler.shutdown.remote(), "scheduler shutdown", 30.0)
        for handle in (self.scheduler, self.orchestrator):
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)


#: Heartbeat threads of this process, by pipeline id (:meth:`PipelineHandle.keep_alive`).
_BEATS: dict[str, threading.Event] = {}
_BEATS_LOCK = threading.Lock()


@dataclass
class PipelineHandle:
    """One registered pipeline: typed, bounded wrappers over the scheduler and its coordinator.

    Cluster arguments accept a cluster name (``"actor_train"``) or a full cluster id.
    """

    pipeline_id: str
    clusters: dict[str, ClusterSpec]
    coordinator: Any
    control_plane: ControlPlane

    def cluster_id(self, cluster: str) -> str:
        if cluster in self.clusters:
            return cluster_id(self.pipeline_id, cluster)
        if any(s.cluster_id == cluster for s in self.clusters.values()):
            return cluster
        raise SchedulerError(f"pipeline {self.pipeline_id} has no cluster {cluster!r}; it has {sorted(self.clusters)}")

    def set_resize_handler(self, handle: Any) -> None:
        call(self.coordinator.set_resize_handler.remote(handle), "set_resize_handler")

    def keep_alive(self) -> None:
        """Renew the driver's lease with the coordinator from this process until :meth:`stop_keep_alive` (idempotent
        per pipeline and process). Once it beats, a driver that is stopped or hangs its whole process loses its lease
        and the scheduler fails the pipeline and frees its GPUs. The driver starts it when it registers, before any
        grant: setup()'s placement, or ``PipelineRuntime.start``."""
        with _BEATS_LOCK:
            if self.pipeline_id in _BEATS:
                return
            stop = _BEATS[self.pipeline_id] = threading.Event()
        coordinator = self.coordinator
        interval = float(call(coordinator.heartbeat_interval_s.remote(), "coordinator.heartbeat_interval_s"))

        def beat() -> None:
            while True:
                with contextlib.suppress(Exception):  # fire and forget: a dead coordinator is the scheduler's business
                    coordinator.heartbeat.remote()
                if stop.wait(interval):
                    return

        threading.Thread(target=beat, name=f"rlix-heartbeat-{self.pipeline_id}", daemon=True).start()

    def stop_keep_alive(self) -> None:
        with _BEATS_LOCK:
            stop = _BEATS.pop(self.pipeline_id, None)
        if stop is not None:
            stop.set()

    def request_gpus(self, cluster: str, priority: Priority | int, *, step: int | None = None,
                     step_target_estimate: int | None = None, timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        cid = self.cluster_id(cluster)
        ref = self.control_plane.scheduler.request_gpus.remote(cid, int(to_priority(priority)), step, step_target_estimate, timeout_s)
        return list(call(ref, f"request_gpus({cid})", timeout_s + self.control_plane.rpc_margin_s,
                         dead=SCHEDULER_DEAD))

    def release_gpus(self, cluster: str, *, step: int | None = None, timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        cid = self.cluster_id(cluster)
        ref = self.control_plane.scheduler.release_gpus.remote(cid, step, timeout_s)
        return list(call(ref, f"release_gpus({cid})", timeout_s + self.control_plane.rpc_margin_s,
                         dead=SCHEDULER_DEAD))

    def release_then_request(self, release: str, request: str, priority: Priority | int, *,
                             step: int | None = None, step_target_estimate: int | None = None,
                             timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        rel, req = self.cluster_id(release), self.cluster_id(request)
        ref = self.control_plane.scheduler.release_then_request.remote(
            rel, req, int(to_priority(priority)), step, step_target_estimate, timeout_s)
        return list(call(ref, f"release_then_request({rel} -> {req})", timeout_s + self.control_plane.rpc_margin_s,
                         dead=SCHEDULER_DEAD))

    def await_release(self, cluster: str = GENERATION_CLUSTER, *, timeout_s: float = 300.0) -> list[int]:
        cid = self.cluster_id(cluster)
        ref = self.control_plane.scheduler.await_release.remote(cid, timeout_s)
        return list(call(ref, f"await_release({cid})", timeout_s + self.control_plane.rpc_margin_s,
                         dead=SCHEDULER_DEAD))

    def report_progress(self, collected: int, step_target: int, *, step: int | None = None,
                        new_batch: bool = False) -> bool:
        return bool(call(self.coordinator.report_progress.remote(collected, step_target, step, new_batch),
                         "report_progress"))

    def get_active_ranks(self) -> list[int]:
        return list(call(self.coordinator.get_active_ranks.remote(), "get_active_ranks"))

    def acquire_resize_lock(self, timeout_s: float = 180.0, lease_s: float | None = None) -> tuple[str, list[int]]:
        """Take the coordinator's resize lock (no expand/shrink until :meth:`release_resize_lock`, or until its lease
        ends); returns its token and the active DP ranks."""
        token, active = call(self.coordinator.acquire_resize_lock.remote(timeout_s, lease_s), "acquire_resize_lock",
                             timeout_s + CONTROL_RPC_TIMEOUT_S)
        return str(token), list(active)

    def release_resize_lock(self, token: str) -> None:
        call(self.coordinator.release_resize_lock.remote(token), "release_resize_lock")

    @contextlib.contextmanager
    def resize_lock(self, timeout_s: float = 180.0, lease_s: float | None = None) -> Iterator[list[int]]:
        """Hold the coordinator's resize lock; yields the active DP ranks (no expand/shrink meanwhile)."""
        token, active = self.acquire_resize_lock(timeout_s, lease_s)
        try:
            yield active
        finally:
            self.release_resize_lock(token)

    def unregister(self, reason: str = "unregistered by its pipeline") -> bool:
        return self.control_plane.unregister_pipeline(self.pipeline_id, reason)

    def fail(self, reason: str) -> bool:
        return self.control_plane.fail_pipeline(self.pipeline_id, reason)

    def kill(self) -> list[str]:
        return self.control_plane.kill_pipeline(self.pipeline_id)
