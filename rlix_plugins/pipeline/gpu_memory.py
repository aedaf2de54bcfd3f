"""GPU memory a process tree holds, per NVML: what a slept rollout rank still occupies.

Why not ``torch.cuda.mem_get_info``: it is device-wide (it counts co-tenant pipelines' training and engines on
the same GPU, so a post-sleep check on it fails wrongly on a shared GPU), and calling it creates a CUDA context
(~0.5-0.9 GiB) in a process that may not need one. NVML reads per-process usage without a context.

The tree is the calling process and its descendants: vLLM's V1 engine core runs in a child process.
``None`` when it cannot be measured (no NVML, no GPU, or the driver lists other PIDs: another PID namespace).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rlix_plugins import envs

__all__ = [
    "fullest_gpu_bytes",
    "per_gpu_bytes",
    "process_tree_gpu_bytes",
    "process_tree_gpu_usage",
    "process_tree_pids",
    "release_cached_blocks",
    "settled_usage",
    "visible_gpu_free_bytes",
]

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: (pid, NVML GPU index, bytes): one process's memory on one GPU of its node
Usage = tuple[int, int, int]


def process_tree_pids(root: int | None = None) -> set[int]:
    """``root`` (default: this process) and all its descendants, from ``/proc`` (Linux)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # the process exited while we scanned
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def per_gpu_bytes(procs: dict[int, list[tuple[int, int]]], pids: set[int]) -> dict[int, int]:
    """``{GPU index: bytes}`` that ``pids`` hold, from NVML's ``{index: [(pid, used bytes), ...]}``; GPUs where none
    of them runs are left out."""
    out: dict[int, int] = {}
    for index, listed in procs.items():
        for pid, used in listed:
            if pid in pids:
                out[index] = out.get(index, 0) + used
    return out


def _nvml_read(read: Callable[[Any], T]) -> T | None:
    """``read(pynvml)`` between NVML's init and shutdown; ``None`` when NVML is missing or anything fails (no GPU,
    another PID namespace): what these readings are for is never worth an error."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        return read(pynvml)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def process_tree_gpu_usage(root: int | None = None) -> list[Usage] | None:
    """(pid, GPU index, bytes) of every process of ``root``'s tree that NVML lists on a GPU of this node; ``None``
    when not measurable."""

    def read(nvml: Any) -> list[Usage]:
        tree = process_tree_pids(root)
        return [(int(p.pid), index, int(p.usedGpuMemory or 0))
                for index in range(nvml.nvmlDeviceGetCount())
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(index))
                if p.pid in tree]

    return _nvml_read(read)


def release_cached_blocks(who: str) -> tuple[int, int] | None:
    """Hand the free blocks torch's caching allocator keeps in this process back to the driver
    (``torch.cuda.empty_cache``) and return (bytes in live tensors, bytes handed back); ``None`` where this process
    has no CUDA context (none is created, torch is not imported). vLLM's sleep empties the cache itself; what the
    engine frees after that (work still finishing when an abort put it to sleep) can stay cached, and NVML counts it as
    the rank's. The post-sleep readings call this first, so that they measure what the next tenant cannot get; the
    log (``who``: the process and when) says what live tensors a slept process still holds, the figure to read when a
    reading is over its limit."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    gc.collect()
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    live, freed = int(torch.cuda.memory_allocated()), int(reserved - torch.cuda.memory_reserved())
    if max(live, freed) >= 64 << 20:
        logger.info("rlix %s: %.2f GiB in live tensors, %.2f GiB of torch's cached blocks handed back",
                    who, live / (1 << 30), freed / (1 << 30))
    return live, freed


def settled_usage(who: str) -> list[Usage] | None:
    """:func:`process_tree_gpu_usage` of this process after :func:`release_cached_blocks`: what a slept process's
    tree holds that the next tenant cannot get (the post-sleep readings of a vLLM worker and its front-end)."""
    release_cached_blocks(who)
    return process_tree_gpu_usage()


def fullest_gpu_bytes(usages: Iterable[Iterable[Sequence[int]] | None]) -> int | None:
    """The bytes on the fullest GPU of several readings of one node (:func:`process_tree_gpu_usage` of a rank's
    front-end and of each of its TP workers): per GPU the sum over distinct processes (a process two readings list,
    a worker in its front-end's tree, counts once). ``None`` when no reading measured anything held."""
    seen: dict[tuple[int, int], int] = {}
    for usage in usages:
        for pid, index, used in usage or ():
            seen[(int(pid), int(index))] = int(used)
    procs: dict[int, list[tuple[int, int]]] = {}
    for (pid, index), used in seen.items():
        procs.setdefault(index, []).append((pid, used))
    held = per_gpu_bytes(procs, {pid for pid, _ in seen})
    return max(held.values()) if held else None


def process_tree_gpu_bytes(root: int | None = None) -> int | None:
    """Device bytes ``root``'s process tree holds on the one GPU where it holds the most (NVML); ``None`` when not
    measurable. Per GPU, not summed: the next tenant of a GPU loses what is left on THAT GPU, and a tensor-parallel
    rank's processes (one per GPU, each with its CUDA context and NCCL buffers) would otherwise count T times. A
    rank whose TP workers are not in its tree (vLLM's Ray executor) needs their readings too: :func:`fullest_gpu_bytes`."""
    return fullest_gpu_bytes([process_tree_gpu_usage(root)])


def visible_gpu_free_bytes() -> int | None:
    """Free bytes, device-wide, of the first GPU in ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), per NVML: no
    CUDA context in the calling process (``torch.cuda.mem_get_info`` would make one, ~0.5 GiB that then counts
    as the process's own). An index is taken as NVML's (PCI bus order, CUDA's too on a node of one GPU model); only
    logged, never checked. ``None`` when not measurable."""
    first = (envs.cuda_visible_devices() or "0").split(",")[0].strip()

    def read(nvml: Any) -> int:
        handle = nvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit() else nvml.nvmlDeviceGetHandleByUUID(first)
        return int(nvml.nvmlDeviceGetMemoryInfo(handle).free)

    return _nvml_read(read)
