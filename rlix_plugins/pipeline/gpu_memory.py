"""GPU memory a process tree holds, per NVML: what a slept rollout rank still occupies.

Why not ``torch.cuda.mem_get_info``: it is device-wide (it counts co-tenant pipelines' training and engines on
the same GPU, so a post-sleep check on it fails wrongly on a shared GPU), and calling it creates a CUDA context
(~0.5-0.9 GiB) in a process that may not need one. NVML reads per-process usage without a context.

The tree is the calling process and its descendants: vLLM's V1 engine core runs in a child process.
``None`` when it cannot be measured (no NVML, no GPU, or the driver lists other PIDs: another PID namespace).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["process_tree_gpu_bytes", "process_tree_pids"]


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


def process_tree_gpu_bytes(root: int | None = None) -> int | None:
    """Device bytes held by ``root``'s process tree on all GPUs (NVML); ``None`` when not measurable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        pids = process_tree_pids(root)
        found = False
        total = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids:
                    found = True
                    total += int(proc.usedGpuMemory or 0)
        return total if found else None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
