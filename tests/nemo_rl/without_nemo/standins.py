"""Stand-ins with NeMo RL's worker surfaces (NeMo RL cannot be installed in this venv), over REAL components.

* :class:`StandinVllmWorker` - the members NeMo RL's ``VllmAsyncGenerationWorker`` DP leader is called with
  (``generate_async``, ``sleep_async(level=None)`` falling back to ``cfg["vllm_cfg"]["sleep_level"]`` as patch
  0003 does, ``wake_up_async(tags=)``, ``reset_prefix_cache_async``, ``checkpoint_engine_rpc_async``) over a real vLLM
  ``AsyncLLM`` (CPU), started with dummy weights like NeMo RL's engines (``load_format="dummy"``).
* :class:`StandinMegatronWorker` - the members our weight source uses on NeMo RL's Megatron worker (``rank``,
  ``_iter_params_with_optional_kv_scales``) over the tiny model's real tensors; ``train(seed)`` swaps them.
* :class:`WorkerGroup`, :class:`StandinPolicy`, :class:`StandinGeneration` - the driver objects: a ``worker_group``
  with ``workers`` / ``dp_size`` / ``get_dp_leader_worker_idx``; ``StandinGeneration.attach_fleet_health`` and its
  dispatch copy ``VllmGeneration``'s (selector ``next_shard`` → ``acquire`` → call leader → ``release``).
* :class:`StandinCollector` (holds a PICKLED copy of the generation, like NeMo RL's collector) and
  :class:`StandinReplayBuffer` (``target_weight_versions`` + ``_lock``, as ``ReplayBufferImpl``).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any


class StandinVllmWorker:
    def __init__(self, model_dir: str, sleep_level: int, max_model_len: int = 512,
                 worker_cls: str = "rlix_plugins.vllm.cpu_worker.RlixCPUWorker") -> None:
        self.worker_cls = worker_cls
        self.cfg = {"vllm_cfg": {"async_engine": True, "sleep_level": sleep_level}}
        self.model_dir, self.max_model_len = model_dir, max_model_len
        self.llm: Any = None
        self.log: list[tuple[str, Any]] = []
        self._ids = 0

    async def start(self) -> float:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=self.model_dir, dtype="float32", enforce_eager=True, max_model_len=self.max_model_len,
            max_num_seqs=8, kv_cache_memory_bytes=64 << 20, load_format="dummy", seed=0,
            worker_cls=self.worker_cls))
        return time.perf_counter() - t0

    async def generate_async(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        from vllm import SamplingParams

        self._ids += 1
        last = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=f"r{self._ids}"):
            last = out
        assert last is not None
        return {"tokens": list(last.outputs[0].token_ids), "finish_reason": last.outputs[0].finish_reason}

    async def sleep_async(self, level: int | None = None) -> None:
        level = level or self.cfg["vllm_cfg"].get("sleep_level", 1)  # patch 0003: the call's level, else config
        self.log.append(("sleep", level))
        await self.llm.reset_prefix_cache()
        await self.llm.sleep(level=level)

    async def wake_up_async(self, **kwargs: Any) -> None:
        self.log.append(("wake_up", kwargs.get("tags")))
        await self.llm.wake_up(**({"tags": kwargs["tags"]} if kwargs.get("tags") is not None else {}))

    async def reset_prefix_cache_async(self) -> None:
        await self.llm.reset_prefix_cache()

    async def checkpoint_engine_rpc_async(self, checkpoint_method: str, method_args: tuple[Any, ...] = ()) -> Any:
        self.log.append(("rpc", checkpoint_method))
        return await self.llm.collective_rpc(checkpoint_method, args=tuple(method_args))

    def calls(self) -> list[tuple[str, Any]]:
        return list(self.log)

    def clear_calls(self) -> None:
        self.log.clear()


class StandinMegatronWorker:
    def __init__(self, model_dir: str) -> None:
        from safetensors.torch import load_file

        self.rank = 0
        self.model_dir = model_dir
        self.params = load_file(f"{model_dir}/model.safetensors")
        self.offloads = 0

    def _iter_params_with_optional_kv_scales(self) -> Any:
        yield from self.params.items()

    def train(self, seed: int) -> None:
        from rlix_plugins.demo.tiny_model import tiny_qwen2_weights

        self.params = tiny_qwen2_weights(self.model_dir, seed)

    def offload(self) -> int:
        self.offloads += 1
        return self.offloads


class WorkerGroup:
    def __init__(self, workers: list[Any]) -> None:
        self.workers = list(workers)
        self.dp_leader_worker_indices = list(range(len(workers)))

    @property
    def dp_size(self) -> int:
        return len(self.dp_leader_worker_indices)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        return self.dp_leader_worker_indices[dp_shard_idx]


class StandinPolicy:
    def __init__(self, worker: Any) -> None:
        self.worker_group = WorkerGroup([worker])

    def offload_after_refit(self) -> None:
        import ray

        ray.get(self.worker_group.workers[0].offload.remote(), timeout=60)


class StandinGeneration:
    def __init__(self, leaders: list[Any]) -> None:
        self.worker_group = WorkerGroup(leaders)
        self.fleet_monitor: Any = None
        self.fleet_selector: Any = None
        self.current_generate_dp_shard_idx = 0

    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        if monitor.shard_count != self.worker_group.dp_size:
            raise ValueError("fleet monitor / worker group shard count mismatch")
        self.fleet_monitor, self.fleet_selector = monitor, selector

    def _next_dp_shard_idx(self) -> int:
        if self.fleet_selector is not None:
            return int(self.fleet_selector.next_shard())
        idx = self.current_generate_dp_shard_idx
        self.current_generate_dp_shard_idx = (idx + 1) % self.worker_group.dp_size
        return idx

    def generate(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        import ray

        shard = self._next_dp_shard_idx()
        leader = self.worker_group.workers[self.worker_group.get_dp_leader_worker_idx(shard)]
        if self.fleet_selector is not None:
            self.fleet_selector.acquire(shard)
        try:
            out = dict(ray.get(leader.generate_async.remote(prompt, max_tokens), timeout=120))
        finally:
            if self.fleet_selector is not None:
                self.fleet_selector.release(shard)
        out["dp_rank"] = shard
        return out


class StandinCollector:
    """Holds its own pickled generation copy (as NeMo RL's collector does) and records published versions."""

    def __init__(self, generation: StandinGeneration) -> None:
        self.generation = generation
        self.versions: list[int] = []
        self.served: list[tuple[int, str, int]] = []  # (dp rank, finish reason, version at the time)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def set_weight_version(self, version: int) -> None:
        self.versions.append(int(version))

    def get_versions(self) -> list[int]:
        return list(self.versions)

    def generate(self, n: int, max_tokens: int = 8) -> list[dict[str, Any]]:
        return [self.generation.generate([1, 2, 3 + i], max_tokens) for i in range(n)]

    def start_background(self, threads: int, max_tokens: int) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                out = self.generation.generate([5, 6, 7], max_tokens)
                self.served.append((out["dp_rank"], str(out["finish_reason"]), self.versions[-1] if self.versions else -9))

        self._stop.clear()
        self._threads = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def stop_background(self) -> list[tuple[int, str, int]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
        return list(self.served)


class StandinReplayBuffer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.target_weight_versions: list[int] = []

    def add(self, target_weight_version: int, n: int = 1) -> None:
        with self._lock:
            self.target_weight_versions.extend([target_weight_version] * n)


def in_flight(worker: Any) -> int:
    """Requests the worker's AsyncLLM holds (run in the worker with ``__ray_call__``)."""
    return len(worker.llm.output_processor.request_states)


class StandinTqController:
    """TransferQueueController's partition table (``_get_partition(id).global_indexes``)."""

    def __init__(self) -> None:
        self.partitions: dict[str, Any] = {}

    def put(self, partition_id: str, n: int) -> None:
        self.partitions.setdefault(partition_id, SimpleNamespace(global_indexes=set()))
        part = self.partitions[partition_id]
        part.global_indexes |= set(range(len(part.global_indexes), len(part.global_indexes) + n))

    def _get_partition(self, partition_id: str) -> Any:
        return self.partitions.get(partition_id)


class StandinRolloutActor:  # NeMo RL's SyncRolloutActor has no set_weight_version
    def ping(self) -> bool:
        return True


def standin_master_config(rlix: dict[str, Any]) -> dict[str, Any]:
    """The NeMo RL config the stand-in host runs: async GRPO, a Megatron policy, a non-colocated async vLLM."""
    return {
        "rlix": rlix, "cluster": {"gpus_per_node": 4},
        "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {"megatron_cfg": {"enabled": True}, "generation": {
            "backend": "vllm", "colocated": {"enabled": False},
            "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
    }
