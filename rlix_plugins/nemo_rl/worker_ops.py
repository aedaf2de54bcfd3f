"""Functions that run INSIDE NeMo RL's Ray worker processes, shipped with ``actor.__ray_call__.remote(fn, ...)``.

Ray runs ``fn(worker_instance, *args)`` in the actor's process; the function is pickled by reference, so
``rlix_plugins`` must be importable in the worker's venv (the PYTHONPATH route, README "NeMo RL"). This reaches
NeMo RL's vLLM generation workers and its Megatron / DTensor policy workers without subclassing them or patching
NeMo RL.

Ownership/lifetime: the state these functions keep lives on the worker instance under ``_rlix_*`` attributes and
dies with the worker. Lockstep: :func:`build_cache` must run on EVERY training worker concurrently (the refit
iterator gathers across the trainer's ranks inside), the owner (global rank 0) keeps the buckets.

vLLM workers (async engine: ``self.llm`` is a ``vllm.v1.engine.async_llm.AsyncLLM``):
* :func:`vllm_abort_all` aborts every request the engine holds; vLLM then finishes each caller's stream with
  ``finish_reason="abort"`` (so callers return instead of hanging). Returns the number aborted.
* :func:`device_usage` - (pid, GPU, bytes) its process tree holds, per NVML; None on CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlix_plugins.nemo_rl.config import Trainer

__all__ = [
    "build_cache",
    "device_usage",
    "is_cache_owner",
    "mark_offloaded",
    "megatron_destroy_nccl",
    "megatron_rebuild_nccl",
    "offload_to_arena",
    "sync_from_cache",
    "vllm_abort_all",
]


# ---------------------------------------------------------------------------------------------- vLLM workers
def vllm_abort_all(worker: Any) -> int:
    """Abort every in-flight request of the worker's engine; returns how many (0 when idle)."""
    llm = getattr(worker, "llm", None)
    if llm is None:
        raise RuntimeError("vllm_abort_all: the worker has no engine (not a DP leader / model owner?)")
    states = getattr(getattr(llm, "output_processor", None), "request_states", None)
    if states is None:
        raise RuntimeError(f"vllm_abort_all: {type(llm).__name__} exposes no output_processor.request_states "
                           "(async engine required: policy.generation.vllm_cfg.async_engine=true)")
    ids = list(states)  # INTERNAL request ids (vLLM >= 0.2x keys request_states by them)
    if ids:
        import inspect

        if "internal" in inspect.signature(llm.abort).parameters:
            result = llm.abort(ids, internal=True)
        else:  # older AsyncLLM: abort takes the external ids
            result = llm.abort([getattr(st, "external_req_id", rid) for rid, st in states.items()])
        if asyncio.iscoroutine(result):  # AsyncLLM.abort: run it on the engine's event loop
            _run_on_engine_loop(llm, result)
    return len(ids)


def vllm_engine_error(worker: Any) -> str | None:
    """vLLM's error when the worker's engine died (``EngineClient.errored``: its EngineCore is gone), else None.
    Local to the actor (vLLM's own monitor thread set the flag): no call reaches the engine, asleep or awake."""
    llm = getattr(worker, "llm", None)
    if llm is None or not getattr(llm, "errored", False):
        return None
    return f"{type(llm.dead_error).__name__}: {llm.dead_error}"


def _run_on_engine_loop(llm: Any, coro: Any, timeout_s: float = 30.0) -> None:
    """``__ray_call__`` runs a sync function on a Ray thread of an async actor, not on its event loop: hand the
    coroutine to the loop AsyncLLM's output handler runs on (or to the running loop when called on it)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is not None:
        running.create_task(coro)
        return
    handler = getattr(llm, "output_handler", None)
    loop = handler.get_loop() if handler is not None else None
    if loop is None:
        coro.close()
        raise RuntimeError("vllm_abort_all: cannot find the engine's event loop (no AsyncLLM output handler yet)")
    asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=timeout_s)


def device_usage(worker: Any) -> list[tuple[int, int, int]] | None:
    """(pid, NVML GPU index, bytes) of this worker's process tree (vLLM's engine core is a child process; NCCL and
    vLLM pools count too), None when not measurable. Not device-wide: co-tenant pipelines on the same GPU would
    fail the post-sleep check. The fleet adds the TP workers' own readings (``rlix_device_usage``), taken first:
    each worker hands its cached blocks back before this tree is read (as this process does its own)."""
    from rlix_plugins.pipeline.gpu_memory import settled_usage

    return settled_usage("vLLM front-end after sleep")


# ---------------------------------------------------------------------------------------------- policy workers
def _rank(worker: Any) -> int:
    rank = getattr(worker, "rank", None)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return int(rank)


def is_cache_owner(worker: Any) -> bool:
    """The cache owner is the global rank 0 training worker (Megatron pp0/dp0/tp0/cp0; DTensor rank 0)."""
    return _rank(worker) == 0


def _require(worker: Any, trainer: Trainer, members: tuple[str, ...]) -> None:
    missing = [m for m in members if not callable(getattr(worker, m, None))]
    if missing:
        raise RuntimeError(f"{type(worker).__name__} has no {', '.join(missing)} (NeMo RL's {trainer} refit "
                           f"iterator): policy.{trainer}_cfg.enabled does not match the policy's workers")


@contextmanager
def _hf_weights(worker: Any, trainer: Trainer) -> Iterator[Iterable[tuple[str, Any]]]:
    """The worker's own refit iterator: full tensors under the HF names vLLM loads, as NeMo RL's refit sends them.

    * Megatron: ``_iter_params_with_optional_kv_scales()`` (HF export; gathers across TP/PP/EP).
    * DTensor (v1 ``DTensorPolicyWorker`` and v2 ``DTensorPolicyWorkerV2``): the checkpoint-engine refit triad
      ``_prepare_checkpoint_engine_weight_send`` (onloads a ``cpu_offload`` model) → ``_checkpoint_engine_weight_
      iterator`` (``dtensor_params_generator``: ``state_dict()`` order, ``DTensor.full_tensor()`` all-gather,
      cast to the policy's ``self.dtype``, tied ``lm_head.weight`` kept; v2 also merges LoRA and applies the
      model's HF state-dict adapter) → ``_finalize_checkpoint_engine_weight_send`` (offloads it again).
    """
    if trainer == "megatron":
        _require(worker, trainer, ("_iter_params_with_optional_kv_scales",))
        yield worker._iter_params_with_optional_kv_scales()
        return
    _require(worker, trainer, ("_prepare_checkpoint_engine_weight_send", "_checkpoint_engine_weight_iterator",
                               "_finalize_checkpoint_engine_weight_send"))
    worker._prepare_checkpoint_engine_weight_send()
    try:
        yield worker._checkpoint_engine_weight_iterator()
    finally:
        worker._finalize_checkpoint_engine_weight_send()


def build_cache(worker: Any, trainer: Trainer, version: int, bucket_size_bytes: int, timeout_s: float) -> int | None:
    """Build cache ``version`` from the worker's refit iterator (HF names). Lockstep: EVERY training worker runs
    this at once (the iterator's all-gathers are collectives); the owner keeps the buckets, the others drain the
    iterator. Returns the version on the owner, else None."""
    from rlix_plugins.transport import VersionedBucketCache

    if getattr(worker, "_rlix_offloaded", False) and version >= 0:
        # Megatron's offload leaves empty storage; DTensor's moves the shards to the CPU, where the
        # NCCL all-gather of full_tensor() cannot run. Refused on every rank, so no peer waits in a collective.
        raise RuntimeError(f"build_cache({version}) after the offload would read parameters that are no longer on "
                           "the device: build it in before_weight_sync, while they are")
    cache = getattr(worker, "_rlix_cache", None)
    if cache is None:
        cache = VersionedBucketCache(bucket_size_bytes, is_owner=is_cache_owner(worker))
        worker._rlix_cache = cache
    with _hf_weights(worker, trainer) as weights:
        built = cache.build(version, weights, timeout_s=timeout_s)
    return None if built is None else int(built)


def release_cached_blocks(worker: Any) -> None:
    """A training worker keeps its states on the GPU between steps (``rlix.offload_trainer: false``): what the step
    left in torch's cache goes back to the driver (the offload's ``empty_cache`` without the offload)."""
    from rlix_plugins.pipeline.gpu_memory import release_cached_blocks as release

    release("trainer after its step")


def mark_offloaded(worker: Any, offloaded: bool) -> None:
    worker._rlix_offloaded = bool(offloaded)


def offload_to_arena(worker: Any) -> dict[str, Any] | None:
    """A DTensor worker's offload with its weights and optimizer states in the worker's exact-size page-locked
    arena (:mod:`.state_arena`; NeMo RL's onload then reads pinned memory), and the rest of NeMo RL's
    ``offload_after_refit``: buffers to the CPU, eval mode, the freed blocks back to the driver. None, with nothing
    changed, where it does not apply (no optimizer, NeMo RL's own ``cpu_offload``, a model not sharded by FSDP2,
    page-locking refused): the caller then runs NeMo RL's offload."""
    import logging

    from rlix_plugins.nemo_rl.state_arena import offload_to_arena as offload

    model, optimizer = getattr(worker, "model", None), getattr(worker, "optimizer", None)
    if model is None or optimizer is None or getattr(worker, "cpu_offload", False):
        return None
    try:
        worker._rlix_arena, moved = offload(model, optimizer, getattr(worker, "_rlix_arena", None))
    except RuntimeError as exc:  # a refusal (not FSDP2, page-locking refused) comes before anything moved; after a
        # later error NeMo RL's offload moves what is still on the device and leaves what is in the arena
        logging.getLogger(__name__).warning("rlix: NeMo RL's offload instead of the state arena: %s", exc)
        return None
    model.eval()
    return {"bytes": moved.bytes, "tensors": moved.tensors, "new_arena": moved.new_arena,
            "repadded": moved.repadded, "seconds": moved.seconds}


def sync_from_cache(worker: Any, targets: dict[int, tuple[Any, list[tuple[int, int]]]],
                    sender: tuple[int, int], timeout_s: float, verify: bool, backend: str | None = None,
                    wake_tags: list[str] | None = None) -> Any:
    """On the owner: push the cache to ``targets`` (dp rank -> (EngineRpc, devices)) - same-GPU targets by
    host_pull (they copy from the cache's shared pinned pages), others by a per-sync broadcast group. Returns a ``SyncResult``.
    The same for every trainer: the cache holds HF-named tensors whichever workers built it."""
    import torch

    from rlix_plugins.pipeline.protocols import SyncResult
    from rlix_plugins.transport import build_comm_plan
    from rlix_plugins.vllm.driver import sync_engines

    cache = getattr(worker, "_rlix_cache", None)
    if cache is None or not is_cache_owner(worker):
        raise RuntimeError("sync_from_cache must run on the cache owner after build_cache")
    on_gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    plan = build_comm_plan(sender, {dp: devs for dp, (_, devs) in targets.items()}, same_gpu_transport="host_pull")
    report = sync_engines(cache, plan, {dp: rpc for dp, (rpc, _) in targets.items()},
                          staging_device="cuda" if on_gpu else "cpu", backend=backend or ("nccl" if on_gpu else "gloo"),
                          timeout_s=timeout_s, verify=verify, wake_tags=wake_tags)
    return SyncResult.of_report(report, targets, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------- Megatron workers
def megatron_destroy_nccl(worker: Any) -> dict[str, Any]:
    """After the offload: destroy the worker's Megatron NCCL groups (kept for :func:`megatron_rebuild_nccl`)."""
    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups

    if getattr(worker, "_rlix_nccl", None) is not None:
        return {"groups_destroyed": 0, "already": True}
    snap = destroy_groups()
    worker._rlix_nccl = snap
    return {"groups_destroyed": snap.groups_destroyed, "already": False}


def megatron_rebuild_nccl(worker: Any) -> bool:
    """Before the next use of the training GPUs: rebuild what :func:`megatron_destroy_nccl` destroyed. A failed
    rebuild raises and keeps the snapshot, so calling this again (on every worker) retries it."""
    from rlix_plugins.nemo_rl.megatron_nccl import rebuild_groups

    snap = getattr(worker, "_rlix_nccl", None)
    if snap is None:
        return False
    rebuilt = rebuild_groups(snap, worker)
    worker._rlix_nccl = None  # only once rebuilt: a snapshot dropped before would make a failed rebuild final
    return rebuilt


# ---------------------------------------------------------------------------------------------- replay buffer
def count_intended_for(replay_buffer: Any, weight_version: int) -> int:
    """Entries of NeMo RL's ``ReplayBufferImpl`` whose TARGET weight version is ``weight_version`` (not
    the age-window count, which under-estimates the remaining demand)."""
    lock = getattr(replay_buffer, "_lock", None)
    if lock is not None:
        with lock:
            return sum(1 for v in replay_buffer.target_weight_versions if v == weight_version)
    return sum(1 for v in replay_buffer.target_weight_versions if v == weight_version)
