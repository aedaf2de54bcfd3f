"""Host->device copy speed by where the host pages come from, chunk by chunk (GPU machine).

A host_pull sync copies from the sender's ``memfd`` pages; its copies ran at 20-55 GB/s within one sync while a
raw copy from ``cudaHostAlloc`` memory ran at 55. This measures, in one process and one run, the same 256 MiB
chunks copied several times from:

* ``cuda_host_alloc``: torch's pinned allocator (the raw baseline of ``benchmarks/transport.py``);
* ``memfd_4k``: a ``memfd`` with ordinary pages, ``cudaHostRegister``-ed (what the cache uses by default);
* ``memfd_thp``: the same with ``MADV_HUGEPAGE`` before the first touch (2 MiB pages where the kernel allows it);
* ``anon_thp``: anonymous memory with ``MADV_HUGEPAGE``, registered.

Per source: GB/s of every chunk in every pass (min / median / max) and the whole-buffer copy; the kernel's
huge-page settings and counters are printed next to them.

Usage: ``python benchmarks/host_pages.py [--gib 2] [--passes 3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlix_plugins.errors import TransportError
from rlix_plugins.transport._host_pull import _register, _unregister

CHUNK = 256 << 20


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


def _meminfo(*keys: str) -> dict[str, str]:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            out[name] = value.strip()
    return out


def _mapped(nbytes: int, *, memfd: bool, huge: bool) -> tuple[torch.Tensor, mmap.mmap]:
    if memfd:
        fd = os.memfd_create("rlix-host-pages")
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
    else:
        m = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)  # first touch: the pages are placed now
    _register(t, "host_pages buffer")
    return t, m


def measure(host: torch.Tensor, dev: torch.Tensor, passes: int) -> dict[str, Any]:
    rates: list[float] = []
    per_chunk: list[list[float]] = []
    for _ in range(passes):
        row = []
        for lo in range(0, host.numel(), CHUNK):
            hi = min(lo + CHUNK, host.numel())
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev[lo:hi].copy_(host[lo:hi], non_blocking=True)
            torch.cuda.synchronize()
            row.append((hi - lo) / (time.perf_counter() - t0) / 1e9)
        per_chunk.append([round(r, 1) for r in row])
        rates.extend(row)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    whole = host.numel() / (time.perf_counter() - t0) / 1e9
    return {"chunk_GBps_min": round(min(rates), 1), "chunk_GBps_median": round(statistics.median(rates), 1),
            "chunk_GBps_max": round(max(rates), 1), "whole_GBps": round(whole, 1), "per_pass": per_chunk}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_pages: needs a GPU", file=sys.stderr)
        return 2
    nbytes = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0), "bytes": nbytes,
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "nr_hugepages": _read("/proc/sys/vm/nr_hugepages"),
        "iommu_groups": len(os.listdir("/sys/kernel/iommu_groups")) if os.path.isdir("/sys/kernel/iommu_groups") else 0,
        "cmdline": _read("/proc/cmdline"),
    }
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    measure(host, dev, 1)  # warm-up: clocks, first-use costs
    out["cuda_host_alloc"] = measure(host, dev, args.passes)
    del host
    keep = []
    for name, memfd, huge in (("memfd_4k", True, False), ("memfd_thp", True, True), ("anon_thp", False, True)):
        before = _meminfo("ShmemHugePages", "AnonHugePages")
        try:
            t, m = _mapped(nbytes, memfd=memfd, huge=huge)
        except (OSError, RuntimeError, TransportError, AttributeError) as exc:
            out[name] = {"error": str(exc)}
            continue
        out[name] = {**measure(t, dev, args.passes), "meminfo_before": before,
                     "meminfo_after": _meminfo("ShmemHugePages", "AnonHugePages")}
        keep.append((t, m))
        print(name, {k: v for k, v in out[name].items() if k != "per_pass"}, flush=True)
    for t, _ in keep:
        _unregister(t)
    text = json.dumps(out, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
