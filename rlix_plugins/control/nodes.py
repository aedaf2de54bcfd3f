"""The node table: which machine and which node-local GPU each of rlix's global GPU ids names.

The control plane owns this fact (the orchestrator builds the table once, when it starts, and hands it on:
``ControlPlane.node_table()``); placement pins its groups with it and checks where workers really landed against
it. Plain Python over Ray's node list (no NeMo RL, no vLLM; Ray only in :func:`current_node_table`).

Rules:

* **Nodes**: the alive Ray nodes that declare GPUs (a CPU-only head is not a GPU node), ordered by node IP
  (numerically, IPv4 before IPv6) then node id, so every process that reads the same Ray node list gets the same
  order; the position is the node's **rank**.
* **Global GPU id** = ``rank * gpus_per_node + local GPU id``. Every GPU node must declare the same GPU count:
  the scheduler and the registration rules already read node boundaries as ``g // gpus_per_node`` (a TP group
  must not cross one), so cumulative offsets over uneven nodes would disagree with them. Uneven nodes are refused
  with the counts and the fix.
* **Local GPU id**: the GPU's index among the node's GPUs, 0..n-1 (Ray's slot; ``ray.get_gpu_ids()`` names the
  same GPU as the raylet's ``CUDA_VISIBLE_DEVICES`` does, e.g. 2 for slot 0 of a raylet started on GPUs 2,3: the
  worker's probe maps it back); it repeats on every node, so it is never a key alone.

The table is fixed when the control plane starts: a node that joins later is not used until the control plane
restarts (``rlix down`` then ``rlix up``); a node that leaves fails the placements pinned to it.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from rlix_plugins.errors import RlixConfigError, RlixError

__all__ = ["NODE_ID_LABEL", "GpuLocation", "Node", "NodeTable", "PlacementMismatchError", "current_node_table"]

#: The label every Ray node carries with its own id (Ray's default labels); placement groups pin bundles with it.
NODE_ID_LABEL: Final = "ray.io/node-id"


class PlacementMismatchError(RlixError):
    """A worker runs somewhere other than the node table says its GPU is."""


@dataclass(frozen=True)
class Node:
    rank: int
    node_id: str  #: Ray node id (hex)
    ip: str  #: Ray's node address (``NodeManagerAddress``): what other nodes reach it by
    num_gpus: int


@dataclass(frozen=True)
class GpuLocation:
    """Where one global GPU id is."""

    gpu: int
    node_rank: int
    node_id: str
    node_ip: str
    local_gpu: int


def _ip_key(ip: str) -> tuple[int, int, str]:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:  # a host name: after every address, by text
        return 2, 0, ip
    return (0 if addr.version == 4 else 1), int(addr), ip


@dataclass(frozen=True)
class NodeTable:
    """Ordered GPU nodes (see the module docstring). Frozen and plain: pickled to placement and workers."""

    nodes: tuple[Node, ...]
    gpus_per_node: int

    def __post_init__(self) -> None:
        if not self.nodes:
            raise RlixConfigError(
                "the Ray cluster has no GPU node; start it with GPUs (`rlix up --num-gpus N` declares N on a CPU "
                "machine; `ray start --address <head> --num-gpus N` adds a node)")
        counts = {n.node_id: n.num_gpus for n in self.nodes}
        if len(set(counts.values())) != 1 or self.gpus_per_node != self.nodes[0].num_gpus:
            detail = ", ".join(f"{n.ip} ({n.node_id[:8]}): {n.num_gpus}" for n in self.nodes)
            raise RlixConfigError(
                f"GPU nodes are not uniform (GPUs per node: {detail}); rlix numbers GPUs node rank x GPUs per node + "
                "local id, so every GPU node must declare the same count: start each node's raylet with the same "
                "--num-gpus (or CUDA_VISIBLE_DEVICES), or leave the odd node out of the Ray cluster")
        if [n.rank for n in self.nodes] != list(range(len(self.nodes))):
            raise RlixConfigError(f"node ranks {[n.rank for n in self.nodes]} are not 0..{len(self.nodes) - 1}")

    @classmethod
    def from_ray_nodes(cls, entries: Iterable[Mapping[str, Any]]) -> NodeTable:
        """The table of ``ray.nodes()`` entries: alive nodes with at least one GPU, ordered (module docstring)."""
        gpu_nodes = [(str(e["NodeManagerAddress"]), str(e["NodeID"]), int(e.get("Resources", {}).get("GPU", 0)))
                     for e in entries if e.get("Alive") and int(e.get("Resources", {}).get("GPU", 0)) > 0]
        gpu_nodes.sort(key=lambda t: (_ip_key(t[0]), t[1]))
        nodes = tuple(Node(rank, node_id, ip, gpus) for rank, (ip, node_id, gpus) in enumerate(gpu_nodes))
        return cls(nodes, nodes[0].num_gpus if nodes else 0)

    @property
    def num_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def locate(self, gpu: int) -> GpuLocation:
        """Where global GPU ``gpu`` is; a clear error for an id outside the pool."""
        if not 0 <= gpu < self.num_gpus:
            raise RlixConfigError(
                f"GPU {gpu} is not in the pool: {len(self.nodes)} node(s) x {self.gpus_per_node} GPUs = ids 0.."
                f"{self.num_gpus - 1} (global id = node rank x GPUs per node + local id); use ids in that range")
        node = self.nodes[gpu // self.gpus_per_node]
        return GpuLocation(gpu, node.rank, node.node_id, node.ip, gpu % self.gpus_per_node)

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise PlacementMismatchError(
            f"Ray node {node_id[:8]}… is not a GPU node of the table ({self.describe()}); it joined after the control "
            "plane started, or declares no GPU: restart the control plane (`rlix down`, `rlix up`) to use it")

    def global_gpu(self, node_id: str, local_gpu: int) -> int:
        """The global id of ``local_gpu`` on node ``node_id``."""
        node = self.node(node_id)
        if not 0 <= local_gpu < self.gpus_per_node:
            raise PlacementMismatchError(f"local GPU {local_gpu} on node {node.ip} is outside 0..{self.gpus_per_node - 1}")
        return node.rank * self.gpus_per_node + local_gpu

    def check_location(self, gpu: int, node_id: str, node_ip: str, local_gpus: list[int]) -> None:
        """Raise :class:`PlacementMismatchError` unless a worker that reported ``(node_id, node_ip, local_gpus)``
        (``ray.get_runtime_context().get_node_id()``, ``ray.util.get_node_ip_address()``, the GPUs' node indices)
        runs on global GPU ``gpu``."""
        want = self.locate(gpu)
        got = f"node {node_ip} ({node_id[:8]}…), local GPUs {local_gpus}"
        if node_id != want.node_id or node_ip != want.node_ip or local_gpus != [want.local_gpu]:
            raise PlacementMismatchError(
                f"GPU {gpu} should be node {want.node_rank} = {want.node_ip} ({want.node_id[:8]}…), local GPU "
                f"{want.local_gpu}, but its worker reports {got}; the Ray cluster changed since the control plane "
                "started (restart it: `rlix down`, `rlix up`) or a node's address is not the one Ray reports "
                "(start each raylet with --node-ip-address)")

    def describe(self) -> str:
        return "; ".join(f"node {n.rank} = {n.ip} ({n.node_id[:8]}…): GPUs {n.rank * self.gpus_per_node}.."
                         f"{(n.rank + 1) * self.gpus_per_node - 1}" for n in self.nodes)


def current_node_table(wait_s: float = 10.0) -> NodeTable:
    """The table of the Ray cluster this process is connected to; waits up to ``wait_s`` for a GPU node to appear
    (a raylet that is still registering). Called by the orchestrator, the table's owner."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        entries = ray.nodes()
        if any(e.get("Alive") and e.get("Resources", {}).get("GPU", 0) > 0 for e in entries) \
                or time.monotonic() >= deadline:
            return NodeTable.from_ray_nodes(entries)
        time.sleep(0.5)
