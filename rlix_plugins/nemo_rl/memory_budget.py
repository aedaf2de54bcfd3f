"""How many pipelines one GPU and one host hold: the memory budget ``rlix recipe`` checks before it writes anything.

A GPU is owned by one cluster at a time (the scheduler's rule), so at most one phase of one pipeline is awake on it;
every other pipeline on that GPU still keeps something there while it sleeps. A pipeline's figures
(:func:`pipeline_memory`):

* **asleep on a GPU** (``gpu_asleep_gib``): its vLLM engine after a sleep (the CUDA context and non-pool
  allocations stay: :data:`ENGINE_ASLEEP_GIB`) and, on its training GPUs, its trainer after the offload (CUDA context,
  NCCL buffers: :data:`TRAINER_OFFLOADED_GIB`);
* **awake** (``gpu_awake_gib``): the larger of its rollout engine (vLLM takes ``gpu_memory_utilization`` of the GPU)
  and its trainer's step (parameters, gradients and Adam states at :data:`TRAIN_BYTES_PER_PARAM` bytes per
  parameter, plus :data:`ACTIVATION_MARGIN` for activations and logits);
* **host** (``host_gib``): its CPU bucket cache (the bf16 weights), the trainer's offloaded state (the same bytes per
  parameter as on the GPU) and its processes (driver, trainer, engine, collector, replay buffer, reward workers:
  :data:`PROCESSES_HOST_GIB`).

A GPU fits its pipelines when ``sum(asleep) + max(awake - asleep) <= GPU memory x GPU_SHARE``; the host fits them
when ``sum(host) <= host memory x HOST_SHARE - RAY_HOST_GIB``. The per-process figures are measured on an H200
(README "Real scale") and rounded up; a refusal names the budget that binds and its figures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.model_shape import ModelShape

GiB: Final = 1 << 30
#: A slept vLLM engine's device memory (its CUDA context and non-pool allocations; 0.82-0.89 GiB measured).
ENGINE_ASLEEP_GIB: Final = 1.0
#: A trainer's device memory after its offload (CUDA context, NCCL and allocator leftovers).
TRAINER_OFFLOADED_GIB: Final = 1.5
#: Full fine-tuning with Adam in mixed precision: fp32 parameters (4) + fp32 gradients (4) + two fp32 moments (8).
TRAIN_BYTES_PER_PARAM: Final = 16
#: Activations, logits over the vocabulary and allocator slack during a training step, as a share of the states.
ACTIVATION_MARGIN: Final = 0.3
#: Host memory of one pipeline's processes besides the cache and the offloaded trainer state.
PROCESSES_HOST_GIB: Final = 10.0
#: Ray's own processes on the node (GCS, raylet, agents, object store in use).
RAY_HOST_GIB: Final = 4.0
#: Shares of the memory the pipelines may plan for (the rest: allocator fragmentation, the OS, other users).
GPU_SHARE: Final = 0.95
HOST_SHARE: Final = 0.9


@dataclass(frozen=True)
class PipelineMemory:
    name: str
    gpu_asleep_gib: float  #: on a GPU it rolls out on (and trains on, when it does), while it sleeps there
    gpu_awake_gib: float  #: its largest awake phase on one GPU
    host_gib: float
    #: how the figures were made (for the refusal)
    detail: str


def pipeline_memory(name: str, shape: ModelShape, *, gpu_memory_gib: float, gpu_memory_utilization: float,
                    trains_here: bool = True, train_gpus: int = 1) -> PipelineMemory:
    """The memory figures of one pipeline training ``shape`` (see the module docstring). ``trains_here``: whether
    its trainer also lives on the GPU in question; ``train_gpus``: GPUs its trainer shards the states over."""
    params = shape.num_parameters
    states = params * TRAIN_BYTES_PER_PARAM
    trainer_gib = states / max(train_gpus, 1) * (1 + ACTIVATION_MARGIN) / GiB
    engine_gib = gpu_memory_utilization * gpu_memory_gib
    asleep = ENGINE_ASLEEP_GIB + (TRAINER_OFFLOADED_GIB if trains_here else 0.0)
    awake = max(engine_gib, trainer_gib if trains_here else 0.0)
    cache_gib = params * 2 / GiB
    host = cache_gib + states / GiB + PROCESSES_HOST_GIB
    detail = (f"{params / 1e9:.2f} B parameters: engine {engine_gib:.1f} GiB awake ({gpu_memory_utilization:g} x "
              f"{gpu_memory_gib:.0f} GiB), trainer {trainer_gib:.1f} GiB in a step; asleep {asleep:.1f} GiB; host: "
              f"cache {cache_gib:.1f} + offloaded trainer {states / GiB:.1f} + processes {PROCESSES_HOST_GIB:.0f} GiB")
    return PipelineMemory(name, asleep, awake, host, detail)


def gpu_need_gib(on_gpu: Sequence[PipelineMemory]) -> float:
    """Memory the pipelines on one GPU need at their worst moment: all asleep but the largest awake phase."""
    if not on_gpu:
        return 0.0
    return sum(p.gpu_asleep_gib for p in on_gpu) + max(p.gpu_awake_gib - p.gpu_asleep_gib for p in on_gpu)


def check_fits(by_gpu: Mapping[int, Sequence[PipelineMemory]], everyone: Sequence[PipelineMemory], *,
               gpu_memory_gib: float | None, host_memory_gib: float | None) -> None:
    """Refuse, naming the budget that binds and its figures, when the pipelines cannot fit. ``None``: that memory is
    unknown here (no GPU on this machine, say): its budget is not checked."""
    problems: list[str] = []
    if gpu_memory_gib is not None:
        budget = gpu_memory_gib * GPU_SHARE
        for gpu, on_gpu in sorted(by_gpu.items()):
            need = gpu_need_gib(on_gpu)
            if need > budget:
                biggest = max(on_gpu, key=lambda p: p.gpu_awake_gib)
                problems.append(
                    f"GPU memory: GPU {gpu} holds {len(on_gpu)} pipelines; asleep they keep "
                    f"{sum(p.gpu_asleep_gib for p in on_gpu):.1f} GiB and the largest awake phase ({biggest.name}) needs "
                    f"{biggest.gpu_awake_gib:.1f} GiB: {need:.1f} GiB > {budget:.1f} GiB ({GPU_SHARE:.0%} of "
                    f"{gpu_memory_gib:.0f} GiB) [{biggest.detail}]; use fewer pipelines per GPU, more GPUs, or a lower "
                    "policy.generation.vllm_cfg.gpu_memory_utilization")
    if host_memory_gib is not None:
        budget = host_memory_gib * HOST_SHARE - RAY_HOST_GIB
        need = sum(p.host_gib for p in everyone)
        if need > budget:
            each = ", ".join(f"{p.name} {p.host_gib:.1f}" for p in everyone)
            problems.append(
                f"host memory: {len(everyone)} pipelines need {need:.1f} GiB ({each}) > {budget:.1f} GiB "
                f"({HOST_SHARE:.0%} of {host_memory_gib:.0f} GiB less {RAY_HOST_GIB:.0f} GiB for Ray) "
                f"[{everyone[0].detail}]; use fewer pipelines or a smaller model")
    if problems:
        raise RlixConfigError("the pipelines do not fit in memory:\n  - " + "\n  - ".join(problems))


def local_gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this machine (NVML), or None without a GPU or NVML."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total for i in range(count)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: all mean "unknown here"
        return None
    return min(sizes) / GiB if sizes else None


def local_host_memory_gib() -> float:
    """MemTotal of this machine."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB


def describe(value: Any) -> str:
    return "unknown here" if value is None else f"{value:.0f} GiB"
