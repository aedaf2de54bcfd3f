"""Shared pipeline runtime: time-sharing of one pipeline's GPUs, independent of the host (NeMo RL or the demo).

What it must never import: NeMo RL, vLLM or torch. The host supplies three picklable seams
(:mod:`~rlix_plugins.pipeline.protocols`) and calls the runtime where patched NeMo RL calls its hooks. Importing the
package imports no Ray either: the names below that need Ray (the runtime, router, resizer, publisher) are imported
on first use.

Public API
----------
* :class:`PipelineRuntime` (driver side, one per pipeline): ``register`` / ``__init__(pipe)`` → ``start(weights,
  fleet|factory, offload=)`` → ``router_client()``, ``progress_reporter()`` → ``attach_collector(publisher)`` →
  per step ``before_training(step)``, ``before_weight_sync(step)``, ``after_training(step, offload=) -> version``,
  (host publishes) ``on_published(step, version)`` → ``end(stop_collector=)``. See :mod:`.runtime`.
* Seams (:mod:`.protocols`): :class:`RolloutFleet` (DP ranks: devices, abort, sleep, wake, memory probe,
  ``engine_rpc`` for ``vllm.driver.sync_engines``), :class:`WeightSource` (cache owner: ``build_cache(version)``,
  ``sync(targets)`` → :class:`SyncResult`), :class:`VersionPublisher` (``set_weight_version``), implemented for
  every host's collector actor by :class:`CollectorPublisher` (:mod:`.publisher`).
* Routing (:mod:`.router`): :class:`RolloutRouter` actor ``rlix:router:<pid>`` (active ranks, in-flight tickets;
  acquire blocks while no rank is active) and :class:`RouterClient` (picklable; ``route(call)`` retries a
  request aborted by a shrink on another active rank). :class:`ShardPreemptedError`.
* Resizing (:mod:`.resizer`): :class:`FleetResizer` actor ``rlix:resizer:<pid>``, the coordinator's resize
  handler: shrink = unroute → abort → drain → sleep → memory check; expand = wake → sync → finalize → verify →
  publish (no bump) → route, atomic; ``refresh_active`` = in-flight sync of the active ranks.
* Versions (:mod:`.versions`): :class:`VersionLedger` (the runtime's ``versions``: cache and published version,
  one writer), ``BOOTSTRAP_VERSION`` -1, ``version_after_step(N) = N + 1`` (the rule, once; NeMo RL's seam holds a
  generated copy), ``published_version(v) = max(v, 0)``, ``check_no_double_bump``.
* :class:`RuntimeConfig` (:mod:`.config`): sleep level (2, or 1), post-sleep memory limit, every timeout.

How a host plugs in (NeMo RL, issue 6; the demo host in :mod:`rlix_plugins.demo` is the worked example)
------------------------------------------------------------------------------------------------------
* ``RolloutFleet`` over ``VllmGeneration``'s DP-leader Ray workers: ``devices`` from the registered inference
  mapping, ``engine_rpc(r)`` = ``vllm.driver.RayEngineRpc(leader, "checkpoint_engine_rpc[_async]",
  "reset_prefix_cache[_async]")``, ``abort`` = the workers' abort-all (must complete the callers' requests),
  ``sleep``/``wake_up`` = ``sleep_async(level)`` / ``wake_up_async(tags)``, ``memory_in_use`` via NVML per worker.
* ``WeightSource``: ``build_cache(v)`` runs ``VersionedBucketCache.build(v, refit iterator)`` on EVERY training
  rank, Megatron or DTensor (owner: global rank 0); ``sync`` runs ``vllm.driver.sync_engines`` on the owner worker with the
  engine handles it is given (host_pull, the default same-GPU transport, for targets on a training GPU; NCCL broadcast for the rest).
* ``VersionPublisher``: :class:`CollectorPublisher` (``collector.set_weight_version.remote(v)``); the collector routes with a
  :class:`RouterClient` instead of its pickled ``VllmGeneration`` round-robin, and reports progress with the
  runtime's :class:`ProgressReporter`.
* Hooks → runtime: ``rlix_pipeline_start`` → ``start``; ``on_trajectory_collector_created`` → ``attach_collector``;
  ``before_training``/``before_weight_sync``/``after_training`` 1:1; ``on_weight_version_published`` →
  ``on_published``; ``on_pipeline_end`` → ``end``. NeMo RL creates its engines in ``setup()`` (before the first
  hook), so pass the existing fleet (not a factory) to ``start``: it is then only prewarmed and slept under the
  INITIALIZATION grant.

Ownership: the runtime creates the router and resizer actors in the pipeline's namespace, owned by the driver
process; with the coordinator they die with it, and the scheduler then frees the pipeline's GPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlix_plugins._lazy import lazy_exports
from rlix_plugins.pipeline.config import RuntimeConfig
from rlix_plugins.pipeline.protocols import (
    RolloutFleet,
    ShardPreemptedError,
    SyncResult,
    VersionPublisher,
    WeightSource,
)
from rlix_plugins.pipeline.versions import (
    BOOTSTRAP_VERSION,
    VersionLedger,
    cache_version_after_step,
    check_no_double_bump,
    published_version,
    version_after_step,
)

if TYPE_CHECKING:
    from rlix_plugins.pipeline.publisher import CollectorPublisher
    from rlix_plugins.pipeline.resizer import FleetResizer, resizer_name
    from rlix_plugins.pipeline.router import RolloutRouter, RouterClient, router_name
    from rlix_plugins.pipeline.runtime import PipelineRuntime, ProgressReporter

# Imported on first use: they import Ray, and the config, the seams and the version rules must not (the hook
# implementation imports them in interpreters without Ray, e.g. NeMo RL's loader resolving the entry point).
_RAY_MODULES = {
    "CollectorPublisher": "publisher", "FleetResizer": "resizer", "resizer_name": "resizer",
    "RolloutRouter": "router", "RouterClient": "router", "router_name": "router",
    "PipelineRuntime": "runtime", "ProgressReporter": "runtime",
}

__getattr__ = lazy_exports(__name__, _RAY_MODULES)


__all__ = [
    "BOOTSTRAP_VERSION",
    "CollectorPublisher",
    "FleetResizer",
    "PipelineRuntime",
    "ProgressReporter",
    "RolloutFleet",
    "RolloutRouter",
    "RouterClient",
    "RuntimeConfig",
    "ShardPreemptedError",
    "SyncResult",
    "VersionLedger",
    "VersionPublisher",
    "WeightSource",
    "cache_version_after_step",
    "check_no_double_bump",
    "published_version",
    "resizer_name",
    "router_name",
    "version_after_step",
]
