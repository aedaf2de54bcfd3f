"""Where the processes of a sync really run, and the rendezvous address of the broadcast group.

A comm plan is built from configuration (``(node, gpu)`` pairs the scheduler assigned); the processes it names run
wherever Ray and CUDA put them. Before a sync the sender asks every target for a :class:`Place` (one per worker,
:func:`local_place`, computed in the worker) and checks the plan against them (:func:`check_comm_plan`): a plan that
sends a target by a same-GPU transport although it runs on another node or GPU, or broadcasts to a rank on the
sender's own GPU, is refused before any byte moves.

Node identity: the Ray node id where the process knows it (a Ray worker; a child process of one through
``RLIX_NODE_ID``/``RLIX_NODE_IP``, see :func:`export_node_env`), always together with the machine's boot id. Two
places are on one node when their machines match and, where both know their Ray node, their Ray nodes match too
(several raylets on one machine are several nodes: a same-machine transport would work there, but the scheduler's
view is per Ray node). GPU identity: the physical GPU's UUID (``CUDA_VISIBLE_DEVICES`` renumbers indices).

Rendezvous (:func:`rendezvous_address`): the broadcast group's store listens on the sender's node IP, the address
Ray reaches the sender's process at; a receiver on another node that dialed its own loopback would never meet it.

Imports torch and the standard library only; Ray is used only when the process has already started it.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

import torch

from rlix_plugins import envs
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.transport._host_pull import BOOT_ID
from rlix_plugins.transport._plan import CommPlan
from rlix_plugins.transport._registry import same_gpu_transport as registered_transport

#: plan fix named by every refusal: the config side is what is wrong, the processes are where they are
_FIX = ("fix the device mapping the plan was built from (rlix.train_devices / rlix.infer_devices / "
        "cluster.gpus_per_node, or the (node, gpu) pairs given to build_comm_plan) so that it matches where the "
        "workers run; a rank on another GPU or node must be a broadcast target")


@final
@dataclass(frozen=True)
class Place:
    """Where one process runs. Plain strings only: it crosses Ray and vLLM's msgpack as :meth:`to_wire`."""

    #: Ray node id ("" where the process knows no Ray node)
    node_id: str
    #: the node's IP as Ray knows it ("" where unknown)
    node_ip: str
    #: the machine's boot id (``/proc/sys/kernel/random/boot_id``)
    machine: str
    hostname: str
    #: the device the process uses, as it names it (``cuda:0``, ``cpu``)
    device: str
    #: physical GPU UUID; None on CPU
    gpu: str | None = None

    def same_node(self, other: Place) -> bool:
        if self.machine != other.machine:
            return False
        return not (self.node_id and other.node_id) or self.node_id == other.node_id

    def same_gpu(self, other: Place) -> bool:
        return self.gpu is not None and self.gpu == other.gpu and self.same_node(other)

    def node(self) -> str:
        """The node in words, for errors."""
        ray_part = f"Ray node {self.node_id[:12]}" if self.node_id else "no Ray node"
        return f"{self.node_ip or self.hostname} ({ray_part}, host {self.hostname})"

    def describe(self) -> str:
        return f"{self.device}{f' (GPU {self.gpu})' if self.gpu else ''} on {self.node()}"

    def to_wire(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "machine": self.machine, "hostname": self.hostname,
                "device": self.device, "gpu": self.gpu}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> Place:
        try:
            gpu = wire.get("gpu")
            return cls(node_id=str(wire["node_id"]), node_ip=str(wire["node_ip"]), machine=str(wire["machine"]),
                       hostname=str(wire["hostname"]), device=str(wire["device"]),
                       gpu=None if gpu is None else str(gpu))
        except (KeyError, TypeError, AttributeError) as exc:
            raise RlixConfigError(f"not a place report: {wire!r} ({exc!r})") from exc


def _ray_node() -> tuple[str, str] | None:
    """(node id, node IP) when this process has Ray up; never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return str(ray.get_runtime_context().get_node_id()), str(ray.util.get_node_ip_address())


def _node() -> tuple[str, str]:
    found = _ray_node()
    if found is not None:
        return found
    return envs.node_id() or "", envs.node_ip() or ""


def export_node_env() -> bool:
    """In a process with Ray up: export its Ray node (``RLIX_NODE_ID``/``RLIX_NODE_IP``) to the child processes it
    starts afterwards (vLLM's engine core and workers, the test harness's receiver workers), which know no Ray node
    of their own. False (nothing exported) without Ray."""
    import os

    found = _ray_node()
    if found is None:
        return False
    os.environ.update({envs.RLIX_NODE_ID: found[0], envs.RLIX_NODE_IP: found[1]})
    return True


def local_place(device: torch.device | str | None = None) -> Place:
    """This process's :class:`Place`, for ``device`` (default: CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    gpu = None
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        dev = torch.device("cuda", index)
        gpu = str(torch.cuda.get_device_properties(index).uuid)
    node_id, node_ip = _node()
    return Place(node_id=node_id, node_ip=node_ip, machine=BOOT_ID, hostname=socket.gethostname(), device=str(dev),
                 gpu=gpu)


def rendezvous_address(master_addr: str | None = None) -> str:
    """The address the broadcast group's store listens on and every receiver dials: ``master_addr`` when given,
    else this process's Ray node IP (Ray up here, or exported by a Ray parent), else a ``RlixConfigError``: without
    Ray there is no address known to be reachable from other nodes, and a loopback default would let a receiver on
    another node dial itself."""
    if master_addr:
        return master_addr
    _, node_ip = _node()
    if node_ip:
        return node_ip
    raise RlixConfigError(
        "no rendezvous address for the weight broadcast: this process has no Ray node (Ray not started here, "
        f"{envs.RLIX_NODE_IP} unset); pass master_addr=<an address of this machine every receiver can reach> "
        "(127.0.0.1 only when every receiver runs on this machine)"
    )


def check_comm_plan(plan: CommPlan, sender: Place, targets: Mapping[int, Sequence[Place]]) -> None:
    """Refuse ``plan`` where it disagrees with where the processes run (``targets``: dp rank -> the place of each
    worker, local-rank order). Raises ``RlixConfigError`` naming the target, both places and the fix:

    * a target the plan serves by its same-GPU transport runs on another node (``host_pull``/``cuda_ipc`` cannot
      work there at all) or, where both GPUs are known, on another GPU; ``cuda_ipc`` also needs both on a GPU;
    * a broadcast target runs on the sender's GPU (NCCL cannot hold two ranks of a group on one GPU);
    * the plan's node numbers disagree with the nodes (a device on the sender's node number runs on another node,
      or one on another node number runs on the sender's node);
    * two devices of the plan are one physical GPU.
    """
    transport = registered_transport(plan.same_gpu_transport)
    seen: dict[str, tuple[int, int]] = {}
    for t in plan.targets:
        places = targets.get(t.dp_rank)
        count = len(t.ipc_local_ranks) + len(t.broadcast_ranks)
        if places is None or len(places) != count:
            raise RlixConfigError(f"dp rank {t.dp_rank}: the plan has {count} devices, the rank reported "
                                  f"{'no place' if places is None else f'{len(places)} workers'}: {_FIX}")
        for local, place in enumerate(places):
            where = f"dp rank {t.dp_rank} local rank {local}"
            if place.gpu is not None:
                if place.gpu in seen:  # a UUID names one GPU in the world
                    other = seen[place.gpu]
                    raise RlixConfigError(f"{where} and dp rank {other[0]} local rank {other[1]} run on one GPU "
                                          f"({place.describe()}); one GPU serves one target rank per sync: {_FIX}")
                seen[place.gpu] = (t.dp_rank, local)
            if local in t.ipc_local_ranks:
                if not place.same_node(sender):
                    raise RlixConfigError(
                        f"{where} runs on {place.node()}, the sender on {sender.node()}: the plan sends it by "
                        f"{transport.name}, a same-GPU transport, which cannot cross nodes (refused, nothing was sent); "
                        f"{_FIX}")
                if transport.name == "cuda_ipc" and (place.gpu is None or sender.gpu is None):
                    raise RlixConfigError(f"{where}: cuda_ipc needs the sender and the target on one GPU; sender "
                                          f"{sender.describe()}, target {place.describe()}: {_FIX}")
                if place.gpu is not None and sender.gpu is not None and place.gpu != sender.gpu:
                    raise RlixConfigError(
                        f"{where} runs on {place.describe()}, not on the sender's GPU ({sender.describe()}), but the "
                        f"plan sends it by {transport.name}, the same-GPU transport: {_FIX}")
            else:
                if place.same_gpu(sender):
                    raise RlixConfigError(
                        f"{where} runs on the sender's own GPU ({place.describe()}) but the plan broadcasts to it "
                        f"(NCCL cannot hold two ranks of a group on one GPU): {_FIX}")
            planned = t.devices[local] if local < len(t.devices) else None
            if planned is not None and (planned.node == plan.sender.node) != place.same_node(sender):
                said = "the sender's node" if planned.node == plan.sender.node else "another node"
                really = "the sender's node" if place.same_node(sender) else "another node"
                raise RlixConfigError(
                    f"{where}: the plan puts it on node {planned.node} ({said}; the sender on node "
                    f"{plan.sender.node}), it runs on {place.node()} ({really}; the sender on {sender.node()}): {_FIX}")
