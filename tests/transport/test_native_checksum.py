"""The native copy-and-checksum kernel of the CPU pack path (``_native_checksum``): the definition's numbers for
any size, address and chunking, zero padding written over stale bytes, the same cache checksums with the kernel
on and off, and the torch path wherever the kernel cannot be built or disagrees with the definition."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rlix_plugins.transport import VersionedBucketCache, _native_checksum, compute_checksums, iter_buckets
from rlix_plugins.transport._checksum import PackChecksums, finish_checksums, tensor_checksum

MiB = 1 << 20
#: one byte, partial words, one row exactly, a partial tail row, many rows, and sizes the pool splits into chunks
SIZES = [1, 3, 511, 512, 513, 4096 * 4 + 7, 5 * MiB + 123, 6 * MiB]


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel switched on and loaded, with 4 torch threads so large copies take the thread pool. Where a C
    compiler exists the kernel must load: a build or self-check failure there is a failure, not a skip."""
    monkeypatch.delenv(_native_checksum.ENV_SWITCH, raising=False)
    if not _native_checksum.available():
        if shutil.which(os.environ.get("CC", "cc")):
            pytest.fail("a C compiler is present but the native checksum kernel did not load (see the log)")
        pytest.skip("no C compiler: the torch path is the only one")
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_kernel() -> Iterator[None]:
    """A test that builds the kernel in its own conditions; later tests load the usual one again."""
    _native_checksum.reset()
    yield
    _native_checksum.reset()


def _random(n: int, seed: int) -> torch.Tensor:
    """``n`` random bytes at an odd address (the kernel must not assume alignment)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n + 1,), dtype=torch.uint8, generator=g)[1:]


def _as_checksum(n: int, sums: torch.Tensor) -> list[int]:
    """``copy_sums``' ``[word_sum, row_weighted, 128 column sums]`` as ``[nbytes, word_sum, weighted_sum]``."""
    col_weighted = (sums[2:] * torch.arange(1, 129, dtype=torch.int32)).sum(dtype=torch.int32).view(1)
    return finish_checksums([n], torch.cat([sums[:2], col_weighted]).view(1, 3))[0]


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize("dst_at", [1024, 1027])  # a row-aligned destination (streaming stores) and an odd one
@pytest.mark.parametrize("n", SIZES)
def test_kernel_copies_pads_and_sums_like_the_definition(n: int, dst_at: int) -> None:
    src = _random(n, n)
    padded = -(-n // 512) * 512
    buffer = torch.full((dst_at + padded + 512,), 0xAB, dtype=torch.uint8)  # stale bytes around and under it
    if n >= 5 * MiB:
        assert _native_checksum._chunks(padded) > 1  # this size exercises the thread pool and chunk offsets
    sums = _native_checksum.copy_sums(src, buffer[dst_at:])
    assert _as_checksum(n, sums) == tensor_checksum(src)
    assert torch.equal(buffer[dst_at : dst_at + n], src)
    assert not buffer[dst_at + n : dst_at + padded].any()  # zero padding written over the stale bytes
    assert (buffer[:dst_at] == 0xAB).all() and (buffer[dst_at + padded :] == 0xAB).all()  # nothing else touched


@pytest.mark.usefixtures("native")
def test_kernel_zeroes_whole_padding_rows_past_the_tail() -> None:
    """The C contract: ``dst[nbytes:padded_bytes]`` is zeroed even when it spans more than the tail row (zero
    rows add nothing to the sums)."""
    assert _native_checksum._fn is not None
    src = _random(700, 1)
    dst = torch.full((3 * 512 + 64,), 0xAB, dtype=torch.uint8)
    out = torch.empty(_native_checksum.OUT_WORDS, dtype=torch.int32)
    _native_checksum._fn(src.data_ptr(), dst.data_ptr(), 700, 3 * 512, 1, out.data_ptr())
    assert torch.equal(dst[:700], src) and not dst[700 : 3 * 512].any() and (dst[3 * 512 :] == 0xAB).all()
    assert _as_checksum(700, out) == tensor_checksum(src)


@pytest.mark.usefixtures("native")
def test_concurrent_and_forked_copies_are_exact() -> None:
    """Copies from several threads at once (one has the C thread pool, the others run alone) and a copy in a
    child forked after the pool started (it has none of the pool's threads) give the definition's numbers."""
    n = 6 * MiB + 5
    srcs = [_random(n, seed) for seed in range(4)]
    want = [tensor_checksum(s) for s in srcs]
    dsts = [torch.empty(n + 512, dtype=torch.uint8) for _ in srcs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda i: _as_checksum(n, _native_checksum.copy_sums(srcs[i], dsts[i])), range(4)))
            assert got == want
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only on an exact result (a hang is caught by the parent's deadline)
        ok = _as_checksum(n, _native_checksum.copy_sums(srcs[0], dsts[0])) == want[0]
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("a copy in a forked child hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.usefixtures("native")
def test_pack_checksums_use_the_kernel_at_a_row_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PackChecksums.copy`` at nonzero row offsets gives the definition's numbers through ``finish``."""
    calls = []
    real = _native_checksum.copy_sums
    monkeypatch.setattr(_native_checksum, "copy_sums", lambda *a: calls.append(1) or real(*a))
    blobs = [_random(n, i) for i, n in enumerate([513, 5 * MiB + 123, 7])]
    starts = [512, 2048, 2048 + 512 * -(-(5 * MiB + 123) // 512)]
    buffer = torch.full((starts[-1] + 512,), 0xAB, dtype=torch.uint8)
    sums = PackChecksums(buffer)
    for start, blob in zip(starts, blobs, strict=True):
        sums.copy(start, blob)
    assert len(calls) == 3
    assert finish_checksums([b.numel() for b in blobs], sums.finish()) == [tensor_checksum(b) for b in blobs]
    for start, blob in zip(starts, blobs, strict=True):
        assert torch.equal(buffer[start : start + blob.numel()], blob)
        assert not buffer[start + blob.numel() : start + -(-blob.numel() // 512) * 512].any()


def _model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        ("big", torch.randn(2048, 1500, generator=g).to(torch.bfloat16)),  # 6 MB: chunked
        ("odd", torch.randn(1001, generator=g)),
        ("three", torch.tensor([1, 2, 3], dtype=torch.uint8)),
        ("bytes", torch.randint(-128, 127, (5 * MiB + 1,), dtype=torch.int8, generator=g)),
        ("view", torch.randn(64, 33, generator=g)[:, 1:]),  # not contiguous: packed from a copy
    ]


@pytest.mark.usefixtures("native")
def test_cache_build_checksums_are_the_same_with_the_kernel_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _native_checksum.copy_sums
    monkeypatch.setattr(_native_checksum, "copy_sums", lambda *a: calls.append(1) or real(*a))
    model = _model()
    want = compute_checksums(model)
    cache = VersionedBucketCache(16 * MiB)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(_native_checksum.ENV_SWITCH, switch)
        calls.clear()
        cache.build(int(switch), iter(model), checksums=True)
        with cache.read(1.0) as snap:
            results[switch] = dict(snap.checksums)
        assert len(calls) == (len(model) if switch == "1" else 0)  # the switch picks the path
    assert results["1"] == results["0"] == want


def _pack(blobs: list[torch.Tensor]) -> list[list[int]]:
    """The bucket checksums ``iter_buckets`` takes while packing ``blobs`` over stale bytes."""
    capacity = sum(-(-b.numel() // 512) * 512 for b in blobs)
    buffer = torch.full((capacity,), 0xAB, dtype=torch.uint8)
    (record,) = iter_buckets([(f"t{i}", b) for i, b in enumerate(blobs)], capacity, lambda _i, _n: buffer,
                             checksum_cpu=True)
    assert record.sums is not None
    return finish_checksums([b.numel() for b in blobs], record.sums)


@pytest.mark.usefixtures("fresh_kernel")
def test_missing_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(_native_checksum.ENV_SWITCH, raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    called = []
    monkeypatch.setattr(_native_checksum, "copy_sums", lambda *a: called.append(1))
    with caplog.at_level(logging.INFO, logger=_native_checksum.__name__):
        assert not _native_checksum.available()
        blobs = [_random(n, n) for n in (513, 5 * MiB + 123, 1)]
        assert _pack(blobs) == [tensor_checksum(b) for b in blobs]
    assert not called
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "no-such-cc" in caplog.text  # once, why
    assert not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.usefixtures("fresh_kernel")
def test_kernel_is_built_once_into_the_cache_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not shutil.which(os.environ.get("CC", "cc")):
        pytest.skip("no C compiler")
    monkeypatch.delenv(_native_checksum.ENV_SWITCH, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # a compiler that rejects -march=native gets the portable build
    flags = ("-O3", "-march=no-such-cpu", "-fPIC", "-shared")
    monkeypatch.setattr(_native_checksum, "_FLAG_SETS", (flags, _native_checksum._FLAG_SETS[1]))
    assert _native_checksum.available()
    (lib,) = (tmp_path / "rlix-plugins").iterdir()  # no temporary files left behind
    built = lib.stat().st_mtime_ns
    _native_checksum.reset()
    assert _native_checksum.available()
    assert list((tmp_path / "rlix-plugins").iterdir()) == [lib] and lib.stat().st_mtime_ns == built


@pytest.mark.usefixtures("fresh_kernel")
def test_a_kernel_that_disagrees_with_the_definition_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    if not shutil.which(os.environ.get("CC", "cc")):
        pytest.skip("no C compiler")
    monkeypatch.delenv(_native_checksum.ENV_SWITCH, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = _native_checksum.SOURCE.read_text()
    assert "out[1] = row_weighted;" in source
    broken = tmp_path / "broken.c"
    broken.write_text(source.replace("out[1] = row_weighted;", "out[1] = row_weighted + 1;"))
    monkeypatch.setattr(_native_checksum, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger=_native_checksum.__name__):
        assert not _native_checksum.available()
    assert "differ from the torch definition" in caplog.text
    blobs = [_random(n, n) for n in (700, 3)]
    assert _pack(blobs) == [tensor_checksum(b) for b in blobs]
