"""What the pipeline runtime needs from each patched NeMo RL GRPO loop (:func:`.topology.grpo_loop`), chosen by the
loop kind the topology check detects, never by the collector's shape:

=====================  ==========================================  ===========================================
loop                   publisher (after every expand)              progress for the scheduler (per weight version)
=====================  ==========================================  ===========================================
``async_grpo_train``   ``collector.set_weight_version`` (actor)    replay-buffer entries intended for the version
``grpo_train_sync``    none: on-policy, the loop itself refreshes  samples in the step's TransferQueue partition
                       generation each step (``after_training``)   (the pipeline's own TQ controller, patch 0007)
``single_controller``  none: the SC publishes ``_trainer_version``  ready prompt groups its staleness sampler may
                       to its rollout manager itself (patch 0006)  still select for the version
=====================  ==========================================  ===========================================

Async GRPO's first step also waits for the next step's batch (NeMo RL's start-up barrier, in its main since 2026-07:
the first step trains only once the lookahead batch is complete too, so that a resumed run cannot consume its step
before the collector produced the next); :meth:`LoopSurface.waited_for` counts it until the trainer first asks for
its grant (v0.7.0, without the barrier, asks at its first batch: the count is right there too). Counted as done, the
pipeline looked idle while its trainer waited, and another pipeline took its only rollout rank (one H200, two 1.5B
pipelines).

Only async GRPO's collector is stopped at the end (the other loops' rollout side ends with the loop). Counters run
in the progress thread of :class:`.runtime_adapter.NemoRuntime`; each call is bounded (Ray RPCs) or in-process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import ray

from rlix_plugins.control.rpc import ray_get
from rlix_plugins.control.timeouts import PROGRESS_RPC_TIMEOUT_S
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl import worker_ops
from rlix_plugins.nemo_rl.config import cfg_path
from rlix_plugins.nemo_rl.topology import ASYNC_GRPO, DATA_PLANE, SINGLE_CONTROLLER
from rlix_plugins.pipeline.protocols import VersionPublisher
from rlix_plugins.pipeline.publisher import CollectorPublisher, LoopPublishes

__all__ = ["LoopSurface", "loop_surface", "sampler_ready_groups", "tq_partition_samples"]

#: TransferQueue's controller actor name and its default Ray namespace (``transfer_queue/interface.py`` at c516143).
TQ_CONTROLLER: Final = "TransferQueueController"
TQ_DEFAULT_NAMESPACE: Final = "transfer_queue"


@dataclass(frozen=True)
class LoopSurface:
    """``count(version)``: entries collected toward ``version`` (raw; the coordinator clamps) out of ``step_target``;
    ``stop_collector``: what ends the rollout side at the end of the run (None: nothing); ``lookahead_below``: the
    loop's first step also waits for the next version's batch where that version is below it (async GRPO with
    ``max_trajectory_age_steps`` > 0: ``grpo.max_num_steps``; 0: never)."""

    loop: str
    publisher: VersionPublisher
    count: Callable[[int], int]
    step_target: int
    stop_collector: Callable[[], None] | None
    lookahead_below: int = 0

    def waited_for(self, version: int, trainer_asked: bool) -> int:
        """Entries of ``version`` the trainer's next step has; before the trainer first asked for a grant, no more
        than of ``version + 1`` where the start-up barrier waits for that batch too (module docstring)."""
        n = self.count(version)
        if not trainer_asked and version + 1 < self.lookahead_below and n > 0:
            n = min(n, self.count(version + 1))
        return n


def loop_surface(loop: str | None, master_config: Any, collector: Any, replay_buffer: Any) -> LoopSurface:
    """The surface of ``loop`` for the objects its ``on_trajectory_collector_created`` call passes: async GRPO (the
    collector and replay-buffer actors), the TransferQueue loop (the ``SyncRolloutActor``, the ``TQPolicy``), the
    SingleController (its in-process rollout manager and staleness sampler)."""
    target = max(1, int(cfg_path(master_config, "grpo.num_prompts_per_step") or 1))
    if loop == ASYNC_GRPO:
        def count_replay(version: int) -> int:
            return int(ray_get(replay_buffer.__ray_call__.remote(worker_ops.count_intended_for, version),
                               "replay_buffer.count_intended_for", PROGRESS_RPC_TIMEOUT_S, dead="the replay buffer died"))

        lookahead = int(cfg_path(master_config, "grpo.async_grpo.max_trajectory_age_steps") or 0) > 0
        return LoopSurface(loop, CollectorPublisher(collector), count_replay, target,
                           lambda: ray.kill(collector, no_restart=True),
                           int(cfg_path(master_config, "grpo.max_num_steps") or 0) if lookahead else 0)
    if loop == DATA_PLANE:
        group = max(1, int(cfg_path(master_config, "grpo.num_generations_per_prompt") or 1))
        namespace = cfg_path(master_config, "data_plane.rlix_namespace") or TQ_DEFAULT_NAMESPACE
        partition = str(getattr(replay_buffer, "tq_partition_id", None) or "train")
        return LoopSurface(loop, LoopPublishes(), _TqPartitionCount(namespace, partition, group), target, None)
    if loop == SINGLE_CONTROLLER:
        return LoopSurface(loop, LoopPublishes(), lambda version: sampler_ready_groups(replay_buffer, version),
                           target, None)
    raise RlixConfigError(f"no time-sharing surface for NeMo RL loop {loop!r}: one of "
                          f"{ASYNC_GRPO}, {DATA_PLANE}, {SINGLE_CONTROLLER} (topology.grpo_loop)")


def tq_partition_samples(controller: Any, partition_id: str) -> int:
    """Runs INSIDE TransferQueue's controller actor (``__ray_call__``): samples the partition holds now."""
    partition = controller._get_partition(partition_id)
    return 0 if partition is None else len(partition.global_indexes)


class _TqPartitionCount:
    """Prompt groups in the TransferQueue partition of the current step (``grpo_train_sync`` clears it after each
    step, so the count belongs to the version being trained next). The rollout actor puts a step's samples at once:
    progress jumps from 0 to the full batch."""

    def __init__(self, namespace: str, partition_id: str, group_size: int) -> None:
        self.namespace, self.partition_id, self.group_size = namespace, partition_id, group_size
        self._controller: Any = None

    def __call__(self, version: int) -> int:
        if self._controller is None:  # TQPolicy starts the controller before the loop starts
            self._controller = ray.get_actor(TQ_CONTROLLER, namespace=self.namespace)
        n = ray_get(self._controller.__ray_call__.remote(tq_partition_samples, self.partition_id),
                    f"samples of TransferQueue partition {self.partition_id!r}", PROGRESS_RPC_TIMEOUT_S,
                    dead="the TransferQueue controller died")
        return int(n) // self.group_size


def sampler_ready_groups(sampler: Any, version: int) -> int:
    """Ready prompt groups in the SingleController's buffer that its staleness sampler may still select when the
    trainer is at ``version`` (start weight within the sampler's eviction window; in-process, a snapshot)."""
    buffer = sampler._buffer
    floor = max(0, version - int(sampler._eviction_window()))
    starts, ready = list(buffer.start_weight_list), list(buffer.ready_list)
    return sum(1 for start, is_ready in zip(starts, ready, strict=False) if is_ready and start >= floor)
