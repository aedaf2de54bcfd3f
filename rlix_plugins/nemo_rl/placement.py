"""Shared placement for several pipelines' workers on the same GPUs (reference F12), and the NeMo RL virtual-cluster
surface its worker groups read.

* :class:`GpuPlacementPool` - a detached named actor ``rlix:placement`` (namespace ``rlix``) that owns ONE placement
  group per GPU (one ``{"GPU": 1}`` bundle each), created once and shared by every pipeline; ``groups(gpus)``
  returns them keyed by the GPU id Ray actually assigned to the bundle (probed once), so rlix's device ids and
  Ray's agree. The actor serialises creation (two drivers never create two groups for one GPU).
* :class:`VirtualClusterAdapter` - duck-typed to the members of NeMo RL's ``RayVirtualCluster`` that
  ``RayWorkerGroup`` / ``Policy`` / ``VllmGeneration`` read (``world_size``, ``node_count``,
  ``get_placement_groups``, ``_init_placement_groups``, ``_sorted_bundle_indices``,
  ``_nvlink_domain_per_bundle_index``, ``use_gpus``, ``num_gpus_per_node``, ``max_colocated_worker_groups``,
  ``get_master_address_and_port``, ``get_available_addresses_and_ports_batch``, ``shutdown``) over groups it does
  not own: each worker asks for ``1 / max_colocated_worker_groups`` GPU, so several pipelines' workers fit one
  bundle. ``shutdown`` is a no-op (the pool owns the groups). Any other attribute raises AttributeError.
* :func:`worker_name_prefix` - unique worker-actor names per pipeline (``<pid>-<role>``).

GAP: NeMo RL's ``setup()`` builds its own ``RayVirtualCluster``s; handing it these adapters needs a seam
(a ``cluster_factory`` in ``setup``) that the patch series does not have yet - not wired, not proven on GPUs.
"""

from __future__ import annotations

import socket
from typing import Any, Final

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlix_plugins.control._rpc import ray_get
from rlix_plugins.errors import RlixConfigError

__all__ = ["GpuPlacementPool", "VirtualClusterAdapter", "placement_pool", "worker_name_prefix"]

POOL_NAME: Final = "rlix:placement"
_NAMESPACE: Final = "rlix"


def worker_name_prefix(pipeline_id: str, role: str) -> str:
    """Prefix of a pipeline's worker-actor names (``ft_ab12…-policy``): unique across pipelines."""
    return f"{pipeline_id}-{role}"


def _probe_gpu() -> list[int]:
    return [int(g) for g in ray.get_gpu_ids()]


def _free_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), int(s.getsockname()[1])


class GpuPlacementPool:
    """See the module docstring. A plain (one call at a time) actor: creation is serialised."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        self._timeout_s = timeout_s
        self._by_gpu: dict[int, PlacementGroup] = {}

    def groups(self, gpus: list[int]) -> dict[int, PlacementGroup]:
        """Placement groups of ``gpus`` (created on first use: one per GPU of the node, probed, kept)."""
        missing = [g for g in gpus if g not in self._by_gpu]
        if missing:
            total = int(ray.cluster_resources().get("GPU", 0))
            if max(gpus) >= total:
                raise RlixConfigError(f"GPUs {sorted(gpus)} requested; the Ray cluster has {total} (ids 0..{total - 1})")
            free = total - len(self._by_gpu)
            new = [placement_group([{"GPU": 1, "CPU": 0.01}], strategy="STRICT_PACK") for _ in range(free)]
            ray_get([pg.ready() for pg in new], f"{len(new)} per-GPU placement groups ready", self._timeout_s)
            probes = [ray.remote(_probe_gpu).options(num_cpus=0, num_gpus=0.01, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0))).remote()
                for pg in new]
            for pg, ids in zip(new, ray.get(probes, timeout=self._timeout_s), strict=True):
                self._by_gpu[ids[0]] = pg
        return {g: self._by_gpu[g] for g in gpus}

    def release_all(self) -> int:
        """Remove every group (``rlix down``; tests). Workers still placed in them are killed by Ray."""
        from ray.util import remove_placement_group

        n = len(self._by_gpu)
        for pg in self._by_gpu.values():
            remove_placement_group(pg)
        self._by_gpu.clear()
        return n


def placement_pool() -> Any:
    """The cluster's pool actor (created detached on first use)."""
    return ray.remote(GpuPlacementPool).options(name=POOL_NAME, namespace=_NAMESPACE, lifetime="detached",
                                                get_if_exists=True, num_cpus=0).remote()


class VirtualClusterAdapter:
    """See the module docstring. ``groups``: placement groups in worker order (one GPU bundle each)."""

    def __init__(self, groups: list[PlacementGroup], *, max_colocated_worker_groups: int, name: str = "") -> None:
        if not groups:
            raise RlixConfigError("VirtualClusterAdapter needs at least one placement group")
        if max_colocated_worker_groups < 1:
            raise RlixConfigError(f"max_colocated_worker_groups={max_colocated_worker_groups} must be >= 1")
        self._groups = list(groups)
        self.name = name
        self.use_gpus = True
        self.num_gpus_per_node = 1  # one bundle per placement group
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self._sorted_bundle_indices = None
        self._nvlink_domain_per_bundle_index = None

    def world_size(self) -> int:
        return len(self._groups)

    def node_count(self) -> int:
        return len(self._groups)

    def get_placement_groups(self) -> list[PlacementGroup]:
        return list(self._groups)

    def _init_placement_groups(self, strategy: str | None = None, use_unified_pg: bool = False) -> list[PlacementGroup]:
        if use_unified_pg:
            raise RlixConfigError("cross-node model parallelism (a unified placement group) is not supported with "
                                  "shared per-GPU placement groups")
        return list(self._groups)

    def get_available_addresses_and_ports_batch(self, pg_bundle_pairs: list[tuple[int, int]],
                                                batch_size: int = 256) -> list[tuple[str, int]]:
        refs = [ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._groups[pg], placement_group_bundle_index=b)).remote() for pg, b in pg_bundle_pairs]
        return [tuple(r) for r in ray.get(refs, timeout=120)]  # type: ignore[misc]

    def get_master_address_and_port(self) -> tuple[str, int]:
        return self.get_available_addresses_and_ports_batch([(0, 0)])[0]

    def shutdown(self) -> bool:
        return True  # the pool owns the placement groups; they outlive any one pipeline
