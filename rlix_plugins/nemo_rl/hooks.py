"""NeMo RL time-sharing hooks: the implementation behind the ``nemo_rl.rlix_hooks`` entry point.

NeMo RL's patched ``async_grpo_train`` (series ``patches/nemo-rl/7ea279a``) loads this class through the entry
point when ``RLIX_CONTROL_PLANE=rlix`` and calls the hooks below with keywords, from the driver's main thread.
One instance = one pipeline = one training run. NeMo RL never imports this module; this module imports nothing
of NeMo RL.

Two modes, chosen at ``rlix_pipeline_start``:

* **full** (a real ``VllmGeneration`` and ``Policy``: both hold a ``worker_group``): the shared pipeline runtime
  (:mod:`rlix_plugins.pipeline`) through :class:`.runtime_adapter.NemoRuntime` - weights cached in the Megatron
  or DTensor workers, partial sleep/wake of vLLM DP ranks, routing installed on ``policy_generation`` before it is pickled
  into the collector, progress from the replay buffer, watchdog, planned shrink at the end.
* **control-only** (anything else, e.g. NeMo RL's unit-test mocks): the GPU grants alone.

::

    rlix_placement (setup()) → validate → pipeline id → shared per-GPU placement groups + worker name prefixes →
                               register + hold INITIALIZATION of every GPU while setup() creates the workers
    rlix_pipeline_start      → load + validate config & topology → connect → take over setup()'s registration and
                               grant, or register/admit (full mode: through the runtime) (→ runtime.start(start_step):
                               init phases under the setup grant, then released)
    on_trajectory_collector_created → (runtime: GENERATION; the first expand syncs real weights; progress thread)
    before_training(N)       → request ACTOR_TRAINING (blocks until granted; donors slept first)
    before_weight_sync(N)    → (runtime: CPU cache of version N + 1 while the parameters are on GPU)
    after_training(N)        → offload (runtime: + NCCL teardown, in-flight refresh) → return N + 1
    on_weight_version_published(N, v) → release ACTOR_TRAINING → return the step's ``rlix/`` metrics (NeMo RL logs
                               them with its training metrics: ``train/rlix/...``)
    before/after_checkpoint  → request / release ACTOR_TRAINING around policy.save_checkpoint
    on_pipeline_end          → release a checkpoint grant → runtime: watchdog off, shrink to zero, unregister
                               (control-only: release → unregister); also at interpreter exit

Version rule (DESIGN §3): the version published after step N is N + 1 (the version of the cache step N built,
the same number the standalone loop would publish); never -1, never bumped twice. A run resumed at step k starts
from version k (the loop's ``weight_version = step``).

pluggy passes an implementation only the arguments it names WITHOUT a default: every hook parameter below has
none (a defaulted one would silently receive its default; ``tests/nemo_rl/test_hook_contract.py``).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, final

import pluggy

from rlix_plugins.control.types import GENERATION_CLUSTER, TRAIN_CLUSTER, Priority
from rlix_plugins.errors import RlixError
from rlix_plugins.nemo_rl.config import RlixRunConfig, load_run_config
from rlix_plugins.nemo_rl.topology import validate_topology

logger = logging.getLogger(__name__)

#: Must equal ``nemo_rl.algorithms.rlix_hooks.PROJECT_NAME`` of the patch series.
PROJECT_NAME: Final = "nemo_rl_rlix"
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PipelineRuntime(Protocol):
    """Weight and generation work of a pipeline (:class:`.runtime_adapter.NemoRuntime`; None = control-only)."""

    def register(self, cp: Any, held: Any) -> Any: ...
    def start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int) -> None: ...
    def attach_collector(self, collector: Any, replay_buffer: Any) -> None: ...
    def before_training(self, step: int) -> None: ...
    def build_cache(self, step: int) -> None: ...
    def after_training(self, step: int) -> int: ...
    def on_published(self, step: int, version: int) -> None: ...
    def step_metrics(self, step: int) -> dict[str, float]: ...
    def before_checkpoint(self, step: int) -> None: ...
    def after_checkpoint(self, step: int) -> None: ...
    def stop(self) -> None: ...


def has_worker_surface(policy: Any, policy_generation: Any) -> bool:
    """A real ``Policy`` + ``VllmGeneration`` (their instance dicts hold a ``worker_group``); mocks do not."""
    return all("worker_group" in getattr(o, "__dict__", {}) for o in (policy, policy_generation))


@dataclass(frozen=True)
class HookEvent:
    """One thing the hooks did (``history``): the hook name, the step, when, and what was granted/released."""

    name: str
    step: int | None
    time: float
    gpus: tuple[int, ...] = ()


@final
@dataclass(eq=False)  # identity semantics: one stateful object per run
class NemoRLHooks:
    """Hook implementation (see the module docstring). Called from the driver's main thread only."""

    runtime: PipelineRuntime | None = None
    history: list[HookEvent] = field(default_factory=list)
    _config: RlixRunConfig | None = None
    _pipe: Any = None  # client.PipelineHandle
    _policy: Any = None
    _collector: Any = None
    _holds_train: bool = False
    _checkpoint_grant: bool = False
    _train_wait_s: float = 0.0
    _ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ introspection
    @property
    def pipeline_id(self) -> str | None:
        return None if self._pipe is None else str(self._pipe.pipeline_id)

    @property
    def holds_training_gpus(self) -> bool:
        return self._holds_train

    def _record(self, name: str, step: int | None, gpus: list[int] | tuple[int, ...] = ()) -> None:
        self.history.append(HookEvent(name, step, time.time(), tuple(gpus)))
        logger.info("rlix %s: %s step=%s%s", self.pipeline_id, name, step, f" gpus={list(gpus)}" if gpus else "")

    def _require_pipe(self, hook: str) -> Any:
        if self._pipe is None:
            raise RlixError(f"{hook} called before rlix_pipeline_start registered the pipeline (or after it ended)")
        return self._pipe

    # ------------------------------------------------------------------ hooks
    @hookimpl
    def rlix_placement(self, master_config: Any) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """Call site: NeMo RL's ``setup()``, before any cluster or worker exists (patch 0002; the loader there
        builds its own instance, so this hook keeps no state). Answers the train / inference clusters over the
        shared per-GPU placement groups and the per-pipeline ``name_prefix`` keywords
        (:func:`.placement.nemo_rl_placement`). Mutates: writes ``rlix.pipeline_id`` into ``master_config``.
        """
        from rlix_plugins.nemo_rl.placement import nemo_rl_placement

        return nemo_rl_placement(master_config)

    @hookimpl
    def rlix_pipeline_start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int) -> None:
        """Call site: ``async_grpo_train`` after setup, before the replay buffer / collector exist. ``start_step``:
        the loop's first step (> 0 on a resumed run; the start weights are then version ``start_step``).

        Blocks on: the control plane (connect, register, admit; bounded RPCs). Mutates nothing of NeMo RL.
        """
        from rlix_plugins.control import client
        from rlix_plugins.nemo_rl.placement import take_setup_grant

        if self._pipe is not None:
            raise RlixError(f"pipeline {self.pipeline_id} is already started; one NemoRLHooks serves one run")
        cfg = load_run_config(master_config)
        validate_topology(master_config, cfg)  # before anything is registered (reference F10 gap)
        if self.runtime is None and has_worker_surface(policy, policy_generation):
            from rlix_plugins.nemo_rl.runtime_adapter import NemoRuntime

            self.runtime = NemoRuntime(cfg)
        cp = client.connect(cfg.ray_address)
        held = take_setup_grant(cfg.pipeline_id, cp)  # setup()'s registration holding INITIALIZATION, or None
        if self.runtime is not None:
            self._pipe = self.runtime.register(cp, held)  # registered (and at the end unregistered) by the runtime
        elif held is not None:  # control-only: no init phases to run under the setup grant
            held.release_gpus(GENERATION_CLUSTER, step=-1, timeout_s=60.0)
            self._pipe = held
        else:
            self._pipe = cp.register_pipeline(
                cluster_tp_configs={TRAIN_CLUSTER: 1, GENERATION_CLUSTER: cfg.infer_tp},
                cluster_device_mappings={TRAIN_CLUSTER: list(cfg.train_devices),
                                         GENERATION_CLUSTER: list(cfg.infer_devices)},
                pipeline_id=cfg.pipeline_id,
            )
        self._config, self._policy = cfg, policy
        atexit.register(self._end_at_exit)
        self._record("registered", None, cfg.train_devices)
        if self.runtime is not None:
            try:
                self.runtime.start(master_config, policy, policy_generation, start_step)
            except BaseException as exc:
                try:  # release and unregister; the start error is the one to report
                    self._end("start_failed_ended")
                except Exception as end_exc:
                    exc.add_note(f"ending the pipeline after the failed start also failed: {end_exc}")
                raise

    @hookimpl
    def on_trajectory_collector_created(self, collector: Any, replay_buffer: Any) -> None:
        """Call site: right after the collector actor exists, before ``start_collection``.

        The runtime requests GENERATION here, syncs the first weights and starts reporting the replay buffer's
        progress to the scheduler. Mutates nothing of NeMo RL.
        """
        self._require_pipe("on_trajectory_collector_created")
        self._collector = collector
        self._record("collector_created", None)
        if self.runtime is not None:
            self.runtime.attach_collector(collector, replay_buffer)

    @hookimpl
    def before_training(self, step: int) -> None:
        """Call site: before ``policy.prepare_for_lp_inference`` of ``step``. Blocks until ACTOR_TRAINING is granted."""
        t0 = time.perf_counter()
        if self.runtime is None:
            self._acquire_train(step, Priority.ACTOR_TRAINING, "train_granted")
        else:
            self._require_pipe("before_training")
            self.runtime.before_training(step)  # the runtime requests (and later releases) the step's grant
            self._holds_train = True
            self._record("train_granted", step)
        self._train_wait_s = time.perf_counter() - t0

    @hookimpl
    def before_weight_sync(self, step: int) -> None:
        """Call site: after ``policy.train`` of ``step``, parameters still on GPU, before any offload."""
        self._require_pipe("before_weight_sync")
        if not self._holds_train:
            raise RlixError(f"before_weight_sync(step={step}) without the training GPUs: before_training did not run")
        self._record("weights_on_gpu", step)
        if self.runtime is not None:
            self.runtime.build_cache(step)

    @hookimpl
    def after_training(self, step: int) -> int:
        """Call site: replaces the refit block of ``step``. Offloads training state; returns ``step + 1``.

        Blocks on: the offload (and the runtime's in-flight refresh of the active ranks). The training GPUs stay
        granted until :meth:`on_weight_version_published`.
        """
        self._require_pipe("after_training")
        if self.runtime is not None:
            version = self.runtime.after_training(step)  # offload → NCCL teardown → in-flight refresh
        else:
            version = step + 1
            if self._policy is not None:
                self._policy.offload_after_refit()
        self._record("offloaded", step)
        return version

    @hookimpl
    def on_weight_version_published(self, step: int, weight_version: int) -> dict[str, float]:
        """Call site: after the collector received ``weight_version``. Releases ACTOR_TRAINING; returns the step's
        ``rlix/`` metrics, which the patched loop merges into the metrics it hands NeMo RL's logger."""
        self._record("published", step, ())
        if self.runtime is not None and self._holds_train:
            self.runtime.on_published(step, weight_version)  # releases ACTOR_TRAINING
            self._holds_train = False
            self._record("train_released", step)
        else:
            self._release_train(step, "train_released")
        metrics = {"rlix/published_version": float(weight_version), "rlix/wait_train_grant_s": self._train_wait_s}
        if self.runtime is not None:
            try:
                metrics.update(self.runtime.step_metrics(step))
            except Exception as exc:  # figures for the logger must never fail the run
                logger.warning("rlix %s: step %s metrics: %s", self.pipeline_id, step, exc)
        return metrics

    @hookimpl
    def before_checkpoint(self, step: int) -> None:
        """Call site: before ``policy.save_checkpoint`` (it runs on the training workers). Blocks for the GPUs."""
        self._acquire_train(step, Priority.ACTOR_TRAINING, "checkpoint_granted")
        self._checkpoint_grant = True
        if self.runtime is not None:
            self.runtime.before_checkpoint(step)  # the offloaded workers' communication groups come back first

    @hookimpl
    def after_checkpoint(self, step: int) -> None:
        """Call site: after ``policy.save_checkpoint`` returned."""
        if self.runtime is not None and self._checkpoint_grant:
            self.runtime.after_checkpoint(step)
        self._release_train(step, "checkpoint_released")
        self._checkpoint_grant = False

    @hookimpl
    def on_pipeline_end(self) -> None:
        """Call site: the ``finally`` of ``async_grpo_train``, before its actors are killed. Idempotent."""
        self._end("ended")

    # ------------------------------------------------------------------ internals
    def _acquire_train(self, step: int, priority: Priority, event: str) -> None:
        pipe = self._require_pipe(event)
        if self._holds_train:
            return
        assert self._config is not None
        gpus = pipe.request_gpus(TRAIN_CLUSTER, priority, step=step, timeout_s=self._config.request_timeout_s)
        self._holds_train = True
        self._record(event, step, gpus)

    def _release_train(self, step: int | None, event: str) -> None:
        pipe = self._require_pipe(event)
        if not self._holds_train:
            return
        gpus = pipe.release_gpus(TRAIN_CLUSTER, step=step, timeout_s=60.0)
        self._holds_train = False
        self._record(event, step, gpus)

    def _end(self, event: str) -> None:
        with self._lock:
            if self._ended or self._pipe is None:
                return
            self._ended = True
        # A grant the hooks took themselves (checkpoint, or control-only) goes first, while still registered; the
        # runtime then releases its own step grant, shrinks to zero and unregisters; control-only unregisters here.
        steps: list[tuple[str, Any]] = []
        if self._checkpoint_grant or self.runtime is None:
            steps.append((f"release {TRAIN_CLUSTER}", lambda: self._release_train(None, "train_released")))
        if self.runtime is not None:
            steps.append(("runtime.stop", self.runtime.stop))
        else:
            steps.append(("unregister", lambda: self._pipe.unregister("the NeMo RL run ended")))
        errors: list[str] = []
        for what, fn in steps:
            try:
                fn()
            except Exception as exc:
                errors.append(f"{what}: {exc}")
        self._holds_train = self._checkpoint_grant = False
        self._record(event, None)
        self._pipe = None
        atexit.unregister(self._end_at_exit)
        if errors:
            raise RlixError(f"ending pipeline: {'; '.join(errors)}")

    def _end_at_exit(self) -> None:
        # Early returns of async_grpo_train (e.g. val_at_start early stop) skip on_pipeline_end.
        try:
            self._end("ended_at_exit")
        except Exception as exc:
            logger.warning("rlix: could not unregister the pipeline at exit: %s", exc)

