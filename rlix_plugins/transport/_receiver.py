"""Receiver-side dispatch for ``update_parameter_in_bucket`` payloads of a per-bucket transport."""

from __future__ import annotations

from typing import Any

import torch

from rlix_plugins.errors import TransportError
from rlix_plugins.transport._memory import DEFAULT_SCRATCH_BYTES
from rlix_plugins.transport._registry import registered_transports
from rlix_plugins.transport._same_gpu import BucketTransport


def receive_bucket(
    payload: dict[str, Any],
    device: torch.device | str = "cpu",
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` from an ``update_parameter_in_bucket`` payload, by its ``"transport"`` tag.

    * ``cpu_serialize``: tensors on ``device`` (one fresh buffer, owned by the caller);
    * ``cuda_ipc``: zero-copy views into the sender's staging buffer on the shared GPU (``device``
      is ignored: the GPU is found by UUID). Load them, synchronise your stream and drop them
      before returning from the RPC.
    """
    per_bucket = {n: t for n, t in registered_transports().items() if isinstance(t, BucketTransport)}
    found = per_bucket.get(str(payload.get("transport")))
    if found is None:
        raise TransportError(f"unknown payload transport {payload.get('transport')!r}; expected one of {tuple(per_bucket)}")
    return found.receive(payload, device, scratch_bytes=scratch_bytes)
