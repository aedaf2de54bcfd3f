"""Versioned CPU bucket cache: one model copy in (pinned) host memory, allocated once, reused per version.

Ownership and lockstep:
* ``build(version, named_tensors)`` is called on EVERY training rank with the same iterator
  (collectives inside it must keep moving); only the owner rank (``is_owner=True``: pp0/dp0/tp0/cp0)
  copies tensors into buckets, the others just drain the iterator.
* Buffers (``bucket_size_bytes`` each, pinned when CUDA is available) are allocated the first time a
  bucket index is needed and reused by every later version: pinning costs ~0.8 s/GiB, ~10x the copy.

Build vs. readers (one copy, never torn): there is exactly one lock. ``read()`` holds it from
"read the cache" through the last receiver barrier and the group teardown of a sync; ``build()``
holds it for the whole rebuild. So a build waits for a running sync and a sync waits for a running
build; no reader ever sees half-written buckets. The version is published only after a complete
build; while a build runs (and after a failed one) no version is published and ``read()`` refuses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import final

import torch

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError
from rlix_plugins.transport._bucket import BucketRecord, iter_buckets
from rlix_plugins.transport._checksum import tensor_checksum
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
        """Largest bucket's used bytes: the staging size a transport needs."""
        return max((b.meta.used_bytes for b in self.buckets), default=0)


@final
class VersionedBucketCache:
    """See the module docstring. Thread-safe; one instance per training process."""

    def __init__(
        self,
        bucket_size_bytes: int,
        *,
        is_owner: bool = True,
        pin_memory: bool | None = None,
        host_fraction: float = HOST_FRACTION,
    ) -> None:
        """
        :param bucket_size_bytes: explicit bucket size (no default on purpose: it bounds receiver GPU
            scratch). Every buffer has exactly this capacity.
        :param is_owner: whether this rank keeps buckets.
        :param pin_memory: pin the buffers; default: when CUDA is available.
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

    def _buffer_for(self, index: int) -> torch.Tensor:
        if index < len(self._buffers):
            return self._buffers[index]
        check_host_capacity(
            self.bucket_size_bytes,
            what=f"bucket cache buffer {index} ({len(self._buffers) + 1} x bucket_size_bytes={self.bucket_size_bytes})",
            fraction=self.host_fraction,
        )
        start = time.perf_counter()
        buffer = torch.empty(self.bucket_size_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.alloc_seconds += time.perf_counter() - start
        self._buffers.append(buffer)
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
        Checksums are computed on each tensor's own device before the copy.
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
            sums: dict[str, list[int]] = {}

            def on_tensor(name: str, tensor: torch.Tensor) -> None:
                if name in sums:
                    raise TransportError(f"parameter {name!r} appears twice in the weight iterator of version {version}")
                sums[name] = tensor_checksum(tensor) if checksums else []

            records = tuple(iter_buckets(named_tensors, self.bucket_size_bytes, self._buffer_for, on_tensor))
            self._records, self._checksums, self._version = records, sums, version
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
        finally:
            self._lock.release()
