"""NeMo RL host of the shared pipeline runtime: :class:`NemoRuntime` plugs NeMo RL's objects into
:class:`rlix_plugins.pipeline.PipelineRuntime` (the same code path the demo host uses).

* fleet: :class:`.generation.NemoVllmFleet` over ``VllmGeneration``'s DP leaders; routing installed on the
  generation object with ``attach_fleet_health`` BEFORE the collector pickles it (:func:`.generation.install_routing`);
* weights: :class:`.weights.PolicyWeightSource` (cache inside the Megatron or DTensor workers, per the config);
* offload (``after_training``): DTensor workers move their states into their page-locked arenas
  (:mod:`.state_arena`), else ``policy.offload_after_refit()`` → workers marked offloaded (a later cache build is
  refused: it would read empty storage) → the trainer's communication groups released (Megatron: NCCL groups
  destroyed inside every training worker; DTensor: FSDP2's stay, see :mod:`.weights`); ``before_training``
  restores them after the grant, before NeMo RL's ``prepare_for_lp_inference``;
* publisher, progress and the end of the rollout side: per loop kind (:func:`.topology.grpo_loop`), see
  :mod:`.loops` (async GRPO: ``collector.set_weight_version``; the TransferQueue loop and the SingleController
  publish themselves);
* registration: :meth:`NemoRuntime.register` adopts the pipeline NeMo RL's ``setup()`` registered (the placement
  hook, holding INITIALIZATION of all its GPUs since before its workers existed: :mod:`.placement`; ``start`` runs
  the init phases under that grant and releases it), else registers + admits through ``PipelineRuntime.register``
  (the demo host's path); ``stop`` ends it through ``PipelineRuntime.end`` (which unregisters);
* resume: ``start(..., start_step=k)`` builds the start cache as version ``k`` (the checkpoint's weights), so every
  expand before the first training step publishes the version NeMo RL's loop publishes (``weight_version = step``);
* metrics: :meth:`NemoRuntime.step_metrics` - the step's ``rlix/`` figures NeMo RL logs with its training metrics;
* progress: a daemon thread counts what the loop collected toward the current weight version (async GRPO:
  replay-buffer entries intended for it, :mod:`.loops` for the others) once a second and sends the raw count with
  ``step_target = grpo.num_prompts_per_step`` through the runtime's fire-and-forget
  :class:`~rlix_plugins.pipeline.runtime.ProgressReporter` (never blocks on the coordinator).

Threads: hook calls come from the driver's main thread; the progress thread only reads and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Final

from rlix_plugins.control.types import GENERATION_CLUSTER, Priority
from rlix_plugins.errors import RlixError
from rlix_plugins.nemo_rl.config import RlixRunConfig, cfg_path
from rlix_plugins.nemo_rl.generation import NemoVllmFleet, install_routing
from rlix_plugins.nemo_rl.loops import LoopSurface, loop_surface
from rlix_plugins.nemo_rl.topology import grpo_loop
from rlix_plugins.nemo_rl.weights import PolicyWeightSource
from rlix_plugins.pipeline.publisher import CollectorPublisher

__all__ = ["CollectorPublisher", "NemoRuntime"]

logger = logging.getLogger(__name__)
_PROGRESS_PERIOD_S: Final = 1.0
#: The runtime phases of a training grant after the step itself (``PipelineRuntime.timings``), reported per step.
_GRANT_PHASES: Final = ("build_cache", "offload", "refresh_active")


class NemoRuntime:
    """See the module docstring. One per pipeline (driver process); a :class:`.hooks.HookRuntime`. The weight
    versions and whether the step's training grant is held are the shared runtime's (``rt.versions``,
    ``rt.holds_train_grant``): this class reads them, never keeps its own. What the shared runtime does alone (the
    cache build of ``before_weight_sync``, the release after the publish) the hooks call on ``rt`` directly."""

    def __init__(self, config: RlixRunConfig) -> None:
        self.config = config
        self.rt: Any = None
        self.weights: PolicyWeightSource | None = None
        self.policy: Any = None
        self.step_target = 1
        self._stop = threading.Event()
        self._trainer_asked = threading.Event()
        self._progress: threading.Thread | None = None
        self.progress_reports: list[tuple[int, int]] = []  # (version, collected) sent
        self._master_config: Any = None
        self._stop_collector: Any = None  # per loop kind (.loops)
        self._init_held = False
        self._history_seen = 0  # resize-history events already counted into step metrics
        self._timings_seen = 0  # runtime phase timings already counted into step metrics
        self._trace_since = time.time()

    def register(self, cp: Any, held: Any = None) -> Any:
        """Adopt ``held`` (the handle setup() registered; its start-up grant is taken in :meth:`start`) or
        register + admit the pipeline through the shared runtime (the demo host's path); returns its handle. The
        runtime also unregisters it (:meth:`stop`)."""
        from rlix_plugins.pipeline import PipelineRuntime

        cfg = self.config
        if held is not None:
            self.rt, self._init_held = PipelineRuntime(held, cfg.runtime), True
        else:
            self.rt = PipelineRuntime(cfg.register(cp), cfg.runtime)
        return self.rt.pipe

    def start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int = 0) -> None:
        """Init phases of the registered pipeline (:meth:`register` first), then routing on ``policy_generation``."""
        if self.rt is None:
            raise RlixError("NemoRuntime.start before register(): the pipeline is not registered")
        cfg = self.config
        self.policy, self._master_config = policy, master_config
        self.step_target = int(cfg_path(master_config, "grpo.num_prompts_per_step") or 1)
        per_node = cfg_path(master_config, "cluster.gpus_per_node")
        self.weights = PolicyWeightSource.from_policy(policy, master_config, list(cfg.train_devices),
                                                      cfg.bucket_size_bytes, per_node)
        fleet = NemoVllmFleet.from_generation(policy_generation, list(cfg.infer_devices), cfg.infer_tp, per_node)
        held, self._init_held = self._init_held, False  # start releases the start-up grant, even when it fails
        if held:  # setup()'s registration: its vLLM ranks took the grant for their device set-up (control.start_gate)
            self.rt.pipe.request_gpus(GENERATION_CLUSTER, Priority.INITIALIZATION, step=-1,
                                      timeout_s=cfg.runtime.init_timeout_s)
        self.rt.start(self.weights, fleet, offload=self._offload, start_step=start_step, init_held=held)
        install_routing(policy_generation, self.rt.router_client())

    def _offload(self) -> None:
        assert self.weights is not None
        if not self.config.offload_trainer:  # the states stay; the step's freed blocks go back to the driver
            self.weights.release_cached_blocks(self.config.runtime.sync_timeout_s)
            return
        if self.weights.offload_to_arena(self.config.runtime.sync_timeout_s) is None:
            self.policy.offload_after_refit()
        self.weights.mark_offloaded(True)
        self.weights.release_comm_groups(self.config.runtime.sync_timeout_s)

    def attach_collector(self, collector: Any, replay_buffer: Any) -> None:
        surface = loop_surface(grpo_loop(self._master_config), self._master_config, collector, replay_buffer)
        self._stop_collector, self.step_target = surface.stop_collector, surface.step_target
        self.rt.attach_collector(surface.publisher)  # publishes the start version first
        self._progress = threading.Thread(target=self._report_progress,
                                          args=(surface, self.rt.progress_reporter()), daemon=True,
                                          name=f"rlix-progress-{self.rt.pipeline_id}")
        self._progress.start()

    def _report_progress(self, surface: LoopSurface, reporter: Any) -> None:
        last: tuple[int, int] | None = None
        while not self._stop.wait(_PROGRESS_PERIOD_S):
            try:
                version = self.rt.versions.published
                n = int(surface.waited_for(version, self._trainer_asked.is_set()))
                if last is None or (version, n) != last:
                    reporter.report(n, self.step_target, step=version, new_batch=last is None or last[0] != version)
                    self.progress_reports.append((version, n))
                    last = (version, n)
            except Exception as exc:  # progress must never kill the run
                logger.warning("rlix progress: %s", exc)

    def before_training(self, step: int) -> list[int]:
        self._trainer_asked.set()  # the start-up barrier is behind the trainer (``LoopSurface.waited_for``)
        assert self.weights is not None
        gpus = self.rt.before_training(step)
        self.weights.restore_comm_groups(self.config.runtime.sync_timeout_s)
        self.weights.mark_offloaded(False)
        return list(gpus)

    def before_checkpoint(self, step: int) -> None:
        """The save runs on the training workers (grant held by the hooks): rebuild their communication groups."""
        assert self.weights is not None
        self.weights.restore_comm_groups(self.config.runtime.sync_timeout_s)

    def after_checkpoint(self, step: int) -> None:
        assert self.weights is not None
        self.weights.release_comm_groups(self.config.runtime.sync_timeout_s)

    def after_training(self, step: int) -> int:
        return self.rt.after_training(step, offload=self._offload)

    def step_metrics(self, step: int) -> dict[str, float]:
        """The ``rlix/`` figures of ``step`` (since the previous call): expands (ranks woken + synced, their
        seconds), shrinks, how many of the shrinks were preemptions by a training grant (the scheduler's trace), and
        the vLLM workers that verified the weights they received (every TP worker of a rank counts), the syncs
        any worker did not verify, the most a slept rank kept on one GPU after a shrink (GiB; 0 where nothing was
        measured, as on CPU), and the seconds of the training grant's hand-over phases: the cache build, the offload
        and the in-flight refresh of the awake ranks (where a grant's time goes after the step itself). Reads the
        resize actor's history and the scheduler's trace (bounded RPCs)."""
        timings = self.rt.timings[self._timings_seen:]
        self._timings_seen += len(timings)
        phases = {what: 0.0 for what in _GRANT_PHASES}
        for _, what, _, seconds in timings:
            if what in phases:
                phases[what] += seconds
        history = self.rt.resize_history(self._history_seen)
        self._history_seen += len(history)
        expands = [e for e in history if e.get("op") == "expand"]
        shrinks = [e for e in history if e.get("op") == "shrink"]
        syncs = [e for e in history if e.get("op") in ("expand", "refresh") and e.get("ranks")]
        now = time.time()
        trace = self.rt.pipe.control_plane.trace(self._trace_since)
        self._trace_since = now
        preempted = [e for e in trace if e.pipeline_id == self.rt.pipeline_id and e.op == "shrink"
                     and "preempt" in e.detail]
        return {
            "rlix/expand_s": float(sum(e.get("seconds", 0.0) for e in expands)),
            "rlix/ranks_expanded": float(sum(len(e.get("ranks", ())) for e in expands)),
            "rlix/ranks_shrunk": float(sum(len(e.get("ranks", ())) for e in shrinks)),
            "rlix/preemptions": float(len(preempted)),
            "rlix/workers_verified": float(sum(sum((e.get("verified_workers") or {}).values()) for e in syncs)),
            "rlix/syncs_unverified": float(sum(1 for e in syncs if not e.get("verified"))),
            "rlix/asleep_gib_max": max((b / (1 << 30) for e in shrinks for b in (e.get("memory_after") or {}).values()
                                        if b is not None), default=0.0),
            **{f"rlix/{what}_s": float(seconds) for what, seconds in phases.items()},
        }

    def stop(self, error: str | None = None) -> None:
        """End the pipeline (``error``: the run failed with it; the pipeline is unregistered as failed)."""
        self._stop.set()
        if self._progress is not None:
            self._progress.join(timeout=15)
        errors: list[str] = []
        if self.rt is not None:
            # Watchdog off → planned shrink to zero → collector stopped → unregister, in this order so a
            # finishing pipeline never drags its peer down; NeMo RL's own ray.kill of the collector right after
            # this hook is then a no-op.
            errors = self.rt.end(stop_collector=self._stop_collector, error=error)
        if errors:
            raise RlixError("; ".join(errors))
