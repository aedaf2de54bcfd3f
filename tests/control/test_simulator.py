"""``rlix simulate``: the discrete-time simulation on the real planner, its baselines and its CLI."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import replace

import pytest

from rlix_plugins.cli import main as rlix_main
from rlix_plugins.control.capacity.comparison import compare, rlix_placements, stock_configs
from rlix_plugins.control.capacity.simulation import JobSpec, Placement, Simulation
from rlix_plugins.control.capacity.timeline import occupancy_spans
from rlix_plugins.control.types import ClusterMemory, Priority


def _jobs(n: int, **kw) -> list[JobSpec]:
    base = {"steps": 3, "step_target": 256, "traj_time_s": 20.0, "train_time_s": 30.0, "init_time_s": 10.0}
    base.update(kw)
    return [JobSpec(name=f"p{i}", start_s=10.0 * i, **base) for i in range(n)]


def _assert_exclusive(events) -> None:
    """Executed plans never put two clusters on one GPU at the same time."""
    by_gpu = defaultdict(list)
    for s in occupancy_spans(events):
        by_gpu[s.gpu].append(s)
    for gpu, spans in by_gpu.items():
        spans.sort(key=lambda s: s.start)
        for a, b in itertools.pairwise(spans):
            assert a.end <= b.start + 1e-9, f"GPU {gpu}: {a} overlaps {b}"


def test_two_pipelines_share_the_pool_and_finish() -> None:
    jobs = _jobs(2)
    sim = Simulation(jobs, rlix_placements(jobs, 8, 8), 8, 8, validate=True)
    run = sim.run()
    assert run.steps == 6 and set(run.finish_s) == {"p0", "p1"}
    assert 0.0 < run.busy_share <= 1.0
    _assert_exclusive(run.events)
    ops = {e.op for e in run.events}
    assert {"allocate", "release", "expand", "shrink"} <= ops
    # partial overlap really happened: a training allocation preempted rollout ranks on its GPUs
    assert any(e.op == "shrink" and "preempt" in e.detail for e in run.events)
    # every training allocation is the whole actor_train mapping of its pipeline
    for e in run.events:
        if e.op == "allocate" and e.priority == Priority.ACTOR_TRAINING:
            assert e.gpus == sim.clusters[e.cluster_id].device_mapping


def test_no_starvation_with_more_pipelines_than_free_gpus() -> None:
    """4 pipelines, 4 GPUs, each trains on one GPU and rolls out anywhere: all of them finish."""
    jobs = _jobs(4, train_gpus=1, steps=2)
    run = Simulation(jobs, rlix_placements(jobs, 4, 4), 4, 4, validate=True).run()
    assert run.steps == 8
    _assert_exclusive(run.events)


@pytest.mark.parametrize("lookahead", [False, True])
def test_one_gpu_two_pipelines_take_turns_and_both_finish(lookahead: bool) -> None:
    """The one-GPU topology (train = infer = [0] for both): each training step preempts the GPU's rollout, and
    the GPU goes back to rollout of the pipeline that waited longest, so both make progress all along (before
    the fix, the pipeline-id order gave p0 every turn and p1 started only once p0 had finished). With NeMo RL's
    start-up barrier (``JobSpec.startup_lookahead``) a pipeline's first step waits for its second batch too, so
    the first two steps of each come together; then turns alternate."""
    jobs = [replace(j, startup_lookahead=lookahead)
            for j in _jobs(2, train_gpus=1, steps=3, step_target=64, traj_time_s=10.0, train_time_s=20.0)]
    run = Simulation(jobs, [Placement((0,), (0,))] * 2, 1, 1, validate=True).run()
    assert run.steps == 6 and set(run.finish_s) == {"p0", "p1"}
    _assert_exclusive(run.events)
    trains = [e.pipeline_id for e in run.events if e.op == "allocate" and e.priority == Priority.ACTOR_TRAINING]
    assert trains == (["p0", "p0", "p1", "p1", "p0", "p1"] if lookahead else ["p0", "p1"] * 3), trains
    preempted = [e.pipeline_id for e in run.events if e.op == "shrink" and "preempt" in e.detail]
    assert set(preempted) == {"p0", "p1"}  # each pipeline's training slept the GPU's rollout

def test_rlix_beats_one_after_another_on_a_rollout_heavy_mix() -> None:
    jobs = _jobs(2, steps=4, step_target=512, traj_time_s=40.0, train_time_s=20.0)
    cmp = compare(jobs, 8, 8, validate=True)
    for mode, run in cmp.runs.items():
        assert run.steps == 8, mode
        assert 0.0 < run.busy_share <= 1.0, mode
    assert cmp.ratio("sequential") > 1.2, cmp.table()
    assert cmp.ratio("static") > 0.95, cmp.table()
    assert "one after another" in cmp.table()


def test_training_bound_mix_never_loses_to_the_static_partition() -> None:
    """Issue 17: two training-heavy jobs lost 0.87x to static because the static baseline trained each job
    data-parallel over its whole slice (colocated) while rlix kept 2 training GPUs. rlix now trains each job as its
    best static configuration does, and time-sharing the rollout on top never loses."""
    heavy = {"train_gpus": 2, "step_target": 256, "traj_time_s": 15.0, "seqs_per_rank": 64, "train_time_s": 120.0,
             "expand_time_s": 2.0, "steps": 4}
    jobs = [JobSpec(name="p0", **heavy), JobSpec(name="p1", start_s=30.0, **heavy)]  # type: ignore[arg-type]
    cmp = compare(jobs, 8, 8, validate=True)
    assert cmp.runs["rlix"].steps == 8
    assert cmp.ratio("static") >= 1.0, cmp.table()
    assert [(j.train_gpus, j.train_time_s) for j in cmp.rlix_jobs] == [(4, 60.0), (4, 60.0)], cmp.rlix_jobs


def test_stock_baseline_configurations() -> None:
    job = JobSpec(name="j", train_gpus=2, train_time_s=60.0)
    roomy = stock_configs(job, 8, 8)
    assert [(v.sync, p.train, p.infer) for v, p in roomy] == [
        (False, (0, 1), (2, 3, 4, 5, 6, 7)),  # async non-colocated
        (True, tuple(range(8)), tuple(range(8))),  # synchronous colocated
    ]
    assert roomy[1][0].train_time_s == pytest.approx(15.0)  # data-parallel over 8 instead of 2 GPUs
    tight = stock_configs(job, 2, 8)
    assert len(tight) == 1 and tight[0][0].sync  # no room beside training: colocated only


def test_sync_job_does_not_overlap_rollout_and_training() -> None:
    job = JobSpec(name="s", train_gpus=2, steps=2, step_target=128, traj_time_s=10.0, train_time_s=20.0, sync=True)
    sim = Simulation([job], [Placement((0, 1), (0, 1))], 2, 2, validate=True)
    run = sim.run()
    assert run.steps == 2
    # with sync=True nothing is produced for step 2 while step 1 trains: the second batch starts after release
    releases = [e.time for e in run.events if e.op == "release" and e.priority == Priority.ACTOR_TRAINING]
    expands = [e.time for e in run.events if e.op == "expand"]
    assert releases and any(t >= releases[0] for t in expands)


def test_cli_runs_and_writes_pictures(tmp_path, capsys) -> None:
    out = tmp_path / "sim"
    rc = rlix_main(["simulate", "--steps", "2", "--gpus", "4", "--train-gpus", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rlix (shared pool)" in text and "static partition" in text and "one after another" in text
    for mode in ("rlix", "static", "sequential"):
        png = out / f"timeline_{mode}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["modes"]["rlix"]["steps"] == 4 and summary["rlix_vs_sequential"] > 0


def test_cli_rejects_bad_input_with_a_reason(tmp_path, capsys) -> None:
    rc = rlix_main(["simulate", "--gpus", "4", "--train-gpus", "3", "--out", str(tmp_path)])
    assert rc == 2
    assert "home slice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rlix_main(["simulate", "--steps", "0"])
    rc = rlix_main(["simulate", "--pipelines", "2", "--tp", "1,1,1", "--out", str(tmp_path)])
    assert rc == 2


def test_cli_memory_figures_let_phases_share_a_gpu(tmp_path, capsys) -> None:
    """``--gpu-gib/--rollout-gib/--train-gib`` (the figures ``rlix recipe`` writes) turn co-residence on in the rlix
    run only: two 1.5 B pipelines on one H200 (figures of the stock recipe) run one's rollout next to the other's
    step, so they beat whole-GPU turns; the one-after-another baseline (stock NeMo RL) is the same run either way."""
    common = ["simulate", "--pipelines", "2", "--gpus", "1", "--steps", "3", "--step-target", "512", "--traj-time",
              "20", "--train-time", "60", "--init-time", "10", "--no-validate"]
    summaries = {}
    for name, extra in (("turns", []), ("shared", ["--gpu-gib", "133.3", "--rollout-gib", "72.4/1.25",
                                                   "--train-gib", "44.4/3"])):
        assert rlix_main([*common, *extra, "--out", str(tmp_path / name)]) == 0
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    capsys.readouterr()
    turns, shared = summaries["turns"], summaries["shared"]
    assert shared["jobs"][0]["memory"][0] == {"gpu_gib": 133.3, "awake_gib": 72.4, "asleep_gib": 1.25}
    assert turns["jobs"][0]["memory"] is None
    assert shared["modes"]["sequential"] == turns["modes"]["sequential"]
    assert shared["modes"]["rlix"]["steps"] == turns["modes"]["rlix"]["steps"] == 6
    assert shared["modes"]["rlix"]["steps_per_hour"] > 1.2 * turns["modes"]["rlix"]["steps_per_hour"]


@pytest.mark.parametrize(("flags", "says"), [
    (["--gpu-gib", "80"], "--gpu-gib, --rollout-gib and --train-gib together"),
    (["--gpu-gib", "80", "--rollout-gib", "90/1", "--train-gib", "40/3"], "--rollout-gib / --gpu-gib of pipeline p0"),
    (["--gpu-gib", "80", "--rollout-gib", "30/1,30/1,30/1", "--train-gib", "40/3"], "3 values for 2 pipelines"),
])
def test_cli_memory_figures_refused_with_the_fix(tmp_path, capsys, flags, says) -> None:
    assert rlix_main(["simulate", "--gpus", "1", *flags, "--out", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rlix_main(["simulate", "--rollout-gib", "72.4"])  # not AWAKE/ASLEEP: argparse names the form


@pytest.mark.parametrize(("pipelines", "rollout_gib"), [(3, 43.7), (4, 30.0)])
def test_rollouts_whose_batches_are_complete_do_not_take_turns_on_a_gpu(pipelines: int, rollout_gib: float) -> None:
    """Pipelines on one GPU with room for some rollouts beside a step (0.5B figures, as `rlix recipe` writes them),
    progress as NeMo RL reports it (the batch the trainer waits for; none while it trains): a rollout whose batch
    was complete took the place of another whose batch was complete too, which took it back the next cycle, each
    take aborting the holder's requests. 406 and 604 rebalancing shrinks in 24 and 32 steps before the fix."""
    mem = (ClusterMemory(133.3, rollout_gib, 1.25), ClusterMemory(133.3, 20.9, 3.0))
    jobs = [JobSpec(f"p{i}", train_gpus=1, step_target=512, traj_time_s=30.0, seqs_per_rank=512, train_time_s=60.0,
                    steps=8, start_s=10.0 * i, memory=mem) for i in range(pipelines)]
    run = Simulation(jobs, [Placement((0,), (0,))] * pipelines, 1, 8, validate=True).run()
    assert run.steps == 8 * pipelines
    rebalances = sum(1 for e in run.events if e.op == "shrink" and e.detail.startswith("rebalance"))
    assert rebalances <= run.steps, rebalances


def test_four_pipelines_on_one_gpu_take_turns_sleeping_beside_steps() -> None:
    """Four 0.5B pipelines on one H200 at the figures `rlix recipe` writes (four steps and two rollouts fit at once):
    the rollouts a training grant puts to sleep take turns, so every pipeline sleeps about as often and they finish
    together. In a fixed order the same two pipelines slept beside every step (0 and 7 preemptions; they finished
    147 s after the others, as two of four did on the H200)."""
    mem = (ClusterMemory(133.3, 18.0, 1.25), ClusterMemory(133.3, 20.9, 8.6))
    jobs = [JobSpec(f"p{i}", train_gpus=1, step_target=512, traj_time_s=20.0, seqs_per_rank=512, train_time_s=47.0,
                    sync_time_s=1.0, expand_time_s=0.5, init_time_s=60.0, steps=12, start_s=5.0 * i, memory=mem)
            for i in range(4)]
    run = Simulation(jobs, [Placement((0,), (0,))] * 4, 1, 8, validate=True).run()
    assert run.steps == 48
    slept = {f"p{i}": 0 for i in range(4)}
    for e in run.events:
        if e.op == "shrink" and e.detail.startswith("preempt"):
            slept[e.cluster_id.split("_")[0]] += 1
    assert max(slept.values()) - min(slept.values()) <= 1, slept
    assert max(run.finish_s.values()) - min(run.finish_s.values()) <= 47.0, run.finish_s
