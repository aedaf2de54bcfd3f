"""Driver side of one time-shared pipeline: the calls a host's training loop makes, in the patched NeMo RL order.

::

    rt = PipelineRuntime.register(cp, train_devices=[0], infer_devices=[0, 1])   # or PipelineRuntime(pipe)
    rt.start(weights, fleet_or_factory, offload=...)   # INIT(train): cache v-1 → offload → release;
                                                       # INIT(infer): create fleet → prewarm + sleep → release
    rt.attach_collector(publisher)                     # GENERATION (estimate ≥ 1); first expand syncs real weights
    for step in ...:
        rt.before_training(step)                       # ACTOR_TRAINING granted (donor ranks already slept)
        ... log-probs, train ...
        rt.before_weight_sync(step)                    # cache v = step + 1 while params are on the device
        v = rt.after_training(step, offload=...)       # offload → in-flight refresh of active ranks → v
        publisher.set_weight_version(v)                # (the loop publishes, as NeMo RL does)
        rt.on_published(step, v)                       # release ACTOR_TRAINING only now
    rt.end(stop_collector=...)                         # watchdog off → planned shrink to zero → stop → unregister

Threads: every method is called from the loop's thread; the only other thread is the GENERATION watchdog.
Every blocking call is bounded by :class:`~rlix_plugins.pipeline.config.RuntimeConfig`.
Failure isolation: the router and resizer actors are owned by this process; if it dies, they and the
pipeline's coordinator die with it and the scheduler frees the pipeline's GPUs (other pipelines continue).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray

from rlix_plugins.control.client import ControlPlane, PipelineHandle
from rlix_plugins.control.coordinator import CoordinatorConfig
from rlix_plugins.control.registration import pipeline_registration
from rlix_plugins.control.rpc import ray_get
from rlix_plugins.control.timeouts import CONTROL_RPC_TIMEOUT_S
from rlix_plugins.control.types import GENERATION_CLUSTER, TRAIN_CLUSTER, Priority, pipeline_namespace
from rlix_plugins.errors import (
    ActorDeadError,
    PipelineUnregisteredError,
    RlixError,
    RlixTimeoutError,
    SchedulerError,
)
from rlix_plugins.pipeline.config import RuntimeConfig
from rlix_plugins.pipeline.protocols import RolloutFleet, VersionPublisher, WeightSource
from rlix_plugins.pipeline.resizer import FleetResizer, resizer_name
from rlix_plugins.pipeline.router import ROUTER_MAX_CONCURRENCY, RolloutRouter, RouterClient, router_name
from rlix_plugins.pipeline.versions import (
    VersionLedger,
    cache_version_after_step,
    initial_cache_version,
    version_after_step,
)

__all__ = ["GrantOnlyRuntime", "PipelineRuntime", "ProgressReporter"]

logger = logging.getLogger(__name__)


def _get(ref: Any, what: str, timeout_s: float) -> Any:
    return ray_get(ref, what, timeout_s)



class ProgressReporter:
    """Picklable, fire-and-forget progress path to the pipeline's coordinator (``miles`` wire format).

    Report the RAW number of trajectories collected for the current step (those intended for it, not the
    age-window count); the coordinator clamps to ``completed`` and forwards on 2 % changes or new batches.
    """

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def report(self, collected: int, step_target: int, step: int | None = None, new_batch: bool = False) -> None:
        self.coordinator.report_progress.remote(int(collected), int(step_target), step, bool(new_batch))


class PipelineRuntime:
    """See the module docstring. One instance per pipeline, in the pipeline's driver process."""

    def __init__(self, pipe: PipelineHandle, config: RuntimeConfig | None = None) -> None:
        self.pipe = pipe
        self.config = config or RuntimeConfig()
        self.num_dp_ranks = pipe.clusters[GENERATION_CLUSTER].num_dp_ranks
        self.router: Any = None
        self.resizer: Any = None
        self.fleet: RolloutFleet | None = None
        self.weights: WeightSource | None = None
        self.publisher: VersionPublisher | None = None
        #: The pipeline's weight versions; this runtime is their only writer (:mod:`.versions`).
        self.versions = VersionLedger()
        #: The resize lock's token from before_weight_sync until after_training published (no expand in between).
        self._sync_lock: str | None = None
        #: The step's ACTOR_TRAINING grant is held: the one record of it (:attr:`holds_train_grant`); set by
        #: before_training, cleared by release_training (on_published, end).
        self._holds_train = False
        self._ended = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._watchdog_requests = 0
        self._final_history: list[dict[str, Any]] = []
        #: the router's final counters (requests served per rank, requests preempted by shrinks), set by end()
        self.router_stats: dict[str, Any] = {}
        #: (time, what, step, seconds) of every blocking phase, for the host's report
        self.timings: list[tuple[float, str, int | None, float]] = []

    # ------------------------------------------------------------------ construction
    @classmethod
    def register(cls, cp: ControlPlane, train_devices: list[int], infer_devices: list[int], *, infer_tp: int = 1,
                 config: RuntimeConfig | None = None, pipeline_id: str | None = None,
                 coordinator_config: CoordinatorConfig | None = None) -> PipelineRuntime:
        """Register + admit a pipeline (training GPUs ⊂ inference GPUs) and wrap it."""
        if not set(train_devices) <= set(infer_devices):
            raise RlixError(
                f"train devices {train_devices} must be a subset of infer devices {infer_devices} (partial overlap)"
            )
        pipe = cp.register_pipeline(**pipeline_registration(train_devices, infer_devices, infer_tp=infer_tp,
                                                            pipeline_id=pipeline_id,
                                                            coordinator_config=coordinator_config))
        return cls(pipe, config)

    def _timed(self, what: str, step: int | None, t0: float) -> None:
        self.timings.append((time.time(), what, step, time.perf_counter() - t0))

    # ------------------------------------------------------------------ start-up
    def start(self, weights: WeightSource, fleet: RolloutFleet | Callable[[], RolloutFleet], *,
              offload: Callable[[], None] | None = None, start_step: int = 0, init_held: bool = False) -> None:
        """Init phases (DESIGN §4): INITIALIZATION(train) → cache of the start weights (version -1, or ``k`` on a
        run resumed at step ``k``: :func:`.versions.initial_cache_version`) → offload → release;
        INITIALIZATION(infer) → fleet created (if a factory) → prewarm once + sleep → release.

        ``init_held``: the pipeline already holds INITIALIZATION of its inference cluster (all its GPUs: training ⊂
        inference), taken before its workers were created (NeMo RL's ``setup()``); both phases run under it and it
        is released at the end, so no other pipeline initialises on these GPUs from worker creation to the sleep.
        """
        ns = pipeline_namespace(self.pipeline_id)
        self.weights = weights
        self.pipe.keep_alive()  # no-op when setup() started it at registration
        try:
            self.router = ray.remote(RolloutRouter).options(
                name=router_name(self.pipeline_id), namespace=ns, num_cpus=0,
                max_concurrency=ROUTER_MAX_CONCURRENCY, max_restarts=0).remote(self.num_dp_ranks)
            _get(self.router.ping.remote(), "starting the router", CONTROL_RPC_TIMEOUT_S)
            self._init_phases(weights, fleet, offload, start_step, held=init_held)
        finally:
            if init_held:
                self.pipe.release_gpus(GENERATION_CLUSTER, step=-1, timeout_s=CONTROL_RPC_TIMEOUT_S)
        self.pipe.set_resize_handler(self.resizer)

    @contextlib.contextmanager
    def _init_grant(self, cluster: str, held: bool) -> Iterator[None]:
        if not held:
            self.pipe.request_gpus(cluster, Priority.INITIALIZATION, step=-1, timeout_s=self.config.init_timeout_s)
        try:
            yield
        finally:
            if not held:
                self.pipe.release_gpus(cluster, step=-1, timeout_s=CONTROL_RPC_TIMEOUT_S)

    def _init_phases(self, weights: WeightSource, fleet: RolloutFleet | Callable[[], RolloutFleet],
                     offload: Callable[[], None] | None, start_step: int, *, held: bool) -> None:
        cfg, ns = self.config, pipeline_namespace(self.pipeline_id)
        t0 = time.perf_counter()
        with self._init_grant(TRAIN_CLUSTER, held):
            self.versions = self.versions.cache_built(
                weights.build_cache(initial_cache_version(start_step), cfg.init_timeout_s))
            if offload is not None:
                offload()
        self._timed("init_train", None, t0)

        t0 = time.perf_counter()
        with self._init_grant(GENERATION_CLUSTER, held):
            self.fleet = fleet if isinstance(fleet, RolloutFleet) else fleet()
            ranks = self.fleet.dp_ranks()
            if sorted(ranks) != list(range(self.num_dp_ranks)):
                raise RlixError(f"fleet has dp ranks {ranks}; the registration has {self.num_dp_ranks} "
                                f"(infer devices / infer tp)")
            self.resizer = ray.remote(FleetResizer).options(
                name=resizer_name(self.pipeline_id), namespace=ns, num_cpus=0, max_concurrency=4, max_restarts=0,
            ).remote(self.pipeline_id, self.fleet, weights, self.router, cfg)
            _get(self.resizer.prewarm_and_sleep.remote(ranks), "prewarm + sleep of the inference ranks",
                 cfg.init_timeout_s)
        self._timed("init_infer", None, t0)

    def router_client(self) -> RouterClient:
        """What the collector holds to route requests (picklable; the state stays in the router actor)."""
        return RouterClient(self.router, self.num_dp_ranks, timeout_s=self.config.route_timeout_s,
                            max_attempts=self.config.max_route_attempts)

    def progress_reporter(self) -> ProgressReporter:
        return ProgressReporter(self.pipe.coordinator)

    def attach_collector(self, publisher: VersionPublisher) -> None:
        """GENERATION with a step-target estimate (>= 1, so the planner never skips it); returns once ≥ 1 rank is
        active with real weights."""
        if self.resizer is None:
            raise RlixError("attach_collector before start(): the fleet and resize handler do not exist yet")
        self.publisher = publisher
        publisher.wait_ready(self.config.init_timeout_s)  # not inside the first expand, which holds a GPU grant
        _get(self.resizer.set_publisher.remote(publisher), "resizer.set_publisher", CONTROL_RPC_TIMEOUT_S)
        self.versions = self.versions.collector_attached()
        _get(self.resizer.set_versions.remote(self.versions), "resizer.set_versions", CONTROL_RPC_TIMEOUT_S)
        t0 = time.perf_counter()
        # Returns after the first expand synced real weights into >= 1 rank. A higher-priority request may take that
        # rank again right away (grants are one-shot): then the scheduler's standing request and the watchdog bring
        # a rank back, and routing blocks meanwhile. Never fail here for it.
        self.pipe.request_gpus(GENERATION_CLUSTER, Priority.GENERATION, step_target_estimate=self.config.step_target_estimate,
                               timeout_s=self.config.request_timeout_s)
        self._timed("first_generation", None, t0)
        self._watchdog = threading.Thread(target=self._watch, name=f"rlix-watchdog-{self.pipeline_id}", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """A pipeline whose ranks were all preempted must ask for GENERATION again (grants are one-shot: it would
        starve). And a pipeline one of whose engines died under its live actor fails now: nothing else would notice
        before the rank's next sync or wake (a sleeping rank's may never come), and the rank would take requests."""
        request: threading.Thread | None = None
        while not self._stop.wait(self.config.watchdog_interval_s):
            try:
                if self._failed_on_dead_engine():
                    return
                if request is not None and request.is_alive():
                    continue
                if _get(self.router.active.remote(), "router.active", CONTROL_RPC_TIMEOUT_S):
                    continue
                request = threading.Thread(target=self._rerequest, daemon=True)
                request.start()
            except Exception as exc:  # the watchdog must never kill the run
                logger.warning("rlix %s watchdog: %s", self.pipeline_id, exc)

    def _failed_on_dead_engine(self) -> bool:
        probe = getattr(self.fleet, "dead_engines", None)  # optional: a fleet that can tell (NeMo RL's can)
        if probe is None:
            return False
        dead: dict[int, str] = probe(self.fleet.dp_ranks() if self.fleet else [], CONTROL_RPC_TIMEOUT_S)
        if not dead or self._stop.is_set():
            return False
        reason = "; ".join(f"the vLLM engine of dp rank {r} died under its live actor ({why})"
                           for r, why in sorted(dead.items()))
        logger.error("rlix %s: %s: failing the pipeline", self.pipeline_id, reason)
        try:
            self.pipe.fail(reason)
        finally:  # the collector's waits end now, not at their timeouts
            with contextlib.suppress(Exception):
                _get(self.router.close.remote(reason), "router.close", CONTROL_RPC_TIMEOUT_S)
        return True

    def _rerequest(self) -> None:
        if self._stop.is_set():
            return
        self._watchdog_requests += 1
        try:
            self.pipe.request_gpus(GENERATION_CLUSTER, Priority.GENERATION,
                                   step_target_estimate=self.config.step_target_estimate,
                                   timeout_s=max(self.config.watchdog_interval_s * 10, 20.0))
        except (PipelineUnregisteredError, ActorDeadError) as exc:
            # The scheduler failed this pipeline, or died (its ranks never come back): make routing fail at once,
            # so the rollout loop and the host's wait for a batch end now instead of at their timeouts.
            if not self._stop.is_set():
                with contextlib.suppress(Exception):
                    _get(self.router.close.remote(str(exc)), "router.close", CONTROL_RPC_TIMEOUT_S)
        except (RlixTimeoutError, SchedulerError):  # pending already / unregistered at the end
            pass

    # ------------------------------------------------------------------ per step
    def before_training(self, step: int) -> list[int]:
        """Block until ACTOR_TRAINING is granted (the scheduler slept the donor ranks before it returns)."""
        t0 = time.perf_counter()
        gpus = self.pipe.request_gpus(TRAIN_CLUSTER, Priority.ACTOR_TRAINING, step=step,
                                      timeout_s=self.config.request_timeout_s)
        self._holds_train = True
        self._timed("wait_train_grant", step, t0)
        return gpus

    def before_weight_sync(self, step: int) -> int:
        """Build the cache of version ``step + 1`` while the parameters are still on the device (offloaded, they
        read as empty storage)."""
        if not self._holds_train:
            raise RlixError(f"before_weight_sync(step={step}) without the training GPUs: call before_training first")
        if self.weights is None:
            raise RlixError("before_weight_sync before start()")
        t0 = time.perf_counter()
        # The resize lock is held from here until after_training has published: an expand in between would sync the
        # new weights (or read a cache being overwritten) and label them with the old version. It waits instead.
        self._release_sync_lock()
        self._sync_lock, _ = self.pipe.acquire_resize_lock(self.config.resize_lock_timeout_s)
        try:
            self.versions = self.versions.cache_rebuilding()
            built = self.weights.build_cache(cache_version_after_step(step), self.config.sync_timeout_s)
            self.versions = self.versions.cache_built(built)
        except BaseException:
            self._release_sync_lock()
            raise
        self._timed("build_cache", step, t0)
        return built

    def after_training(self, step: int, *, offload: Callable[[], None] | None = None) -> int:
        """Offload → in-flight refresh of the active ranks → the version to publish, all under the resize lock
        ``before_weight_sync`` took (it is released here, on errors too)."""
        try:
            versions = self.versions.after_step(step)  # refused before anything moves (no cache, wrong version)
            if self._sync_lock is None:
                raise RlixError(f"after_training(step={step}) without before_weight_sync({step}) holding the resize "
                                "lock; call before_weight_sync first")
            t0 = time.perf_counter()
            if offload is not None:
                offload()
            self._timed("offload", step, t0)
            t1 = time.perf_counter()
            _get(self.resizer.refresh_active.remote(), "in-flight refresh of the active ranks",
                 self.config.sync_timeout_s + CONTROL_RPC_TIMEOUT_S)
            # Inside the lock: an expand right after it already publishes the new version, never the old one.
            _get(self.resizer.set_versions.remote(versions), "resizer.set_versions", CONTROL_RPC_TIMEOUT_S)
        finally:
            self._release_sync_lock()
        self.versions = versions
        self._timed("refresh_active", step, t1)
        assert versions.published is not None  # after_step sets it
        return versions.published

    def _release_sync_lock(self) -> None:
        token, self._sync_lock = self._sync_lock, None
        if token is not None:
            self.pipe.release_resize_lock(token)

    def on_published(self, step: int, version: int) -> None:
        """The collector has ``version``: only now may the training GPUs go (publish, then release: DESIGN §3)."""
        if version != self.versions.published:
            raise RlixError(f"on_published(step={step}, version={version}): after_training returned "
                            f"{self.versions.published}; publish exactly the version it returned")
        self.release_training(step)

    def release_training(self, step: int | None = None) -> None:
        """Release the step's ACTOR_TRAINING grant if it is held (a failed release keeps it recorded as held)."""
        if self._holds_train:
            self.pipe.release_gpus(TRAIN_CLUSTER, step=step, timeout_s=CONTROL_RPC_TIMEOUT_S)
            self._holds_train = False

    def report_progress(self, collected: int, step_target: int, step: int | None = None,
                        new_batch: bool = False) -> None:
        self.pipe.report_progress(collected, step_target, step=step, new_batch=new_batch)

    # ------------------------------------------------------------------ end
    def end(self, *, stop_collector: Callable[[], None] | None = None, error: str | None = None) -> list[str]:
        """Watchdog off → release training → planned shrink to zero → stop the collector → unregister (as failed,
        with ``error`` as the reason ``rlix status`` shows, when the run failed).

        Idempotent; never raises (returns the errors it met) so the host's ``finally`` completes and a
        finishing pipeline never drags its peer down.
        """
        if self._ended:
            return []
        self._ended = True
        errors: list[str] = []
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=self.config.watchdog_interval_s + CONTROL_RPC_TIMEOUT_S)
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self._sync_lock is not None:  # ended between before_weight_sync and after_training
            steps.append(("release the resize lock", self._release_sync_lock))
        if self._holds_train:
            steps.append(("release training GPUs", self.release_training))
        steps += [
            ("planned shrink to zero", lambda: self.pipe.await_release(GENERATION_CLUSTER,
                                                                       timeout_s=self.config.release_timeout_s)),
            ("stop the collector", stop_collector or (lambda: None)),
            ("unregister", (lambda: self.pipe.fail(f"the run failed: {error}")) if error
             else (lambda: self.pipe.unregister("the pipeline finished"))),
        ]
        for what, fn in steps:
            with self._logged(what, errors):
                fn()
        self.pipe.stop_keep_alive()
        self._holds_train = False
        # Figures for the report, then the actors: a failure is logged and returned, never raised (see above).
        if self.resizer is not None:
            with self._logged("read the resize history", errors):
                self._final_history = list(_get(self.resizer.history.remote(0), "resizer.history", CONTROL_RPC_TIMEOUT_S))
        if self.router is not None:
            with self._logged("read the router's counters", errors):
                self.router_stats = dict(_get(self.router.stats.remote(), "router.stats", CONTROL_RPC_TIMEOUT_S))
        for name, actor in (("resizer", self.resizer), ("router", self.router)):
            if actor is not None:
                with self._logged(f"kill the {name} actor", errors):
                    ray.kill(actor, no_restart=True)
        return errors

    @contextlib.contextmanager
    def _logged(self, what: str, errors: list[str]) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            logger.warning("rlix %s end: %s failed: %s", self.pipeline_id, what, exc)

    # ------------------------------------------------------------------ introspection
    @property
    def pipeline_id(self) -> str:
        return str(self.pipe.pipeline_id)

    def resize_history(self, since: int = 0) -> list[dict[str, Any]]:
        if self._ended or self.resizer is None:
            return self._final_history[since:]
        return list(_get(self.resizer.history.remote(since), "resizer.history", CONTROL_RPC_TIMEOUT_S))

    @property
    def holds_train_grant(self) -> bool:
        """Whether the step's ACTOR_TRAINING grant is held (granted by :meth:`before_training`, not yet released).
        The only record of it: the NeMo RL hooks read it here."""
        return self._holds_train

    @property
    def published(self) -> int | None:
        return self.versions.published

    @property
    def cache_version(self) -> int | None:
        return self.versions.cache

    @property
    def watchdog_requests(self) -> int:
        return self._watchdog_requests


class GrantOnlyRuntime(PipelineRuntime):
    """A :class:`PipelineRuntime` for a host with neither weight cache nor fleet (NeMo RL's unit-test mocks, behind
    :class:`rlix_plugins.nemo_rl.hooks.ControlOnlyRuntime`): the step's training grant alone, kept in the same one
    place (:attr:`holds_train_grant`). Never started; the host publishes its own versions."""

    def before_weight_sync(self, step: int) -> int:
        """No cache to build; the grant must be held all the same."""
        if not self._holds_train:
            raise RlixError(f"before_weight_sync(step={step}) without the training GPUs: call before_training first")
        return version_after_step(step)

    def on_published(self, step: int, version: int) -> None:
        """No ledger to check ``version`` against: release the grant."""
        self.release_training(step)
