"""The NeMo RL GPU report (tools/gpu-offline/gpu/nemo_rl_shared_report.py) over a stored H200 run: its trace figures come from
the timeline's own span reconstruction (``occupancy_spans``/``held_seconds``) and match the report written then."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results"
RUN = RESULTS / "h200-2026-11-26-real-scale/shared2-coresident"


def _report(run: Path, tmp_path: Path, alone: Path | None = None) -> str:
    """The report over a stored run's files (and, with ``alone``, against that one-pipeline run's summary.json)."""
    for f in run.iterdir():
        if f.suffix == ".gz":
            with gzip.open(f, "rb") as src, open(tmp_path / f.stem, "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif f.name in ("summary.json", "status.json", "gpu_after.csv"):
            shutil.copy(f, tmp_path / f.name)
    args = ["--alone", str(alone)] if alone else []
    return subprocess.run([sys.executable, "tools/gpu-offline/gpu/nemo_rl_shared_report.py", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120, check=True, cwd=RESULTS.parents[1]).stdout


def test_report_of_the_stored_coresident_run(tmp_path: Path) -> None:
    out = _report(RUN, tmp_path)
    stored = (RUN / "report.txt").read_text()
    for line in ("steps 16; step phase 898.8 s -> 64 steps/h", "GPU busy 0.618 of the steps phase",
                 "held by rollout + training: 785 s of the steps phase, busy 0.654",
                 "held by training: 99 s of the steps phase, busy 0.392",
                 "at most 1 steps of another while one waited"):
        assert line in out and line in stored, (line, out)
    assert "allocated 0.997" in out and "GPU allocated 0.997 of the steps phase" in stored


def test_a_cluster_on_gpus_2_3_reads_its_trace_against_those_gpus(tmp_path: Path) -> None:
    """The trace names the cluster's GPUs 0-1 (its Ray cluster sees two), NVML the machine's 2-3: the report pairs
    them by position (it read "allocated 0.000" on both before)."""
    out = _report(RESULTS / "h200x4-2026-11-28-faults/shared2-engine-g23", tmp_path)
    assert "GPU allocated 1.000 of the steps phase" in out, out
    assert "  GPU 2: allocated 1.000" in out and "  GPU 3: allocated 1.000" in out, out
    assert "held by rollout + training: 150 s of the steps phase" in out, out


def test_a_pair_against_one_pipeline_alone(tmp_path: Path) -> None:
    """``--alone DIR``: together vs one after another (derived from one pipeline alone: N in a row make its
    steps/hour) and the ceiling min(N, 1 / its busy share), for the stored sized pair of 2026-11-30."""
    sized = RESULTS / "h200x2-2026-11-30-sized-pair"
    out = _report(sized / "shared2", tmp_path, alone=sized / "shared1")
    assert "steps 16; step phase 652.3 s -> 88 steps/h" in out, out
    assert ("together / one after another 1.55x over the steps phase, 1.75x over the whole run" in out
            and "ceiling min(2, 1 / 0.372) = 2.00x: 0.77 of it; while every pipeline ran 1.64x: 0.82 of it\n"
            in out), out  # the ceiling capped at N: no split into busy share and cost per step


def test_each_gpu_process_peak_is_read_from_the_samplers_procs_file(tmp_path: Path) -> None:
    """``nvml_procs.csv`` (the sampler's per-process readings) gives each GPU process's peak and the title it ran
    under (not an idle Ray worker's), and is not read as a run's NVML samples: the stored run's figures stand."""
    t0 = 1795707300.0  # inside the stored run's steps phase
    rows = ["time,gpu,pid,bytes,name",
            f"{t0},0,11,{2**30},ray::IDLE",
            f"{t0 + 1},0,11,{40 * 2**30},ray::VllmAsyncGenerationWorker.generate",
            f"{t0 + 2},0,11,{38 * 2**30},ray::VllmAsyncGenerationWorker.generate",
            f"{t0 + 1},0,12,{45 * 2**30},ray::DTensorPolicyWorker.train",
            f"{t0 + 2},0,12,{3 * 2**30},ray::DTensorPolicyWorker.offload_after_refit"]
    (tmp_path / "nvml_procs.csv").write_text("\n".join(rows) + "\n")
    out = _report(RUN, tmp_path)
    assert "steps 16; step phase 898.8 s -> 64 steps/h" in out and "GPU busy 0.618 of the steps phase" in out, out
    lines = out[out.index("nvml_procs: each GPU process's peak"):].splitlines()
    assert lines[1].startswith("  GPU 0 pid 12: 45.00 GiB at ") and lines[1].endswith(
        "(ray::DTensorPolicyWorker.train)"), lines
    assert lines[2].startswith("  GPU 0 pid 11: 40.00 GiB at ") and lines[2].endswith(
        "(ray::VllmAsyncGenerationWorker.generate)"), lines


def test_each_pipelines_waits_for_its_batch_are_read_from_nemo_rls_step_timing(tmp_path: Path) -> None:
    """The pair of 2026-11-30 at engines of one step's batch: one rollout fitted beside both training steps and
    pipeline a's rank kept that place, so b waited 21-33 s for its batch in five steps while a waited ~0.4 s. The
    turn metric cannot see it (b never waited for a grant); NeMo RL's ``exposed_generation`` does."""
    out = _report(RESULTS / "h200x2-2026-11-30-one-batch-pair/shared2", tmp_path)
    assert "waits for its batch (NeMo RL's 'exposed_generation') [0.3, 0.5, 0.4, 0.4, 0.4, 0.5, 0.5, 0.4] s" in out
    assert "waits for its batch (NeMo RL's 'exposed_generation') [0.4, 0.5, 32.9, 21.2, 24.3, 22.8, 28.8, 0.5] s" in out


def test_four_on_one_gpu_against_one_alone_split_what_is_left_of_the_ceiling(tmp_path: Path) -> None:
    """Where the ceiling is 1 / busy alone (below N) on one GPU, the fraction reached is the busy share together times
    a step's GPU-busy seconds alone over together: for the stored four 0.5B pipelines of 2026-12-01, 0.952 x 12.4 /
    13.3 = 0.89; and the same while all four still ran (one finished 58 s before the last)."""
    turns = RESULTS / "h200-2026-12-01-four-turns"
    out = _report(turns / "shared4-0.5b", tmp_path, alone=turns / "alone-0.5b")
    assert "steps 32; step phase 446.4 s -> 258 steps/h" in out, out
    assert ("ceiling min(4, 1 / 0.491) = 2.04x: 0.89 of it = busy together 0.952 x GPU-busy s a step alone / "
            "together 12.4 / 13.3; while every pipeline ran 1.92x: 0.94 of it") in out, out
    # b ended first (388.2 s into the steps phase); the three steps then in progress count by their time passed
    assert ("while every pipeline ran (the first 388.2 s of the steps phase): 29.6 steps (those in progress at its end by their "
            "time passed) -> 274 steps/h, GPU busy 0.983") in out, out
