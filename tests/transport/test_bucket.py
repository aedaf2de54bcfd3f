"""Bucket format: pack/unpack round trips, alignment, wire metadata, large-tensor policy (a bucket of its own)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_plugins.errors import RlixConfigError, TransportError
from rlix_plugins.transport import (
    ALIGN_BYTES,
    BucketMeta,
    align_up,
    dtype_to_str,
    iter_buckets,
    pack_bucket,
    str_to_dtype,
    unpack_bucket,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
DTYPES += [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included) of ``dtype``: random bytes reinterpreted."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)
entries = st.lists(st.tuples(st.sampled_from(DTYPES), shapes, st.integers(0, 2**31)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(entries)
def test_pack_unpack_round_trip_is_bit_exact(items: list[tuple[torch.dtype, tuple[int, ...], int]]) -> None:
    """Every dtype/shape (0-d, empty, odd sizes) comes back with identical bytes, shape and dtype."""
    named = [(f"layer.{i}.w", _random_tensor(d, s, seed)) for i, (d, s, seed) in enumerate(items)]
    record = pack_bucket(named)
    meta = BucketMeta.from_wire(json.loads(json.dumps(record.meta.to_wire())))  # plain types only
    out = unpack_bucket(meta, record.buffer)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _bytes(got) == _bytes(want)
    assert all(o % ALIGN_BYTES == 0 for o in meta.offsets)
    last_end = meta.offsets[-1] + named[-1][1].numel() * named[-1][1].element_size()
    assert meta.used_bytes == last_end == record.buffer.numel()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=30), st.integers(3000, 9000))
def test_iter_buckets_respects_bucket_size_and_order(sizes: list[int], bucket: int) -> None:
    """Greedy packing keeps iteration order, never exceeds the bucket size, loses nothing."""
    named = [(f"t{i}", torch.full((n,), i % 251, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    records = list(iter_buckets(iter(named), bucket))
    assert [n for r in records for n in r.meta.names] == [n for n, _ in named]
    assert all(r.meta.used_bytes <= bucket for r in records)
    assert [r.meta.index for r in records] == list(range(len(records)))
    got = {n: t for r in records for n, t in unpack_bucket(r.meta, r.buffer)}
    assert all(torch.equal(got[n], t) for n, t in named)


def test_views_are_zero_copy() -> None:
    """Unpacked tensors alias the bucket buffer."""
    record = pack_bucket([("a", torch.zeros(4)), ("b", torch.zeros(3, dtype=torch.bfloat16))])
    (_, a), (_, b) = unpack_bucket(record.meta, record.buffer)
    base = record.buffer.data_ptr()
    assert a.data_ptr() == base and b.data_ptr() == base + ALIGN_BYTES
    a.fill_(1.0)
    assert record.buffer[:16].view(torch.float32).tolist() == [1.0] * 4


def test_non_contiguous_source_is_packed_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    (_, got), = unpack_bucket(pack_bucket([("t", t)]).meta, pack_bucket([("t", t)]).buffer)
    assert torch.equal(got, t)


def test_tensor_larger_than_the_bucket_travels_alone_in_a_bucket_sized_to_it() -> None:
    """An oversized tensor closes the pending bucket and goes alone into a bucket of its own size (asked of
    ``buffer_for`` with that size); its neighbours keep greedy packing; every byte round-trips."""
    bucket = 4096
    named = [("a", _random_tensor(torch.uint8, (1000,), 1)), ("b", _random_tensor(torch.float32, (500,), 2)),
             ("big", _random_tensor(torch.bfloat16, (5, 1024), 3)),  # 10 KiB
             ("c", _random_tensor(torch.uint8, (100,), 4)), ("d", _random_tensor(torch.int32, (300,), 5)),
             ("huge", _random_tensor(torch.float32, (3000,), 6)), ("e", _random_tensor(torch.uint8, (7,), 7))]
    asked: list[tuple[int, int]] = []

    def buffer_for(index: int, nbytes: int) -> torch.Tensor:
        asked.append((index, nbytes))
        return torch.full((max(bucket, nbytes),), 0xAB, dtype=torch.uint8)  # stale bytes, as in a reused buffer

    records = list(iter_buckets(iter(named), bucket, buffer_for))
    assert [r.meta.names for r in records] == [("a", "b"), ("big",), ("c", "d"), ("huge",), ("e",)]
    assert [r.meta.index for r in records] == list(range(5))
    assert asked == [(0, 1024 + 2000), (1, 10240), (2, 512 + 1200), (3, 12000), (4, 7)]
    assert [r.meta.used_bytes for r in records] == [n for _, n in asked]
    got = {n: t for r in records for n, t in unpack_bucket(r.meta, r.buffer)}
    assert [n for r in records for n in r.meta.names] == [n for n, _ in named]
    for name, want in named:
        assert got[name].dtype == want.dtype and got[name].shape == want.shape and _bytes(got[name]) == _bytes(want)
    # the default buffers are exactly the packed size, the lone tensor's included
    (alone,) = iter_buckets(named[2:3], bucket)
    assert alone.buffer.numel() == alone.meta.used_bytes == 10240
    assert _bytes(unpack_bucket(alone.meta, alone.buffer)[0][1]) == _bytes(named[2][1])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 12000), min_size=1, max_size=30), st.integers(3000, 9000))
def test_greedy_packing_with_tensors_larger_than_the_bucket(sizes: list[int], bucket: int) -> None:
    """Any mix of sizes: a bucket over the bucket size holds exactly one tensor, a bucket closes only when the next
    tensor would not fit, and nothing is lost or reordered."""
    named = [(f"t{i}", torch.full((n,), i % 251, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    records = list(iter_buckets(iter(named), bucket))
    assert [n for r in records for n in r.meta.names] == [n for n, _ in named]
    assert all(r.meta.used_bytes <= bucket or len(r.meta.names) == 1 for r in records)
    for prev, nxt in itertools.pairwise(records):
        assert align_up(prev.meta.used_bytes) + nxt.meta.nbytes(0) > bucket, "closed although the next tensor fit"
    got = {n: t for r in records for n, t in unpack_bucket(r.meta, r.buffer)}
    assert all(torch.equal(got[n], t) for n, t in named)


def test_largest_tensor_of_a_bucket() -> None:
    record = pack_bucket([("a", torch.zeros(4)), ("b", torch.zeros(3, 5, dtype=torch.bfloat16)), ("c", torch.zeros(1))])
    assert record.meta.largest() == ("b", 30)
    assert BucketMeta((), (), (), (), 0).largest() == ("", 0)


def test_exact_fit_and_alignment_boundary() -> None:
    """A tensor ending exactly at the bucket size fits; alignment padding pushes the next one out."""
    named = [("a", torch.zeros(100, dtype=torch.uint8)), ("b", torch.zeros(512, dtype=torch.uint8))]
    records = list(iter_buckets(named, 1024))
    assert len(records) == 1 and records[0].meta.offsets == (0, 512) and records[0].meta.used_bytes == 1024
    records = list(iter_buckets([*named, ("c", torch.zeros(1, dtype=torch.uint8))], 1024))
    assert [r.meta.names for r in records] == [("a", "b"), ("c",)]


def test_bad_bucket_size_and_inputs() -> None:
    with pytest.raises(RlixConfigError, match="bucket_size_bytes"):
        list(iter_buckets([("a", torch.zeros(1))], 0))
    with pytest.raises(TransportError, match=r"expected a torch\.Tensor"):
        list(iter_buckets([("a", [1, 2])], 1024))  # type: ignore[list-item]


def test_metadata_validation() -> None:
    record = pack_bucket([("a", torch.zeros(8))])
    with pytest.raises(TransportError, match="used_bytes"):
        unpack_bucket(record.meta, record.buffer[:4])
    with pytest.raises(TransportError, match="malformed"):
        BucketMeta.from_wire({"names": ["a"]})
    with pytest.raises(TransportError, match="lengths differ"):
        BucketMeta(names=("a",), shapes=(), dtypes=("float32",), offsets=(0,), used_bytes=4)
    bad = {**record.meta.to_wire(), "offsets": [3]}
    with pytest.raises(TransportError, match="misaligned"):
        unpack_bucket(bad, record.buffer)
    with pytest.raises(TransportError, match="unknown dtype"):
        str_to_dtype("float13")


def test_dtype_strings_round_trip() -> None:
    for d in DTYPES:
        assert str_to_dtype(dtype_to_str(d)) == d
    assert dtype_to_str(torch.bfloat16) == "bfloat16"
