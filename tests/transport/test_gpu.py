"""GPU weight sync (device machine only): CUDA IPC same-GPU handoff, pinned-cache push, NCCL per-sync
broadcast on 2 GPUs. Bit-exact, verified, and free GPU memory back to its level after every sync."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.transport import VersionedBucketCache, build_comm_plan, sync_weights, wait_for_teardowns
from tests.harness.local_receiver import SubprocessReceiver

pytestmark = pytest.mark.gpu

BUCKET = 16 << 20
#: Allowed drift of device-wide free memory across one sync (allocator/driver granularity).
MEM_SLACK = 16 << 20


def _model(version: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(version)
    out = [(f"layers.{i}.w", torch.randn(1024, 1024 + 8 * i, generator=g, device=device).bfloat16()) for i in range(24)]
    out.append(("embed", torch.randn(2048, 1024, generator=g, device=device)))  # 8 MiB fp32
    out.append(("step", torch.tensor(version, device=device)))
    out.append(("mask", torch.rand(1001, generator=g, device=device) > 0.5))
    if hasattr(torch, "float8_e4m3fn"):
        out.append(("fp8", torch.randn(333, 77, generator=g, device=device).to(torch.float8_e4m3fn)))
    return out


def _free(devices: list[int]) -> list[int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the build's checksum scratch must not count as "freed by the sync"
    return [int(torch.cuda.mem_get_info(d)[0]) for d in devices]


def _assert_bit_exact(ep: SubprocessReceiver, model: list[tuple[str, torch.Tensor]]) -> None:
    got = ep.call_worker(0, "tensors").result(60)
    for name, t in model:
        assert got[name][2] == t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), name


def _cycles(
    cache: VersionedBucketCache,
    plan_targets: dict[int, list[tuple[int, int]]],
    endpoints: dict[int, SubprocessReceiver],
    transport: str,
    devices: list[int],
    cycles: int = 3,
) -> list[list[int]]:
    """Run ``cycles`` syncs; from the second on, free memory after >= before - slack. Returns the drops."""
    plan = build_comm_plan((0, 0), plan_targets, transport)  # type: ignore[arg-type]
    deltas = []
    for version in range(cycles):
        model = _model(version, "cuda:0")
        cache.build(version, iter(model))
        before = _free(devices)
        report = sync_weights(cache, plan, endpoints, staging_device="cuda:0", master_addr="127.0.0.1",
                              timeout_s=120, verify=True)
        # NCCL groups are aborted in the background after a successful sync: memory is back once that finished
        assert wait_for_teardowns(30) and all(ep.call_worker(0, "wait_for_teardowns").result(60) for ep in endpoints.values())
        after = _free(devices)
        assert report.verified and report.num_buckets >= 3
        for ep in endpoints.values():
            _assert_bit_exact(ep, model)
            assert ep.call_worker(0, "state").result(30)["groups"] == []
        delta = [b - a for b, a in zip(before, after, strict=True)]
        deltas.append(delta)
        if version >= 1:  # cycle 0 allocates the receivers' persistent parameters
            assert all(d <= MEM_SLACK for d in delta), f"cycle {version}: free memory dropped by {delta} bytes"
    print(f"[{transport}] free-memory drop per sync (bytes, per device {devices}): {deltas}")
    return deltas


@pytest.fixture(scope="module")
def same_gpu_receiver() -> Iterator[SubprocessReceiver]:
    ep = SubprocessReceiver(("cuda:0",))
    yield ep
    ep.close()


def test_cuda_ipc_same_gpu_handoff(same_gpu_receiver: SubprocessReceiver) -> None:
    cache = VersionedBucketCache(BUCKET)
    assert cache.pin_memory
    _cycles(cache, {0: [(0, 0)]}, {0: same_gpu_receiver}, "cuda_ipc", [0])


def test_host_pull_same_gpu(same_gpu_receiver: SubprocessReceiver) -> None:
    """The receiver maps the cache's pinned pages once and copies from them; no sender GPU memory at all."""
    cache = VersionedBucketCache(BUCKET)
    assert cache.shared and cache.pin_memory
    _cycles(cache, {0: [(0, 0)]}, {0: same_gpu_receiver}, "host_pull", [0])
    cache.close()


def test_pinned_cache_push_cpu_serialize(same_gpu_receiver: SubprocessReceiver) -> None:
    """The locked-down path: pinned cache bytes to a GPU receiver without CUDA IPC; buffers stay pinned."""
    cache = VersionedBucketCache(BUCKET)
    _cycles(cache, {0: [(0, 0)]}, {0: same_gpu_receiver}, "cpu_serialize", [0], cycles=2)
    assert cache.num_buffers >= 3 and all(b.is_pinned() for b in cache._buffers)


def test_nccl_per_sync_broadcast_two_gpus(same_gpu_receiver: SubprocessReceiver) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    other = SubprocessReceiver(("cuda:1",))
    try:
        cache = VersionedBucketCache(BUCKET)
        _cycles(cache, {0: [(0, 0)], 1: [(0, 1)]}, {0: same_gpu_receiver, 1: other}, "cuda_ipc", [0, 1])
    finally:
        other.close()


def test_device_view_reads_pinned_pages_with_a_kernel() -> None:
    """``device_view``: the mapped, pinned cache pages as a CUDA tensor (no copy); a copy kernel reading it lands the
    pages' bytes, and the view follows later writes to the pages (it is the pages, not a snapshot)."""
    from rlix_plugins.transport import SharedHostBuffer, device_view, map_host_buffer

    buf = SharedHostBuffer(8 << 20, pin=True)
    try:
        buf.tensor.copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8))
        pages = map_host_buffer(buf.handle, pin=True)
        view = device_view(pages, torch.device("cuda", 0))
        assert view.is_cuda and view.data_ptr() == pages.data_ptr() and view.numel() == pages.numel()
        out = torch.empty(1 << 20, dtype=torch.int64, device="cuda:0")
        torch._foreach_copy_([out], [view.view(torch.int64)])
        assert torch.equal(out.view(torch.uint8).cpu(), buf.tensor)
        buf.tensor[:8].fill_(7)
        torch._foreach_copy_([out[:1]], [view.view(torch.int64)[:1]])
        assert out.view(torch.uint8)[:8].cpu().tolist() == [7] * 8
    finally:
        buf.close()


def test_copy_kernel_lands_pinned_pages_in_every_word_size() -> None:
    """The SM copy kernel (an expand's reads): rows from the device view of pinned pages into scattered destinations,
    longer than a span and in each word size the addresses allow, land exactly those bytes and nothing else."""
    pytest.importorskip("triton")
    from rlix_plugins.transport import SharedHostBuffer, device_view, map_host_buffer
    from rlix_plugins.transport import _copy_kernel as kernel

    dev = torch.device("cuda", 0)
    assert kernel.copy_kernel_ok(dev)
    size = 3 * kernel.SPAN_BYTES + 64
    buf = SharedHostBuffer(size, pin=True)
    try:
        buf.tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
        source = device_view(map_host_buffer(buf.handle, pin=True), dev).data_ptr()
        out = torch.zeros(2 * size, dtype=torch.uint8, device=dev)
        base = out.data_ptr()
        for copies, word in (
            ([(base + size, 0, size)], 8),  # several spans
            ([(base + 8, 64, 2 * kernel.SPAN_BYTES + 128), (base + size + 4, 4, 12)], 4),  # two copies, out of order
            ([(base + 2, 6, 10)], 2),
            ([(base + 3, 5, 6)], 1),
        ):
            out.zero_()
            plan = kernel.kernel_copies(source, copies, dev)
            assert plan is not None and plan.word == word
            plan.launch()
            want = torch.zeros(2 * size, dtype=torch.uint8)
            for dst, lo, hi in copies:
                want[dst - base : dst - base + hi - lo] = buf.tensor[lo:hi]
            assert torch.equal(out.cpu(), want), copies
    finally:
        buf.close()


def test_checksum_kernel_matches_the_definition() -> None:
    """The triton checksum kernel (one launch over the pieces where they lie) gives the torch form's numbers:
    items of one and of several pieces, one longer than a span, an empty one, words with the top bit set (the
    products and sums wrap modulo 2**32); after its self-check a direct pull gets it, and a piece with trailing
    bytes keeps the torch form."""
    pytest.importorskip("triton")
    from rlix_plugins.transport import _checksum_kernel as kernel
    from rlix_plugins.transport import finish_checksums, start_checksums

    g = torch.Generator(device="cuda:0").manual_seed(3)

    def blob(nbytes: int) -> torch.Tensor:
        return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8, device="cuda:0")

    big = blob(4 * kernel.SPAN_WORDS * 2 + 4 * 700)  # two spans and a partial one
    parts = [blob(512 * 3), blob(4 * 129), blob(4 * 1000)]
    items = [[big], parts, [], [blob(4)], [torch.full((4096,), 255, dtype=torch.uint8, device="cuda:0")]]
    want = finish_checksums([sum(p.numel() for p in it) for it in items],
                            start_checksums([torch.cat(it) if it else big[:0] for it in items]))
    table = kernel.table_for(items)
    assert table is not None and len([r for r in table if r[3] == 0]) == 3
    got = finish_checksums(kernel.KernelChecksums(items, table).nbytes, kernel.KernelChecksums(items, table).start())
    assert got == want
    assert kernel.self_check(items, want)
    assert isinstance(kernel.kernel_checksums(items), kernel.KernelChecksums)
    assert kernel.kernel_checksums([[blob(6)]]) is None  # 1-3 trailing bytes: the torch form
