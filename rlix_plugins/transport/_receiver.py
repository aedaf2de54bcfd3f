"""Receiver-side dispatch for ``update_parameter_in_bucket`` payloads (cpu_serialize or cuda_ipc)."""

from __future__ import annotations

from typing import Any

import torch

from rlix_plugins.errors import TransportError
from rlix_plugins.transport._cpu_serialize import TRANSPORT as CPU_SERIALIZE
from rlix_plugins.transport._cpu_serialize import receive_cpu_serialize
from rlix_plugins.transport._cuda_ipc import TRANSPORT as CUDA_IPC
from rlix_plugins.transport._cuda_ipc import open_cuda_ipc
from rlix_plugins.transport._memory import DEFAULT_SCRATCH_BYTES


def receive_bucket(
    payload: dict[str, Any],
    device: torch.device | str = "cpu",
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` from an ``update_parameter_in_bucket`` payload.

    * ``cpu_serialize``: tensors on ``device`` (one fresh buffer, owned by the caller);
    * ``cuda_ipc``: zero-copy views into the sender's staging buffer on the shared GPU (``device``
      is ignored: the GPU is found by UUID). Load them, synchronise your stream and drop them
      before returning from the RPC.
    """
    transport = payload.get("transport")
    if transport == CPU_SERIALIZE:
        return receive_cpu_serialize(payload, device, scratch_bytes=scratch_bytes)
    if transport == CUDA_IPC:
        return open_cuda_ipc(payload)
    raise TransportError(f"unknown payload transport {transport!r}; expected {CPU_SERIALIZE!r} or {CUDA_IPC!r}")
