"""Chaos soak: N built-in pipelines on declared GPUs for a given time while random faults of the fault matrix hit them.

    python benchmarks/soak.py --minutes 30 --pipelines 2 --gpus 2 --out soak.json

Pipeline ``i`` trains on GPU ``i mod G`` and rolls out on every GPU (the demo's topology). At random times
(exponential, mean ``--mean-gap-s``) one fault of :data:`tests.harness.chaos.FAULTS` hits a random running
pipeline (the scheduler kill hits them all; ``rlix up`` then restarts the control plane). A pipeline that failed
or finished is started again, so the soak keeps going. Checked all along:

* hangs (must be 0): a broken pipeline not unregistered, or its driver's ``run()`` not returned, within
  ``RESOLVE_S``; a pipeline not started within ``START_S``; a started one without a new step for 180 s;
* invariant violations (must be 0): the scheduler checks the state it committed after every cycle
  (``status()["invariant_checks"]`` / ``["invariant_violations"]``); this script also checks every status it
  reads (no GPU held twice, allocations inside the pool, nothing allocated to an unregistered pipeline);
* GPUs leaked at the end (must be 0): after every pipeline stopped, nothing is allocated;
* syncs verified: every weight sync (expand or in-flight refresh) the pipelines reported, and whether its
  checksums were verified.

Prints the report and writes it as JSON. Exit code 0 only when hangs, violations and leaks are all 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlix_plugins.control.admin import ray_auth
from tests.harness.chaos import BENCH_RUNTIME, FAULTS, RESOLVE_S, Bench, Run, inject

#: A pipeline must start (engines up, first expand) within this: the runtime's init bound plus slack.
START_S = BENCH_RUNTIME.init_timeout_s + 120.0
#: Faults drawn per injection (the control-plane kill restarts everything, so it is drawn less often).
WEIGHTS = {kind: (0.3 if f.control_plane else 1.0) for kind, f in FAULTS.items()}


def _status_problems(st: dict[str, Any]) -> list[str]:
    """Invariants visible from outside in one ``rlix status`` reading."""
    problems: list[str] = []
    owner: dict[int, str] = {}
    pool = set(st["gpus"])
    for cid, a in st["allocations"].items():
        if a["pipeline_id"] not in st["pipelines"]:
            problems.append(f"{cid} allocated to unregistered pipeline {a['pipeline_id']}")
        for g in a["gpus"]:
            if g not in pool:
                problems.append(f"{cid} holds GPU {g} outside the pool")
            if g in owner:
                problems.append(f"GPU {g} held by {owner[g]} and {cid}")
            owner[g] = cid
    if set(st["idle_gpus"]) != pool - set(owner):
        problems.append(f"idle GPUs {st['idle_gpus']} are not the pool minus the allocated ones")
    return problems


class Soak:
    def __init__(self, pipelines: int, gpus: int, workdir: Path, seed: int, stall_s: float) -> None:
        self.rng = random.Random(seed)
        self.gpus = gpus
        self.bench = Bench(workdir)
        self.slots: list[Run | None] = [None] * pipelines
        self.stall_s = stall_s
        self.last_step: dict[int, tuple[int, float]] = {}
        self.running: set[int] = set()
        self.faults: Counter[str] = Counter()
        self.hangs: list[str] = []
        self.violations: list[str] = []
        self.reasons: list[dict[str, Any]] = []
        self.syncs = {"verified": 0, "unverified": 0}
        self.steps = 0
        self.launched = 0
        self.cycles = 0
        self.checks = 0
        self._sched_counts = (0, 0)

    def _say(self, line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    # ------------------------------------------------------------------ pipelines
    def _launch(self, i: int) -> None:
        run = self.bench.launch(f"p{i}", [i % self.gpus], list(range(self.gpus)))
        self.slots[i] = run
        self.launched += 1
        self.last_step[i] = (0, time.monotonic())
        self.running.discard(i)

    def _account(self, run: Run) -> None:
        """Count the steps and syncs a run reported (once, when it is retired)."""
        run.poll()
        self.steps += sum(1 for e in run.events if e["kind"] == "step")
        for e in run.events:
            for r in e.get("resizes", []):
                if r["op"] in ("expand", "refresh") and r["ranks"]:
                    self.syncs["verified" if r["verified"] else "unverified"] += 1

    def _retire(self, i: int) -> None:
        run = self.slots[i]
        if run is not None:
            self._account(run)
            run.kill()
        self.slots[i] = None

    def _tend(self) -> None:
        """Restart finished pipelines. A hang: a pipeline not started (registered, engines up, first expand) within
        ``START_S``, or a started one without a new step for ``stall_s``."""
        for i, run in enumerate(self.slots):
            if run is None or run.finished():
                self._retire(i)
                self._launch(i)
                continue
            steps = run.steps()
            last, since = self.last_step[i]
            started = run.started()
            if steps != last or (started and i not in self.running):
                self.last_step[i] = (steps, time.monotonic())
                if started:
                    self.running.add(i)
                continue
            bound = self.stall_s if started else START_S
            if time.monotonic() - since > bound:
                what = f"no step for {bound:.0f} s (at step {steps})" if started else f"not started within {bound:.0f} s"
                self.hangs.append(f"{run.name}: {what}")
                self._say(f"HANG {self.hangs[-1]}")
                self._retire(i)
                self._launch(i)

    # ------------------------------------------------------------------ control plane
    def _observe(self) -> None:
        try:
            st = self.bench.status()
        except Exception:
            return  # the scheduler is being restarted
        self.violations += _status_problems(st)
        cycles, checks = st.get("cycles", 0), st.get("invariant_checks", 0)
        last_cycles, last_checks = self._sched_counts
        if cycles < last_cycles:  # a new scheduler: its counters restart
            last_cycles = last_checks = 0
        self.cycles += cycles - last_cycles
        self.checks += checks - last_checks
        self._sched_counts = (cycles, checks)
        seen = set(self.violations)
        self.violations += [v for v in st.get("invariant_violations", []) if v not in seen]

    # ------------------------------------------------------------------ faults
    def _fault(self) -> None:
        ready = [i for i, r in enumerate(self.slots) if r is not None and r.started() and not r.finished()]
        if not ready:
            return
        kind = self.rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
        i = self.rng.choice(ready)
        run = self.slots[i]
        assert run is not None
        try:
            pid = run.pipeline_id()
            done = inject(self.bench, run, kind)
        except Exception as exc:  # the moment never came (e.g. the pipeline ended first): not a fault
            self.reasons.append({"fault": kind, "skipped": f"{type(exc).__name__}: {exc}"[:300]})
            self._say(f"{kind} on {run.name} skipped: {self.reasons[-1]['skipped'][:160]}")
            return
        self.faults[kind] += 1
        victims = [r for r in self.slots if r is not None] if FAULTS[kind].control_plane else [run]
        if FAULTS[kind].control_plane:
            self._resolve_control_plane(victims)
        else:
            self._resolve(run, pid, kind, done)
        for j, r in enumerate(self.slots):
            if r in victims:
                self._retire(j)
                self._launch(j)

    def _resolve(self, run: Run, pid: str, kind: str, done: dict[str, Any]) -> None:
        deadline = time.monotonic() + RESOLVE_S
        while time.monotonic() < deadline:
            self._observe()
            st = self.bench.status()
            if pid not in st["pipelines"]:
                self.reasons.append({"fault": kind, "pipeline": run.name,
                                     "reason": st.get("failed", {}).get(pid, {}).get("reason"),
                                     "resolved_s": round(time.time() - done["time"], 1)})
                self._say(f"{kind} on {run.name}: failed after {self.reasons[-1]['resolved_s']} s: "
                          f"{str(self.reasons[-1]['reason'])[:160]}")
                break
            time.sleep(0.5)
        else:
            self.hangs.append(f"{run.name} ({kind}): still registered {RESOLVE_S:.0f} s after the fault")
        if kind == "lease_expiry":
            os.kill(done["stopped_pid"], signal.SIGCONT)
        try:
            run.result(RESOLVE_S)
        except TimeoutError as exc:
            self.hangs.append(f"{kind}: {exc}")

    def _resolve_control_plane(self, runs: list[Run]) -> None:
        t0 = time.time()
        for run in runs:
            try:
                run.result(RESOLVE_S)
            except TimeoutError as exc:
                self.hangs.append(f"scheduler_kill: {exc}")
        self.reasons.append({"fault": "scheduler_kill", "all_ended_s": round(time.time() - t0, 1)})
        self._say(f"scheduler_kill: every pipeline ended within {self.reasons[-1]['all_ended_s']} s; `rlix up`")
        self.bench.cp = Bench.control_plane()  # `rlix up`
        self._sched_counts = (0, 0)

    # ------------------------------------------------------------------ the soak
    def run(self, seconds: float, mean_gap_s: float) -> dict[str, Any]:
        t_start = time.monotonic()
        for i in range(len(self.slots)):
            self._launch(i)
        next_fault = time.monotonic() + self.rng.expovariate(1.0 / mean_gap_s)
        while time.monotonic() - t_start < seconds:
            self._observe()
            self._tend()
            if time.monotonic() >= next_fault:
                self._fault()
                next_fault = time.monotonic() + self.rng.expovariate(1.0 / mean_gap_s)
            time.sleep(1.0)
        return self._finish(time.monotonic() - t_start)

    def _finish(self, seconds: float) -> dict[str, Any]:
        for run in self.slots:
            if run is not None:
                with contextlib.suppress(Exception):
                    run.driver.stop.remote()
        for i, run in enumerate(self.slots):
            if run is None:
                continue
            try:
                run.result(RESOLVE_S)
            except TimeoutError as exc:
                self.hangs.append(f"end: {exc}")
            self._retire(i)
        self._observe()
        leaked: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = self.bench.status()
            leaked = sorted({g for a in st["allocations"].values() for g in a["gpus"]})
            if not leaked:
                break
            time.sleep(1.0)
        return {
            "seconds": round(seconds, 1), "pipelines": len(self.slots), "gpus": self.gpus,
            "cycles": self.cycles, "invariant_checks": self.checks,
            "faults_injected": sum(self.faults.values()), "faults_by_kind": dict(sorted(self.faults.items())),
            "hangs": len(self.hangs), "hang_details": self.hangs,
            "invariant_violations": len(self.violations), "violation_details": self.violations[:20],
            "gpus_leaked": len(leaked), "syncs_verified": self.syncs["verified"],
            "syncs_not_verified": self.syncs["unverified"], "pipelines_launched": self.launched,
            "steps_trained": self.steps, "fault_outcomes": self.reasons,
        }


def run_soak(minutes: float, pipelines: int = 2, gpus: int = 2, *, seed: int = 0, mean_gap_s: float = 40.0,
             stall_s: float = 180.0, workdir: Path | None = None) -> dict[str, Any]:
    """Run the soak on the current Ray cluster (``ray.init`` first; it needs ``gpus`` declared GPUs)."""
    work = workdir or Path(tempfile.mkdtemp(prefix="rlix-soak-"))
    return Soak(pipelines, gpus, work, seed, stall_s).run(minutes * 60.0, mean_gap_s)


def report_lines(report: dict[str, Any]) -> list[str]:
    return [
        f"chaos soak: {report['pipelines']} pipelines on {report['gpus']} GPUs for {report['seconds'] / 60:.1f} min",
        f"  scheduling cycles {report['cycles']} (committed states checked: {report['invariant_checks']})",
        f"  faults injected {report['faults_injected']}: "
        + ", ".join(f"{k} {v}" for k, v in report["faults_by_kind"].items()),
        f"  hangs {report['hangs']}, invariant violations {report['invariant_violations']}, "
        f"GPUs leaked at the end {report['gpus_leaked']}",
        f"  weight syncs verified {report['syncs_verified']} (not verified: {report['syncs_not_verified']}); "
        f"{report['steps_trained']} steps trained by {report['pipelines_launched']} pipeline runs",
    ]


def _token_auth() -> str | None:
    """Ray's token authentication on, as for users and in the tests (``tests/conftest.py``). Without a token of the
    caller's (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``) the soak's cluster gets a fresh one in a private temporary
    file rather than the user's ``~/.ray/auth_token``; returns that file's directory, to remove after the soak."""
    ray_auth.enable_token_mode()  # this process imported Ray already: its config must see the mode too
    tmp = None
    if not os.environ.get(ray_auth.TOKEN_ENV) and not os.environ.get(ray_auth.TOKEN_PATH_ENV):
        tmp = tempfile.mkdtemp(prefix="rlix-soak-token-")  # 0700
        os.environ[ray_auth.TOKEN_PATH_ENV] = os.path.join(tmp, "auth_token")
    ray_auth.ensure_private_token()  # created 0600, or the caller's checked
    return tmp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--pipelines", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-gap-s", type=float, default=40.0, help="mean seconds between two faults")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args(argv)
    import ray

    token_dir = _token_auth()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    try:
        ray.init(address="local", num_gpus=args.gpus, num_cpus=max(8, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False, namespace="rlix_soak")
        report = run_soak(args.minutes, args.pipelines, args.gpus, seed=args.seed, mean_gap_s=args.mean_gap_s)
        for line in report_lines(report):
            print(line)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"  report: {args.out}")
    finally:
        ray.shutdown()
        if token_dir is not None:
            shutil.rmtree(token_dir, ignore_errors=True)
    return 0 if report["hangs"] == 0 and report["invariant_violations"] == 0 and report["gpus_leaked"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
