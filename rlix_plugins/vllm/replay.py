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

A recorded layout whose copies each move one contiguous byte range of the bucket into a contiguous parameter slice,
tiling every tensor of the bucket, is also a :class:`DirectCopies`: later syncs copy those ranges from the sender's
pinned host pages straight into the parameters (no receive buffer, no device-to-device pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["BucketReplay", "CopyRecorder", "DirectCopies", "parameter_storages"]


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
        elif name.endswith("_") and not name.startswith("__") and self.foreign is None and not _empty(args):
            self.foreign = f"in-place {name}"  # (one on an empty view writes nothing: vLLM's embedding loader
            # zero-fills the vocabulary padding, an empty slice when there is none)
        return func(*args, **(kwargs or {}))


def _empty(args: Any) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].numel() == 0


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


@dataclass
class DirectCopies:
    """One bucket layout loaded straight from host pages: ``copies`` are ``(parameter bytes, lo, hi)`` with ``[lo, hi)``
    a byte range of the bucket; ``pieces[k]`` are the parameter bytes that hold bucket tensor ``k``, in order (their
    concatenation is the tensor's bytes: what the receiver checksums to verify the sync)."""

    copies: list[tuple[torch.Tensor, int, int]]
    pieces: list[list[torch.Tensor]]
    storages: set[int]
    #: ``copies``' destinations as the widest integer words every range allows, and that word's size (built once)
    _words: tuple[list[torch.Tensor], int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_replay(cls, replay: BucketReplay, offsets: Sequence[int], nbytes: Sequence[int]) -> DirectCopies | str:
        """The direct form of ``replay`` for a bucket with tensors at ``offsets`` of ``nbytes``; a reason when the
        recorded copies are not plain contiguous ranges that tile every tensor exactly once."""
        copies: list[tuple[torch.Tensor, int, int]] = []
        for c in (c for group in replay.groups for c in group):
            if not c.dst.is_contiguous() or c.stride != _contiguous_strides(c.shape):
                return f"a strided copy into {tuple(c.dst.shape)}"
            size = c.dst.numel() * c.dtype.itemsize
            copies.append((c.dst.reshape(-1).view(torch.uint8), c.offset, c.offset + size))
        copies.sort(key=lambda c: c[1])
        pieces: list[list[torch.Tensor]] = []
        i = 0
        for k, (start, size) in enumerate(zip(offsets, nbytes, strict=True)):
            at, mine = start, []
            while i < len(copies) and copies[i][1] < start + size:
                dst, lo, hi = copies[i]
                if lo != at or hi > start + size:
                    return f"tensor {k}'s bytes are not copied exactly once, in order"
                mine.append(dst)
                at, i = hi, i + 1
            if at != start + size:
                return f"tensor {k} is not copied whole (the loader skips or splits it)"
            pieces.append(mine)
        if i != len(copies):
            return "a copy from outside the bucket's tensors"
        return cls(copies, pieces, set(replay.storages))

    def valid(self, params: set[int]) -> bool:
        return self.storages <= params

    def word_copies(self, source: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(destinations, sources)`` for one ``torch._foreach_copy_`` from ``source`` (the bucket's bytes, e.g. a
        :func:`~rlix_plugins.transport.device_view` of its pages) into the parameters, both as the widest integer
        words all ranges and addresses allow: a copy kernel then moves whole words per load."""
        if self._words is None:
            ranges = [(dst.data_ptr(), lo, hi) for dst, lo, hi in self.copies]
            size = next(w for w in (8, 4, 2, 1) if all(p % w == 0 and lo % w == 0 and hi % w == 0 for p, lo, hi in ranges))
            self._words = ([dst.view(_WORDS[size]) for dst, _, _ in self.copies], size)
        dsts, size = self._words
        if source.data_ptr() % size:
            size, dsts = 1, [dst for dst, _, _ in self.copies]
        src = source.view(_WORDS[size])
        return dsts, [src[lo // size : hi // size] for _, lo, hi in self.copies]


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _view(buffer: torch.Tensor, c: _Copy) -> torch.Tensor:
    itemsize = c.dtype.itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(c.shape, c.stride, strict=True)) if all(c.shape) else 0
    flat = buffer[c.offset : c.offset + span * itemsize].view(c.dtype)
    return flat.as_strided(c.shape, c.stride)
