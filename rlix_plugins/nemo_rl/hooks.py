"""NeMo RL time-sharing hooks: the implementation behind the ``nemo_rl.rlix_hooks`` entry point.

NeMo RL's patched ``async_grpo_train`` (series ``patches/nemo-rl/7ea279a``) loads this class through the entry
point when ``RLIX_CONTROL_PLANE=rlix`` and calls the hooks below with keywords, from the driver's main thread.
One instance = one pipeline = one training run. NeMo RL never imports this module; this module imports nothing
of NeMo RL. The contract is :class:`.hookspec.RLixHookSpec` (patch 0001 is generated from it; the seam checks this
class against it when it registers it).

The hooks keep the bookkeeping (the checkpoint grant, history, end at exit) and hand the work to a
:class:`HookRuntime`, chosen at ``rlix_pipeline_start``. Whether the step's ACTOR_TRAINING grant is held is recorded
in one place, the runtime's :class:`~rlix_plugins.pipeline.runtime.PipelineRuntime` (``runtime.rt.holds_train_grant``);
the hooks read it there and call that runtime directly for what it does alone (the cache build, the release after the
publish):

* :class:`.runtime_adapter.NemoRuntime` (a real ``VllmGeneration`` and ``Policy``: both hold a ``worker_group``):
  the shared pipeline runtime (:mod:`rlix_plugins.pipeline`) - weights cached in the Megatron or DTensor workers,
  partial sleep/wake of vLLM DP ranks, routing installed on ``policy_generation`` before it is pickled into the
  collector, progress from the replay buffer, watchdog, planned shrink at the end;
* :class:`ControlOnlyRuntime` (anything else, e.g. NeMo RL's unit-test mocks): the GPU grants alone (its ``rt`` is a
  :class:`~rlix_plugins.pipeline.runtime.GrantOnlyRuntime`).

::

    rlix_placement (setup()) → parse + validate config & topology → pipeline id → shared per-GPU placement groups +
                               worker name prefixes → register + hold INITIALIZATION of every GPU while setup()
                               creates the workers (:func:`.placement.take_setup` hands all of it to the loop)
    rlix_pipeline_start      → take setup()'s grant (else parse + validate, then adopt setup()'s registration from
                               another process - the SingleController's actor - or register) → runtime.register →
                               runtime.start(start_step) (init phases under the setup grant, then released)
    on_trajectory_collector_created → (runtime: GENERATION; the first expand syncs real weights; progress thread)
    before_training(N)       → request ACTOR_TRAINING (blocks until granted; donors slept first)
    before_weight_sync(N)    → (runtime.rt: CPU cache of version N + 1 while the parameters are on GPU)
    after_training(N)        → offload (runtime: + NCCL teardown, in-flight refresh) → return N + 1
    on_weight_version_published(N, v) → runtime.rt releases ACTOR_TRAINING → return the step's ``rlix/`` metrics (NeMo RL logs
                               them with its training metrics: ``train/rlix/...``)
    before/after_checkpoint  → request / release ACTOR_TRAINING around policy.save_checkpoint
    on_pipeline_end          → release a checkpoint grant → runtime.stop (full: watchdog off, shrink to zero;
                               both: unregister); also at interpreter exit

Version rule: :func:`rlix_plugins.pipeline.versions.version_after_step` (N + 1, the number the standalone loop
would publish); never -1, never bumped twice. A run resumed at step k starts from version k.

pluggy passes an implementation only the arguments it names WITHOUT a default: every hook parameter below has
none (the seam's ``register`` refuses a defaulted one;
``tests/nemo_rl/without_nemo/test_hook_contract.py``).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, final

import pluggy

from rlix_plugins.control.timeouts import CONTROL_RPC_TIMEOUT_S
from rlix_plugins.control.types import GENERATION_CLUSTER, TRAIN_CLUSTER, Priority
from rlix_plugins.errors import RlixError
from rlix_plugins.nemo_rl.config import RlixRunConfig, load_run_config
from rlix_plugins.nemo_rl.hookspec import PROJECT_NAME
from rlix_plugins.nemo_rl.topology import validate_topology
from rlix_plugins.pipeline.versions import version_after_step

if TYPE_CHECKING:
    from rlix_plugins.pipeline.runtime import PipelineRuntime

logger = logging.getLogger(__name__)

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class HookRuntime(Protocol):
    """The work behind the hooks (:class:`.runtime_adapter.NemoRuntime`, :class:`ControlOnlyRuntime`). Methods named
    after a hook take its arguments, under the same names. What the pipeline runtime ``rt`` does alone
    (``before_weight_sync``, ``on_published``) the hooks call on it directly."""

    @property
    def rt(self) -> PipelineRuntime | None:
        """The pipeline runtime (set by :meth:`register`): the one record of the step's training grant."""
        ...

    def register(self, cp: Any, held: Any) -> Any:
        """Register the pipeline (or adopt ``held``, setup()'s registration holding INITIALIZATION); its handle."""
        ...

    def start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int) -> None: ...
    def attach_collector(self, collector: Any, replay_buffer: Any) -> None: ...

    def before_training(self, step: int) -> list[int]:
        """Block until ACTOR_TRAINING of ``step`` is granted; the GPUs granted."""
        ...

    def after_training(self, step: int) -> int: ...
    def step_metrics(self, step: int) -> dict[str, float]: ...
    def before_checkpoint(self, step: int) -> None: ...
    def after_checkpoint(self, step: int) -> None: ...

    def stop(self, error: str | None = None) -> None:
        """Release what the runtime holds (the step's grant among it) and unregister the pipeline (as failed, with ``error`` as the reason,
        when the run raised); raise what failed."""
        ...


def has_worker_surface(policy: Any, policy_generation: Any) -> bool:
    """A real ``Policy`` + ``VllmGeneration`` (their instance dicts hold a ``worker_group``); mocks do not."""
    return all("worker_group" in getattr(o, "__dict__", {}) for o in (policy, policy_generation))


@final
class ControlOnlyRuntime:
    """The null runtime: GPU grants only (no weight cache, no fleet), for hosts without worker groups such as NeMo
    RL's unit-test mocks. ``after_training`` offloads the policy and answers :func:`version_after_step`."""

    def __init__(self, config: RlixRunConfig, policy: Any) -> None:
        self.config = config
        self.policy = policy
        self.pipe: Any = None
        self.rt: PipelineRuntime | None = None

    def register(self, cp: Any, held: Any) -> Any:
        from rlix_plugins.pipeline.runtime import GrantOnlyRuntime

        if held is not None:  # no init phases: give back the start-up grant its vLLM ranks may have taken
            held.release_gpus(GENERATION_CLUSTER, step=-1, timeout_s=CONTROL_RPC_TIMEOUT_S)
            self.pipe = held
        else:
            self.pipe = self.config.register(cp)
        self.rt = GrantOnlyRuntime(self.pipe, self.config.runtime)
        return self.pipe

    def start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int) -> None:
        """Nothing to start: no workers to prepare."""

    def attach_collector(self, collector: Any, replay_buffer: Any) -> None:
        """Nothing to attach: generation is NeMo RL's own."""

    def before_training(self, step: int) -> list[int]:
        assert self.rt is not None  # set by register
        return list(self.rt.before_training(step))

    def after_training(self, step: int) -> int:
        if self.policy is not None:
            self.policy.offload_after_refit()
        return version_after_step(step)

    def step_metrics(self, step: int) -> dict[str, float]:
        return {}

    def before_checkpoint(self, step: int) -> None:
        """Nothing to restore: the hooks hold the checkpoint's grant."""

    def after_checkpoint(self, step: int) -> None:
        """Nothing to release but the hooks' grant."""

    def stop(self, error: str | None = None) -> None:
        if self.rt is not None:
            self.rt.release_training(None)
        if error:
            self.pipe.fail(f"the NeMo RL run failed: {error}")
        else:
            self.pipe.unregister("the NeMo RL run ended")


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

    #: The work behind the hooks; chosen by ``rlix_pipeline_start`` unless set before it (tests).
    runtime: HookRuntime | None = None
    history: list[HookEvent] = field(default_factory=list)
    _config: RlixRunConfig | None = None
    _pipe: Any = None  # client.PipelineHandle
    _checkpoint_grant: bool = False  # the hooks' own ACTOR_TRAINING grant around a checkpoint
    _train_wait_s: float = 0.0
    _ended: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ introspection
    @property
    def pipeline_id(self) -> str | None:
        return None if self._pipe is None else str(self._pipe.pipeline_id)

    @property
    def holds_training_gpus(self) -> bool:
        return self._holds_step_grant or self._checkpoint_grant

    @property
    def _holds_step_grant(self) -> bool:
        """The step's ACTOR_TRAINING grant, as the pipeline runtime (its one record) has it; none once ended."""
        rt = None if self._pipe is None or self.runtime is None else self.runtime.rt
        return rt is not None and rt.holds_train_grant

    def _pipeline_runtime(self, hook: str) -> PipelineRuntime:
        rt = self._started(hook).rt
        if rt is None:
            raise RlixError(f"{hook}: the runtime has no pipeline runtime (register did not run)")
        return rt

    def _record(self, name: str, step: int | None, gpus: list[int] | tuple[int, ...] = ()) -> None:
        self.history.append(HookEvent(name, step, time.time(), tuple(gpus)))
        logger.info("rlix %s: %s step=%s%s", self.pipeline_id, name, step, f" gpus={list(gpus)}" if gpus else "")

    def _started(self, hook: str) -> HookRuntime:
        if self._pipe is None or self.runtime is None:
            raise RlixError(f"{hook} called before rlix_pipeline_start registered the pipeline (or after it ended)")
        return self.runtime

    # ------------------------------------------------------------------ hooks
    @hookimpl
    def rlix_placement(self, master_config: Any) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
        """Call site: NeMo RL's ``setup()``, before any cluster or worker exists (patch 0002; the loader there
        builds its own instance, so this hook keeps no state). Answers the train / inference clusters over the
        shared per-GPU placement groups and the per-pipeline ``name_prefix`` keywords
        (:func:`.placement.nemo_rl_placement`). Mutates nothing of NeMo RL.
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
        from rlix_plugins.nemo_rl.placement import adopt_setup, take_setup

        if self._pipe is not None:
            raise RlixError(f"pipeline {self.pipeline_id} is already started; one NemoRLHooks serves one run")
        setup = take_setup(master_config)  # setup()'s parsed config + registration holding INITIALIZATION
        if setup is None:
            cfg = load_run_config(master_config)
            validate_topology(master_config, cfg)  # before anything is registered: a bad topology fails here
            setup = adopt_setup(master_config, cfg, client.connect(cfg.ray_address))  # the SingleController's actor
        if setup is None:
            held = None
        else:
            cfg, held = setup.config, setup.pipe
        if self.runtime is None:
            if has_worker_surface(policy, policy_generation):
                from rlix_plugins.nemo_rl.runtime_adapter import NemoRuntime

                self.runtime = NemoRuntime(cfg)
            else:
                self.runtime = ControlOnlyRuntime(cfg, policy)
        self._pipe = self.runtime.register(client.connect(cfg.ray_address), held)  # unregistered by runtime.stop
        self._config = cfg
        atexit.register(self._end_at_exit)
        self._record("registered", None, cfg.train_devices)
        try:
            self.runtime.start(master_config, policy, policy_generation, start_step)
        except BaseException as exc:
            try:  # release and unregister as failed (`rlix status` names why); the start error is the one to report
                self._end("start_failed_ended", error=f"start failed: {type(exc).__name__}: {exc}"[:500])
            except Exception as end_exc:
                exc.add_note(f"ending the pipeline after the failed start also failed: {end_exc}")
            raise

    @hookimpl
    def on_trajectory_collector_created(self, collector: Any, replay_buffer: Any) -> None:
        """Call site: right after the collector actor exists, before ``start_collection``.

        The runtime requests GENERATION here, syncs the first weights and starts reporting the replay buffer's
        progress to the scheduler. Mutates nothing of NeMo RL.
        """
        runtime = self._started("on_trajectory_collector_created")
        self._record("collector_created", None)
        runtime.attach_collector(collector, replay_buffer)

    @hookimpl
    def before_training(self, step: int) -> None:
        """Call site: before ``policy.prepare_for_lp_inference`` of ``step``. Blocks until ACTOR_TRAINING is granted."""
        runtime = self._started("before_training")
        t0 = time.perf_counter()
        gpus = runtime.before_training(step)  # the pipeline runtime requests (and later releases) the step's grant
        self._train_wait_s = time.perf_counter() - t0
        self._record("train_granted", step, gpus)

    @hookimpl
    def before_weight_sync(self, step: int) -> None:
        """Call site: after ``policy.train`` of ``step``, parameters still on GPU, before any offload."""
        rt = self._pipeline_runtime("before_weight_sync")
        if not rt.holds_train_grant:
            raise RlixError(f"before_weight_sync(step={step}) without the training GPUs: before_training did not run")
        self._record("weights_on_gpu", step)
        rt.before_weight_sync(step)

    @hookimpl
    def after_training(self, step: int) -> int:
        """Call site: replaces the refit block of ``step``. Offloads training state; returns the version to publish
        (:func:`version_after_step`).

        Blocks on: the offload (and the runtime's in-flight refresh of the active ranks). The training GPUs stay
        granted until :meth:`on_weight_version_published`.
        """
        version = self._started("after_training").after_training(step)
        self._record("offloaded", step)
        return version

    @hookimpl
    def on_weight_version_published(self, step: int, weight_version: int) -> dict[str, float]:
        """Call site: after the collector received ``weight_version``. Releases ACTOR_TRAINING; returns the step's
        ``rlix/`` metrics, which the patched loop merges into the metrics it hands NeMo RL's logger."""
        runtime = self._started("on_weight_version_published")
        rt = self._pipeline_runtime("on_weight_version_published")
        self._record("published", step)
        if rt.holds_train_grant:
            rt.on_published(step, weight_version)  # releases ACTOR_TRAINING
            self._record("train_released", step)
        metrics = {"rlix/published_version": float(weight_version), "rlix/wait_train_grant_s": self._train_wait_s}
        try:
            metrics.update(runtime.step_metrics(step))
        except Exception as exc:  # figures for the logger must never fail the run
            logger.warning("rlix %s: step %s metrics: %s", self.pipeline_id, step, exc)
        return metrics

    @hookimpl
    def before_checkpoint(self, step: int) -> None:
        """Call site: before ``policy.save_checkpoint`` (it runs on the training workers). Blocks for the GPUs."""
        runtime = self._started("before_checkpoint")
        if not self.holds_training_gpus:
            assert self._config is not None  # set with the pipe
            gpus = self._pipe.request_gpus(TRAIN_CLUSTER, Priority.ACTOR_TRAINING, step=step,
                                           timeout_s=self._config.runtime.request_timeout_s)
            self._checkpoint_grant = True
            self._record("checkpoint_granted", step, gpus)
        runtime.before_checkpoint(step)  # the offloaded workers' communication groups come back first

    @hookimpl
    def after_checkpoint(self, step: int) -> None:
        """Call site: after ``policy.save_checkpoint`` returned."""
        runtime = self._started("after_checkpoint")
        if self._checkpoint_grant:
            runtime.after_checkpoint(step)
            self._release_checkpoint_grant(step)

    @hookimpl
    def on_pipeline_end(self) -> None:
        """Call site: the ``finally`` of ``async_grpo_train``, before its actors are killed. Idempotent.

        When that ``finally`` runs because the loop raised, the exception is still propagating (``sys.exc_info``):
        the pipeline is then unregistered as failed with it as the reason, which ``rlix status`` shows."""
        failure = sys.exc_info()[1]
        self._end("ended", error=None if failure is None else f"{type(failure).__name__}: {failure}"[:500])

    # ------------------------------------------------------------------ internals
    def _release_checkpoint_grant(self, step: int | None) -> None:
        gpus = self._pipe.release_gpus(TRAIN_CLUSTER, step=step, timeout_s=CONTROL_RPC_TIMEOUT_S)
        self._checkpoint_grant = False
        self._record("checkpoint_released", step, gpus)

    def _end(self, event: str, error: str | None = None) -> None:
        with self._lock:
            if self._ended or self._pipe is None or self.runtime is None:
                return
            self._ended = True
        # The hooks' own grant goes first, while still registered; the runtime then releases its step grant,
        # (full) shrinks to zero, and unregisters.
        steps: list[tuple[str, Any]] = []
        if self._checkpoint_grant:
            steps.append((f"release {TRAIN_CLUSTER}", lambda: self._release_checkpoint_grant(None)))
        runtime = self.runtime
        steps.append(("runtime.stop", lambda: runtime.stop(error=error)))
        errors: list[str] = []
        for what, fn in steps:
            try:
                fn()
            except Exception as exc:
                errors.append(f"{what}: {exc}")
        self._checkpoint_grant = False
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
            logger.warning("rlix %s: could not unregister the pipeline at exit: %s", self.pipeline_id, exc)
