"""Host-to-device copy speed right after GPU memory is freed or allocated (GPU only, torch only).

Why: inside a vLLM engine a weight copy runs at 27-34 GB/s for about half a second after ``wake_up()`` and at
53-55 GB/s later (benchmarks/expand.py, `copy_after_wake`). A wake maps freshly created physical memory and a
sleep releases it. This probe asks whether the driver's work on memory that changes hands (scrubbing it) is
what slows copies, by timing the same pinned->device copy in chunks, as a time series, after each event:

* ``idle``: nothing happened before (the baseline);
* ``after_free``: right after releasing a large block to the driver (``empty_cache``);
* ``after_alloc``: right after allocating a large block fresh from the driver;
* ``after_alloc_touch``: the same, after a kernel has written every byte of the new block;
* ``into_fresh``: copies into a block fresh from the driver, each chunk the first write to its pages.

Both allocation routes: cudaMalloc (torch's default) and cuMemCreate/cuMemMap (``expandable_segments``, the
route vLLM's sleep-mode allocator takes). Run each route in its own process:

    python benchmarks/after_free.py --route malloc --gib 16 --out malloc.json
    python benchmarks/after_free.py --route vmm --gib 16 --out vmm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def series(torch: Any, src: Any, dst: Any, chunk: int, seconds: float) -> list[tuple[float, float]]:
    """(seconds since start, GB/s) of back-to-back chunk copies for ``seconds``."""
    out = []
    start = time.perf_counter()
    n_src, n_dst = src.numel() // chunk, dst.numel() // chunk
    i = 0
    while time.perf_counter() - start < seconds:
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        k, j = i % n_src, i % n_dst
        a.record()
        dst[j * chunk:(j + 1) * chunk].copy_(src[k * chunk:(k + 1) * chunk], non_blocking=True)
        b.record()
        b.synchronize()
        out.append((round(time.perf_counter() - start, 4), round(chunk / (a.elapsed_time(b) / 1e3) / 1e9, 1)))
        i += 1
    return out


def summary(points: list[tuple[float, float]]) -> dict[str, float]:
    def mean(lo: float, hi: float) -> float:
        xs = [g for t, g in points if lo <= t < hi]
        return round(sum(xs) / len(xs), 1) if xs else 0.0
    return {"0-0.1s": mean(0, 0.1), "0.1-0.3s": mean(0.1, 0.3), "0.3-0.6s": mean(0.3, 0.6),
            "0.6-1s": mean(0.6, 1.0), "1-2s": mean(1.0, 2.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--route", choices=("malloc", "vmm"), required=True)
    ap.add_argument("--gib", type=float, default=16.0, help="size of the block freed / allocated")
    ap.add_argument("--copy-mib", type=int, default=64, help="one timed copy")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.route == "vmm":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    chunk = args.copy_mib << 20
    src = torch.empty(16 * chunk, dtype=torch.uint8).pin_memory()
    src.fill_(7)
    dst = torch.empty(16 * chunk, dtype=torch.uint8, device="cuda")
    dst.fill_(0)
    big = int(args.gib * (1 << 30))
    results: dict[str, Any] = {"route": args.route, "gib": args.gib, "copy_mib": args.copy_mib,
                               "device": torch.cuda.get_device_name()}
    series(torch, src, dst, chunk, 0.3)  # warm-up
    results["idle"] = series(torch, src, dst, chunk, args.seconds)

    block = torch.empty(big, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    time.sleep(2.0)
    del block
    torch.cuda.empty_cache()  # the physical memory goes back to the driver
    results["after_free"] = series(torch, src, dst, chunk, args.seconds)

    time.sleep(2.0)
    t = time.perf_counter()
    block = torch.empty(big, dtype=torch.uint8, device="cuda")  # fresh from the driver
    results["alloc_s"] = round(time.perf_counter() - t, 4)
    results["after_alloc"] = series(torch, src, dst, chunk, args.seconds)
    del block
    torch.cuda.empty_cache()

    time.sleep(2.0)
    block = torch.empty(big, dtype=torch.uint8, device="cuda")
    t = time.perf_counter()
    block.fill_(2)
    torch.cuda.synchronize()
    results["touch_s"] = round(time.perf_counter() - t, 4)
    results["after_alloc_touch"] = series(torch, src, dst, chunk, args.seconds)
    del block
    torch.cuda.empty_cache()

    time.sleep(2.0)
    block = torch.empty(big, dtype=torch.uint8, device="cuda")
    results["into_fresh"] = series(torch, src, block, chunk, args.seconds)
    del block
    torch.cuda.empty_cache()

    for key in ("idle", "after_free", "after_alloc", "after_alloc_touch", "into_fresh"):
        print(f"{args.route:6s} {key:18s} GB/s {summary(results[key])}")
    print(f"{args.route:6s} alloc {results['alloc_s']} s, first fill of the block {results['touch_s']} s "
          f"({big / results['touch_s'] / 1e9:.0f} GB/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
