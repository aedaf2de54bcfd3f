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

``--route map`` instead calls the driver as vLLM's sleep-mode allocator does at a wake and a sleep (cuMemCreate,
Map, SetAccess / Unmap, Release) for a 2 MiB and a ``--gib`` block, with and without ``gpuDirectRDMACapable``, and
times copies right after each call.
"""

from __future__ import annotations

import argparse
import ctypes
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


class _Prop(ctypes.Structure):  # CUmemAllocationProp (CUDA 12/13 driver API)
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class DriverMapping:
    """cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess of ``nbytes`` on device 0, as vLLM's sleep-mode
    allocator maps memory at a wake (``rdma``: with ``gpuDirectRDMACapable``, which vLLM sets when the device
    supports GPUDirect RDMA with VMM); ``release`` unmaps and frees it, as a sleep does."""

    def __init__(self, nbytes: int, *, rdma: bool) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.nbytes = nbytes
        prop = _Prop(type=1, handle_types=0, loc_type=1, loc_id=0, rdma=1 if rdma else 0)
        self.handle = ctypes.c_ulonglong()
        self.ptr = ctypes.c_ulonglong()
        self._check("cuMemCreate", self.cu.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(nbytes),
                                                       ctypes.byref(prop), ctypes.c_ulonglong(0)))
        self._check("cuMemAddressReserve", self.cu.cuMemAddressReserve(
            ctypes.byref(self.ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0), ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0)))
        self._check("cuMemMap", self.cu.cuMemMap(self.ptr, ctypes.c_size_t(nbytes), ctypes.c_size_t(0), self.handle,
                                                 ctypes.c_ulonglong(0)))
        access = _Access(loc_type=1, loc_id=0, flags=3)
        self._check("cuMemSetAccess", self.cu.cuMemSetAccess(self.ptr, ctypes.c_size_t(nbytes), ctypes.byref(access),
                                                             ctypes.c_size_t(1)))

    @staticmethod
    def _check(what: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {rc}")

    def unmap_keep_address(self) -> None:
        """Unmap and free the memory but keep the address range, as vLLM's sleep does."""
        self._check("cuMemUnmap", self.cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.nbytes)))
        self._check("cuMemRelease", self.cu.cuMemRelease(self.handle))

    def remap(self, *, rdma: bool) -> None:
        """New memory into the kept address range, as vLLM's wake does."""
        prop = _Prop(type=1, handle_types=0, loc_type=1, loc_id=0, rdma=1 if rdma else 0)
        self._check("cuMemCreate", self.cu.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(self.nbytes),
                                                       ctypes.byref(prop), ctypes.c_ulonglong(0)))
        self._check("cuMemMap", self.cu.cuMemMap(self.ptr, ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                                 self.handle, ctypes.c_ulonglong(0)))
        access = _Access(loc_type=1, loc_id=0, flags=3)
        self._check("cuMemSetAccess", self.cu.cuMemSetAccess(self.ptr, ctypes.c_size_t(self.nbytes),
                                                             ctypes.byref(access), ctypes.c_size_t(1)))

    def release(self) -> None:
        self._check("cuMemUnmap", self.cu.cuMemUnmap(self.ptr, ctypes.c_size_t(self.nbytes)))
        self._check("cuMemRelease", self.cu.cuMemRelease(self.handle))
        self._check("cuMemAddressFree", self.cu.cuMemAddressFree(self.ptr, ctypes.c_size_t(self.nbytes)))


def map_route(torch: Any, src: Any, dst: Any, chunk: int, seconds: float, gib: float) -> dict[str, Any]:
    """Copy speed right after the driver calls of a vLLM wake / sleep, by size and by the RDMA flag."""
    out: dict[str, Any] = {}
    for size_name, nbytes in (("2MiB", 2 << 20), (f"{gib:g}GiB", int(gib * (1 << 30)))):
        for rdma in (False, True):
            time.sleep(1.0)
            t = time.perf_counter()
            mapping = DriverMapping(nbytes, rdma=rdma)
            took = time.perf_counter() - t
            name = f"map_{size_name}_{'rdma' if rdma else 'plain'}"
            out[name] = series(torch, src, dst, chunk, seconds)
            out[name + "_s"] = round(took, 4)
            time.sleep(1.0)
            mapping.release()
            out[name.replace("map_", "release_")] = series(torch, src, dst, chunk, seconds)
    for rdma in (False, True):  # vLLM keeps each allocation's address range over a sleep and maps new memory into it
        mappings = [DriverMapping(10 << 20, rdma=rdma) for _ in range(340)] + [DriverMapping(16 << 30, rdma=rdma)]
        for m in mappings:
            m.unmap_keep_address()
        time.sleep(1.0)
        for m in mappings:
            m.remap(rdma=rdma)
        name = f"remap_340x10MiB_16GiB_{'rdma' if rdma else 'plain'}"
        out[name] = series(torch, src, dst, chunk, seconds)
        for m in mappings:
            m.release()
    for rdma in (False, True):  # a vLLM wake maps one block per allocation: ~340 for a 1.5B model's weights
        time.sleep(1.0)
        t = time.perf_counter()
        mappings = [DriverMapping(10 << 20, rdma=rdma) for _ in range(340)]
        name = f"map_340x10MiB_{'rdma' if rdma else 'plain'}"
        out[name + "_s"] = round(time.perf_counter() - t, 4)
        out[name] = series(torch, src, dst, chunk, seconds)
        time.sleep(1.0)
        for m in mappings:
            m.release()
        out[name.replace("map_", "release_")] = series(torch, src, dst, chunk, seconds)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--route", choices=("malloc", "vmm", "map"), required=True)
    ap.add_argument("--gib", type=float, default=16.0, help="size of the block freed / allocated")
    ap.add_argument("--copy-mib", type=int, default=64, help="one timed copy")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--out", default="")
    ap.add_argument("--src", choices=("pinned", "memfd"), default="pinned",
                    help="copy source: cudaHostAlloc memory, or a registered memfd mapping as host_pull reads")
    args = ap.parse_args()
    if args.route == "vmm":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    chunk = args.copy_mib << 20
    if args.src == "memfd":  # as host_pull reads the cache: shared memory registered with cudaHostRegister
        from rlix_plugins.transport._host_pull import SharedHostBuffer

        shared = SharedHostBuffer(16 * chunk, pin=True)
        src = shared.tensor
    else:
        src = torch.empty(16 * chunk, dtype=torch.uint8).pin_memory()
    src.fill_(7)
    dst = torch.empty(16 * chunk, dtype=torch.uint8, device="cuda")
    dst.fill_(0)
    big = int(args.gib * (1 << 30))
    results: dict[str, Any] = {"route": args.route, "src": args.src, "gib": args.gib, "copy_mib": args.copy_mib,
                               "device": torch.cuda.get_device_name()}
    series(torch, src, dst, chunk, 0.3)  # warm-up
    results["idle"] = series(torch, src, dst, chunk, args.seconds)
    if args.route == "map":
        results.update(map_route(torch, src, dst, chunk, args.seconds, args.gib))
        for key, value in results.items():
            if isinstance(value, list):
                print(f"map    {key:24s} GB/s {summary(value)}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f)
        return 0

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
