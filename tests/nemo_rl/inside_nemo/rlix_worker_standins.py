"""Worker stand-ins for the inside_nemo scenarios (runs inside a patched NeMo RL copy; not a test module).

NeMo RL's mocks (``mock_grpo_components``) have no Ray workers, so our hooks would run control-only (GPU grants
only, no rollout ranks). These stand-ins give the mock ``policy`` / ``policy_generation`` the ``worker_group``
surfaces our runtime uses, so the FULL time-sharing path runs: ``NemoRuntime``, ``NemoVllmFleet``,
``PolicyWeightSource`` (Megatron), :mod:`rlix_plugins.nemo_rl.worker_ops` (through ``__ray_call__``), the real weight
transport (cpu_serialize to the same-GPU rank, a per-sync gloo broadcast group to the others) and the real
receiver (:class:`rlix_plugins.vllm.receiver.RlixReceiverMixin` with checksum verification).

What cannot exist in the conformance venv (no vLLM, no Megatron) is replaced, and only that:

* :class:`StandinVllmLeader` - the members our fleet calls on NeMo RL's ``VllmAsyncGenerationWorker`` DP leader
  (``sleep_async(level=)`` of patch 0003, ``wake_up_async(tags=)``, ``reset_prefix_cache_async``,
  ``checkpoint_engine_rpc_async``, ``llm.output_processor.request_states`` / ``llm.abort``) with ONE in-process
  "vLLM worker": our receiver mixin over NeMo RL's refit contract (``_load_weights`` +
  ``_weight_update_lifecycle``), loading in place into a zero-initialised ("dummy weights") torch module.
* :class:`RecordingCollectorActor` + :class:`CollectorHandle` - the ``AsyncTrajectoryCollector`` surface the loop
  calls, as a real actor (our resize actor publishes to it from its own process); it generates nothing.
* :class:`StandinMegatronWorker` - ``rank`` + NeMo RL's refit iterator ``_iter_params_with_optional_kv_scales``
  over small real tensors that ``train(seed)`` replaces; ``megatron.core.parallel_state`` is a stub saying "model
  parallel not initialized" (a one-process trainer has no Megatron groups to tear down).

Lifetime: every actor is owned by the driver process that created it and dies with it (a SIGKILLed driver's
workers go too, as NeMo RL's do).
"""

import contextlib
import sys
import time
import types
from typing import Any

import ray

from rlix_plugins.vllm.receiver import RlixReceiverMixin

PARAM_SHAPES = {"model.embed_tokens.weight": (64, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
                "lm_head.weight": (64, 16)}


def tiny_params(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in PARAM_SHAPES.items()}


class StandinWorkerGroup:
    """``RayWorkerGroup`` members our runtime reads: ``workers``, ``dp_size``, ``get_dp_leader_worker_idx``."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = list(workers)

    @property
    def dp_size(self) -> int:
        return len(self.workers)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        return int(dp_shard_idx)


class _Engine:
    """``AsyncLLM`` members ``worker_ops.vllm_abort_all`` uses (no requests: the mock collector generates none)."""

    def __init__(self) -> None:
        self.output_processor = types.SimpleNamespace(request_states={})
        self.aborted: list[str] = []

    def abort(self, request_ids: list[str], internal: bool = False) -> None:
        self.aborted.extend(request_ids)


def _dummy_model() -> Any:
    """A torch module holding :data:`PARAM_SHAPES` under their HF names, zero-filled ("dummy weights" start)."""
    import torch

    root = torch.nn.Module()
    for name, shape in PARAM_SHAPES.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(*shape), requires_grad=False))
    return root


class _ReceiverWorker(RlixReceiverMixin):
    """One vLLM worker: our receiver over NeMo RL's refit contract (duck-typed by ``loading.is_nemo_rl_worker``),
    loading in place into ``model_runner.model`` (which the receiver's live checksum check and CPU re-pack pass
    read, as on a real vLLM worker)."""

    local_rank = 0

    def __init__(self) -> None:
        self.model_runner = types.SimpleNamespace(model=_dummy_model())
        self.finalized = 0

    def _load_weights(self, weights: list[tuple[str, Any]]) -> None:
        params = dict(self.model_runner.model.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)

    @contextlib.contextmanager
    def _weight_update_lifecycle(self, transport: str) -> Any:
        def finalize() -> None:
            self.finalized += 1

        yield finalize


class StandinVllmLeader:
    """See the module docstring. ``log`` records (what, detail, time) for the test."""

    def __init__(self, sleep_level: int) -> None:
        self.cfg = {"vllm_cfg": {"async_engine": True, "sleep_level": sleep_level}}
        self.llm = _Engine()
        self.worker = _ReceiverWorker()
        self.asleep = False
        self.log: list[tuple[str, Any, float]] = []

    def _note(self, what: str, detail: Any = None) -> None:
        self.log.append((what, detail, time.time()))

    def sleep_async(self, level: int | None = None) -> None:
        """Patch 0003's signature: the call's level, else the worker's ``vllm_cfg.sleep_level``."""
        self.asleep = True
        self._note("sleep", level or self.cfg["vllm_cfg"]["sleep_level"])

    def wake_up_async(self, tags: list[str] | None = None) -> None:
        self.asleep = False
        self._note("wake_up", tags)

    def reset_prefix_cache_async(self) -> bool:
        return True

    def checkpoint_engine_rpc_async(self, checkpoint_method: str, method_args: tuple[Any, ...] = ()) -> list[Any]:
        """NeMo RL's pass-through to ``collective_rpc`` over this engine's (one) worker."""
        result = getattr(self.worker, checkpoint_method)(*method_args)
        if checkpoint_method == "rlix_finish_weight_update" and result["finalized"]:  # a sync's one finish call
            self._note("finalize", self.worker.finalized)
        return [result]

    def state(self) -> dict[str, Any]:
        return {"asleep": self.asleep, "finalized": self.worker.finalized, "log": list(self.log),
                "params": {n: t.detach().clone() for n, t in self.worker.model_runner.model.named_parameters()}}


class _ServingEngine(_Engine):
    """``_Engine`` whose requests are real entries of ``request_states``: ``abort`` ends them (as vLLM's does)."""

    def abort(self, request_ids: list[str], internal: bool = False) -> None:
        super().abort(request_ids, internal)
        for rid in request_ids:
            self.output_processor.request_states.pop(rid, None)


class ServingVllmLeader(StandinVllmLeader):
    """A leader that also serves NeMo RL's streaming ``generate_async`` (run it threaded: ``max_concurrency``). A
    request's prompt index is its first token. Until the first abort, prompts below ``quick`` are answered at once
    and the others stay in the engine (as long generations do) until an abort ends them; after an abort every
    request is answered at once. The log records ``("served", (prompt, "stop" | "abort"))``."""

    def __init__(self, sleep_level: int, quick: int) -> None:
        super().__init__(sleep_level)
        self.llm = _ServingEngine()
        self.quick, self.requests = quick, 0

    @ray.method(num_returns="streaming")  # as NeMo RL's worker declares it
    def generate_async(self, data: Any, greedy: bool = False) -> Any:
        self.requests += 1
        prompt = int(data["input_ids"][0][0])
        rid, states = f"req-{self.requests}", self.llm.output_processor.request_states
        held = prompt >= self.quick and not self.llm.aborted
        states[rid] = prompt
        deadline = time.monotonic() + 120
        while held and rid in states and time.monotonic() < deadline:
            time.sleep(0.01)
        how = "abort" if rid not in states else "stop"
        states.pop(rid, None)
        self._note("served", (prompt, how))
        yield (0, {"finish_reason": how})


def _stub_megatron() -> None:
    """``megatron.core.parallel_state`` for a one-process trainer: model parallel never initialized."""
    if "megatron.core.parallel_state" in sys.modules:
        return
    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: False
    core = types.ModuleType("megatron.core")
    core.parallel_state = ps
    root = types.ModuleType("megatron")
    root.core = core
    sys.modules.update({"megatron": root, "megatron.core": core, "megatron.core.parallel_state": ps})


class StandinMegatronWorker:
    """See the module docstring. ``trained`` lists the seeds of every ``train`` call."""

    def __init__(self, seed: int) -> None:
        _stub_megatron()
        self.rank = 0
        self.params = tiny_params(seed)
        self.trained: list[int] = []

    def _iter_params_with_optional_kv_scales(self) -> Any:
        yield from self.params.items()

    def train(self, seed: int) -> None:
        self.params = tiny_params(seed)
        self.trained.append(seed)

    def state(self) -> dict[str, Any]:
        return {"trained": list(self.trained), "params": {n: t.clone() for n, t in self.params.items()}}


class RecordingCollectorActor:
    """The ``AsyncTrajectoryCollector`` methods ``async_grpo_train`` calls, as a REAL Ray actor (our resize actor
    publishes each expanded rank's version to it from another process), recording every published version
    ``(version, time)`` and the loop's other calls. It generates nothing (NeMo RL's stub replay buffer is full)."""

    def __init__(self) -> None:
        self.versions: list[tuple[int, float]] = []
        self.calls: list[str] = []

    def set_weight_version(self, version: int) -> None:
        self.versions.append((int(version), time.time()))

    def get_versions(self) -> list[tuple[int, float]]:
        return list(self.versions)

    def get_calls(self) -> list[str]:
        return list(self.calls)

    def _call(self, name: str) -> None:
        self.calls.append(name)

    def start_collection(self, *args: Any, **kwargs: Any) -> None:
        self._call("start_collection")

    def check_health(self) -> None:
        return None

    def get_status(self) -> dict[str, Any]:
        return {"running": True, "data_exhausted": False, "errored": False, "inflight_workers": 0}

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def prepare_for_refit(self) -> None:
        self._call("prepare_for_refit")

    def resume_after_refit(self) -> None:
        self._call("resume_after_refit")

    def stop(self) -> None:
        self._call("stop")

    def wait_for_stop(self, *args: Any, **kwargs: Any) -> None:
        self._call("wait_for_stop")

    def get_efficiency_metrics(self) -> dict[str, Any]:
        return {}

    def get_dataloader_state(self) -> dict[str, Any]:
        return {}

    def get_rollouts_state(self) -> dict[str, Any]:
        from nemo_rl.experience.interfaces import NEXT_NEMO_GYM_TASK_INDEX_KEY

        return {NEXT_NEMO_GYM_TASK_INDEX_KEY: 0}


class CollectorHandle:
    """What the loop holds as its ``trajectory_collector``: forwards ``<method>.remote(...)`` to a
    :class:`RecordingCollectorActor`. Only ``set_weight_version`` carries its argument: the others' arguments are
    NeMo RL's mocks (e.g. the ``StatefulDataLoader`` mock), which cannot be pickled. Picklable itself (an actor
    handle), so our runtime ships it to its resize actor, which publishes through it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "actor":
            raise AttributeError(name)
        method = getattr(self.actor, name)
        keep = name == "set_weight_version"
        return types.SimpleNamespace(remote=lambda *a, **k: method.remote(*a, **k) if keep else method.remote())


class ReplayBufferActor:
    """NeMo RL's test ``StubReplayBuffer`` (always a complete batch ready) as a REAL Ray actor, so our progress
    thread reaches it as it reaches NeMo RL's ``ReplayBuffer`` actor: ``__ray_call__`` running
    ``worker_ops.count_intended_for`` over ``target_weight_versions`` under ``_lock`` (``ReplayBufferImpl``'s
    members). It always holds a complete batch (``size`` groups) intended for the version the loop last sampled
    and one for the next (the collector runs one step ahead): ``start_version`` at first, ``v`` and ``v + 1`` once
    the loop sampled for version ``v``. Checkpoints save nothing."""

    def __init__(self, batch: Any, size: int, start_version: int) -> None:
        import threading

        self._batch, self._size = batch, size
        self._lock = threading.Lock()
        self.target_weight_versions = [start_version] * size
        self.sampled: list[int] = []

    def size(self) -> int:
        return self._size

    def has_complete_batch(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def get_trajectories_needed(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def sample(self, num_prompt_groups: int, current_weight_version: int, max_age_steps: int) -> dict[str, Any]:
        with self._lock:
            self.sampled.append(current_weight_version)
            self.target_weight_versions = [current_weight_version, current_weight_version + 1] * self._size
        trajectories = [{"batch": self._batch, "rollout_metrics": {"mean_gen_tokens_per_sample": 2.0}}
                        for _ in range(num_prompt_groups)]
        return {"trajectories": trajectories, "avg_trajectory_age": 0.5}

    def get_debug_info(self) -> dict[str, Any]:
        with self._lock:
            return {"total_trajectories": self._size, "trajectory_versions": [0],
                    "target_weight_versions": list(self.target_weight_versions), "max_size": 100}

    def save_to_path(self, path: str) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:  # NeMo RL v0.7.0 saves the buffer through this at checkpoints
        return {"trajectories": []}

    def get_sampled(self) -> list[int]:
        return list(self.sampled)
