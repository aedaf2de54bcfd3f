"""Timeline picture: occupancy reconstruction from trace events and a real, legible PNG."""

from __future__ import annotations

from rlix_plugins.control.timeline import occupancy_spans, phase_of, render_timeline
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
