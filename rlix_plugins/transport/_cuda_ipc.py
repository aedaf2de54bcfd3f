"""``cuda_ipc`` transport: a zero-copy handle to the sender's GPU staging buffer, same physical GPU only.

Payload (plain dict; the handle is pickled into bytes so msgpack never sees torch objects)::

    {"transport": "cuda_ipc", "meta": BucketMeta.to_wire(), "handle": bytes, "device_uuid": str}

Lockstep and lifetime:
* the sender stages the bucket on its GPU, synchronises, then builds the payload;
* the receiver opens the handle (``open_cuda_ipc``), loads from the views, synchronises its stream
  (``torch.cuda.current_stream(dev).synchronize()``) and drops the views **before its RPC returns**;
* only after every receiver returned (the per-bucket barrier) may the sender rewrite the staging
  buffer. After the sync the sender frees it and calls ``torch.cuda.ipc_collect()``.

The device is matched by UUID, not index: the receiver's ``CUDA_VISIBLE_DEVICES`` may number the
same GPU differently. ``handle`` is a pickle: accept payloads only from the cluster's own sender.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import torch

from rlix_plugins import envs
from rlix_plugins.errors import TransportError
from rlix_plugins.transport._bucket import BucketMeta, BucketRecord, unpack_bucket
from rlix_plugins.transport._same_gpu import BucketTransport

TRANSPORT = "cuda_ipc"
#: position of ``storage_device`` in ``rebuild_cuda_tensor``'s arguments when introspection fails
_DEVICE_ARG = 6


def _device_arg_index(rebuild: Any) -> int:
    try:
        return list(inspect.signature(rebuild).parameters).index("storage_device")
    except (ValueError, TypeError):
        return _DEVICE_ARG


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index_for_uuid(uuid: str) -> int:
    """The index under which this process sees the GPU with ``uuid``."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise TransportError(
        f"cuda_ipc: GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES="
        f"{envs.cuda_visible_devices()!r}); cuda_ipc works only for a receiver on the "
        "sender's physical GPU: fix the comm plan's device mapping or use same_gpu_transport='cpu_serialize'"
    )


def make_cuda_ipc_payload(meta: BucketMeta, staging: torch.Tensor) -> dict[str, Any]:
    """Sender side: a handle to ``staging`` (1-D uint8 CUDA tensor holding ``meta.used_bytes`` bytes).

    The caller keeps ``staging`` alive and unmodified until every receiver returned.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if staging.device.type != "cuda" or staging.dtype != torch.uint8:
        raise TransportError(f"cuda_ipc needs a uint8 CUDA staging buffer, got {staging.dtype} on {staging.device}")
    _, args = reduce_tensor(staging)
    return {
        "transport": TRANSPORT,
        "meta": meta.to_wire(),
        "handle": pickle.dumps(args),
        "device_uuid": device_uuid(staging.device.index or 0),
    }


def open_cuda_ipc(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Receiver side: zero-copy ``(name, view)`` into the sender's staging buffer.

    Views are valid only until the receiver's RPC returns (see the module docstring). Clone
    anything that must outlive it.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if payload.get("transport") != TRANSPORT:
        raise TransportError(f"expected a {TRANSPORT!r} payload, got transport={payload.get('transport')!r}")
    meta = BucketMeta.from_wire(payload["meta"])
    args = list(pickle.loads(payload["handle"]))
    args[_device_arg_index(rebuild_cuda_tensor)] = local_index_for_uuid(str(payload["device_uuid"]))
    buffer = rebuild_cuda_tensor(*args)
    return unpack_bucket(meta, buffer.view(-1)[: meta.used_bytes])


class CudaIpc(BucketTransport):
    """A handle to the sender's GPU staging copy; receivers get zero-copy views (``device`` is found by UUID)."""

    name = TRANSPORT
    reads_staging = True

    def payload(self, record: BucketRecord, data: torch.Tensor) -> dict[str, Any]:
        return make_cuda_ipc_payload(record.meta, data)

    def receive(self, payload: dict[str, Any], device: torch.device | str, *, scratch_bytes: int) -> list[tuple[str, torch.Tensor]]:
        return open_cuda_ipc(payload)

    def release(self, device: torch.device) -> None:
        torch.cuda.ipc_collect()  # release staging blocks kept alive for IPC consumers
