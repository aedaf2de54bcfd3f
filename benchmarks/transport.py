"""Weight-transport benchmark: every number is a ratio against the raw primitive, measured in the same run.

* CPU: cache build (pack into reused buffers) vs a raw memcpy of the same bytes.
* GPU (>= 1 GPU): cache -> GPU push to a receiver process on the same GPU vs a raw pinned host->device copy: by
  ``host_pull`` (the receiver copies from the sender's pinned pages; the default: a bucket lands in one copy, the
  stand-in receiver's parameters being views of one buffer per bucket layout - the vLLM receiver's per-parameter
  copies are measured by ``expand.py``) and by ``cuda_ipc`` (sender GPU staging + IPC handle; the receiver copies
  every tensor into its own parameters, as vLLM's load does).
* GPU (>= 2 GPUs): NCCL per-sync broadcast (group created + destroyed per sync) from the pinned cache
  to a receiver process on GPU 1 vs a raw NCCL broadcast of one flat GPU buffer; and group
  setup+teardown time.

Usage: ``python benchmarks/transport.py [--sizes-gib 1 4] [--bucket-mib 256] [--cpu-only] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # the stand-in receiver is test harness (tests.harness), importable from the root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch

from rlix_plugins.transport import (
    GroupHost,
    VersionedBucketCache,
    build_comm_plan,
    sync_weights,
    wait_for_teardowns,
)
from tests.harness.local_receiver import SubprocessReceiver

MiB = 1 << 20
GiB = 1 << 30


def progress(msg: str) -> None:
    """Stage marker on stderr (a run cut off by a time limit still shows where it was)."""
    print(f"[transport-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_model(total_bytes: int, device: str) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors in a transformer-like size mix (32 MiB, 8 MiB, 22 MiB, 8 KiB) up to ``total_bytes``."""
    pattern = [(4096, 4096), (1024, 4096), (2816, 4096), (4096,)]
    out: list[tuple[str, torch.Tensor]] = []
    used = i = 0
    while used < total_bytes:
        shape = pattern[i % len(pattern)]
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        t.normal_()
        out.append((f"layers.{i // len(pattern)}.p{i % len(pattern)}", t))
        used += t.numel() * 2
        i += 1
    return out


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_cpu(total: int, bucket: int, repeats: int) -> dict[str, float]:
    model = make_model(total, "cpu")
    nbytes = sum(t.numel() * t.element_size() for _, t in model)
    cache = VersionedBucketCache(bucket, pin_memory=False)
    cache.build(0, iter(model), checksums=False)  # allocates the buffers once
    pack = best_of(lambda: cache.build(1, iter(model), checksums=False), repeats)
    pack_ck = best_of(lambda: cache.build(2, iter(model), checksums=True), repeats)  # best of as many runs as memcpy
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)
    raw = best_of(lambda: dst.copy_(src), repeats)
    return {
        "bytes": nbytes,
        "pack_GBps": nbytes / pack / 1e9,
        "memcpy_GBps": nbytes / raw / 1e9,
        "pack_vs_memcpy": raw / pack,
        "pack_with_checksums_vs_memcpy": raw / pack_ck,
    }


def _sync_timed(cache: VersionedBucketCache, plan: Any, eps: dict[int, Any], repeats: int) -> tuple[float, list[Any]]:
    reports = []

    def once() -> None:
        reports.append(sync_weights(cache, plan, eps, staging_device="cuda:0", master_addr="127.0.0.1", timeout_s=300))

    once()  # warm-up: first IPC open / NCCL init / receiver parameter allocation
    reports.clear()
    return best_of(once, repeats), reports


def raw_h2d(nbytes: int, repeats: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")

    def once() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    once()
    return best_of(once, repeats)


def raw_nccl_broadcast(ep: SubprocessReceiver, nbytes: int, repeats: int) -> float:
    """One flat GPU buffer, rank 0 (GPU 0) -> rank 1 (GPU 1), over the same kind of stateless group."""
    name = f"raw_{nbytes}"
    host = GroupHost(name, "nccl", "cuda:0", 120, "127.0.0.1")
    try:
        fut = ep.setup_collective_group(name, "127.0.0.1", host.port, {0: 1}, 2, "nccl", 120)
        host.join(2)
        fut.result(120)
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        flat.fill_(3)

        def once() -> None:
            call = ep.call_worker(0, "raw_broadcast", name, nbytes)
            host.broadcast(flat)
            call.result(120)

        once()
        return best_of(once, repeats)
    finally:
        host.close(clean=True)
        ep.destroy_collective_group(name).result(60)


def bench_gpu(sizes_gib: list[float], bucket: int, repeats: int) -> dict[str, Any]:
    two = torch.cuda.device_count() >= 2
    same = SubprocessReceiver(("cuda:0",), checksums=False)
    other = SubprocessReceiver(("cuda:1",), checksums=False) if two else None
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    try:
        for size in sizes_gib:
            progress(f"{size:g} GiB: building the cache")
            model = make_model(int(size * GiB), "cuda:0")
            nbytes = sum(t.numel() * t.element_size() for _, t in model)
            cache = VersionedBucketCache(bucket)
            t0 = time.perf_counter()
            cache.build(0, iter(model), checksums=False)
            first_build = time.perf_counter() - t0
            t0 = time.perf_counter()
            cache.build(1, iter(model), checksums=False)
            rebuild = time.perf_counter() - t0
            del model
            torch.cuda.empty_cache()
            h2d = raw_h2d(nbytes, repeats)
            row: dict[str, Any] = {
                "bytes": nbytes,
                "buckets": cache.num_buffers,
                "first_build_s(pins)": first_build,
                "rebuild_s(reuses pinned)": rebuild,
                "raw_h2d_GBps": nbytes / h2d / 1e9,
            }
            progress(f"{size:g} GiB: cuda_ipc push")
            ipc_plan = build_comm_plan((0, 0), {0: [(0, 0)]}, "cuda_ipc")
            push, push_reports = _sync_timed(cache, ipc_plan, {0: same}, repeats)
            best = min(push_reports, key=lambda r: r.transfer_seconds)
            row.update(push_GBps=nbytes / push / 1e9, push_vs_raw_h2d=h2d / push,
                       # where a push's time goes: the staging copies' GPU time (vs the one raw copy), the
                       # send->barrier time, and the whole transfer phase (no lock/report overhead)
                       push_copy_gpu_vs_raw_h2d=h2d / max(best.staging_copy_seconds, 1e-9),
                       push_transfer_vs_raw_h2d=h2d / best.transfer_seconds,
                       push_wire_s=best.wire_seconds, push_transfer_s=best.transfer_seconds, raw_h2d_s=h2d)
            progress(f"{size:g} GiB: host_pull push")
            pull_plan = build_comm_plan((0, 0), {0: [(0, 0)]}, "host_pull")
            pull, pull_reports = _sync_timed(cache, pull_plan, {0: same}, repeats)
            row.update(host_pull_GBps=nbytes / pull / 1e9, host_pull_vs_raw_h2d=h2d / pull,
                       host_pull_transfer_vs_raw_h2d=h2d / min(r.transfer_seconds for r in pull_reports))
            if other is not None:
                progress(f"{size:g} GiB: raw NCCL broadcast")
                bcast = raw_nccl_broadcast(other, nbytes, repeats)
                progress(f"{size:g} GiB: NCCL per-sync broadcast")
                nccl_plan = build_comm_plan((0, 0), {1: [(0, 1)]}, "cuda_ipc")
                ours, reports = _sync_timed(cache, nccl_plan, {1: other}, repeats)
                transfer = min(r.transfer_seconds for r in reports)
                wire = min(r.wire_seconds for r in reports)
                row.update(
                    raw_nccl_bcast_GBps=nbytes / bcast / 1e9,
                    sync_GBps=nbytes / ours / 1e9,
                    sync_transfer_vs_raw_bcast=bcast / transfer,
                    # the broadcast protocol alone (bucketed sends + receiver loads + barriers), without the
                    # host->device staging it overlaps: the part the per-sync group design can be blamed for
                    sync_wire_vs_raw_bcast=bcast / wire,
                    sync_transfer_vs_bottleneck=max(bcast, h2d) / transfer,
                    sync_transfer_vs_h2d_plus_bcast=(bcast + h2d) / transfer,
                    sync_total_vs_h2d_plus_bcast=(bcast + h2d) / ours,
                )
            results[f"{size:g}GiB"] = row
            cache.close()
            torch.cuda.empty_cache()
        if other is not None:
            progress("NCCL group setup+teardown")
            tiny = VersionedBucketCache(8 * MiB)
            tiny.build(0, iter([("w", torch.ones(MiB, device="cuda:0"))]), checksums=False)
            plan = build_comm_plan((0, 0), {1: [(0, 1)]}, "cuda_ipc")
            sync_weights(tiny, plan, {1: other}, staging_device="cuda:0", master_addr="127.0.0.1", timeout_s=120)
            lifecycle = []
            for _ in range(5):
                wait_for_teardowns(30)  # the previous sync's background NCCL abort (not part of the next sync)
                other.call_worker(0, "wait_for_teardowns").result(60)
                r = sync_weights(tiny, plan, {1: other}, staging_device="cuda:0", master_addr="127.0.0.1", timeout_s=120)
                lifecycle.append((r.setup_seconds, r.teardown_seconds, r.setup_seconds + r.transfer_seconds + r.teardown_seconds))
            results["nccl_group"] = {
                "setup_s_median": statistics.median(x[0] for x in lifecycle),
                "teardown_s_median": statistics.median(x[1] for x in lifecycle),
                "setup_plus_teardown_s_median": statistics.median(x[0] + x[1] for x in lifecycle),
                "whole_tiny_sync_s_median": statistics.median(x[2] for x in lifecycle),
            }
    finally:
        same.close()
        if other is not None:
            other.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--cpu-mib", type=int, default=256, help="model size for the CPU pack benchmark")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-only", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    bucket = args.bucket_mib * MiB
    results: dict[str, Any] = {"torch": torch.__version__, "bucket_bytes": bucket}
    progress("CPU pack vs memcpy")
    results["cpu"] = bench_cpu(args.cpu_mib * MiB, min(bucket, 64 * MiB), args.repeats)
    if not args.cpu_only and torch.cuda.is_available():
        results["gpu"] = bench_gpu(args.sizes_gib, bucket, args.repeats)
    text = json.dumps(results, indent=2, default=float)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
