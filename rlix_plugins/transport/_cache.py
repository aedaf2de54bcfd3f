"""Versioned CPU bucket cache: one model copy in (pinned) host memory, allocated once, reused per version.

Ownership and lockstep:
* ``build(version, named_tensors)`` is called on EVERY training rank with the same iterator
  (collectives inside it must keep moving); only the owner rank (``is_owner=True``: pp0/dp0/tp0/cp0)
  copies tensors into buckets, the others just drain the iterator.
* Buffers (pinned when CUDA is available) are allocated the first time a bucket index is needed and reused
  by every later version: pinning costs ~0.8 s/GiB, ~10x the copy. A buffer holds ``bucket_size_bytes``, or
  more for a tensor larger than that (it travels alone in a bucket sized to it, ``iter_buckets``); a later
  version whose bucket at an index needs more than its buffer holds replaces that buffer (it never shrinks).

Build vs. readers (one copy, never torn): there is exactly one lock. ``read()`` holds it from
"read the cache" through the last receiver barrier and the group teardown of a sync; ``build()``
holds it for the whole rebuild. So a build waits for a running sync and a sync waits for a running
build; no reader ever sees half-written buckets. The version is published only after a complete
build; while a build runs (and after a failed one) no version is published and ``read()`` refuses.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import final

import torch

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError
from rlix_plugins.transport._bucket import BucketRecord, align_up, iter_buckets
from rlix_plugins.transport._checksum import finish_checksums, start_checksums
from rlix_plugins.transport._host_pull import SharedHostBuffer
from rlix_plugins.transport._memory import HOST_FRACTION, check_host_capacity


@final
@dataclass(frozen=True)
class CacheSnapshot:
    """What a sync reads under the cache lock. Valid only inside ``VersionedBucketCache.read()``."""

    version: int
    buckets: tuple[BucketRecord, ...]
    #: sender-side checksums of this version, ``{name: [nbytes, word_sum, weighted_sum]}``
    checksums: dict[str, list[int]]

    @property
    def used_bytes(self) -> int:
        return sum(b.meta.used_bytes for b in self.buckets)

    @property
    def capacity_bytes(self) -> int:
        """Largest bucket's used bytes: the staging size a transport needs (above ``bucket_size_bytes`` when a
        tensor is larger than it)."""
        return max((b.meta.used_bytes for b in self.buckets), default=0)

    @property
    def largest_tensor(self) -> tuple[str, int]:
        """``(name, bytes)`` of the largest tensor of this version, for memory errors (``check_device_capacity``)."""
        return max((b.meta.largest() for b in self.buckets), key=lambda t: t[1], default=("", 0))


@final
class VersionedBucketCache:
    """See the module docstring. Thread-safe; one instance per training process."""

    def __init__(
        self,
        bucket_size_bytes: int,
        *,
        is_owner: bool = True,
        pin_memory: bool | None = None,
        shared: bool | None = None,
        host_fraction: float = HOST_FRACTION,
    ) -> None:
        """
        :param bucket_size_bytes: explicit bucket size (no default on purpose: it bounds receiver GPU
            scratch, together with the largest tensor). Every buffer holds at least this; a tensor larger
            than it gets a buffer of its own size.
        :param is_owner: whether this rank keeps buckets.
        :param pin_memory: pin the buffers; default: when CUDA is available.
        :param shared: allocate the buffers in shared memory that receivers on this machine can map
            (the ``host_pull`` transport); default: where ``memfd_create`` exists (Linux).
        :param host_fraction: new buffers may take at most this fraction of ``MemAvailable``.
        """
        if not isinstance(bucket_size_bytes, int) or bucket_size_bytes <= 0:
            raise RlixConfigError(
                f"bucket_size_bytes must be a positive int, got {bucket_size_bytes!r}; set rlix.bucket_size_bytes "
                "(e.g. 268435456 for 256 MiB)"
            )
        self.bucket_size_bytes = bucket_size_bytes
        self.is_owner = is_owner
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.shared = hasattr(os, "memfd_create") if shared is None else shared
        self._shared: list[SharedHostBuffer] = []
        self.host_fraction = host_fraction
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._records: tuple[BucketRecord, ...] = ()
        self._checksums: dict[str, list[int]] = {}
        self._version: int | None = None
        #: seconds spent allocating (pinning) buffers, cumulative; stays flat after the first build
        self.alloc_seconds = 0.0

    # -- state -------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The published version, or None (nothing built yet, a build is running, or the last one failed)."""
        return self._version

    @property
    def host_bytes(self) -> int:
        """Host memory held by the cache's buffers."""
        return sum(b.numel() for b in self._buffers)

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    # -- build -------------------------------------------------------------------------------

    def _buffer_for(self, index: int, nbytes: int) -> torch.Tensor:
        """The buffer of bucket ``index``, at least ``nbytes`` long: the one allocated before when it is large
        enough, else a new one of ``max(bucket_size_bytes, nbytes)`` (512-aligned: checksums read whole rows)
        that takes its place; the replaced buffer is freed."""
        if index < len(self._buffers) and self._buffers[index].numel() >= nbytes:
            return self._buffers[index]
        size = max(self.bucket_size_bytes, align_up(nbytes))
        replaced = index < len(self._buffers)
        check_host_capacity(
            size,
            what=f"bucket cache buffer {index} ({size} bytes{', replacing a smaller one' if replaced else ''}; "
                 f"bucket_size_bytes={self.bucket_size_bytes}, {self.host_bytes} bytes held in {self.num_buffers} "
                 "buffers)",
            fraction=self.host_fraction,
        )
        start = time.perf_counter()
        shared = SharedHostBuffer(size, pin=self.pin_memory) if self.shared else None
        buffer = shared.tensor if shared else torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.alloc_seconds += time.perf_counter() - start
        if replaced:  # the old bytes belong to no published version (build() dropped its records): free them now
            self._buffers[index] = buffer
            if shared:
                old, self._shared[index] = self._shared[index], shared
                old.close()
        else:
            self._buffers.append(buffer)
            if shared:
                self._shared.append(shared)
        return buffer

    def _acquire(self, timeout_s: float, what: str) -> None:
        if not self._lock.acquire(timeout=timeout_s):
            raise RlixTimeoutError(
                f"{what}: the bucket cache lock was not free within {timeout_s:.0f} s; a weight sync "
                "(or another build) still holds it - check for a stuck receiver"
            )

    def build(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        checksums: bool = True,
        timeout_s: float = 600.0,
    ) -> int | None:
        """Rebuild the cache from ``named_tensors`` and publish ``version``; returns it (None on non-owners).

        Every rank must call this with its iterator. On the owner the lock is taken BEFORE the
        iterator is first advanced, so peers wait in their first collective, not mid-model.
        Checksums: a GPU tensor's on its GPU (launched as it is packed, read once at the end); CPU tensors'
        summed in the same pass that packs them (``PackChecksums``).
        On error no version is published (the old bytes are already partly overwritten).
        """
        if not self.is_owner:
            for _ in named_tensors:
                pass
            return None
        self._acquire(timeout_s, f"build of version {version}")
        try:
            self._version = None
            self._records = ()
            sums = _BuildChecksums(version) if checksums else None
            records = []
            for record in iter_buckets(named_tensors, self.bucket_size_bytes, self._buffer_for,
                                       sums.on_tensor if sums else None, checksum_cpu=sums is not None):
                if self.shared:
                    record = dataclasses.replace(record, host=self._shared[record.meta.index].handle)
                records.append(record)
                if sums:
                    sums.on_bucket(record)
            self._checksums = sums.finish() if sums else {name: [] for r in records for name in r.meta.names}
            self._records, self._version = tuple(records), version
            return version
        finally:
            self._lock.release()

    # -- read --------------------------------------------------------------------------------

    @contextmanager
    def read(self, timeout_s: float = 150.0) -> Iterator[CacheSnapshot]:
        """Hold the cache lock and yield the published version; keep it through the last receiver barrier."""
        if not self.is_owner:
            raise TransportError("this rank is not the cache owner: only the owner (pp0/dp0/tp0/cp0) can send weights")
        self._acquire(timeout_s, "weight sync")
        try:
            if self._version is None:
                raise TransportError(
                    "the bucket cache has no complete version (never built, or the last build failed); "
                    "build it (before_weight_sync) before syncing"
                )
            yield CacheSnapshot(self._version, self._records, self._checksums)
        finally:
            self._lock.release()

    def close(self, timeout_s: float = 300.0) -> None:
        """Free every buffer (end of the pipeline). Waits (bounded) for a running sync or build."""
        self._acquire(timeout_s, "close")
        try:
            self._buffers, self._records, self._checksums, self._version = [], (), {}, None
            for shared in self._shared:
                shared.close()
            self._shared = []
        finally:
            self._lock.release()


class _BuildChecksums:
    """The checksums of one build (see ``VersionedBucketCache.build``)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.order: list[str] = []
        self.nbytes: dict[str, int] = {}
        self.on_gpu: dict[str, torch.Tensor] = {}
        self.packed: list[tuple[tuple[str, ...], list[int], torch.Tensor]] = []

    def on_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.nbytes:
            raise TransportError(f"parameter {name!r} appears twice in the weight iterator of version {self.version}")
        self.order.append(name)
        self.nbytes[name] = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            self.on_gpu[name] = start_checksums([tensor])[0]

    def on_bucket(self, record: BucketRecord) -> None:
        if record.sums is not None:  # taken while packing; rows of GPU-sourced tensors are dropped in finish
            self.packed.append((record.meta.names, [self.nbytes[n] for n in record.meta.names], record.sums))

    def finish(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for names, nbytes, partial in self.packed:
            out.update((n, s) for n, s in zip(names, finish_checksums(nbytes, partial), strict=True) if n not in self.on_gpu)
        if self.on_gpu:
            gpu_names = list(self.on_gpu)
            sums = finish_checksums([self.nbytes[n] for n in gpu_names], torch.stack(list(self.on_gpu.values())))
            out.update(zip(gpu_names, sums, strict=True))
        return {name: out[name] for name in self.order}
