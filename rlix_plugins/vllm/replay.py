"""Load a received bucket without the model's Python loader: its copies, recorded once, replayed as one call.

vLLM's ``load_weights`` walks every tensor in Python (name mapping, stacked-parameter lookup, ``narrow`` and
``copy_``): ~0.1 ms per tensor, 30-45 ms for a 1.5B model on the H100 - longer than the host->device copy of
its 2.9 GiB. The bucket layout is the same every sync and the parameters keep their addresses (sleep and wake
re-map the same virtual addresses), so the first load of a layout runs the real loader under a recorder that
notes every ``copy_`` from the receive buffer into a parameter; later syncs replay those copies with one
``torch._foreach_copy_`` per group.

A layout is replayed only if its recorded load did nothing else: every in-place op was a ``copy_`` from the
receive buffer into parameter storage (a loader that transforms the bytes - FP8 quantization, vocabulary
padding, a transpose - is left alone and runs every time). Before each replay the parameters' storages are
checked against the recorded ones; a change (a loader that re-allocated a parameter) drops the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["BucketReplay", "CopyRecorder", "parameter_storages"]


def parameter_storages(model: Any) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


@dataclass
class _Copy:
    dst: torch.Tensor
    offset: int  # bytes from the start of the receive buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class CopyRecorder(TorchFunctionMode):
    """Notes the ``copy_`` calls of one load whose source lies in ``buffer``; anything else in place is foreign."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.base = buffer.data_ptr()
        self.end = self.base + buffer.numel()
        self.copies: list[_Copy] = []
        self.foreign: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if self.base <= src.data_ptr() < self.end and src.dtype == dst.dtype and src.shape == dst.shape:
                self.copies.append(_Copy(dst, src.data_ptr() - self.base, tuple(src.shape), tuple(src.stride()),
                                         src.dtype))
            elif self.foreign is None:
                self.foreign = f"copy_ from outside the received bucket into {tuple(dst.shape)}"
        elif name.endswith("_") and not name.startswith("__") and self.foreign is None:
            self.foreign = f"in-place {name}"
        return func(*args, **(kwargs or {}))


@dataclass
class BucketReplay:
    """The recorded copies of one bucket layout, per load group."""

    groups: list[list[_Copy]] = field(default_factory=list)
    storages: set[int] = field(default_factory=set)

    @classmethod
    def from_recording(cls, per_group: list[CopyRecorder], params: set[int]) -> BucketReplay | None:
        """None when a group's load did anything but copy received bytes into parameters."""
        if any(r.foreign for r in per_group):
            return None
        storages = {c.dst.untyped_storage().data_ptr() for r in per_group for c in r.copies}
        if not storages <= params:
            return None  # a copy into something that is not a parameter: not ours to repeat
        return cls([list(r.copies) for r in per_group], storages)

    def valid(self, params: set[int]) -> bool:
        return self.storages <= params

    def apply(self, group: int, buffer: torch.Tensor) -> int:
        """Repeat group ``group``'s copies from ``buffer`` (the receive buffer now holding this layout)."""
        copies = self.groups[group]
        if not copies:
            return 0
        srcs = [_view(buffer, c) for c in copies]
        torch._foreach_copy_([c.dst for c in copies], srcs)
        return len(copies)


def _view(buffer: torch.Tensor, c: _Copy) -> torch.Tensor:
    itemsize = c.dtype.itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(c.shape, c.stride, strict=True)) if all(c.shape) else 0
    flat = buffer[c.offset : c.offset + span * itemsize].view(c.dtype)
    return flat.as_strided(c.shape, c.stride)
