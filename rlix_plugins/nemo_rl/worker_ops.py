"""Functions that run INSIDE NeMo RL's Ray worker processes, shipped with ``actor.__ray_call__.remote(fn, ...)``.

Ray runs ``fn(worker_instance, *args)`` in the actor's process; the function is pickled by reference, so
``rlix_plugins`` must be importable in the worker's venv (the PYTHONPATH route, README "NeMo RL"). This reaches
NeMo RL's vLLM generation workers and Megatron policy workers without subclassing them or patching NeMo RL.

Ownership/lifetime: the state these functions keep lives on the worker instance under ``_rlix_*`` attributes and
dies with the worker. Lockstep: :func:`megatron_build_cache` must run on EVERY training worker concurrently (the
HF export gathers across TP/PP/EP inside), the owner (global rank 0 = pp0/dp0/tp0/cp0) keeps the buckets.

vLLM workers (async engine: ``self.llm`` is a ``vllm.v1.engine.async_llm.AsyncLLM``):
* :func:`vllm_abort_all` aborts every request the engine holds; vLLM then finishes each caller's stream with
  ``finish_reason="abort"`` (so callers return, reference bug 7). Returns the number aborted.
* :func:`device_memory_in_use` - bytes in use on the worker's device (``mem_get_info``), None on CPU.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = [
    "device_memory_in_use",
    "megatron_build_cache",
    "megatron_is_owner",
    "megatron_sync_from_cache",
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


def device_memory_in_use(worker: Any) -> int | None:
    """Device bytes this worker's process tree holds, per NVML (vLLM's engine core is a child process; NCCL and
    vLLM pools count too). Not device-wide: co-tenant pipelines on the same GPU would fail the post-sleep check."""
    from rlix_plugins.pipeline.gpu_memory import process_tree_gpu_bytes

    return process_tree_gpu_bytes()


# ---------------------------------------------------------------------------------------------- Megatron workers
def _rank(worker: Any) -> int:
    rank = getattr(worker, "rank", None)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return int(rank)


def megatron_is_owner(worker: Any) -> bool:
    """The cache owner is the global rank 0 training worker (pp0/dp0/tp0/cp0)."""
    return _rank(worker) == 0


def _named_hf_tensors(worker: Any) -> Any:
    it = getattr(worker, "_iter_params_with_optional_kv_scales", None)
    if it is None:
        raise RuntimeError(f"{type(worker).__name__} has no _iter_params_with_optional_kv_scales (NeMo RL's Megatron "
                           "refit iterator); time-sharing needs the Megatron policy (policy.megatron_cfg.enabled)")
    return it()


def megatron_build_cache(worker: Any, version: int, bucket_size_bytes: int, timeout_s: float) -> int | None:
    """Build cache ``version`` from the worker's refit iterator (HF names). EVERY training worker runs this;
    the owner keeps the buckets, the others drain the iterator. Returns the version on the owner, else None."""
    from rlix_plugins.transport import VersionedBucketCache

    if getattr(worker, "_rlix_offloaded", False) and version >= 0:
        raise RuntimeError(f"build_cache({version}) after the offload would read empty storage (debug #34): build "
                           "it in before_weight_sync, while the parameters are on the device")
    cache = getattr(worker, "_rlix_cache", None)
    if cache is None:
        cache = VersionedBucketCache(bucket_size_bytes, is_owner=megatron_is_owner(worker))
        worker._rlix_cache = cache
    built = cache.build(version, _named_hf_tensors(worker), timeout_s=timeout_s)
    return None if built is None else int(built)


def megatron_mark_offloaded(worker: Any, offloaded: bool) -> None:
    worker._rlix_offloaded = bool(offloaded)


def megatron_sync_from_cache(worker: Any, targets: dict[int, tuple[Any, list[tuple[int, int]]]],
                             sender: tuple[int, int], timeout_s: float, verify: bool,
                             backend: str | None = None) -> Any:
    """On the owner: push the cache to ``targets`` (dp rank -> (EngineRpc, devices)) - same-GPU targets by
    cuda_ipc (cpu_serialize without CUDA), others by a per-sync broadcast group. Returns a ``SyncResult``."""
    import torch

    from rlix_plugins.pipeline.protocols import SyncResult
    from rlix_plugins.transport import build_comm_plan
    from rlix_plugins.vllm.driver import sync_engines

    cache = getattr(worker, "_rlix_cache", None)
    if cache is None or not megatron_is_owner(worker):
        raise RuntimeError("megatron_sync_from_cache must run on the cache owner after megatron_build_cache")
    on_gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    plan = build_comm_plan(sender, {dp: devs for dp, (_, devs) in targets.items()},
                           same_gpu_transport="cuda_ipc" if on_gpu else "cpu_serialize")
    report = sync_engines(cache, plan, {dp: rpc for dp, (rpc, _) in targets.items()},
                          staging_device="cuda" if on_gpu else "cpu", backend=backend or ("nccl" if on_gpu else "gloo"),
                          timeout_s=timeout_s, verify=verify)
    verified = {dp: min(int(w.get("received", 0)) for w in per) if per else 0 for dp, per in report.verified.items()}
    return SyncResult(version=report.transport.version, dp_ranks=tuple(sorted(targets)),
                      seconds=time.perf_counter() - t0, verified_params=verified,
                      payload_bytes=report.transport.payload_bytes, ipc_dp_ranks=report.transport.ipc_dp_ranks,
                      broadcast_dp_ranks=report.transport.broadcast_dp_ranks)


def megatron_destroy_nccl(worker: Any) -> dict[str, Any]:
    """After the offload: destroy the worker's Megatron NCCL groups (kept for :func:`megatron_rebuild_nccl`)."""
    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups

    if getattr(worker, "_rlix_nccl", None) is not None:
        return {"groups_destroyed": 0, "already": True}
    snap = destroy_groups()
    worker._rlix_nccl = snap
    return {"groups_destroyed": snap.groups_destroyed, "already": False}


def megatron_rebuild_nccl(worker: Any) -> bool:
    """Before the next use of the training GPUs: rebuild what :func:`megatron_destroy_nccl` destroyed."""
    from rlix_plugins.nemo_rl.megatron_nccl import rebuild_groups

    snap = getattr(worker, "_rlix_nccl", None)
    if snap is None:
        return False
    worker._rlix_nccl = None
    return rebuild_groups(snap, worker)


# ---------------------------------------------------------------------------------------------- replay buffer
def count_intended_for(replay_buffer: Any, weight_version: int) -> int:
    """Entries of NeMo RL's ``ReplayBufferImpl`` whose TARGET weight version is ``weight_version`` (reference F9:
    not the age-window count, which under-estimates the remaining demand)."""
    lock = getattr(replay_buffer, "_lock", None)
    if lock is not None:
        with lock:
            return sum(1 for v in replay_buffer.target_weight_versions if v == weight_version)
    return sum(1 for v in replay_buffer.target_weight_versions if v == weight_version)
