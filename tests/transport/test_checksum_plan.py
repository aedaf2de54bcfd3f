"""Checksums (bit-exact, order-sensitive) and the comm plan (deterministic classification)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_plugins.errors import RlixConfigError, WeightVerificationError
from rlix_plugins.transport import (
    DeviceRef,
    _checksum,
    bucket_checksums,
    build_comm_plan,
    compute_checksums,
    iter_buckets,
    tensor_checksum,
    verify_checksums,
)
from rlix_plugins.transport._checksum import ROW_WORDS, WIDE_WORDS, finish_checksums, segment_checksums

CHUNK_WORDS = WIDE_WORDS * 64


def test_single_bit_flip_changes_the_checksum() -> None:
    t = torch.randn(1001, dtype=torch.float32)
    base = tensor_checksum(t)
    raw = t.view(torch.uint8)
    for pos in (0, 1, 2000, raw.numel() - 1):
        for bit in (0, 7):
            raw[pos] ^= 1 << bit
            assert tensor_checksum(t) != base
            raw[pos] ^= 1 << bit
    assert tensor_checksum(t) == base


def test_swapped_words_and_signed_zero_are_detected() -> None:
    t = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    assert tensor_checksum(t) != tensor_checksum(t.flip(0))
    assert tensor_checksum(torch.tensor([0.0])) != tensor_checksum(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert tensor_checksum(nan) == tensor_checksum(nan.clone())  # bytes, not float equality


def test_chunk_boundary_and_odd_sizes() -> None:
    """Tensors spanning several chunks and odd byte counts are handled exactly."""
    t = torch.randint(-(2**31), 2**31 - 1, (CHUNK_WORDS * 2 + 3,), dtype=torch.int32)
    a = tensor_checksum(t)
    t[CHUNK_WORDS] += 1
    assert tensor_checksum(t) != a
    odd = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert tensor_checksum(odd)[0] == 3
    assert tensor_checksum(torch.zeros(0)) == [0, 0, 0]
    assert tensor_checksum(odd[1:]) == tensor_checksum(odd[1:].clone())  # odd storage offset


def _reference(data: bytes) -> list[int]:
    """The definition in the module docstring, in plain Python."""
    padded = data + b"\0" * (-len(data) % 4)
    word_sum = weighted = 0
    for i in range(0, len(padded), 4):
        w = int.from_bytes(padded[i : i + 4], "little", signed=True)
        k, j = divmod(i // 4, ROW_WORDS)
        word_sum += w
        weighted += w * ((k + 1) * (ROW_WORDS + 1) + j + 1)
    return [len(data), word_sum % 2**32, weighted % 2**32]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=1500), min_size=1, max_size=6))
def test_one_tensor_and_batched_bucket_forms_match_the_definition(blobs: list[bytes]) -> None:
    """The per-tensor form (CPU and senders) and the batched form (receivers' GPUs) agree, on any layout."""
    offsets, end = [], 0
    for blob in blobs:
        start = -(-end // 512) * 512
        offsets.append(start)
        end = start + len(blob)
    buffer = torch.zeros(end + 3, dtype=torch.uint8)  # ends mid-row: the batched form pads the last row itself
    for blob, start in zip(blobs, offsets, strict=True):
        if blob:
            buffer[start : start + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    want = [_reference(b) for b in blobs]
    assert [tensor_checksum(torch.frombuffer(bytearray(b), dtype=torch.uint8)) if b else [0, 0, 0] for b in blobs] == want
    assert finish_checksums([len(b) for b in blobs], segment_checksums(buffer, offsets, [len(b) for b in blobs])) == want


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_equal_bytes_equal_checksum_regardless_of_dtype_view(data: bytes) -> None:
    padded = data + b"\0" * (-len(data) % 4)
    u8 = torch.frombuffer(bytearray(padded), dtype=torch.uint8)
    assert tensor_checksum(u8) == tensor_checksum(u8.view(torch.float32))


def test_verify_names_first_differing_parameter() -> None:
    named = [("a", torch.ones(3)), ("b", torch.zeros(2)), ("c", torch.arange(4))]
    expected = compute_checksums(named)
    verify_checksums(expected, dict(expected))
    actual = dict(expected)
    actual["c"] = tensor_checksum(torch.arange(1, 5))
    actual["b"] = tensor_checksum(torch.ones(2))
    with pytest.raises(WeightVerificationError, match="'b' differs"):
        verify_checksums(expected, actual)
    with pytest.raises(WeightVerificationError, match="'c' was sent but never received"):
        verify_checksums(expected, {k: v for k, v in expected.items() if k != "c"})
    verify_checksums(expected, {"a": expected["a"]}, require_all=False)
    with pytest.raises(WeightVerificationError, match="never sent"):
        verify_checksums({"a": expected["a"]}, expected)


def test_comm_plan_same_gpu_goes_by_ipc_rest_by_broadcast() -> None:
    plan = build_comm_plan((0, 1), {3: [(1, 0), (1, 1)], 0: [(0, 0), (0, 1)], 1: [(0, 2)]})
    assert [t.dp_rank for t in plan.targets] == [0, 1, 3]
    t0, t1, t3 = plan.targets
    assert t0.ipc_local_ranks == (1,) and t0.broadcast_rank_map() == {0: 1}
    assert t1.ipc_local_ranks == () and t1.broadcast_rank_map() == {0: 2}
    assert t3.broadcast_rank_map() == {0: 3, 1: 4} and plan.broadcast_world_size == 5
    assert plan.sender == DeviceRef(0, 1) and plan.needs_group


def test_comm_plan_ipc_only_needs_no_group_and_is_deterministic() -> None:
    targets = {0: [(0, 0)]}
    plan = build_comm_plan((0, 0), targets, "cpu_serialize")
    assert not plan.needs_group and plan.broadcast_world_size == 1
    assert plan == build_comm_plan(DeviceRef(0, 0), dict(targets), "cpu_serialize")
    assert plan.to_wire()["targets"] == [{"dp_rank": 0, "ipc_local_ranks": [0], "broadcast_ranks": {}}]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(0, 7), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=1, max_size=3), max_size=5))
def test_comm_plan_invariants(raw: dict[int, list[tuple[int, int]]]) -> None:
    """Every device classified once; broadcast ranks are 1..N, unique, in (dp, local) order."""
    used: set[tuple[int, int]] = set()
    targets = {}
    for dp, devs in raw.items():
        fresh = [d for d in dict.fromkeys(devs) if d not in used]
        if fresh:
            used.update(fresh)
            targets[dp] = fresh
    plan = build_comm_plan((0, 0), targets)
    ranks = [r for t in plan.targets for _, r in t.broadcast_ranks]
    assert ranks == list(range(1, len(ranks) + 1))
    for t in plan.targets:
        devs = targets[t.dp_rank]
        assert sorted(t.ipc_local_ranks + t.broadcast_local_ranks) == list(range(len(devs)))
        assert all(devs[i] == (0, 0) for i in t.ipc_local_ranks)
        assert all(devs[i] != (0, 0) for i in t.broadcast_local_ranks)


def test_comm_plan_rejects_bad_input() -> None:
    with pytest.raises(RlixConfigError, match=r"dp rank 0 and dp rank 1|dp rank 1 and dp rank 0"):
        build_comm_plan((0, 0), {0: [(0, 1)], 1: [(0, 1)]})
    with pytest.raises(RlixConfigError, match="no devices"):
        build_comm_plan((0, 0), {0: []})
    with pytest.raises(RlixConfigError, match="same_gpu_transport"):
        build_comm_plan((0, 0), {0: [(0, 0)]}, "nvlink")  # type: ignore[arg-type]
    with pytest.raises(RlixConfigError, match=r"\(node, gpu\) pair"):
        build_comm_plan((0,), {0: [(0, 0)]})
    with pytest.raises(RlixConfigError, match="not a target"):
        build_comm_plan((0, 0), {0: [(0, 0)]}).target(5)


@pytest.mark.parametrize("step_rows", [3, 64 * 2, 1 << 14])
@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 5, 512, 4096, 64 * 512, 64 * 512 * 2 + 700, 64 * 512 * 3 - 4]),
                      min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_checksums_taken_while_packing_match_the_definition(step_rows: int, sizes: list[int], seed: int) -> None:
    """The CPU pack path (copy step by step, sums of each step from cache) gives the definition's numbers for
    tensors of one row or many, several steps, partial column groups and partial last rows, and packs the bytes
    with zero padding."""
    g = torch.Generator().manual_seed(seed)
    blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    capacity = sum(-(-n // 512) * 512 for n in sizes) or 512
    buffer = torch.full((capacity,), 0xAB, dtype=torch.uint8)  # stale bytes: padding must be rewritten
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_checksum, "PACK_STEP_BYTES", step_rows * _checksum.ROW_BYTES)
        (record,) = iter_buckets([(f"t{i}", b) for i, b in enumerate(blobs)], capacity, lambda _i, _n: buffer,
                                 checksum_cpu=True)
    assert record.sums is not None
    want = [_reference(bytes(b.tolist())) for b in blobs]
    assert finish_checksums(sizes, record.sums) == want
    assert finish_checksums(sizes, bucket_checksums(buffer, list(record.meta.offsets), sizes)) == want
    for b, start in zip(blobs, record.meta.offsets, strict=True):
        assert torch.equal(buffer[start : start + b.numel()], b)


def test_pack_checksums_fall_back_when_the_buffer_ends_inside_a_row() -> None:
    """A buffer too short for the last tensor's whole row is checksummed after packing, with the same numbers."""
    blobs = [torch.arange(701, dtype=torch.int32).view(torch.uint8)[:2801], torch.ones(90, dtype=torch.uint8)]
    buffer = torch.zeros(3072 + 100, dtype=torch.uint8)  # the second tensor's row [3072, 3584) does not fit
    (record,) = iter_buckets([("a", blobs[0]), ("b", blobs[1])], buffer.numel(), lambda _i, _n: buffer, checksum_cpu=True)
    assert record.meta.offsets == (0, 3072) and record.sums is not None
    assert finish_checksums([2801, 90], record.sums) == [_reference(bytes(b.tolist())) for b in blobs]


def test_checksum_kernel_table_spans_and_the_torch_fallback() -> None:
    """The kernel's table (``_checksum_kernel.table_for``): each piece in spans of whole words with the index of
    its first word in its item; pieces with trailing bytes or at an address not a multiple of 4 get no table
    (the torch form); before its self-check, and where it cannot run, the kernel is never used."""
    from rlix_plugins.transport import _checksum_kernel as kernel

    span = kernel.SPAN_WORDS
    a = torch.zeros(4 * span + 8, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    table = kernel.table_for([[a, b], [], [b]])
    assert table == [(a.data_ptr(), span, 0, 0), (a.data_ptr() + 4 * span, 2, span, 0), (b.data_ptr(), 16, span + 2, 0),
                     (b.data_ptr(), 16, 0, 2)]
    assert kernel.table_for([[a[:6]]]) is None and kernel.table_for([[a[1:9]]]) is None
    kernel._matched = None
    assert kernel.kernel_checksums([[a]]) is None
    try:
        assert kernel.self_check([[], []], [[0, 0, 0], [0, 0, 0]]) is False and kernel._matched is None  # nothing read
        assert kernel.self_check([[b]], [[64, 0, 0]]) is False  # no kernel here (no triton, or no GPU to run it)
        assert kernel._matched is False and kernel.kernel_checksums([[a]]) is None
    finally:
        kernel._matched = None
