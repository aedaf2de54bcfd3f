"""The NeMo RL host of the shared runtime end to end on CPU: our hooks (full mode) + the real control plane +
two real vLLM ``AsyncLLM`` engines behind NeMo RL's DP-leader worker surface + the cache in a stand-in Megatron
worker (reached with ``__ray_call__``) + a collector holding its own pickled generation copy.

What is real: Ray, the control plane, the runtime (router, resizer, watchdog), vLLM (dummy-weight start, weights
loaded by the first expand), the weight transport (same-GPU cpu_serialize to rank 0, gloo broadcast to rank 1),
checksum verification, the hooks. Stand-ins (tests/nemo_rl/without_nemo/standins.py) replace only the NeMo RL classes.
On CPU vLLM's sleep is a no-op, so "memory dropped" is not measurable here (GPU-only).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.nemo_rl.generation import NemoVllmFleet, RouterShardSelector
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from rlix_plugins.nemo_rl.runtime_adapter import NemoRuntime
from tests.nemo_rl.without_nemo.standins import (
    StandinCollector,
    StandinGeneration,
    StandinMegatronWorker,
    StandinPolicy,
    StandinReplayBuffer,
    StandinVllmWorker,
    in_flight,
    standin_master_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
ROOT = Path(__file__).resolve().parents[3]

#: NVML stand-in on the engines' PYTHONPATH (a CPU machine has no NVML). While the file ``RLIX_TEST_NVML_HOLD``
#: names exists, a process that asks sees one process on GPU 0, itself, holding the bytes the file says: each
#: reading sees only its own process, as a DP leader's reading (filtered by its process tree) does not see a TP
#: worker that vLLM's Ray executor runs as another Ray actor. Without the file it sees no GPU process (None).
_NVML_STUB = """import os
from types import SimpleNamespace


def _held():
    try:
        with open(os.environ["RLIX_TEST_NVML_HOLD"]) as f:
            return int(f.read())
    except (KeyError, OSError, ValueError):
        return None


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return 0 if _held() is None else 1


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetComputeRunningProcesses(handle):
    held = _held()
    return [] if held is None else [SimpleNamespace(pid=os.getpid(), usedGpuMemory=held)]
"""


@pytest.fixture(scope="module")
def nvml_hold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file the engines' NVML stand-in reads (absent: no GPU process), and the stand-in's directory."""
    stub = tmp_path_factory.mktemp("nvml")
    (stub / "pynvml.py").write_text(_NVML_STUB)
    return stub / "hold"


@pytest.fixture(scope="module")
def engines(ray_cluster: dict[str, float], tmp_path_factory: pytest.TempPathFactory, nvml_hold: Path) -> Any:
    """Two AsyncLLM engines (one per DP rank), shared by the module (each costs ~25 s and ~1 GiB)."""
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    model = build_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny", seed=0)
    path = (str(nvml_hold.parent), str(ROOT), os.environ.get("PYTHONPATH", ""))
    env = {**ENV, "RLIX_TEST_NVML_HOLD": str(nvml_hold), "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cls = ray.remote(StandinVllmWorker).options(num_cpus=0, runtime_env={"env_vars": env})
    # The workers' own default level is NeMo RL's (1, vllm_cfg.sleep_level unset): rlix.sleep_level (2 by default)
    # must reach them per call, or the configured level has no effect (the sleep asserts below fail).
    leaders = [cls.remote(str(model), 1) for _ in range(2)]
    ray.get([w.start.remote() for w in leaders], timeout=300)
    yield model, leaders
    for w in leaders:
        ray.kill(w)


def _config(**rlix: Any) -> dict[str, Any]:
    section = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 120, "init_timeout_s": 300,
               "sync_timeout_s": 60, "drain_timeout_s": 30, "watchdog_interval_s": 0.5, "bucket_size_bytes": 4 << 20,
               **rlix}
    return standin_master_config(section)


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _start_pipeline(engines: Any) -> tuple[Any, Any, StandinGeneration, NemoRLHooks, NemoRuntime]:
    """A pipeline on the module's engines: (control plane, trainer actor, stand-in generation, started hooks,
    their runtime)."""
    from rlix_plugins.control import client

    model, leaders = engines
    cp = client.connect()
    trainer = ray.remote(StandinMegatronWorker).options(num_cpus=0).remote(str(model))
    generation = StandinGeneration(leaders)
    hooks = NemoRLHooks()
    hooks.rlix_pipeline_start(master_config=_config(), policy=StandinPolicy(trainer), policy_generation=generation,
                              start_step=0)
    rt = hooks.runtime
    assert isinstance(rt, NemoRuntime)
    return cp, trainer, generation, hooks, rt


def test_time_shared_steps_with_real_vllm(engines: Any) -> None:
    _model, leaders = engines
    cp, trainer, generation, hooks, rt = _start_pipeline(engines)
    pid = hooks.pipeline_id
    assert pid is not None
    try:
        # Routing installed on the driver's object BEFORE the collector pickles it (its copy must see resizes).
        assert isinstance(generation.fleet_selector, RouterShardSelector)
        # Init: every rank prewarmed once (wake, one warm-up sync of the start-up cache, sleep at rlix.sleep_level = 2,
        # not the workers' 1), none routed yet.
        for w in leaders:
            calls = ray.get(w.calls.remote())
            slept = calls.index(("sleep", 2))
            assert calls[0] == ("wake_up", None) and ("rpc", "rlix_finish_weight_update") in calls[1:slept], calls
            assert all(c[0] == "rpc" for c in calls[1:slept]), calls
        assert ray.get(rt.rt.router.active.remote()) == []

        collector = ray.remote(StandinCollector).options(num_cpus=0, max_concurrency=8).remote(generation)
        replay = ray.remote(StandinReplayBuffer).options(num_cpus=0).remote()
        hooks.on_trajectory_collector_created(collector=collector, replay_buffer=replay)
        # First expand loaded the real (version -1 = base) weights into the dummy-weight engines; published 0.
        assert ray.get(collector.get_versions.remote()) == [0]
        expands = [e for e in rt.rt.resize_history() if e["op"] == "expand"]
        assert expands and all(e["verified"] and e["version"] == -1 and e["published"] == 0 for e in expands)
        ray.get(collector.set_weight_version.remote(0))  # the loop's own initial publish (patched grpo.py)

        ray.get(collector.start_background.remote(2, 16))
        for step in range(2):
            ray.get(replay.add.remote(step, 3))  # 3 of the 4 prompt groups intended for version `step`
            # Progress: the count intended for the CURRENT version reaches the scheduler's coordinator.
            _wait(lambda s=step: (s, 3) in rt.progress_reports, 15, f"progress (version {step}, 3)")
            hooks.before_training(step=step)
            # Training GPU 0 granted: rank 0 (on GPU 0) was shrunk first; the collector's copy routes to rank 1 only.
            assert ray.get(rt.rt.router.active.remote()) == [1]
            outs = ray.get(collector.generate.remote(4))
            assert {o["dp_rank"] for o in outs} == {1}
            ray.get(trainer.train.remote(seed=10 + step))
            hooks.before_weight_sync(step=step)
            version = hooks.after_training(step=step)
            assert version == step + 1
            ray.get(collector.set_weight_version.remote(version))
            hooks.on_weight_version_published(step=step, weight_version=version)
            _wait(lambda: ray.get(rt.rt.router.active.remote()) == [0, 1], 60, "rank 0 re-expanded")
        hooks.before_checkpoint(step=1)  # the save runs on the training workers: grant + comm groups back
        assert ray.get(rt.rt.router.active.remote()) == [1]
        hooks.after_checkpoint(step=1)
        _wait(lambda: ray.get(rt.rt.router.active.remote()) == [0, 1], 60, "rank 0 re-expanded after the save")
        served = ray.get(collector.stop_background.remote())
        assert {r for r, _, _ in served} == {0, 1}
        _wait(lambda: (2, 0) in rt.progress_reports, 10, "progress for version 2")
        # Both ranks serve the newest weights: greedy outputs agree (rank 0 by expand, rank 1 by in-flight refresh).
        a = ray.get(leaders[0].generate_async.remote([1, 2, 3], 12))
        b = ray.get(leaders[1].generate_async.remote([1, 2, 3], 12))
        assert a["tokens"] == b["tokens"]
        versions = ray.get(collector.get_versions.remote())
    finally:
        hooks.on_pipeline_end()

    # End of run: watchdog off, planned shrink to zero, the collector stopped, unregistered.
    assert [e["op"] for e in rt.rt.resize_history()][-1] == "shrink"  # the planned shrink to zero came last
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(collector.get_versions.remote(), timeout=30)

    hist = rt.rt.resize_history()
    ops = [(e["op"], e["ranks"]) for e in hist]
    assert ("expand_failed" not in {o for o, _ in ops}) and ("refresh_failed" not in {o for o, _ in ops})
    refreshes = [e for e in hist if e["op"] == "refresh"]
    assert [(e["ranks"], e["version"], e["verified"]) for e in refreshes] == [([1], 1, True), ([1], 2, True)]
    re_expands = [e for e in hist if e["op"] == "expand" and e["version"] >= 1]
    assert [(e["ranks"], e["version"], e["published"]) for e in re_expands] == [([0], 1, 1), ([0], 2, 2), ([0], 2, 2)]
    # Versions reached the collector in order, never -1, never bumped twice.
    assert versions == sorted(versions) and min(versions) == 0 and max(versions) == 2
    # Progress restarted from 0 for each new version (not the age-window count of older entries).
    assert (1, 0) in rt.progress_reports and (2, 0) in rt.progress_reports
    # The cache was built while the parameters were "on GPU": before each offload (init + 2 steps).
    assert ray.get(trainer.offload.remote()) == 4
    status = cp.status()
    assert pid not in status["pipelines"]
    assert not [c for c, a in status["allocations"].items() if a["pipeline_id"] == pid]


def test_abort_finishes_callers_and_partial_sleep_wake(engines: Any) -> None:
    """Abort via __ray_call__ ends a long in-flight request (finish_reason 'abort', the caller returns, not hangs);
    partial sleep/wake reach only the named rank, at the level the fleet is given (not the workers' default 1)."""
    _model, leaders = engines
    fleet = NemoVllmFleet.from_generation(StandinGeneration(leaders), [0, 1], 1, 4)
    assert fleet.devices(1) == [(0, 1)] and fleet.memory_in_use([0, 1], 30) == {0: None, 1: None}
    for w in leaders:
        ray.get(w.clear_calls.remote())
    long = leaders[1].generate_async.remote([9, 8, 7], 480)
    _wait(lambda: ray.get(leaders[1].__ray_call__.remote(in_flight)) > 0, 30, "the request in flight")
    fleet.abort([1], 30)
    out = ray.get(long, timeout=60)
    assert out["finish_reason"] == "abort" and len(out["tokens"]) < 480
    fleet.sleep([1], 2, 30)
    fleet.wake_up([1], ["weights"], 30)
    assert ray.get(leaders[1].calls.remote()) == [("sleep", 2), ("wake_up", ["weights"])]
    assert ray.get(leaders[0].calls.remote()) == []


def test_memory_probe_reads_every_vllm_worker_not_only_the_leaders_tree(engines: Any, nvml_hold: Path) -> None:
    """The post-sleep probe of a rank counts what its vLLM workers hold though the DP leader's process tree does not
    show them (NeMo RL runs TP > 1 on vLLM's Ray executor: the TP workers are other Ray actors). The NVML stand-in
    shows each reading only its own process: the leader's front-end and, through ``collective_rpc``, the engine's
    worker each hold 3 GiB on GPU 0, so the rank holds 6 GiB there; the leader's reading alone said 3."""
    _model, leaders = engines
    fleet = NemoVllmFleet.from_generation(StandinGeneration(leaders), [0, 1], 1, 4)
    nvml_hold.write_text(str(3 << 30))
    try:
        held = fleet.memory_in_use([0, 1], 60)
    finally:
        nvml_hold.unlink()
    assert held == {0: 6 << 30, 1: 6 << 30}
    assert fleet.memory_in_use([1], 30) == {1: None}  # nothing measurable: the probe says so, it does not guess


def test_shrink_aborts_a_request_that_reaches_vllm_after_its_first_abort(engines: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind the SingleController's first GPU shrink: a request took its router ticket on rank 1 just
    before the shrink deactivated the rank, and reaches vLLM just AFTER the shrink's abort. The resizer (entered as
    the scheduler enters it, ``resize_infer``) aborts again while tickets are out, so the request ends as aborted
    (its caller retries elsewhere) instead of running to its full length inside the drain."""
    import threading

    from rlix_plugins.pipeline import resizer as resizer_mod
    from rlix_plugins.pipeline.config import RuntimeConfig
    from rlix_plugins.pipeline.router import RolloutRouter, RouterClient

    _model, leaders = engines
    monkeypatch.setattr(resizer_mod, "ABORT_REPEAT_S", 0.2)  # in-process resizer: re-abort sooner than 1 s

    class FirstAbortSignal(NemoVllmFleet):  # the real fleet; only says when its first abort returned
        first_done = threading.Event()

        def abort(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int]:
            held = super().abort(dp_ranks, timeout_s)
            self.first_done.set()
            return held

    router = ray.remote(RolloutRouter).options(num_cpus=0, max_concurrency=8).remote(2)
    try:
        ray.get(router.activate.remote([0, 1]), timeout=30)
        client = RouterClient(router, 2, timeout_s=30)
        fleet = FirstAbortSignal([leaders[0], leaders[1]], {0: [(0, 0)], 1: [(0, 1)]})
        resizer = resizer_mod.FleetResizer("late", fleet, None, router,  # type: ignore[arg-type]
                                           RuntimeConfig(drain_timeout_s=60, post_sleep_max_bytes=None))
        rank, ticket = client.acquire(exclude=[0])
        assert rank == 1
        out: dict[str, Any] = {}

        def late_request() -> None:  # dispatched only once the shrink's first abort found the engine empty
            assert fleet.first_done.wait(30)
            out["result"] = ray.get(leaders[1].generate_async.remote([4, 5, 6], 480), timeout=120)
            out["preempted"] = client.release(ticket)

        thread = threading.Thread(target=late_request)
        thread.start()
        resizer.resize_infer([1], [])
        thread.join(timeout=120)
        shrink = resizer.history()[-1]
        assert shrink["op"] == "shrink" and shrink["aborted"] == {1: 0}  # the first abort saw nothing
        assert out["result"]["finish_reason"] == "abort" and len(out["result"]["tokens"]) < 480, out
        assert out["preempted"] is True  # the caller knows to run it again elsewhere
        fleet.wake_up([1], None, 60)
    finally:
        ray.kill(router)


_OTHER_DRIVER = """
import sys, time
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
cfg = {"rlix": {"train_devices": [1], "infer_devices": [0, 1], "request_timeout_s": 120, "ray_address": sys.argv[1]},
       "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
       "loss_fn": {"use_importance_sampling_correction": True},
       "policy": {"megatron_cfg": {"enabled": True}, "generation": {"backend": "vllm", "colocated": {"enabled": False},
                  "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}}}
hooks = NemoRLHooks()
hooks.rlix_pipeline_start(master_config=cfg, policy=None, policy_generation=None, start_step=0)
hooks.before_training(step=0)
print("GRANTED", hooks.pipeline_id, flush=True)
time.sleep(600)
"""


def test_other_pipeline_preempts_and_its_crash_releases_its_gpus(engines: Any, tmp_path: Path) -> None:
    """Pipeline B (another driver process) trains on GPU 1: the scheduler shrinks pipeline A's rank 1 first and A
    keeps generating on rank 0. B is then killed mid-step (SIGKILL, holding GPU 1): its GPUs return to the pool,
    A's watchdog / standing GENERATION request re-expands rank 1, and A finishes a step."""
    import subprocess
    import sys

    cp, trainer, generation, hooks, rt = _start_pipeline(engines)
    other = None
    try:
        collector = ray.remote(StandinCollector).options(num_cpus=0, max_concurrency=8).remote(generation)
        replay = ray.remote(StandinReplayBuffer).options(num_cpus=0).remote()  # empty: A still has demand
        hooks.on_trajectory_collector_created(collector=collector, replay_buffer=replay)
        _wait(lambda: ray.get(rt.rt.router.active.remote()) == [0, 1], 60, "A on both ranks")
        address = ray.get_runtime_context().gcs_address
        other = subprocess.Popen([sys.executable, "-c", _OTHER_DRIVER, address], cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert other.stdout is not None
        line = other.stdout.readline()  # blocks until B holds GPU 1
        while line and not line.startswith("GRANTED"):  # Ray's own lines may come first (a raylet warning did)
            line = other.stdout.readline()
        assert line.startswith("GRANTED"), "the other driver ended before its grant"
        other_pid = line.split()[1]
        assert ray.get(rt.rt.router.active.remote()) == [0]  # A's rank 1 was slept before B's grant returned
        assert {o["dp_rank"] for o in ray.get(collector.generate.remote(3))} == {0}

        # Let one health probe (5 s) see B alive first, so this exercises the path of a known coordinator dying.
        # (A coordinator that dies before any probe found it is reaped after a grace: tests/control.)
        time.sleep(6.0)
        other.kill()  # crash mid-step, while holding the training GPU
        other.wait(timeout=30)
        try:
            _wait(lambda: ray.get(rt.rt.router.active.remote()) == [0, 1], 120, "A re-expanded onto B's freed GPU")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; control plane: {cp.status()}") from None
        allocs = cp.status()["allocations"]
        assert not [c for c, a in allocs.items() if a["pipeline_id"] == other_pid]

        hooks.before_training(step=0)
        ray.get(trainer.train.remote(seed=21))
        hooks.before_weight_sync(step=0)
        version = hooks.after_training(step=0)
        ray.get(collector.set_weight_version.remote(version))
        hooks.on_weight_version_published(step=0, weight_version=version)
        assert version == 1
    finally:
        if other is not None and other.poll() is None:
            other.kill()
        hooks.on_pipeline_end()
    assert hooks.pipeline_id is None or hooks.pipeline_id not in cp.status()["pipelines"]
