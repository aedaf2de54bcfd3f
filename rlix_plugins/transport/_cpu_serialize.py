"""``cpu_serialize`` transport: bucket bytes travel inside the RPC payload; no CUDA IPC, no process group.

Works in locked-down containers (no ``--ipc=host``, no ``CAP_SYS_PTRACE``) and on CPU-only machines.
Payload (plain dict, msgpack/pickle-safe)::

    {"transport": "cpu_serialize", "meta": BucketMeta.to_wire(), "data": bytes}   # len(data) == used_bytes

Ownership: ``data`` is a copy of the sender's pinned bucket; the sender may rewrite the bucket as
soon as the payload is built. Receiver tensors are views of one fresh buffer per call.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlix_plugins.errors import TransportError
from rlix_plugins.transport._bucket import BucketMeta, BucketRecord, unpack_bucket
from rlix_plugins.transport._memory import DEFAULT_SCRATCH_BYTES, check_device_capacity
from rlix_plugins.transport._same_gpu import BucketTransport

TRANSPORT = "cpu_serialize"


def make_cpu_serialize_payload(record: BucketRecord) -> dict[str, Any]:
    """Sender side: copy ``record.payload`` (CPU) into a bytes payload."""
    if record.buffer.device.type != "cpu":
        raise TransportError(f"cpu_serialize needs a CPU bucket, bucket {record.meta.index} is on {record.buffer.device}")
    return {"transport": TRANSPORT, "meta": record.meta.to_wire(), "data": record.payload.numpy().tobytes()}


def receive_cpu_serialize(
    payload: dict[str, Any],
    device: torch.device | str = "cpu",
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: ``(name, tensor)`` on ``device`` from a cpu_serialize payload.

    The tensors are views of one buffer owned by the caller (freed when the last view goes).
    Raises ``TransportError`` for a wrong transport tag, a truncated payload, or a bucket that does
    not fit the free memory of ``device`` (checked before allocating).
    """
    if payload.get("transport") != TRANSPORT:
        raise TransportError(f"expected a {TRANSPORT!r} payload, got transport={payload.get('transport')!r}")
    meta = BucketMeta.from_wire(payload["meta"])
    data = payload["data"]
    if len(data) != meta.used_bytes:
        raise TransportError(f"bucket {meta.index}: payload has {len(data)} bytes, metadata says {meta.used_bytes}")
    dev = torch.device(device)
    if meta.used_bytes == 0:
        return unpack_bucket(meta, torch.empty(0, dtype=torch.uint8, device=dev))
    with warnings.catch_warnings():
        # bytes are read-only; we only read them (the copy below), never write through this view
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(data, dtype=torch.uint8)
    if dev.type == "cpu":
        buffer = src.clone()
    else:
        check_device_capacity(meta.used_bytes, dev, scratch_bytes=scratch_bytes, what=f"bucket {meta.index}",
                              largest=meta.largest())
        buffer = src.to(dev)
    return unpack_bucket(meta, buffer)


class CpuSerialize(BucketTransport):
    """The bucket's bytes in the RPC (sent from the pinned bucket, never from a GPU copy)."""

    name = TRANSPORT

    def payload(self, record: BucketRecord, data: torch.Tensor) -> dict[str, Any]:
        return make_cpu_serialize_payload(record)

    def receive(self, payload: dict[str, Any], device: torch.device | str, *, scratch_bytes: int) -> list[tuple[str, torch.Tensor]]:
        return receive_cpu_serialize(payload, device, scratch_bytes=scratch_bytes)
