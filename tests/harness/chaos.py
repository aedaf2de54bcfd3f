"""Fault injection on the built-in host: the fault matrix (README, ``tests/faults``) and the chaos soak
(``benchmarks/soak.py``) break real pipelines the same way.

A :class:`Bench` runs demo pipelines (:class:`~rlix_plugins.demo.pipeline.DemoPipeline` driver actors with real
vLLM-CPU engines, a real trainer and the real control plane) on short timeouts. :func:`inject` breaks one of
them through a real mechanism - SIGKILL/SIGSTOP of the real process by pid, a receiver that never answers or
flips a byte of a real bucket (:mod:`~tests.harness.fault_worker`), an NVML that reports the memory a sleep
kept (the only stand-in: NVML cannot exist on a CPU machine) - at the moment named by the fault, observed from
outside (scheduler state, the trainer's phase, the fault file the broken component claimed).
:func:`check_failed_alone` then checks what every row promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import ray

from rlix_plugins.control.client import ControlPlane, connect
from rlix_plugins.control.coordinator import CoordinatorConfig
from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.types import cluster_id as make_cluster_id
from rlix_plugins.demo.pipeline import DemoPipeline, PipelineSpec
from rlix_plugins.pipeline.config import RuntimeConfig
from tests.harness import ROOT
from tests.harness.fault_file import FAULT_FILE_ENV

__all__ = ["BENCH_COORDINATOR", "BENCH_RUNTIME", "BENCH_SCHEDULER", "FAULTS", "Bench", "Fault", "Run",
           "check_failed_alone", "inject", "versions_in_order"]

#: Short bounds so a broken pipeline is failed in seconds (the defaults are sized for real GPUs and models).
BENCH_SCHEDULER: Final = SchedulerConfig(resize_timeout_s=60.0, poll_interval_s=0.2, health_interval_s=0.5,
                                         health_timeout_s=3.0, default_request_timeout_s=120.0)
BENCH_COORDINATOR: Final = CoordinatorConfig(lock_timeout_s=20.0, handler_timeout_s=30.0, lock_lease_s=60.0,
                                             heartbeat_lease_s=10.0)
BENCH_RUNTIME: Final = RuntimeConfig(request_timeout_s=150.0, init_timeout_s=300.0, sync_timeout_s=8.0,
                                     drain_timeout_s=8.0, route_timeout_s=20.0, resize_lock_timeout_s=40.0,
                                     release_timeout_s=40.0, watchdog_interval_s=1.0)
#: A fault must be resolved (the broken pipeline unregistered, its driver returned) within this: else a hang.
RESOLVE_S: Final = 150.0
#: How long an injector waits for the moment it aims at (a step, a phase, a claimed fault).
AIM_S: Final = 120.0
_FAULT_WORKER_CLS: Final = "tests.harness.fault_worker.FaultCPUWorker"


@dataclass(frozen=True)
class Fault:
    """One row of the fault matrix: what is broken, when, and what the failure reason names."""

    what: str
    when: str
    #: words of which the reason ``rlix status`` gives for the failed pipeline contains at least one
    reason_words: tuple[str, ...]
    #: it kills the control plane itself (every pipeline fails; ``rlix up`` restores service)
    control_plane: bool = False


FAULTS: Final[dict[str, Fault]] = {
    "driver_kill_training": Fault("driver SIGKILL", "while it holds the training grant", ("coordinator",)),
    "driver_kill_waiting": Fault("driver SIGKILL", "while it waits for a grant", ("coordinator",)),
    "driver_kill_expand": Fault("driver SIGKILL", "during an expand (engine waking)", ("coordinator", "expand")),
    "engine_kill_sync": Fault("vLLM engine actor SIGKILL", "mid weight sync (bucket being received)",
                              ("expand", "sync", "died", "refresh", "engine")),
    "engine_kill_shrink": Fault("vLLM engine actor SIGKILL", "mid shrink (engine going to sleep)",
                                ("shrink", "died", "sleep", "engine")),
    "engine_kill_wake": Fault("vLLM engine actor SIGKILL", "mid wake (expand)", ("expand", "died", "wake", "engine")),
    "trainer_kill_cache": Fault("trainer actor SIGKILL", "while it builds the CPU bucket cache", ("trainer",)),
    "receiver_hang": Fault("vLLM receiver never answers", "during a weight sync",
                           ("no answer", "did not", "within", "timed out", "Timeout")),
    "bucket_corrupt": Fault("one byte of a received bucket flipped", "during a weight sync",
                            ("checksum", "Verification", "verified")),
    "sleep_keeps_memory": Fault("a sleep that frees no memory (NVML reports it held)", "at a shrink",
                                ("after sleep", "still hold")),
    "coordinator_kill": Fault("pipeline coordinator actor SIGKILL", "while the pipeline runs", ("coordinator",)),
    "worker_oom": Fault("Ray worker OOM-killed (SIGKILL of the pipeline's largest process by pid)",
                        "while the pipeline runs", ("died", "engine", "trainer", "coordinator", "actor")),
    "lease_expiry": Fault("driver stops responding (SIGSTOP) while holding a grant", "while it holds the training grant",
                          ("lease expired",)),
    "scheduler_kill": Fault("scheduler actor SIGKILL", "while both pipelines run", ("scheduler",),
                            control_plane=True),
}

_NVML_STUB = '''"""NVML stand-in written by tests.harness.chaos (a CPU machine has no NVML): it reports the device
memory an armed "memory" fault says this process kept after a sleep, once, and nothing otherwise."""
import os
from types import SimpleNamespace

from tests.harness.fault_file import claim_fault

_held = []


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    fault = claim_fault("memory")
    if fault is not None:
        _held.append(int(fault["bytes"]))
    return 1 if _held else 0


def nvmlDeviceGetHandleByIndex(index):
    return index


def nvmlDeviceGetComputeRunningProcesses(handle):
    return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=_held.pop())] if _held else []
'''


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def _pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


def versions_in_order(versions: list[int]) -> bool:
    """Published weight versions are complete and in order: 0, 1, 2, ... (no gap, no repeat, no -1)."""
    return versions == list(range(len(versions)))


@dataclass
class Run:
    """One launched pipeline: its driver actor, the run's object ref and what it emitted."""

    name: str
    spec: PipelineSpec
    driver: Any
    ref: Any
    fault_file: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    killed: bool = False
    _pipeline_id: str | None = None

    def poll(self) -> list[dict[str, Any]]:
        """New events (none once the driver is gone)."""
        if self.killed:
            return []
        try:
            new = list(ray.get(self.driver.events.remote(len(self.events)), timeout=30))
        except Exception:
            return []
        self.events += new
        return new

    def steps(self) -> int:
        self.poll()
        return sum(1 for e in self.events if e["kind"] == "step")

    def started(self) -> bool:
        self.poll()
        return any(e["kind"] in ("started", "error") for e in self.events)

    def pipeline_id(self) -> str:
        """The id it registered under (asked once: it stays known after the driver died)."""
        if self._pipeline_id is None:
            self._pipeline_id = str(_wait(lambda: ray.get(self.driver.get_pipeline_id.remote(), timeout=30), 300,
                                          f"{self.name} registered"))
        return self._pipeline_id

    def actors(self) -> dict[str, Any]:
        return dict(ray.get(self.driver.actors.remote(), timeout=30))

    def driver_pid(self) -> int:
        return _pid_of(self.driver)

    def finished(self) -> bool:
        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout_s: float) -> dict[str, Any] | None:
        """The run's summary; None when the driver died. Raises ``TimeoutError`` when it hangs."""
        ready, _ = ray.wait([self.ref], timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"{self.name}: the driver's run() did not return within {timeout_s:.0f} s")
        try:
            return dict(ray.get(self.ref))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            return None

    def arm(self, **fault: Any) -> None:
        """Arm a fault for this pipeline's engines (written atomically; claimed once)."""
        self.hit_file.unlink(missing_ok=True)
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fault))
        tmp.rename(self.fault_file)

    @property
    def hit_file(self) -> Path:
        return Path(str(self.fault_file) + ".hit")

    def wait_hit(self, timeout_s: float = AIM_S) -> dict[str, Any]:
        """Wait until a component claimed the armed fault; returns what it wrote (op, pid, ...)."""
        _wait(lambda: self.hit_file.exists() and self.hit_file.stat().st_size > 0, timeout_s,
              f"{self.name}: armed fault claimed")
        return dict(_wait(lambda: _read_json(self.hit_file), 5, "fault claim record"))

    def kill(self) -> None:
        """End the driver (and with it every actor it owns) for good."""
        self.killed = True
        with contextlib.suppress(Exception):
            ray.kill(self.driver, no_restart=True)
        self.fault_file.unlink(missing_ok=True)
        self.hit_file.unlink(missing_ok=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


class Bench:
    """Demo pipelines on the current Ray cluster's control plane (with :data:`BENCH_SCHEDULER` if it creates it)."""

    def __init__(self, workdir: Path, *, steps: int = 10_000, prompts_per_step: int = 2, group_size: int = 2,
                 max_tokens: int = 6) -> None:
        from rlix_plugins.demo.tiny_model import build_tiny_qwen2

        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = str(build_tiny_qwen2(self.workdir / "model", seed=0))
        stub = self.workdir / "nvml_stub"
        stub.mkdir(exist_ok=True)
        (stub / "pynvml.py").write_text(_NVML_STUB)
        self._stub = str(stub)
        self._steps, self._prompts_per_step = steps, prompts_per_step
        self._group_size, self._max_tokens = group_size, max_tokens
        self._count = 0
        self.cp = self.control_plane()

    @staticmethod
    def control_plane() -> ControlPlane:
        """The control plane, started (``rlix up``) if it is missing or its scheduler died."""
        return connect(create_if_missing=True, scheduler_config=BENCH_SCHEDULER)

    def launch(self, name: str, train: list[int], infer: list[int], *, steps: int | None = None) -> Run:
        """Start a pipeline's driver (it registers, starts its engines and trains ``steps`` steps)."""
        self._count += 1
        fault_file = self.workdir / f"fault-{name}-{self._count}.json"
        # The engines import the stub's pynvml and the fault worker (``tests.harness``, not in the package) by name:
        # both directories go on their PYTHONPATH, whatever working directory the caller's Ray driver has.
        path = (self._stub, str(ROOT), os.environ.get("PYTHONPATH", ""))
        env = {FAULT_FILE_ENV: str(fault_file), "PYTHONPATH": os.pathsep.join(p for p in path if p)}
        spec = PipelineSpec(name=name, index=self._count, model_dir=self.model, train_devices=tuple(train),
                            infer_devices=tuple(infer), seed=self._count, runtime=BENCH_RUNTIME,
                            coordinator=BENCH_COORDINATOR, sample_timeout_s=90.0, worker_cls=_FAULT_WORKER_CLS,
                            engine_env=env, steps=steps or self._steps, prompts_per_step=self._prompts_per_step,
                            group_size=self._group_size, max_tokens=self._max_tokens)
        driver: Any = ray.remote(DemoPipeline).options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(spec)
        return Run(name, spec, driver, driver.run.remote(), fault_file)

    def status(self) -> dict[str, Any]:
        return self.cp.status()

    def holds(self, pipeline_id: str, status: dict[str, Any] | None = None) -> list[str]:
        """What the scheduler still has for the pipeline: its registration, allocations, pending requests."""
        st = status or self.status()
        out = ["registered" for pid in st["pipelines"] if pid == pipeline_id]
        out += [f"allocation {cid} {a['gpus']}" for cid, a in st["allocations"].items() if a["pipeline_id"] == pipeline_id]
        out += [f"pending {r['cluster_id']}" for r in st["pending"] if r["cluster_id"].startswith(pipeline_id + "_")]
        return out


class Survivor:
    """A matrix's shared survivor pipeline (train / infer GPUs ``layout``), started again when a row (or a failed
    test) ended it: one start-up for all the rows instead of one per row."""

    def __init__(self, bench: Bench, layout: dict[str, list[int]]) -> None:
        self.bench, self.layout = bench, layout
        self.run: Run | None = None

    def get(self) -> Run:
        if self.run is None or self.run.finished():
            if self.run is not None:
                self.run.kill()
            self.run = self.bench.launch("S", self.layout["train"], self.layout["infer"])
            _wait(self.run.started, 300, "the survivor started", every_s=0.2)
        return self.run

    def kill(self) -> None:
        if self.run is not None:
            self.run.kill()


# ---------------------------------------------------------------------------------------------------- injectors
def _train_cluster(run: Run) -> str:
    return make_cluster_id(run.pipeline_id(), "actor_train")


def _wait_training(bench: Bench, run: Run) -> None:
    cid = _train_cluster(run)
    _wait(lambda: (a := bench.status()["allocations"].get(cid)) is not None and a["priority"] == "ACTOR_TRAINING",
          AIM_S, f"{run.name} holds its training grant", every_s=0.02)


def _wait_pending(bench: Bench, run: Run) -> None:
    prefix = run.pipeline_id() + "_"
    _wait(lambda: any(r["cluster_id"].startswith(prefix) and r["priority"] != "GENERATION"
                      for r in bench.status()["pending"]),
          AIM_S, f"{run.name} waits for a grant", every_s=0.01)


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _largest_process(run: Run) -> tuple[str, int]:
    """(component, pid) of the pipeline's process with the largest resident set: the OOM killer's choice."""
    actors = run.actors()
    pids = {"driver": run.driver_pid()}
    for key, handle in actors.items():
        for i, h in enumerate(handle if isinstance(handle, list) else [handle]):
            try:
                pids[f"{key}{i if isinstance(handle, list) else ''}"] = _pid_of(h)
            except Exception:
                continue

    def rss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    name = max(pids, key=lambda k: rss(pids[k]))
    return name, pids[name]


def inject(bench: Bench, run: Run, kind: str, *, node_ip: str | None = None) -> dict[str, Any]:
    """Break ``run`` as fault ``kind`` says (run must have started); returns what was done. ``node_ip``: an engine
    fault is claimed only by the engine on that Ray node."""
    if kind not in FAULTS:
        raise KeyError(f"unknown fault {kind!r}; known: {sorted(FAULTS)}")
    run.pipeline_id()  # known before the driver may die
    aim: dict[str, Any] = {"node_ip": node_ip} if node_ip else {}
    slow: dict[str, Any] = {"action": "slow", "seconds": 30.0, **aim}
    done: dict[str, Any] = {"fault": kind, "time": time.time()}
    if kind == "driver_kill_training":
        pid = run.driver_pid()
        _wait_training(bench, run)
        _kill(pid)
    elif kind == "driver_kill_waiting":
        pid = run.driver_pid()
        _wait_pending(bench, run)
        _kill(pid)
    elif kind in ("driver_kill_expand", "engine_kill_wake"):
        run.arm(op="wake", **slow)
        hit = run.wait_hit()
        _kill(run.driver_pid() if kind == "driver_kill_expand" else hit["pid"])
    elif kind == "engine_kill_sync":
        run.arm(op="update", **slow)
        _kill(run.wait_hit()["pid"])
    elif kind == "engine_kill_shrink":
        run.arm(op="sleep", **slow)
        _kill(run.wait_hit()["pid"])
    elif kind == "trainer_kill_cache":
        trainer = run.actors()["trainer"]
        pid = _pid_of(trainer)
        _wait(lambda: ray.get(trainer.__ray_call__.remote(lambda self: self.phase), timeout=30) == "build_cache",
              AIM_S, f"{run.name}'s trainer builds its cache", every_s=0.0)
        _kill(pid)
    elif kind == "receiver_hang":
        run.arm(op="update", action="hang", **aim)
        run.wait_hit()
    elif kind == "bucket_corrupt":
        run.arm(op="update", action="corrupt", **aim)
        run.wait_hit()
    elif kind == "sleep_keeps_memory":
        run.arm(op="memory", action="hold", bytes=8 << 30, **aim)
        run.wait_hit()
    elif kind == "coordinator_kill":
        _kill(_pid_of(run.actors()["coordinator"]))
    elif kind == "worker_oom":
        name, pid = _largest_process(run)
        done["component"] = name
        _kill(pid)
    elif kind == "lease_expiry":
        pid = run.driver_pid()
        _wait_training(bench, run)
        os.kill(pid, signal.SIGSTOP)
        done["stopped_pid"] = pid
    elif kind == "scheduler_kill":
        _kill(_pid_of(bench.cp.scheduler))
    done["injected_s"] = time.time() - done["time"]
    return done


# ---------------------------------------------------------------------------------------------------- checks
def _status_without(bench: Bench, pipeline_id: str) -> dict[str, Any] | None:
    st = bench.status()
    return None if pipeline_id in st["pipelines"] else st


def check_failed_alone(bench: Bench, victim: Run, survivor: Run | None, kind: str, done: dict[str, Any], *,
                       survivor_steps: int = 2, resolve_s: float = RESOLVE_S) -> dict[str, Any]:
    """What every row promises. Raises ``AssertionError`` naming the broken promise; returns measurements.

    The victim is unregistered within ``resolve_s`` (never hangs), ``rlix status`` names it as failed and why,
    nothing stays allocated to it, its driver's ``run()`` returns (or the driver is dead); the survivor trains
    ``survivor_steps`` more steps and its published versions are complete and in order.
    """
    vpid = victim.pipeline_id()
    t0 = time.monotonic()
    try:
        st = _wait(lambda: _status_without(bench, vpid), resolve_s, f"{victim.name} ({kind}) unregistered",
                   every_s=0.2)
    except TimeoutError as exc:
        raise AssertionError(f"hang: {exc}; the scheduler still has {bench.holds(vpid)}") from None
    out: dict[str, Any] = {"resolved_s": round(time.monotonic() - t0 + done.get("injected_s", 0.0), 1)}
    failed = st.get("failed", {}).get(vpid)
    assert failed is not None, f"rlix status does not name {vpid} as failed ({kind}): failed={st.get('failed')}"
    reason = failed["reason"]
    out["reason"] = reason
    assert any(w.lower() in reason.lower() for w in FAULTS[kind].reason_words), \
        f"{kind}: the failure reason {reason!r} names none of {FAULTS[kind].reason_words}"
    assert not bench.holds(vpid, st), f"{kind}: the scheduler still has {bench.holds(vpid, st)} for the failed {vpid}"
    if kind == "lease_expiry":
        os.kill(done["stopped_pid"], signal.SIGCONT)  # it wakes up unregistered: it must end, not hang
    try:
        victim.result(resolve_s)
    except TimeoutError as exc:
        raise AssertionError(f"hang: {exc}") from None
    if survivor is not None:
        base = survivor.steps()
        try:
            _wait(lambda: survivor.steps() >= base + survivor_steps or survivor.finished(), resolve_s,
                  f"{survivor.name} trains {survivor_steps} more steps", every_s=0.5)
        except TimeoutError as exc:
            raise AssertionError(f"{kind}: the surviving pipeline stalled: {exc}") from None
        assert not survivor.finished(), f"{kind}: the surviving pipeline ended: {survivor.result(5)}"
        versions = ray.get(survivor.actors()["collector"].stats.remote(), timeout=30)["versions_seen"]
        assert versions_in_order(versions), f"{kind}: the survivor published versions {versions}"
        out["survivor_versions"] = len(versions)
    return out

