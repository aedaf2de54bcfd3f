"""Bucket format: named tensors packed into one contiguous uint8 buffer at 512-byte aligned offsets.

Layout of one bucket (``BucketMeta`` describes it, the buffer holds the bytes)::

    offset 0            offsets[1]          offsets[2]                    used_bytes   capacity
    | tensor 0 | pad    | tensor 1 | pad    | tensor 2 |  (no trailing pad) |  unused ... |

* every tensor starts at a multiple of ``ALIGN_BYTES`` (512) so any dtype can be viewed in place;
* ``used_bytes`` = end of the last tensor (no trailing padding); only ``buffer[:used_bytes]`` travels;
* the buffer may be larger than ``used_bytes`` (cache buffers are allocated once at the bucket size, or at a
  larger tensor's size).

Large-tensor policy: a tensor larger than the bucket size travels **alone, in a bucket of its own** sized to it
(its ``used_bytes`` exceeds the bucket size); it is never split and never refused. Splitting was rejected on
purpose: vLLM's ``load_weights`` needs whole tensors, so a receiver would have to re-assemble the pieces in a
buffer as large as the tensor anyway. So the GPU scratch of a sync is the largest bucket, i.e. at least the
largest tensor (``CacheSnapshot.capacity_bytes``); the receivers' memory guards name that tensor when it alone
does not fit.

Metadata is plain Python (str/int/lists): dtypes travel as strings such as ``"bfloat16"`` because
vLLM's msgpack transport rejects ``torch.dtype``. ``BucketMeta.to_wire()`` / ``from_wire()`` convert.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, final

import torch

from rlix_plugins.errors import RlixConfigError, TransportError
from rlix_plugins.transport._checksum import PackChecksums, bucket_checksums

#: Every tensor in a bucket starts at a multiple of this many bytes.
ALIGN_BYTES: Final = 512


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    """Smallest multiple of ``align`` that is >= ``nbytes``."""
    return (nbytes + align - 1) // align * align


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (plain string for msgpack)."""
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; a clear error for names this torch build does not know."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise TransportError(
            f"unknown dtype {name!r} in bucket metadata: this torch {torch.__version__} has no torch.{name}; "
            "sender and receiver must run torch versions that share the dtype"
        )
    return dtype


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor allocation (this runs per tensor on the unpack path)


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * element_size(dtype)


@final
@dataclass(frozen=True)
class BucketMeta:
    """Names, shapes, dtypes and aligned offsets of the tensors in one bucket. Plain types only."""

    #: parameter names in pack order (HF names when fed from NeMo RL's refit iterator)
    names: tuple[str, ...]
    #: one shape per name; ``()`` for 0-d tensors
    shapes: tuple[tuple[int, ...], ...]
    #: one dtype string per name (``dtype_to_str``), e.g. ``"bfloat16"``, ``"float8_e4m3fn"``, ``"bool"``
    dtypes: tuple[str, ...]
    #: byte offset of each tensor in the buffer; multiples of ``ALIGN_BYTES``
    offsets: tuple[int, ...]
    #: end of the last tensor (no trailing padding); the number of bytes a transport must move
    used_bytes: int
    #: position of the bucket in its cache version (0-based), for error messages
    index: int = 0

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.shapes) == len(self.dtypes) == len(self.offsets) == n):
            raise TransportError(
                f"bucket {self.index}: metadata lengths differ (names={n}, shapes={len(self.shapes)}, "
                f"dtypes={len(self.dtypes)}, offsets={len(self.offsets)})"
            )

    def nbytes(self, i: int) -> int:
        """Bytes of tensor ``i`` (without padding)."""
        return tensor_nbytes(self.shapes[i], str_to_dtype(self.dtypes[i]))

    def largest(self) -> tuple[str, int]:
        """``(name, bytes)`` of the bucket's largest tensor (``("", 0)`` for an empty bucket), for memory errors."""
        return max(((n, self.nbytes(i)) for i, n in enumerate(self.names)), key=lambda t: t[1], default=("", 0))

    def to_wire(self) -> dict[str, Any]:
        """Plain dict (lists, str, int) that msgpack, pickle and JSON all accept."""
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "offsets": list(self.offsets),
            "used_bytes": int(self.used_bytes),
            "index": int(self.index),
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | BucketMeta) -> BucketMeta:
        """Inverse of ``to_wire``; accepts a ``BucketMeta`` unchanged."""
        if isinstance(wire, BucketMeta):
            return wire
        try:
            return cls(
                names=tuple(str(n) for n in wire["names"]),
                shapes=tuple(tuple(int(d) for d in s) for s in wire["shapes"]),
                dtypes=tuple(str(d) for d in wire["dtypes"]),
                offsets=tuple(int(o) for o in wire["offsets"]),
                used_bytes=int(wire["used_bytes"]),
                index=int(wire.get("index", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed bucket metadata {sorted(wire)!r}: {exc}") from exc


@final
@dataclass(frozen=True)
class BucketRecord:
    """One bucket: metadata plus the uint8 buffer that holds ``meta.used_bytes`` meaningful bytes.

    Ownership: the buffer belongs to whoever packed it (the cache, for cache buckets); views from
    ``unpack_bucket`` alias it and are valid only while the owner does not rewrite it.
    """

    meta: BucketMeta
    #: 1-D uint8 tensor, ``numel() >= meta.used_bytes``
    buffer: torch.Tensor
    #: how another process on this machine opens ``buffer`` (``host_pull``); None when not shared
    host: dict[str, Any] | None = None
    #: ``iter_buckets(checksum_cpu=True)``: the ``(n, 3)`` partial checksums (read with ``finish_checksums``) of the
    #: packed bytes, valid for the tensors that came from CPU memory; None when not asked for or none came from there
    sums: torch.Tensor | None = None

    @property
    def payload(self) -> torch.Tensor:
        """``buffer[:used_bytes]``: exactly the bytes a transport must move."""
        return self.buffer[: self.meta.used_bytes]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor's data (a contiguous copy first if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def unpack_bucket(meta: BucketMeta | dict[str, Any], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views ``(name, tensor)`` into ``buffer`` (on whatever device ``buffer`` lives).

    The views alias ``buffer``: callers that keep a tensor beyond the buffer's lifetime must clone it.
    """
    meta = BucketMeta.from_wire(meta)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TransportError(f"bucket {meta.index}: buffer must be a 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    if buffer.numel() < meta.used_bytes:
        raise TransportError(
            f"bucket {meta.index}: buffer holds {buffer.numel()} bytes but the metadata says used_bytes={meta.used_bytes}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    for i, name in enumerate(meta.names):
        dtype = str_to_dtype(meta.dtypes[i])
        nbytes = tensor_nbytes(meta.shapes[i], dtype)
        start = meta.offsets[i]
        if start % ALIGN_BYTES or start + nbytes > meta.used_bytes:
            raise TransportError(
                f"bucket {meta.index}: tensor {name!r} at offset {start} (+{nbytes} bytes) is misaligned "
                f"or past used_bytes={meta.used_bytes}"
            )
        out.append((name, buffer[start : start + nbytes].view(dtype).view(meta.shapes[i])))
    return out


def plan_layout(items: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
    """Aligned offsets and ``used_bytes`` for packing ``items`` into one bucket, in order."""
    offsets: list[int] = []
    end = 0
    for _, tensor in items:
        start = align_up(end)
        offsets.append(start)
        end = start + tensor.numel() * tensor.element_size()
    return offsets, end


def _fill(index: int, items: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, checksum_cpu: bool = False) -> BucketRecord:
    offsets, used = plan_layout(items)
    if buffer.numel() < used:
        raise TransportError(f"bucket {index}: the buffer of {buffer.numel()} bytes cannot hold its {used} bytes "
                             "(buffer_for(index, nbytes) must return at least nbytes)")
    needs_sync = False
    # checksums of CPU sources while packing (one read of the bytes); a buffer that ends inside the last row is
    # checksummed after packing instead
    sums = PackChecksums(buffer) if checksum_cpu and buffer.device.type == "cpu" else None
    if sums is not None and not sums.fits(offsets[-1], used - offsets[-1]):
        sums = None
    fused = 0
    ends = [*offsets[1:], min(align_up(used), buffer.numel())][: len(items)]
    for (_, tensor), start, next_start in zip(items, offsets, ends, strict=True):
        src = _as_bytes(tensor)
        if sums is not None and src.device.type == "cpu":
            sums.copy(start, src)  # writes the zero padding up to next_start too (rows end where tensors start)
            fused += 1
            continue
        if sums is not None:
            sums.skip()
        if src.numel():
            non_blocking = src.device.type == "cuda" and buffer.is_pinned()
            buffer[start : start + src.numel()].copy_(src, non_blocking=non_blocking)
            needs_sync = needs_sync or non_blocking
        if start + src.numel() < next_start:  # zero padding: bucket checksums read whole 512-byte rows
            buffer[start + src.numel() : next_start].zero_()
    if needs_sync:
        torch.cuda.synchronize()  # one sync per bucket: the non_blocking D2H copies must land first
    meta = BucketMeta(
        names=tuple(n for n, _ in items),
        shapes=tuple(tuple(int(d) for d in t.shape) for _, t in items),
        dtypes=tuple(dtype_to_str(t.dtype) for _, t in items),
        offsets=tuple(offsets),
        used_bytes=used,
        index=index,
    )
    if sums is not None and fused:
        return BucketRecord(meta=meta, buffer=buffer, sums=sums.finish())
    if checksum_cpu and any(t.device.type == "cpu" for _, t in items):
        nbytes = [t.numel() * t.element_size() for _, t in items]
        return BucketRecord(meta=meta, buffer=buffer, sums=bucket_checksums(buffer, offsets, nbytes))
    return BucketRecord(meta=meta, buffer=buffer)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_size_bytes: int,
    buffer_for: Callable[[int, int], torch.Tensor] | None = None,
    on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    checksum_cpu: bool = False,
) -> Iterator[BucketRecord]:
    """Greedy packing in iteration order: a bucket closes when the next tensor would not fit.

    A tensor larger than ``bucket_size_bytes`` closes the pending bucket and goes alone into a bucket of its
    own, sized to it (tensors are never split: vLLM's ``load_weights`` needs whole tensors).

    ``buffer_for(i, nbytes)`` returns the uint8 buffer for bucket ``i``, at least ``nbytes`` long (the
    bucket's ``used_bytes``: at most ``bucket_size_bytes`` except for a lone larger tensor); by default a
    fresh CPU buffer of exactly the packed size. ``on_tensor(name, tensor)`` sees every tensor once before
    it is copied (checksums are computed there, on the tensor's own device).
    ``checksum_cpu``: each record's ``sums`` holds the checksums of its CPU-sourced tensors, taken from the
    copy that packs them (``PackChecksums``).

    Lockstep: the source iterator is consumed strictly in order and only once. Buffer reuse: a
    buffer handed out by ``buffer_for(i, nbytes)`` is written while bucket ``i`` is packed; the caller must
    not hand out a buffer whose previous content is still being read.
    """
    if bucket_size_bytes <= 0:
        raise RlixConfigError(f"bucket_size_bytes must be > 0, got {bucket_size_bytes}; set rlix.bucket_size_bytes")
    pending: list[tuple[str, torch.Tensor]] = []
    end = 0
    index = 0

    def close() -> BucketRecord:
        nonlocal pending, end, index
        _, used = plan_layout(pending)
        buffer = buffer_for(index, used) if buffer_for else torch.empty(used, dtype=torch.uint8)
        record = _fill(index, pending, buffer, checksum_cpu)
        pending, end, index = [], 0, index + 1
        return record

    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TransportError(f"parameter {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if on_tensor is not None:
            on_tensor(name, tensor)
        start = align_up(end)
        if pending and start + nbytes > bucket_size_bytes:
            yield close()
            start = 0
        pending.append((name, tensor))
        end = start + nbytes
        if nbytes > bucket_size_bytes:  # alone in a bucket sized to it: emit it now, nothing can join it
            yield close()
    if pending:
        yield close()


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> BucketRecord:
    """Pack all tensors into one freshly allocated CPU bucket of exactly the needed size."""
    items = list(named_tensors)
    _, used = plan_layout(items)
    return _fill(0, items, torch.empty(used, dtype=torch.uint8))
