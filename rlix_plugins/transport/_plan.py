"""Comm plan: which target device gets a bucket by same-GPU handoff and which by broadcast.

Rule (from configuration; ``check_comm_plan`` in ``_place`` holds it against where the workers really run before
every sync): a target device whose ``(node, gpu)`` equals the sender's goes by the plan's same-GPU transport (a
registered name, see ``_registry``: ``host_pull``, the receiver copies from the sender's pinned cache pages;
``cuda_ipc``, a handle to the sender's GPU staging copy; ``cpu_serialize``, the bytes in the RPC); every other device joins the
per-sync broadcast group. NCCL cannot put two ranks on one GPU, so same-GPU targets must never be
broadcast targets.

Group ranks are deterministic: the sender is rank 0, broadcast devices follow in ascending
``(dp_rank, local_rank)`` order. ``local_rank`` is the index of the device in the dp rank's device
list (the vLLM TP rank of the worker on it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, final

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.transport._registry import same_gpu_transport as registered_transport


@final
@dataclass(frozen=True, order=True)
class DeviceRef:
    """One physical GPU: node rank in the cluster and GPU index on that node."""

    node: int
    gpu: int


@final
@dataclass(frozen=True)
class TargetPlan:
    """What one DP rank (one vLLM engine; its workers are ``local_rank`` 0..tp-1) receives, and how."""

    dp_rank: int
    #: local ranks on the sender's GPU: they get ``update_parameter_in_bucket`` payloads
    ipc_local_ranks: tuple[int, ...]
    #: local rank -> rank in the broadcast group, for local ranks on other GPUs
    broadcast_ranks: tuple[tuple[int, int], ...]
    #: the ``(node, gpu)`` the plan was built with, per local rank (checked against where the workers run)
    devices: tuple[DeviceRef, ...] = ()

    @property
    def broadcast_local_ranks(self) -> tuple[int, ...]:
        return tuple(local for local, _ in self.broadcast_ranks)

    def broadcast_rank_map(self) -> dict[int, int]:
        """``{local_rank: group_rank}`` (plain ints; what ``setup_collective_group`` receives)."""
        return dict(self.broadcast_ranks)


@final
@dataclass(frozen=True)
class CommPlan:
    """The whole plan for one sync from one sender."""

    sender: DeviceRef
    #: how same-GPU targets are served: a registered transport name
    same_gpu_transport: str
    #: one entry per target dp rank, ascending dp_rank
    targets: tuple[TargetPlan, ...]

    @property
    def broadcast_world_size(self) -> int:
        """1 (the sender) + number of broadcast devices; 1 means no group is needed."""
        return 1 + sum(len(t.broadcast_ranks) for t in self.targets)

    @property
    def needs_group(self) -> bool:
        return self.broadcast_world_size > 1

    def target(self, dp_rank: int) -> TargetPlan:
        for t in self.targets:
            if t.dp_rank == dp_rank:
                return t
        raise RlixConfigError(f"dp rank {dp_rank} is not a target of this plan; targets: {[t.dp_rank for t in self.targets]}")

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for logs and RPCs."""
        return {
            "sender": [self.sender.node, self.sender.gpu],
            "same_gpu_transport": self.same_gpu_transport,
            "targets": [
                {
                    "dp_rank": t.dp_rank,
                    "ipc_local_ranks": list(t.ipc_local_ranks),
                    "broadcast_ranks": {int(k): int(v) for k, v in t.broadcast_ranks},
                }
                for t in self.targets
            ],
        }


def _device(value: DeviceRef | Sequence[int], what: str) -> DeviceRef:
    if isinstance(value, DeviceRef):
        return value
    try:
        node, gpu = value
        return DeviceRef(int(node), int(gpu))
    except (TypeError, ValueError) as exc:
        raise RlixConfigError(f"{what} must be a (node, gpu) pair, got {value!r}") from exc


def build_comm_plan(
    sender: DeviceRef | Sequence[int],
    targets: Mapping[int, Sequence[DeviceRef | Sequence[int]]],
    same_gpu_transport: str = "host_pull",
) -> CommPlan:
    """Classify every target device of every dp rank; deterministic for equal inputs.

    :param sender: the GPU that holds the staging buffer (the cache owner's GPU).
    :param targets: dp rank -> devices of that rank, in local-rank (TP) order.
    :param same_gpu_transport: a registered transport: ``host_pull`` (receiver copies from the shared pinned
        cache, one RPC per sync), ``cuda_ipc`` (zero-copy handle to the sender's GPU staging) or
        ``cpu_serialize`` (bytes in the RPC).
    """
    registered_transport(same_gpu_transport)  # an unknown name fails here, listing the registered ones
    src = _device(sender, "sender")
    seen: dict[DeviceRef, int] = {}
    classified: list[tuple[int, list[DeviceRef], list[int], list[int]]] = []
    for dp_rank in sorted(targets):
        devices = [_device(d, f"device of dp rank {dp_rank}") for d in targets[dp_rank]]
        if not devices:
            raise RlixConfigError(f"dp rank {dp_rank} has no devices; every target dp rank needs >= 1 (node, gpu)")
        ipc: list[int] = []
        bcast: list[int] = []
        for local, dev in enumerate(devices):
            if dev in seen:
                raise RlixConfigError(
                    f"device {dev} is listed for dp rank {dp_rank} and dp rank {seen[dev]}: one GPU serves one target rank per sync"
                )
            seen[dev] = dp_rank
            (ipc if dev == src else bcast).append(local)
        classified.append((dp_rank, devices, ipc, bcast))
    plans: list[TargetPlan] = []
    next_rank = 1
    for dp_rank, devices, ipc, bcast in classified:
        ranks = []
        for local in bcast:
            ranks.append((local, next_rank))
            next_rank += 1
        plans.append(TargetPlan(dp_rank=dp_rank, ipc_local_ranks=tuple(ipc), broadcast_ranks=tuple(ranks),
                                devices=tuple(devices)))
    return CommPlan(sender=src, same_gpu_transport=same_gpu_transport, targets=tuple(plans))
