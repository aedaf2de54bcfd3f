"""Memory guards: fail before allocating, with the number to change, instead of OOM-ing mid-sync."""

from __future__ import annotations

import os
from typing import Final

import torch

from rlix_plugins.errors import TransportError

#: Fraction of ``MemAvailable`` the cache may take.
HOST_FRACTION: Final = 0.8
#: Fraction of a GPU's free memory a bucket plus scratch may take.
DEVICE_FRACTION: Final = 0.9
#: Default transport scratch reserved next to a bucket on a receiver GPU (NCCL buffers, checksums).
DEFAULT_SCRATCH_BYTES: Final = 128 << 20

GiB: Final = float(1 << 30)


def host_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (falls back to free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_host_capacity(nbytes: int, *, what: str, fraction: float = HOST_FRACTION, available: int | None = None) -> None:
    """Raise ``TransportError`` when ``nbytes`` more host memory would exceed ``fraction`` of what is available."""
    avail = host_available_bytes() if available is None else available
    if nbytes > fraction * avail:
        raise TransportError(
            f"{what} needs {nbytes / GiB:.2f} GiB of host memory but only {avail / GiB:.2f} GiB are available "
            f"(limit {fraction:.0%}); free host memory, use fewer co-located pipelines, or give the node more RAM"
        )


def device_free_bytes(device: torch.device | str | int) -> int:
    """Free bytes on a CUDA device, counting blocks this process's caching allocator holds but does not use."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    free, _ = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return int(free + max(cached, 0))


def check_device_capacity(
    bucket_bytes: int,
    device: torch.device | str,
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    fraction: float = DEVICE_FRACTION,
    free_bytes: int | None = None,
    what: str = "bucket",
    largest: tuple[str, int] | None = None,
) -> None:
    """Raise ``TransportError`` when ``bucket_bytes + scratch_bytes`` does not fit ``fraction`` of free memory.

    A no-op for CPU devices. ``free_bytes`` overrides the measurement (for pre-flight checks with a
    number a receiver reported). ``largest``: ``(name, bytes)`` of the largest tensor in what is checked
    (``BucketMeta.largest()``); when that tensor alone cannot fit, the error names it instead of a smaller
    bucket size (tensors are never split, so no bucket size helps).
    """
    dev = torch.device(device)
    if dev.type != "cuda" and free_bytes is None:
        return
    free = device_free_bytes(dev) if free_bytes is None else free_bytes
    need = bucket_bytes + scratch_bytes
    if need > fraction * free:
        fit = max(int(fraction * free) - scratch_bytes, 0)
        head = (f"{what} of {bucket_bytes / GiB:.3f} GiB + {scratch_bytes / GiB:.3f} GiB transport scratch does not fit "
                f"the {free / GiB:.3f} GiB free on {dev} (limit {fraction:.0%})")
        free_more = f"free GPU memory on {dev} (sleep the co-located engine, lower gpu_memory_utilization)"
        if largest is not None and largest[1] > fit:
            name, nbytes = largest
            raise TransportError(
                f"{head}: its largest tensor {name!r} alone has {nbytes / GiB:.3f} GiB and tensors are never split, "
                f"so no rlix.bucket_size_bytes makes it fit; {free_more}"
            )
        raise TransportError(f"{head}; lower rlix.bucket_size_bytes to at most {fit} bytes, or {free_more}")
