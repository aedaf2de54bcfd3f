"""How many pipelines one GPU and one host hold: the memory budget ``rlix recipe`` checks before it writes anything.

The budget is the worst case without co-residence: one phase of one pipeline awake on a GPU at a time, while every
other pipeline on that GPU still keeps something there asleep (the scheduler wakes more phases side by side only
where their figures fit: ``control.scheduling.coresidence``). A pipeline's figures
(:func:`pipeline_memory`):

* **asleep on a GPU** (``gpu_asleep_gib``): its vLLM engine after a sleep (CUDA context and non-pool allocations:
  :func:`engine_asleep_gib`) and, on its training GPUs, its trainer after the offload (CUDA context, NCCL and
  allocator leftovers: :data:`TRAINER_OFFLOADED_GIB`);
* **awake** (``gpu_awake_gib``): the largest of its start-up (the engine just initialised, ``gpu_memory_utilization``
  of the GPU plus its context, next to the trainer's freshly loaded policy and reference weights,
  :data:`TRAINER_LOADED_BYTES_PER_PARAM`), its rollout (the engine alone) and its training step
  (:func:`step_gib`: per parameter, plus the logits of one micro-batch);
* **host** (``host_gib``): its trainer process, which holds the offloaded weights, gradients, Adam moments and the
  reference model, plus the CPU bucket cache (:data:`TRAINER_HOST_BYTES_PER_PARAM`), and its other processes
  (driver, engine, collector, replay buffer, reward workers: :data:`PROCESSES_HOST_GIB`).

The scheduler gets each cluster's figures too (:func:`cluster_memory`, ``rlix.memory``): with them a pipeline's rollout
may run next to another pipeline's training step where both fit (co-residence, DESIGN §4).

A GPU fits its pipelines when ``sum(asleep) + max(awake - asleep) <= GPU memory x GPU_SHARE``; the host fits them
when ``sum(host) <= host memory x HOST_SHARE - RAY_HOST_GIB``. The figures were measured on an H200 with NeMo RL's
stock ``grpo_math_1B`` (DTensor v1, micro-batch 4 x 1,024 tokens) at the Qwen2.5-1.5B shape, two pipelines on one GPU
(``benchmarks/results/h200-2026-11-26-real-scale/``), and rounded up; the host figures fit two shapes (1.5B and
0.5B). A refusal names the budget that binds and its figures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.model_shape import ModelShape

GiB: Final = 1 << 30
#: A slept vLLM engine's device memory: 0.96 GiB measured on an H200 (weights taken by host_pull only), 1.18 GiB on an
#: H100 once it had received weights over NCCL (a rollout rank outside its pipeline's training GPUs does), 1.42 GiB
#: the most of 13 sleeps of an engine that ``rlix recipe`` sized (1,024 sequences, CUDA graphs, Qwen2.5-1.5B shape,
#: H200). Two other sleeps read 2.33 GiB; readings since hand torch's cached blocks back first and log the live
#: tensors, which says whether that was cache or live memory.
ENGINE_ASLEEP_GIB: Final = 1.5
#: The same of an engine of vLLM tensor parallel > 1, on each of its GPUs: its TP communicators (NCCL's buffers,
#: vLLM's all-reduce buffers) come on top; 2.12-2.22 GiB measured per GPU at TP 2 on H200s (a tiny model and
#: Qwen2.5-1.5B under NeMo RL).
ENGINE_ASLEEP_TP_GIB: Final = 2.5
#: vLLM's working memory on each GPU of an engine beside its weights and KV cache: the profile run's activations
#: and sampler, CUDA graphs, non-torch allocations (cuBLAS workspaces, NCCL). 0.63 GiB measured on an H200 at the
#: Qwen2.5-1.5B shape (0.35 GiB profiled + 0.28 GiB of CUDA graphs; the engine's log: 69.9 GiB share, weights 2.98,
#: KV cache 66.57); taken three times over, because an engine whose share does not cover it does not start. The MLP
#: activations of a profile batch come on top (:data:`ENGINE_BATCH_TOKENS`).
ENGINE_WORK_GIB: Final = 2.0
#: The tokens one engine step runs (``max_num_batched_tokens``) that ``rlix recipe`` writes unless the recipe says:
#: vLLM's profile batch, whose MLP activations (gate and up projections, bf16) an engine's share must hold, and what
#: a running engine holds beyond its share grows a little with it (:data:`ENGINE_RUN_BYTES_PER_TOKEN_VOCAB`). A
#: quarter of what vLLM's synchronous engine runs on H100/H200-class GPUs (16,384): decode steps, at most
#: :data:`ENGINE_MAX_SEQS` tokens, are never cut, and a 1.5B engine decoded a step's rollout as fast at either.
ENGINE_BATCH_TOKENS: Final = 4096
#: What a running engine holds beyond its share (weights, KV cache and the activations vLLM profiled), in bytes per
#: vocabulary entry of each sequence it may run at once (``max_num_seqs``) and of each token of its step batch
#: (``max_num_batched_tokens``). Measured on an H200 under NeMo RL at the Qwen2.5-1.5B shape (vocabulary 151,936),
#: as the awake engine process's GPU memory beyond its share, less its context and the two sync buffers the figure
#: counts apart: 9.2 GiB at 1,024 sequences / 4,096 tokens (45.1 GiB on a 33.6 GiB share from its first rollout on,
#: eager), 13.9 GiB at 1,024 / 16,384 (its sleep freed that much beyond the sleep-mode pools; CUDA graphs), 0.94 GiB
#: at 128 / 2,048. A lone engine of 1,024 / 4,096 with CUDA graphs and no sleep held 1.8 GiB beyond its share
#: (``benchmarks/engine_share.py``), so the growth comes with time-sharing's engines, not with the batch alone; it
#: follows the sequences far more than the tokens (4x the tokens added 4.7 GiB). With CUDA graphs the engines of a
#: pair held 46.1 and 46.5 GiB at 1,024 / 4,096 (one alone 45.7), 1.1 GiB over what 52 bytes planned; a lone engine
#: grew 6.4 GiB at its first rollout with sleep mode on (graphs or eager) and none without it, so the growth is sleep
#: mode's (``benchmarks/results/h200x2-2026-11-30-kept-token-only-pair/``). 61 and 3 bytes cover every measurement.
#: At 512 / 4,096 the engines of a pair held 22.0 GiB on a 19.7 GiB share (2.4 beyond it; 6.2 figured), and a lone
#: engine of 1,024 with torch's expandable segments grew 0.9 GiB instead of 6.4: the growth is the allocator's
#: fragmentation, not a cost per sequence, so the figure is high below 1,024 (kept: it errs on the side that fits).
ENGINE_RUN_BYTES_PER_SEQ_VOCAB: Final = 61
ENGINE_RUN_BYTES_PER_TOKEN_VOCAB: Final = 3
#: The most sequences ``rlix recipe`` lets one engine run at once unless the recipe says (``max_num_seqs``: vLLM's
#: synchronous engine's default on H100/H200-class GPUs; its async engine's is 128): more requests than that wait in
#: its queue and need no KV cache yet.
ENGINE_MAX_SEQS: Final = 1024
#: The fewest sequences ``rlix recipe`` lets an engine run at once where a smaller engine lets more phases share a
#: GPU (``recipe._engine_seqs``). Measured on an H200 at the Qwen2.5-1.5B shape, one engine decoding a two-step
#: rollout (1,024 requests x 512 tokens, token-only, CUDA graphs, sleep mode): 512 at once 25,303 tokens/s, 1,024
#: at once 17,932 (0.71x, same run: the sampler's work over the vocabulary grows with the sequences of each step),
#: 256 at once 20,435 (~0.81x of 512, another machine). Fewer were not measured.
ENGINE_MIN_SEQS: Final = 256
#: A trainer's device memory after its offload (2.7 GiB measured for a DTensor worker).
TRAINER_OFFLOADED_GIB: Final = 3.0
#: A trainer that keeps its states on the GPU between steps (``rlix.offload_trainer: false``) holds its fp32 weights
#: and both Adam moments there, per parameter of its shard, on top of :data:`TRAINER_OFFLOADED_GIB` (NeMo RL's
#: DTensor trainer frees its gradients after each step).
TRAINER_RESIDENT_BYTES_PER_PARAM: Final = 12
#: A trainer right after it loaded (fp32 policy and reference weights; 11.6 GiB measured at 1.54 B parameters).
TRAINER_LOADED_BYTES_PER_PARAM: Final = 8
#: A training step: fp32 weights, gradients and Adam moments (16 bytes) and the activations that grow with the model,
#: per parameter, plus :data:`TRAINER_STEP_LOGIT_BYTES` of vocabulary logits per micro-batch token. Fitted to two
#: shapes of one vocabulary (151,936) at micro-batch 4 x 1,024 tokens on an H200: 42.7 GiB at 1.54 B parameters, 20.2
#: GiB at 0.49 B (four 0.5B pipelines, a step's share read from three GPU states; 30 bytes per parameter alone, fitted
#: to the first, planned 13.9), and rounded up: 44.3 and 20.9 GiB.
TRAINER_STEP_BYTES_PER_PARAM: Final = 24
#: Bytes per vocabulary entry per micro-batch token of a training step (fp32 logits and their copies: softmax,
#: gradient; ~4 x 4 bytes).
TRAINER_STEP_LOGIT_BYTES: Final = 17
#: The micro-batch a step's logits are counted for when the recipe does not say (NeMo RL's stock ``grpo_math_1B``:
#: ``train_micro_batch_size`` 4 x ``max_total_sequence_length`` 512).
DEFAULT_STEP_TOKENS: Final = 4 * 512
#: A pipeline's host memory grows with the model by this much (its trainer's offloaded weights, gradients, Adam
#: moments, reference model and the bucket cache) on top of :data:`PROCESSES_HOST_GIB`. Both come from a fit to two
#: measured shapes (peak host use per pipeline over a whole run): 49.5 GiB at 1.54 B parameters (two pipelines),
#: 27.8 GiB at 0.49 B (four pipelines; 27.5 alone).
TRAINER_HOST_BYTES_PER_PARAM: Final = 22
#: A pipeline's host memory that does not follow the model: its processes (driver, engine, collector, replay buffer,
#: reward workers) and the trainer's fixed part (libraries, CUDA host state).
PROCESSES_HOST_GIB: Final = 17.5
#: Ray's own processes on the node (GCS, raylet, agents, the control plane: 2.2 GiB used before the first driver).
RAY_HOST_GIB: Final = 2.5
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


def engine_asleep_gib(tp: int = 1) -> float:
    """What a slept vLLM engine of ``tp`` GPUs keeps on each of them."""
    return ENGINE_ASLEEP_TP_GIB if tp > 1 else ENGINE_ASLEEP_GIB


def engine_run_gib(shape: ModelShape, batched_tokens: int = ENGINE_BATCH_TOKENS,
                   max_seqs: int = ENGINE_MAX_SEQS) -> float:
    """What a running engine holds on each GPU beyond its ``gpu_memory_utilization`` share, running up to
    ``max_seqs`` sequences and ``batched_tokens`` tokens a step (:data:`ENGINE_RUN_BYTES_PER_SEQ_VOCAB`)."""
    return (max_seqs * ENGINE_RUN_BYTES_PER_SEQ_VOCAB
            + batched_tokens * ENGINE_RUN_BYTES_PER_TOKEN_VOCAB) * shape.vocab_size / GiB


def engine_awake_gib(shape: ModelShape, *, gpu_memory_gib: float, gpu_memory_utilization: float, tp: int = 1,
                     engine_tokens: int = ENGINE_BATCH_TOKENS, engine_seqs: int = ENGINE_MAX_SEQS) -> float:
    """An awake engine on each of its GPUs: its share, its context (what it keeps asleep) and what it holds beyond
    its share running ``engine_seqs`` sequences and ``engine_tokens`` tokens a step."""
    return (gpu_memory_utilization * gpu_memory_gib + engine_asleep_gib(tp)
            + engine_run_gib(shape, engine_tokens, engine_seqs))


def kv_bytes_per_token(shape: ModelShape, tp: int = 1, dtype_bytes: int = 2) -> int:
    """KV cache bytes of one token on each GPU of an engine of ``tp`` GPUs: keys and values of every layer's KV heads
    (split over the GPUs, or replicated where there are fewer heads than GPUs), in the model's dtype."""
    return 2 * shape.num_hidden_layers * math.ceil(shape.num_key_value_heads / tp) * shape.head_dim * dtype_bytes


def engine_need_gib(shape: ModelShape, *, requests: int, max_model_len: int, tp: int = 1,
                    max_seqs: int = ENGINE_MAX_SEQS, batched_tokens: int = ENGINE_BATCH_TOKENS) -> float:
    """What one vLLM engine needs on each of its ``tp`` GPUs to hold ``requests`` requests of up to ``max_model_len``
    tokens at once (at most ``max_seqs`` run together; the rest wait in its queue): bf16 weights, their KV cache, a
    profile batch's (``batched_tokens``) MLP activations and :data:`ENGINE_WORK_GIB`. More gives the engine nothing
    (vLLM cannot use KV cache beyond the tokens of what runs); less makes requests wait for cache."""
    weights = shape.num_parameters * 2 / tp
    kv = min(requests, max_seqs) * max_model_len * kv_bytes_per_token(shape, tp)
    activations = batched_tokens * 2 * shape.intermediate_size * 2 / tp
    return (weights + kv + activations) / GiB + ENGINE_WORK_GIB


def trainer_idle_gib(shape: ModelShape, train_gpus: int = 1, *, resident: bool = False) -> float:
    """What a trainer keeps on each of its GPUs between steps: after its offload, or with its states resident."""
    shard = shape.num_parameters / max(train_gpus, 1)
    return TRAINER_OFFLOADED_GIB + (shard * TRAINER_RESIDENT_BYTES_PER_PARAM / GiB if resident else 0.0)


def step_gib(shape: ModelShape, train_gpus: int = 1, step_tokens: int = DEFAULT_STEP_TOKENS) -> float:
    """A training step's device memory on each of its ``train_gpus`` GPUs: the model's share (its states sharded over
    them) and the logits of one micro-batch of ``step_tokens`` tokens (every GPU computes its own)."""
    shard = shape.num_parameters / max(train_gpus, 1)
    return (shard * TRAINER_STEP_BYTES_PER_PARAM + step_tokens * shape.vocab_size * TRAINER_STEP_LOGIT_BYTES) / GiB


def pipeline_memory(name: str, shape: ModelShape, *, gpu_memory_gib: float, gpu_memory_utilization: float,
                    trains_here: bool = True, train_gpus: int = 1,
                    step_tokens: int = DEFAULT_STEP_TOKENS, tp: int = 1,
                    engine_tokens: int = ENGINE_BATCH_TOKENS, engine_seqs: int = ENGINE_MAX_SEQS,
                    trainer_resident: bool = False) -> PipelineMemory:
    """The memory figures of one pipeline training ``shape`` (see the module docstring). ``trains_here``: whether
    its trainer also lives on the GPU in question; ``train_gpus``: GPUs its trainer shards the states over;
    ``step_tokens``: tokens of one training micro-batch; ``tp``: its vLLM engines' tensor parallel size;
    ``engine_tokens`` / ``engine_seqs``: their ``max_num_batched_tokens`` / ``max_num_seqs``;
    ``trainer_resident``: its trainer keeps its states on the GPU between steps."""
    params = shape.num_parameters
    shard = params / max(train_gpus, 1)
    engine_gib = engine_awake_gib(shape, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
                                  tp=tp, engine_tokens=engine_tokens, engine_seqs=engine_seqs)
    step = step_gib(shape, train_gpus, step_tokens) if trains_here else 0.0
    start_gib = engine_gib + (shard * TRAINER_LOADED_BYTES_PER_PARAM / GiB if trains_here else 0.0)
    asleep = engine_asleep_gib(tp) + (trainer_idle_gib(shape, train_gpus, resident=trainer_resident)
                                      if trains_here else 0.0)
    awake = max(start_gib, engine_gib, step)
    trainer_host = params * TRAINER_HOST_BYTES_PER_PARAM / GiB
    host = trainer_host + PROCESSES_HOST_GIB
    detail = (f"{params / 1e9:.2f} B parameters: engine {engine_gib:.1f} GiB awake ({gpu_memory_utilization:g} x "
              f"{gpu_memory_gib:.0f} GiB + context + what it holds beyond its share), start-up {start_gib:.1f}, "
              f"training step {step:.1f}, asleep {asleep:.1f} GiB; host: trainer {trainer_host:.1f} (offloaded "
              f"states, reference model, bucket cache) + processes {PROCESSES_HOST_GIB:.0f} GiB")
    return PipelineMemory(name, asleep, awake, host, detail)


def cluster_memory(shape: ModelShape, *, gpu_memory_gib: float, gpu_memory_utilization: float,
                   train_gpus: int = 1, bucket_size_bytes: int = 0,
                   step_tokens: int = DEFAULT_STEP_TOKENS, tp: int = 1,
                   engine_tokens: int = ENGINE_BATCH_TOKENS, engine_seqs: int = ENGINE_MAX_SEQS,
                   trainer_resident: bool = False) -> dict[str, dict[str, float]]:
    """The scheduler's figures of one pipeline's clusters (``rlix.memory``; ``control.types.ClusterMemory``), GiB per
    GPU, rounded up to 0.1: its vLLM engine awake (with what it holds beyond vLLM's share running ``engine_seqs``
    sequences and ``engine_tokens`` tokens a step, and the two bucket-sized buffers a weight sync receives into) /
    asleep, its trainer's step / between steps (offloaded, or ``trainer_resident``: its states kept on the GPU), and
    the share of the GPU the pipelines may plan for."""
    shard = shape.num_parameters / max(train_gpus, 1)
    trainer = max(step_gib(shape, train_gpus, step_tokens), shard * TRAINER_LOADED_BYTES_PER_PARAM / GiB)
    idle = trainer_idle_gib(shape, train_gpus, resident=trainer_resident)

    def up(x: float) -> float:
        return math.ceil(x * 10 - 1e-9) / 10

    gpu = math.floor(gpu_memory_gib * GPU_SHARE * 10) / 10
    engine = engine_awake_gib(shape, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
                              tp=tp, engine_tokens=engine_tokens, engine_seqs=engine_seqs)
    return {
        "actor_infer": {"gpu_gib": gpu, "awake_gib": up(engine + 2 * bucket_size_bytes / GiB),
                        "asleep_gib": engine_asleep_gib(tp)},
        "actor_train": {"gpu_gib": gpu, "awake_gib": up(max(trainer, idle)), "asleep_gib": up(idle)},
    }


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

