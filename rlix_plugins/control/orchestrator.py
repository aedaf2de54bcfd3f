"""The orchestrator actor (``rlix:orchestrator`` in namespace ``rlix``): pipeline ids, registration, kill.

It owns the pool description: the node table (``control.nodes``: GPU nodes ordered by IP then node id, the same GPU
count on each, global GPU id = node rank x GPUs per node + local id), built once at start and handed to placement
(``node_table``); and it creates the scheduler singleton on first start. Registration input is
validated here (``registration.build_cluster_specs``) and handed to the scheduler as ``ClusterSpec`` records.

A threaded actor: every method is short except ``kill_pipeline`` (bounded by ``kill_timeout_s``).
Nothing here stops Ray; ``kill_pipeline`` only touches the actors of that pipeline's namespace.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Final

import ray

from rlix_plugins.control.nodes import NodeTable, current_node_table
from rlix_plugins.control.registration import build_cluster_specs, validate_pipeline_id
from rlix_plugins.control.rpc import ray_get
from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.scheduling.scheduler import Scheduler
from rlix_plugins.control.timeouts import CONTROL_RPC_TIMEOUT_S
from rlix_plugins.control.types import RLIX_NAMESPACE, SCHEDULER_NAME, ClusterSpec, pipeline_namespace
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError

logger = logging.getLogger(__name__)

PIPELINE_KINDS: Final = ("ft", "lora")


def discover_pool(wait_s: float = 10.0) -> tuple[int, int]:
    """(num_gpus, gpus_per_node) of the current Ray cluster's node table; waits up to ``wait_s`` for GPUs."""
    table = current_node_table(wait_s)
    return table.num_gpus, table.gpus_per_node


class Orchestrator:
    """Create through ``client.connect``; methods are plain (threaded actor)."""

    def __init__(self, scheduler_config: SchedulerConfig | None = None) -> None:
        self._nodes = current_node_table()
        self._num_gpus, self._gpus_per_node = self._nodes.num_gpus, self._nodes.gpus_per_node
        self._config = scheduler_config
        self._scheduler = _create_scheduler(self._num_gpus, self._gpus_per_node, scheduler_config)
        _get(self._scheduler.ping.remote(), "scheduler start")
        self._ids: set[str] = set()

    def ping(self) -> str:
        return "ok"

    def restart_scheduler(self, scheduler_config: SchedulerConfig | None = None) -> None:
        """Start a new scheduler when the old one died (``rlix up``). It starts empty: the pipelines that were
        registered failed with the old one and register again."""
        if scheduler_config is not None:
            self._config = scheduler_config
        self._scheduler = _create_scheduler(self._num_gpus, self._gpus_per_node, self._config)
        _get(self._scheduler.ping.remote(), "scheduler start")

    def pool(self) -> dict[str, int]:
        return {"num_gpus": self._num_gpus, "gpus_per_node": self._gpus_per_node}

    def node_table(self) -> NodeTable:
        """The node table the pool's GPU ids refer to (the one owner of that fact; see ``control.nodes``)."""
        return self._nodes

    def allocate_pipeline_id(self, kind: str = "ft") -> str:
        """A fresh id ``<kind>_<12 hex>`` (kind ``ft`` = full finetune, ``lora``)."""
        if kind not in PIPELINE_KINDS:
            raise RlixConfigError(f"unknown pipeline kind {kind!r}; valid: {list(PIPELINE_KINDS)}")
        while True:
            pid = f"{kind}_{secrets.token_hex(6)}"
            if pid not in self._ids:
                self._ids.add(pid)
                return pid

    def register_pipeline(
        self,
        pipeline_id: str,
        cluster_tp_configs: dict[str, int],
        cluster_device_mappings: dict[str, list[int]],
        cluster_memory: dict[str, dict[str, float]] | None = None,
        job_id: str | None = None,
    ) -> dict[str, ClusterSpec]:
        """Validate and register; returns the canonical cluster specs by name. Raises ``RlixConfigError``.

        ``job_id``: the registering driver's Ray job (hex); when the scheduler fails the pipeline, its GPUs stay
        fenced until that job's processes are gone (``scheduling.fences``)."""
        specs = build_cluster_specs(
            pipeline_id, cluster_tp_configs, cluster_device_mappings,
            num_gpus=self._num_gpus, gpus_per_node=self._gpus_per_node, cluster_memory=cluster_memory,
        )
        _get(self._scheduler.register_pipeline.remote(pipeline_id, list(specs.values()), job_id=job_id),
             "register_pipeline")
        self._ids.add(pipeline_id)
        return specs

    def admit_pipeline(self, pipeline_id: str) -> None:
        validate_pipeline_id(pipeline_id)
        _get(self._scheduler.admit_pipeline.remote(pipeline_id), "admit_pipeline")

    def unregister_pipeline(self, pipeline_id: str, reason: str = "unregistered by its pipeline") -> bool:
        """Idempotent; False when the pipeline was not registered (e.g. already failed by the scheduler)."""
        return bool(_get(self._scheduler.unregister_pipeline.remote(pipeline_id, reason), "unregister_pipeline"))

    def kill_pipeline(self, pipeline_id: str, kill_timeout_s: float = 30.0) -> list[str]:
        """Unregister the pipeline and kill every named actor in its namespace; returns the killed names."""
        validate_pipeline_id(pipeline_id)
        self.unregister_pipeline(pipeline_id, reason="killed")
        ns = pipeline_namespace(pipeline_id)
        killed: list[str] = []
        deadline = time.monotonic() + kill_timeout_s
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") != ns:
                continue
            if time.monotonic() > deadline:
                raise RlixTimeoutError(f"kill_pipeline({pipeline_id}) ran over {kill_timeout_s:.0f} s; killed {killed}")
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=ns), no_restart=True)
                killed.append(entry["name"])
            except ValueError:
                continue  # exited meanwhile
        return sorted(killed)


def _create_scheduler(num_gpus: int, gpus_per_node: int, config: SchedulerConfig | None) -> Any:
    actor: Any = ray.remote(Scheduler)
    try:
        return actor.options(
            name=SCHEDULER_NAME, namespace=RLIX_NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=0, max_concurrency=10_000,
        ).remote(num_gpus, gpus_per_node, config)
    except ValueError:  # lost a creation race to another orchestrator start
        return ray.get_actor(SCHEDULER_NAME, namespace=RLIX_NAMESPACE)


def _get(ref: Any, what: str, timeout_s: float = CONTROL_RPC_TIMEOUT_S) -> Any:
    return ray_get(ref, f"scheduler {what}", timeout_s,
                   dead="the scheduler actor is dead; restart the control plane with `rlix up`")

