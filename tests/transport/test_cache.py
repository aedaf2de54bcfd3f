"""Versioned bucket cache: owner-only buckets, buffers reused, publish-after-build, one lock, memory guards."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError
from rlix_plugins.transport import (
    VersionedBucketCache,
    check_device_capacity,
    check_host_capacity,
    compute_checksums,
    unpack_bucket,
)

BUCKET = 4096


def _model(version: int, n: int = 10) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [(f"w{i}", torch.randn(100 + 7 * i, generator=g)) for i in range(n)]


def _contents(cache: VersionedBucketCache) -> dict[str, torch.Tensor]:
    with cache.read(1.0) as snap:
        return {n: t.clone() for b in snap.buckets for n, t in unpack_bucket(b.meta, b.buffer)}


def test_build_publishes_version_checksums_and_exact_bytes() -> None:
    cache = VersionedBucketCache(BUCKET)
    assert cache.version is None and not cache.pin_memory
    model = _model(0)
    assert cache.build(-1, iter(model)) == -1
    assert cache.version == -1
    got = _contents(cache)
    assert all(torch.equal(got[n], t) for n, t in model)
    with cache.read(1.0) as snap:
        assert snap.checksums == compute_checksums(model)
        assert snap.used_bytes <= cache.host_bytes and snap.capacity_bytes <= BUCKET


def test_buffers_are_allocated_once_and_reused_across_versions() -> None:
    cache = VersionedBucketCache(BUCKET)
    cache.build(0, iter(_model(0)))
    ptrs = [b.data_ptr() for b in cache._buffers]
    host = cache.host_bytes
    assert host == len(ptrs) * BUCKET
    for v in (1, 2, 3):
        model = _model(v)
        cache.build(v, iter(model))
        assert [b.data_ptr() for b in cache._buffers] == ptrs and cache.host_bytes == host
        got = _contents(cache)
        assert all(torch.equal(got[n], t) for n, t in model)


def test_non_owner_drains_the_iterator_and_keeps_nothing() -> None:
    seen = []

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in _model(0):
            seen.append(name)  # stands in for a collective every rank must reach
            yield name, t

    cache = VersionedBucketCache(BUCKET, is_owner=False)
    assert cache.build(0, gen()) is None
    assert len(seen) == 10 and cache.host_bytes == 0 and cache.version is None
    with pytest.raises(TransportError, match="not the cache owner"), cache.read(1.0):
        pass


def test_failed_build_publishes_nothing_and_next_build_works() -> None:
    cache = VersionedBucketCache(BUCKET)
    cache.build(0, iter(_model(0)))

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        yield from _model(1)[:5]
        raise RuntimeError("collective failed mid-gather")

    with pytest.raises(RuntimeError, match="mid-gather"):
        cache.build(1, broken())
    assert cache.version is None
    with pytest.raises(TransportError, match="no complete version"), cache.read(1.0):
        pass
    cache.build(2, iter(_model(2)))
    assert cache.version == 2
    with pytest.raises(TransportError, match="appears twice"):
        cache.build(3, iter([*_model(3), ("w0", torch.zeros(1))]))


def test_reader_and_builder_exclude_each_other() -> None:
    """The one lock: a running sync blocks a build, a running build blocks a sync (bounded waits)."""
    cache = VersionedBucketCache(BUCKET)
    cache.build(0, iter(_model(0)))
    with cache.read(1.0) as snap:
        assert snap.version == 0
        with pytest.raises(RlixTimeoutError, match="weight sync"):
            cache.build(1, iter(_model(1)), timeout_s=0.2)
    assert cache.version == 0  # the refused build touched nothing

    started, release = threading.Event(), threading.Event()

    def slow() -> Iterator[tuple[str, torch.Tensor]]:
        started.set()
        release.wait(10)
        yield from _model(1)

    builder = threading.Thread(target=cache.build, args=(1, slow()))
    builder.start()
    assert started.wait(10)
    with pytest.raises(RlixTimeoutError, match="lock was not free"), cache.read(0.2):
        pass
    release.set()
    builder.join(10)
    assert cache.version == 1


def test_bucket_size_is_explicit_and_validated() -> None:
    with pytest.raises(RlixConfigError, match=r"rlix\.bucket_size_bytes"):
        VersionedBucketCache(0)
    with pytest.raises(RlixConfigError, match="at least"):
        VersionedBucketCache(256).build(0, iter(_model(0)))


def test_host_memory_guard() -> None:
    with pytest.raises(TransportError, match=r"needs 2\.00 GiB of host memory but only 1\.00 GiB"):
        check_host_capacity(2 << 30, what="cache", available=1 << 30)
    check_host_capacity(1 << 20, what="cache", available=1 << 30)
    cache = VersionedBucketCache(BUCKET, host_fraction=1e-15)
    with pytest.raises(TransportError, match="bucket cache buffer 0"):
        cache.build(0, iter(_model(0)))


def test_device_memory_guard_names_the_bucket_size_to_use() -> None:
    free = 1 << 30
    with pytest.raises(TransportError, match=r"does not fit.*lower rlix\.bucket_size_bytes to at most \d+"):
        check_device_capacity(1 << 30, "cuda:0", scratch_bytes=64 << 20, free_bytes=free)
    check_device_capacity(256 << 20, "cuda:0", scratch_bytes=64 << 20, free_bytes=free)
    check_device_capacity(1 << 40, "cpu")  # CPU receivers are not guarded here
