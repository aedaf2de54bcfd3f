"""Control plane: a Ray-hosted GPU scheduler that time-shares one pool between several RL pipelines.

Imports neither NeMo RL nor vLLM (nor torch). Three actors in namespace ``rlix``: the orchestrator (pipeline ids,
registration, kill), the scheduler (blocking GPU requests, the planning cycle) and, per pipeline, a coordinator
(resize lock, active DP ranks, progress) in ``pipeline_<pid>_NS``. Drivers reach them through :mod:`.client`.

Public API
----------
* Driver side (:mod:`.client`): :func:`connect` → :class:`ControlPlane` → ``register_pipeline`` →
  :class:`PipelineHandle` (``request_gpus``, ``release_gpus``, ``await_release``, ``report_progress``,
  ``resize_lock``, ``unregister``); :func:`ensure_ray` joins a cluster by address, bounded.
* Records (:mod:`.types`, plain frozen Python): :class:`Priority`, :class:`ClusterSpec`, :class:`Allocation`,
  :class:`PendingRequest`, :class:`Progress`, :class:`SchedulerSnapshot`, :class:`CyclePlan` and its ops,
  :class:`TraceEvent`; names: ``GENERATION_CLUSTER``, ``TRAIN_CLUSTER``, :func:`cluster_id`,
  :func:`pipeline_namespace`, :func:`coordinator_name`.
* Actors: :class:`Orchestrator` (:mod:`.orchestrator`), :class:`Scheduler` with :class:`SchedulerConfig`
  (:mod:`.scheduling`), :class:`Coordinator` with :class:`CoordinatorConfig` and the pipeline's
  :class:`ResizeHandler` seam (:mod:`.coordinator`); :class:`TraceRecorder` (:mod:`.trace`), the scheduler's
  decision trace.
* Pure scheduling (:mod:`.scheduling.planner`, :mod:`.registration`): :func:`plan_cycle`, :func:`validate_plan`
  (raises :class:`PlanInvariantError`), :func:`build_cluster_specs`, :func:`validate_cluster_specs`.
* :func:`ray_get` (:mod:`.rpc`): ``ray.get`` with a timeout whose failures come back as rlix errors; every
  package's bounded Ray call.

Subpackages: :mod:`.scheduling` (the scheduler actor and its planner), :mod:`.capacity` (``rlix simulate`` and
the timeline picture), :mod:`.admin` (``rlix up/down/status/timeline``: the local Ray head and its auth token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlix_plugins._lazy import lazy_exports
from rlix_plugins.control.types import (
    GENERATION_CLUSTER,
    RLIX_NAMESPACE,
    TRAIN_CLUSTER,
    Allocation,
    ClusterSpec,
    CyclePlan,
    ExpandOp,
    Grant,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
    ShrinkOp,
    TraceEvent,
    cluster_id,
    coordinator_name,
    parse_cluster_id,
    pipeline_namespace,
)

if TYPE_CHECKING:
    from rlix_plugins.control.client import ControlPlane, PipelineHandle, connect, ensure_ray
    from rlix_plugins.control.coordinator import Coordinator, CoordinatorConfig, ResizeHandler
    from rlix_plugins.control.orchestrator import Orchestrator
    from rlix_plugins.control.registration import build_cluster_specs, validate_cluster_specs
    from rlix_plugins.control.rpc import ray_get
    from rlix_plugins.control.scheduling.config import SchedulerConfig
    from rlix_plugins.control.scheduling.planner import PlanInvariantError, plan_cycle, validate_plan
    from rlix_plugins.control.scheduling.scheduler import Scheduler
    from rlix_plugins.control.trace import TraceRecorder

# Imported on first use: most import Ray, and the records must not (NeMo RL's hook implementation imports them in
# interpreters without Ray); the pure ones too, so that importing the records stays as cheap as it was.
_LAZY = {
    "ControlPlane": "client", "PipelineHandle": "client", "connect": "client", "ensure_ray": "client",
    "Coordinator": "coordinator", "CoordinatorConfig": "coordinator", "ResizeHandler": "coordinator",
    "Orchestrator": "orchestrator",
    "build_cluster_specs": "registration", "validate_cluster_specs": "registration",
    "ray_get": "rpc",
    "SchedulerConfig": "scheduling.config",
    "PlanInvariantError": "scheduling.planner", "plan_cycle": "scheduling.planner", "validate_plan": "scheduling.planner",
    "Scheduler": "scheduling.scheduler",
    "TraceRecorder": "trace",
}
__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "GENERATION_CLUSTER",
    "RLIX_NAMESPACE",
    "TRAIN_CLUSTER",
    "Allocation",
    "ClusterSpec",
    "ControlPlane",
    "Coordinator",
    "CoordinatorConfig",
    "CyclePlan",
    "ExpandOp",
    "Grant",
    "Orchestrator",
    "PendingRequest",
    "PipelineHandle",
    "PlanInvariantError",
    "Priority",
    "Progress",
    "ResizeHandler",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerSnapshot",
    "ShrinkOp",
    "TraceEvent",
    "TraceRecorder",
    "build_cluster_specs",
    "cluster_id",
    "connect",
    "coordinator_name",
    "ensure_ray",
    "parse_cluster_id",
    "pipeline_namespace",
    "plan_cycle",
    "ray_get",
    "validate_cluster_specs",
    "validate_plan",
]
