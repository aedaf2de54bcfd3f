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
    verify_checksums,
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
    cache = VersionedBucketCache(256)  # smaller than every tensor: each travels alone, none is refused
    model = _model(0)
    cache.build(0, iter(model))
    assert cache.num_buffers == len(model) and _contents(cache).keys() == dict(model).keys()


BIG = 10 << 10  # bytes of the oversized tensor (bf16): more than BUCKET


def _with_big(version: int, at: int = 3) -> list[tuple[str, torch.Tensor]]:
    """``_model(version)`` with a 10 KiB tensor (more than a bucket) at position ``at``."""
    model = _model(version)
    g = torch.Generator().manual_seed(1000 + version)
    return [*model[:at], ("big", torch.randn(BIG // 2, generator=g).to(torch.bfloat16)), *model[at:]]


def _check(cache: VersionedBucketCache, model: list[tuple[str, torch.Tensor]]) -> None:
    """The published version holds ``model`` byte for byte, with the checksums of its tensors."""
    got = _contents(cache)
    assert got.keys() == dict(model).keys()
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in model)
    with cache.read(1.0) as snap:
        assert snap.checksums == compute_checksums(model)
        verify_checksums(snap.checksums, compute_checksums(list(got.items())))


@pytest.mark.parametrize("shared", [True, False])
def test_tensor_larger_than_the_bucket_gets_a_buffer_of_its_own_reused_by_later_versions(shared: bool) -> None:
    cache = VersionedBucketCache(BUCKET, shared=shared)
    model = _with_big(0)
    assert cache.build(0, iter(model)) == 0 and cache.version == 0
    _check(cache, model)
    with cache.read(1.0) as snap:
        (alone,) = [b for b in snap.buckets if "big" in b.meta.names]
        assert alone.meta.names == ("big",) and alone.meta.used_bytes == BIG
        assert snap.capacity_bytes == BIG > BUCKET and snap.largest_tensor == ("big", BIG)
        assert all(b.meta.used_bytes <= BUCKET for b in snap.buckets if b is not alone)
        if shared:
            assert alone.host is not None and alone.host["nbytes"] == BIG
        index = alone.meta.index
    assert [b.numel() for b in cache._buffers] == [BIG if i == index else BUCKET for i in range(cache.num_buffers)]
    assert cache.host_bytes == (cache.num_buffers - 1) * BUCKET + BIG
    ptrs, host, count, alloc = [b.data_ptr() for b in cache._buffers], cache.host_bytes, cache.num_buffers, cache.alloc_seconds
    for v in (1, 2):  # same layout: every buffer reused, nothing allocated
        model = _with_big(v)
        cache.build(v, iter(model))
        _check(cache, model)
        assert [b.data_ptr() for b in cache._buffers] == ptrs
        assert (cache.host_bytes, cache.num_buffers, cache.alloc_seconds) == (host, count, alloc)


@pytest.mark.parametrize("shared", [True, False])
def test_a_later_layout_that_needs_more_replaces_the_buffer_at_its_index(shared: bool) -> None:
    cache = VersionedBucketCache(BUCKET, shared=shared)
    cache.build(0, iter(_model(0)))
    ptrs, count = [b.data_ptr() for b in cache._buffers], cache.num_buffers
    assert cache.host_bytes == count * BUCKET
    old = cache._shared[1] if shared else None
    model = _with_big(1, at=2)  # bucket 1 now holds the big tensor alone
    cache.build(1, iter(model))
    _check(cache, model)
    with cache.read(1.0) as snap:
        assert snap.buckets[1].meta.names == ("big",)
        if shared:
            assert snap.buckets[1].host == cache._shared[1].handle and snap.buckets[1].host["nbytes"] == BIG
    assert cache._buffers[1].numel() == BIG and cache._buffers[1].data_ptr() != ptrs[1]
    assert [b.data_ptr() for i, b in enumerate(cache._buffers[:count]) if i != 1] == ptrs[:1] + ptrs[2:count]
    assert cache.host_bytes == (cache.num_buffers - 1) * BUCKET + BIG
    if old is not None:
        assert cache._shared[1] is not old and old._map.closed  # the replaced shared buffer was freed
        assert len(cache._shared) == cache.num_buffers
    # back to small tensors: the big buffer stays (buffers never shrink), nothing is allocated
    ptrs, host, alloc = [b.data_ptr() for b in cache._buffers], cache.host_bytes, cache.alloc_seconds
    model = _model(2)
    cache.build(2, iter(model))
    _check(cache, model)
    assert [b.data_ptr() for b in cache._buffers] == ptrs and (cache.host_bytes, cache.alloc_seconds) == (host, alloc)


def test_replacing_a_buffer_checks_host_memory_first() -> None:
    """The memory guard runs before the larger buffer is allocated; the failed build publishes nothing and keeps
    the old buffer."""
    cache = VersionedBucketCache(BUCKET)
    cache.build(0, iter(_model(0)))
    kept = cache._buffers[1]
    cache.host_fraction = 1e-15
    with pytest.raises(TransportError, match=rf"bucket cache buffer 1 \({BIG} bytes, replacing a smaller one"):
        cache.build(1, iter(_with_big(1, at=2)))
    assert cache.version is None and cache._buffers[1] is kept and cache.host_bytes == cache.num_buffers * BUCKET


QWEN_15B_LAYER = [  # one decoder layer of Qwen/Qwen2.5-1.5B (hidden 1536, 12 heads, 2 KV heads, intermediate 8960)
    ("self_attn.q_proj.weight", (1536, 1536)), ("self_attn.q_proj.bias", (1536,)),
    ("self_attn.k_proj.weight", (256, 1536)), ("self_attn.k_proj.bias", (256,)),
    ("self_attn.v_proj.weight", (256, 1536)), ("self_attn.v_proj.bias", (256,)),
    ("self_attn.o_proj.weight", (1536, 1536)), ("mlp.gate_proj.weight", (8960, 1536)),
    ("mlp.up_proj.weight", (8960, 1536)), ("mlp.down_proj.weight", (1536, 8960)),
    ("input_layernorm.weight", (1536,)), ("post_attention_layernorm.weight", (1536,)),
]


def test_qwen25_1_5b_shapes_build_with_the_default_bucket_size() -> None:
    """The stock GRPO recipe's model at its real shapes (bf16): the 445 MiB embedding is more than the default 256 MiB
    bucket and travels alone; the layers pack as usual (the embedding plus two layers keep the test's memory low)."""
    from rlix_plugins.nemo_rl.config import DEFAULT_BUCKET_SIZE_BYTES

    named = [("model.embed_tokens.weight", torch.ones(151936, 1536, dtype=torch.bfloat16))]
    for i in range(2):
        named += [(f"model.layers.{i}.{n}", torch.full(s, i + 2, dtype=torch.bfloat16)) for n, s in QWEN_15B_LAYER]
    named.append(("model.norm.weight", torch.ones(1536, dtype=torch.bfloat16)))
    cache = VersionedBucketCache(DEFAULT_BUCKET_SIZE_BYTES, pin_memory=False)
    try:
        assert cache.build(0, iter(named)) == 0
        with cache.read(1.0) as snap:
            first = snap.buckets[0]
            assert first.meta.names == ("model.embed_tokens.weight",) and first.meta.used_bytes == 151936 * 1536 * 2
            assert snap.capacity_bytes == first.meta.used_bytes > DEFAULT_BUCKET_SIZE_BYTES
            assert all(b.meta.used_bytes <= DEFAULT_BUCKET_SIZE_BYTES for b in snap.buckets[1:])
            assert [n for b in snap.buckets for n in b.meta.names] == [n for n, _ in named]
            assert snap.checksums == compute_checksums(named)
        assert cache.host_bytes == first.meta.used_bytes + (cache.num_buffers - 1) * DEFAULT_BUCKET_SIZE_BYTES
    finally:
        cache.close()


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


def test_device_memory_guard_names_a_tensor_that_alone_cannot_fit() -> None:
    """A bucket holding one tensor larger than the free memory: no bucket size helps, so the error names the tensor;
    when the largest tensor would fit, the error still names the bucket size to use."""
    free, scratch = 400 << 20, 64 << 20
    embedding = ("model.embed_tokens.weight", 151936 * 1536 * 2)
    with pytest.raises(TransportError, match=r"largest tensor 'model\.embed_tokens\.weight' alone has 0\.435 GiB.*"
                                             r"never split, so no rlix\.bucket_size_bytes makes it fit; free GPU memory"):
        check_device_capacity(embedding[1], "cuda:0", scratch_bytes=scratch, free_bytes=free, largest=embedding)
    with pytest.raises(TransportError, match=r"lower rlix\.bucket_size_bytes to at most \d+"):
        check_device_capacity(embedding[1], "cuda:0", scratch_bytes=scratch, free_bytes=free, largest=("w", 1 << 20))
