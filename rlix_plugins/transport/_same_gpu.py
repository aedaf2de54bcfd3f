"""The interface of a same-GPU transport: how the sender hands a sync's buckets to a receiver on its own GPU.

The comm plan names one transport for every target device equal to the sender's (``_registry`` looks it up);
other devices join the per-sync broadcast group (``_broadcast``), which is a collective per bucket, not one
of these. Payloads are plain dicts tagged ``{"transport": name, ...}`` (msgpack-safe); receivers dispatch on
the tag. Two shapes: a :class:`BucketTransport` sends one payload per bucket, a :class:`SyncTransport` one
payload with every bucket of the sync.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from rlix_plugins.transport._bucket import BucketRecord


class SameGpuTransport(ABC):
    """One registered transport (stateless; one instance serves every sync)."""

    #: the name in the comm plan and the ``"transport"`` tag of every payload
    name: ClassVar[str]
    #: payloads point into the sender's GPU staging copy of the bucket: needs a CUDA staging device
    reads_staging: ClassVar[bool] = False

    def release(self, device: torch.device) -> None:  # noqa: B027 - a hook most transports leave empty
        """Sender side, after a sync dropped its staging buffers on ``device``."""


class BucketTransport(SameGpuTransport):
    """One payload per bucket, started next to the bucket's broadcast; the receiver loads it before its RPC
    returns, and that return is the bucket's barrier (the sender reuses its staging buffer after it)."""

    @abstractmethod
    def payload(self, record: BucketRecord, data: torch.Tensor) -> dict[str, Any]:
        """Sender side: the payload of bucket ``record``; ``data`` holds its ``used_bytes`` (the GPU staging copy
        on a CUDA sender, else the pinned bucket itself)."""

    @abstractmethod
    def receive(self, payload: dict[str, Any], device: torch.device | str, *, scratch_bytes: int) -> list[tuple[str, torch.Tensor]]:
        """Receiver side: ``(name, tensor)`` of the bucket (see the transport's module for who owns the memory)."""


class SyncTransport(SameGpuTransport):
    """One payload with every bucket of the sync, started once per target before the first bucket and awaited
    after the last; the receiver pipelines its own copies (no per-bucket barrier)."""

    @abstractmethod
    def payload(self, records: Sequence[BucketRecord], *, deferred: bool = False,
                overlaps_wake: bool = False) -> dict[str, Any]:
        """Sender side: the payload naming every bucket of the sync. ``deferred``: receivers may return once their
        reads are queued; the sender then waits on their ``finish`` call (``sync_weights(finish=True)``).
        ``overlaps_wake``: the receivers' engines wake memory while they read (``sync_weights(after_issue=...)``)."""
