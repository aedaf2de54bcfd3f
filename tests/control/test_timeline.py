"""Timeline picture: occupancy reconstruction from trace events and a real, legible PNG."""

from __future__ import annotations

from rlix_plugins.control.capacity.timeline import held_seconds, occupancy_spans, phase_of, render_timeline
from rlix_plugins.control.types import Priority, TraceEvent


def E(t, pid, cluster, op, gpus=(), prio=None, detail=""):
    cid = f"{pid}_{cluster}" if cluster else ""
    return TraceEvent(float(t), pid, cid, op, tuple(gpus), prio, detail)


EVENTS = [
    E(0, "a", "actor_train", "allocate", (0, 1), Priority.INITIALIZATION),
    E(10, "a", "actor_train", "release", (0, 1), Priority.INITIALIZATION),
    E(10, "a", "actor_infer", "expand", (0, 1, 2, 3), Priority.GENERATION),
    E(12, "b", "actor_infer", "expand", (4, 5), Priority.GENERATION),
    E(40, "a", "actor_infer", "shrink", (0, 1), Priority.GENERATION, "preempt"),
    E(40, "a", "actor_train", "allocate", (0, 1), Priority.ACTOR_TRAINING),
    E(60, "a", "actor_train", "release", (0, 1), Priority.ACTOR_TRAINING),
    E(61, "b", "actor_infer", "expand", (0, 1), Priority.GENERATION),
    E(70, "b", "actor_train", "allocate", (6,), Priority.REF_LOG_PROBS),
    E(80, "b", "", "fail"),
    E(90, "a", "", "unregister", (2, 3)),
]


def test_occupancy_spans_follow_the_trace() -> None:
    spans = {(s.gpu, s.cluster_id, s.start, s.end, s.phase) for s in occupancy_spans(EVENTS)}
    assert (0, "a_actor_train", 0.0, 10.0, "init") in spans
    assert (0, "a_actor_infer", 10.0, 40.0, "rollout") in spans
    assert (0, "a_actor_train", 40.0, 60.0, "training") in spans
    assert (0, "b_actor_infer", 61.0, 80.0, "rollout") in spans  # closed by the pipeline's fail event
    assert (6, "b_actor_train", 70.0, 80.0, "log-probs") in spans
    assert (2, "a_actor_infer", 10.0, 90.0, "rollout") in spans  # closed by unregister
    # a vacate op of another cluster never closes a span
    assert not any(s.cluster_id == "a_actor_infer" and s.gpu == 4 for s in occupancy_spans(EVENTS))


def test_phase_of() -> None:
    assert phase_of(Priority.GENERATION, "x_actor_infer") == "rollout"
    assert phase_of(Priority.ACTOR_TRAINING, "x_actor_train") == "training"
    assert phase_of(Priority.OLD_LOG_PROBS, "x_actor_train") == "log-probs"
    assert phase_of(None, "x_actor_infer") == "rollout"


def test_render_writes_a_real_picture(tmp_path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    path = render_timeline(EVENTS, tmp_path / "sub" / "t.png", gpus=8, title="unit")
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w > 1000 and h > 300
    # colour per pipeline: both tab10 blue (a) and orange (b) are present
    rgb = (img[..., :3] * 255).round().astype(int).reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(rgb // 8, axis=0)}
    assert len(colours) > 20
    # gpus=None draws the GPUs seen in the trace; an empty trace still gives a picture
    assert render_timeline(EVENTS, tmp_path / "seen.png").exists()
    assert render_timeline([], tmp_path / "empty.png", gpus=[0, 1]).exists()


def _svg_text(events, tmp_path, **kwargs) -> str:
    """The rendered SVG with its text kept as text (so labels can be read back)."""
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        return render_timeline(events, tmp_path / "t.svg", **kwargs).read_text()


DEMO_LIKE = [  # start-up fills 80 of 92 s; then rollout and three training steps per pipeline
    E(0, "ft_aa", "actor_train", "allocate", (0,), Priority.INITIALIZATION),
    E(0, "ft_bb", "actor_train", "allocate", (1,), Priority.INITIALIZATION),
    E(40, "ft_aa", "actor_train", "release", (0,), Priority.INITIALIZATION, "step=-1"),
    E(80, "ft_bb", "actor_train", "release", (1,), Priority.INITIALIZATION, "step=-1"),
    E(84, "ft_aa", "actor_infer", "expand", (0, 1), Priority.GENERATION),
    *[ev for k in range(3) for ev in (
        E(86 + 2 * k, "ft_aa", "actor_infer", "shrink", (0,), Priority.GENERATION, "preempt"),
        E(86 + 2 * k, "ft_aa", "actor_train", "allocate", (0,), Priority.ACTOR_TRAINING, "seq=1"),
        E(87 + 2 * k, "ft_aa", "actor_train", "release", (0,), Priority.ACTOR_TRAINING, f"step={k}"),
    )],
    E(92, "ft_aa", "", "unregister"),
    E(92, "ft_bb", "", "unregister"),
]


def test_training_spans_carry_their_step() -> None:
    steps = sorted(s.step for s in occupancy_spans(DEMO_LIKE) if s.phase == "training")
    assert steps == [0, 1, 2]
    assert all(s.step is None for s in occupancy_spans(DEMO_LIKE) if s.phase != "training")


def test_start_up_gets_its_own_panel_steps_and_names_are_shown(tmp_path) -> None:
    svg = _svg_text(DEMO_LIKE, tmp_path, gpus=2, names={"ft_aa": "p0", "ft_bb": "p1"})
    assert "start-up (80 s)" in svg and ">steps<" in svg
    assert ">p0<" in svg and ">p1<" in svg and "ft_aa" not in svg  # the names the console prints, not ids
    assert all(f">s{k}<" in svg for k in range(3))  # every training step labelled


def test_short_start_up_keeps_one_panel(tmp_path) -> None:
    svg = _svg_text(EVENTS, tmp_path, gpus=8)
    assert "start-up" not in svg and ">a<" in svg  # no names given: ids as they are


def test_a_rollout_next_to_a_training_step_keeps_both_spans_and_counts_once(tmp_path) -> None:
    """Co-residence: b trains on GPU 0 while a's rollout rank wakes there; both spans survive each other's events, the
    GPU counts as held once, and the chart draws the GPU in two lanes."""
    events = [
        TraceEvent(1.0, "b", "b_actor_train", "allocate", (0,), int(Priority.ACTOR_TRAINING)),
        TraceEvent(2.0, "a", "a_actor_infer", "expand", (0,)),
        TraceEvent(5.0, "b", "b_actor_train", "release", (0,), int(Priority.ACTOR_TRAINING), "step=0"),
        TraceEvent(8.0, "a", "a_actor_infer", "shrink", (0,)),
        TraceEvent(9.0, "b", "b_actor_train", "allocate", (0,), int(Priority.ACTOR_TRAINING)),
        TraceEvent(10.0, "b", "b_actor_train", "release", (0,), int(Priority.ACTOR_TRAINING), "step=1"),
    ]
    spans = sorted((s.cluster_id, s.start, s.end, s.step) for s in occupancy_spans(events))
    assert spans == [("a_actor_infer", 2.0, 8.0, None), ("b_actor_train", 1.0, 5.0, 0), ("b_actor_train", 9.0, 10.0, 1)]
    assert held_seconds(occupancy_spans(events), [0], 0.0, 10.0) == 8.0
    assert render_timeline(events, tmp_path / "t.png").stat().st_size > 0


def test_rollouts_of_several_pipelines_on_one_gpu_each_get_a_lane_below_the_training_step(tmp_path) -> None:
    """Co-residence of several rollout ranks: b trains on GPU 0 while the rollouts of a, c and d come and go there;
    each span keeps its own lane (training on top), lanes are reused once free, and GPU 1 (alone) keeps one."""
    from rlix_plugins.control.capacity.timeline import _lanes

    events = [
        TraceEvent(1.0, "b", "b_actor_train", "allocate", (0,), int(Priority.ACTOR_TRAINING)),
        TraceEvent(2.0, "a", "a_actor_infer", "expand", (0,)),
        TraceEvent(3.0, "c", "c_actor_infer", "expand", (0,)),
        TraceEvent(4.0, "a", "a_actor_infer", "shrink", (0,)),
        TraceEvent(5.0, "d", "d_actor_infer", "expand", (0, 1)),  # its second rank: GPU 1
        TraceEvent(6.0, "b", "b_actor_train", "release", (0,), int(Priority.ACTOR_TRAINING), "step=0"),
        TraceEvent(9.0, "c", "c_actor_infer", "shrink", (0,)),
        TraceEvent(9.0, "d", "d_actor_infer", "shrink", (0, 1)),
    ]
    spans = occupancy_spans(events)
    lanes = {(s.cluster_id, s.gpu): lane for s, lane in zip(spans, _lanes(spans), strict=True)}
    assert lanes == {("b_actor_train", 0): (0, 3), ("a_actor_infer", 0): (1, 3), ("c_actor_infer", 0): (2, 3),
                     ("d_actor_infer", 0): (1, 3), ("d_actor_infer", 1): (0, 1)}
    assert held_seconds(spans, [0], 0.0, 10.0) == 8.0
    assert render_timeline(events, tmp_path / "t.png").stat().st_size > 0


def test_training_steps_side_by_side_keep_their_spans_and_lanes(tmp_path) -> None:
    """Two pipelines' training steps on GPU 0 at once (co-residence), with c's rollout beside them: neither step's
    allocate closes the other's span, each step keeps its number, and the GPU's row has two training lanes on top of
    the rollout's."""
    from rlix_plugins.control.capacity.timeline import _lanes

    train = int(Priority.ACTOR_TRAINING)
    events = [
        TraceEvent(1.0, "a", "a_actor_train", "allocate", (0,), train),
        TraceEvent(2.0, "c", "c_actor_infer", "expand", (0,)),
        TraceEvent(3.0, "b", "b_actor_train", "allocate", (0,), train),
        TraceEvent(6.0, "a", "a_actor_train", "release", (0,), train, "step=0"),
        TraceEvent(8.0, "b", "b_actor_train", "release", (0,), train, "step=4"),
        TraceEvent(9.0, "c", "c_actor_infer", "shrink", (0,)),
    ]
    spans = occupancy_spans(events)
    assert sorted((s.cluster_id, s.start, s.end, s.step) for s in spans) == [
        ("a_actor_train", 1.0, 6.0, 0), ("b_actor_train", 3.0, 8.0, 4), ("c_actor_infer", 2.0, 9.0, None)]
    lanes = {s.cluster_id: lane for s, lane in zip(spans, _lanes(spans), strict=True)}
    assert lanes == {"a_actor_train": (0, 3), "b_actor_train": (1, 3), "c_actor_infer": (2, 3)}
    assert held_seconds(spans, [0], 0.0, 10.0) == 8.0
    assert render_timeline(events, tmp_path / "t.png").stat().st_size > 0


def test_a_saved_trace_draws_without_a_cluster_through_the_cli(tmp_path) -> None:
    """``rlix timeline --trace`` (what a finished run's saved trace is for): the events round-trip through the file
    (gzip too), the CLI draws them with no Ray cluster, and a line that is no event is refused naming it."""
    import os
    import subprocess
    import sys

    from rlix_plugins.control.capacity.timeline import read_trace, write_trace

    saved = write_trace(EVENTS, tmp_path / "trace.jsonl.gz")
    assert read_trace(saved) == EVENTS
    cli = [sys.executable, "-m", "rlix_plugins.cli", "timeline", "--trace"]
    done = subprocess.run([*cli, str(saved), "--out", str(tmp_path / "t.png")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 0, done.stderr
    assert f"({len(EVENTS)} trace events)" in done.stdout and (tmp_path / "t.png").stat().st_size > 10_000
    (tmp_path / "matplotlibrc").write_text("svg.fonttype: none\n")  # the SVG keeps its text as text
    named = subprocess.run([*cli, str(saved), "--out", str(tmp_path / "n.svg"), "--name", "a=trainer-a"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MATPLOTLIBRC": str(tmp_path / "matplotlibrc")})
    assert named.returncode == 0 and ">trainer-a<" in (tmp_path / "n.svg").read_text(), named.stderr
    unknown = subprocess.run([*cli, str(saved), "--out", str(tmp_path / "u.png"), "--name", "zz=x"],
                             capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "no pipeline zz in the trace" in unknown.stderr, unknown.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(write_trace(EVENTS[:1], tmp_path / "one.jsonl").read_text() + "{}\n")
    refused = subprocess.run([*cli, str(bad), "--out", str(tmp_path / "b.png")], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "line 2: not a trace event" in refused.stderr, refused.stderr
