"""Gantt chart of GPU occupancy from scheduler trace events (``rlix timeline``, ``rlix simulate``, ``rlix demo``).

One row per GPU, time on x, one colour per pipeline (named as the caller's console names them, else by id). The
phases differ at a glance: rollout is a pale tint, training (and log-probs) the solid colour with a black
outline and the step number, initialisation a grey cross-hatch. When start-up fills much of the run it gets a
narrow panel of its own and the steps get the rest of the width. Occupancy is reconstructed from the trace:
``allocate``/``expand`` start a span for the event's cluster on its GPUs, ``release``/``shrink``/``unregister``/
``fail`` end it (see ``control/trace.py``). A GPU holds spans of different pipelines side by side (co-residence:
training steps and rollouts); where spans overlapped the GPU's row splits into lanes, training on top, rollouts
below, each in a lane of its own. ``fail``/``timeout``/``error`` events are marked with
red ticks (not a rollout request's timeout: its waiter asks again).
A trace saved as JSON lines (:func:`write_trace`, one :class:`TraceEvent` a line, gzip by the ``.gz`` suffix) draws
later without the cluster (:func:`read_trace`, ``rlix timeline --trace``).
matplotlib (Agg) is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from rlix_plugins.control.types import Priority, TraceEvent, parse_cluster_id
from rlix_plugins.errors import RlixConfigError


def _open_text(path: pathlib.Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "wt" if mode == "w" else "rt", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def write_trace(events: Sequence[TraceEvent], path: str | os.PathLike[str]) -> pathlib.Path:
    """Save ``events`` as JSON lines (gzip when ``path`` ends in ``.gz``)."""
    out = pathlib.Path(path)
    with _open_text(out, "w") as f:
        for e in events:
            f.write(json.dumps(dataclasses.asdict(e), default=str) + "\n")
    return out


def read_trace(path: str | os.PathLike[str]) -> list[TraceEvent]:
    """The events of a trace saved by :func:`write_trace`; a line that is no event is an error naming it."""
    src = pathlib.Path(path)
    if not src.is_file():
        raise RlixConfigError(f"--trace {str(src)!r}: no such file (a trace saved as JSON lines, .gz allowed)")
    events = []
    n = 0
    try:
        with _open_text(src, "r") as f:
            for line in f:
                n += 1  # named by the errors below
                if not line.strip():
                    continue
                d = json.loads(line)
                prio = d.get("priority")
                events.append(TraceEvent(float(d["time"]), str(d["pipeline_id"]), str(d["cluster_id"]), str(d["op"]),
                                         tuple(int(g) for g in d["gpus"]), None if prio is None else int(prio),
                                         str(d.get("detail", ""))))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise RlixConfigError(f"--trace {str(src)!r} line {n}: not a trace event ({type(exc).__name__}: {exc}); each "
                              "line is one JSON object with time, pipeline_id, cluster_id, op, gpus") from None
    except (OSError, EOFError) as exc:  # a damaged or cut .gz
        raise RlixConfigError(f"--trace {str(src)!r}: unreadable after line {n} ({type(exc).__name__}: {exc})") from None
    return events


OCCUPY_OPS = frozenset({"allocate", "expand"})
VACATE_OPS = frozenset({"release", "shrink", "unregister", "fail"})
ALERT_OPS = frozenset({"fail", "timeout", "error"})

#: phase name -> (hatch, alpha, outline width, hatch/outline colour).
PHASE_STYLE: dict[str, tuple[str, float, float, str]] = {
    "rollout": ("", 0.3, 0.3, "grey"),
    "training": ("//", 1.0, 1.2, "black"),
    "log-probs": ("..", 1.0, 1.2, "black"),
    "init": ("xx", 0.25, 0.3, "dimgrey"),
}
#: Start-up gets a panel of its own when it lasts longer than this share of the run.
INIT_PANEL_SHARE = 0.3
_STEP = re.compile(r"\bstep=(\d+)")


@dataclass(frozen=True)
class Span:
    gpu: int
    start: float
    end: float
    pipeline_id: str
    cluster_id: str
    phase: str
    #: The training step a training/log-probs span served (from the release that ended it), if known.
    step: int | None = None


def phase_of(priority: int | None, cluster_id: str) -> str:
    if priority is None:
        try:
            name = parse_cluster_id(cluster_id)[1]
        except ValueError:
            name = ""
        return "rollout" if name == "actor_infer" else "training"
    if priority == Priority.GENERATION:
        return "rollout"
    if priority == Priority.INITIALIZATION:
        return "init"
    if priority in (Priority.ACTOR_TRAINING, Priority.CRITIC_TRAINING):
        return "training"
    return "log-probs"


def occupancy_spans(events: Sequence[TraceEvent]) -> list[Span]:
    """Per-GPU occupancy spans reconstructed from ``events`` (any order; sorted by time here)."""
    ordered = sorted(events, key=lambda e: e.time)
    if not ordered:
        return []
    # (gpu, cluster, rollout or not) -> (start, pipeline, cluster, phase): on a GPU, one span of each kind per cluster
    # (co-residence: training steps and rollouts of different pipelines side by side)
    open_: dict[tuple[int, str, bool], tuple[float, str, str, str]] = {}
    spans: list[Span] = []

    def close(key: tuple[int, str, bool], t: float, detail: str = "") -> None:
        start, pid, cid, phase = open_.pop(key)
        step = _STEP.search(detail) if phase in ("training", "log-probs") else None
        if t > start:
            spans.append(Span(key[0], start, t, pid, cid, phase, int(step.group(1)) if step else None))

    for e in ordered:
        if e.op in OCCUPY_OPS:
            phase = phase_of(e.priority if e.op == "allocate" else Priority.GENERATION, e.cluster_id)
            for g in e.gpus:
                key = (g, e.cluster_id, phase == "rollout")
                if key in open_:
                    close(key, e.time)
                open_[key] = (e.time, e.pipeline_id, e.cluster_id, phase)
        elif e.op in VACATE_OPS:
            gpus = set(e.gpus)
            if not gpus and e.op in ("unregister", "fail"):
                gpus = {k[0] for k, cur in open_.items() if cur[1] == e.pipeline_id}
            for key in [k for k in open_ if k[0] in gpus]:
                cur = open_[key]
                same = cur[2] == e.cluster_id if e.cluster_id else cur[1] == e.pipeline_id
                if same or (e.op in ("unregister", "fail") and cur[1] == e.pipeline_id):
                    close(key, e.time, e.detail)
    end = ordered[-1].time
    for key in list(open_):
        close(key, end)
    return spans


def held_seconds(spans: Sequence[Span], gpus: Sequence[int] | set[int], t0: float, t1: float) -> float:
    """GPU-seconds of ``[t0, t1]`` in which some span held one of ``gpus`` (a GPU with a rollout next to a training
    step counts once)."""
    total = 0.0
    for g in set(gpus):
        cuts = sorted((max(s.start, t0), min(s.end, t1)) for s in spans if s.gpu == g and s.end > t0 and s.start < t1)
        edge = t0
        for a, b in cuts:
            if b > edge:
                total += b - max(a, edge)
                edge = b
    return total


def _routine(e: TraceEvent) -> bool:
    """A timed-out GENERATION request is a rollout waiter's poll (it asks again), not an alert."""
    return e.op == "timeout" and e.priority == Priority.GENERATION


def _lanes(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """(lane, lanes of its GPU) for each of ``spans``: one lane on a GPU whose spans never overlapped; else the spans
    other than rollout packed greedily into the top lanes and, where one ran next to a training step, the rollouts
    into the lanes below (co-residence)."""
    by_gpu: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        by_gpu.setdefault(s.gpu, []).append(i)
    out = [(0, 1)] * len(spans)

    def pack(idx: list[int], first: int, lane_of: dict[int, int]) -> int:
        """Put ``idx`` in lanes from ``first`` on, none overlapping within a lane; return the lanes used."""
        ends: list[float] = []  # per lane, the end of its last span
        for i in sorted(idx, key=lambda i: (spans[i].start, spans[i].end)):
            lane = next((k for k, end in enumerate(ends) if end <= spans[i].start), None)
            if lane is None:
                lane = len(ends)
                ends.append(spans[i].end)
            else:
                ends[lane] = spans[i].end
            lane_of[i] = lane + first
        return len(ends)

    for idx in by_gpu.values():
        lane_of: dict[int, int] = {}
        other = [i for i in idx if spans[i].phase != "rollout"]
        rollout = [i for i in idx if spans[i].phase == "rollout"]
        # rollouts get lanes of their own only where one ran next to a training step (else turns share lane 0)
        below = any(spans[o].start < spans[r].end and spans[r].start < spans[o].end for o in other for r in rollout)
        top = pack(other, 0, lane_of)
        used = pack(rollout, top if below else 0, lane_of)
        count = top + used if below else max(top, used)
        for i in idx:
            out[i] = (lane_of[i], count)
    return out


def render_timeline(
    events: Sequence[TraceEvent],
    out: str | os.PathLike[str],
    *,
    gpus: Sequence[int] | int | None = None,
    title: str = "",
    names: Mapping[str, str] | None = None,
) -> pathlib.Path:
    """Write the Gantt chart of ``events`` to ``out`` (format from the suffix, e.g. ``.png``); return the path.

    ``gpus``: the rows to draw (a count means ``range(count)``); default: every GPU seen in the trace.
    ``names``: pipeline id -> the name users see (``p0``); ids without one are shown as they are.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    spans = occupancy_spans(events)
    if isinstance(gpus, int):
        rows = list(range(gpus))
    elif gpus is not None:
        rows = sorted(gpus)
    else:
        rows = sorted({g for e in events for g in e.gpus})
    if not rows:
        rows = [0]
    t0 = min((e.time for e in events), default=0.0)
    t_end = max((e.time for e in events), default=t0 + 1.0)
    horizon = max(t_end - t0, 1e-9)
    scale, unit = (60.0, "min") if horizon > 1200 else (1.0, "s")

    label = dict(names or {})
    pipelines = sorted({s.pipeline_id for s in spans} | {e.pipeline_id for e in events if e.pipeline_id},
                       key=lambda p: (label.get(p, p), p))
    cmap = plt.get_cmap("tab10" if len(pipelines) <= 10 else "tab20")
    colour = {pid: cmap(i % cmap.N) for i, pid in enumerate(pipelines)}
    row_of = {g: i for i, g in enumerate(rows)}

    # Start-up panel: from the first event until the last initialisation ends, when that is a large share.
    init_end = max((s.end for s in spans if s.phase == "init"), default=t0)
    split = INIT_PANEL_SHARE * horizon < init_end - t0 < horizon
    windows = [(t0, init_end), (init_end, t_end)] if split else [(t0, t_end)]

    height = min(max(2.5, 0.32 * len(rows) + 1.8), 40.0)
    fig, axes_ = plt.subplots(1, len(windows), figsize=(13, height), sharey=True, squeeze=False,
                              width_ratios=[1, 3] if split else [1], layout="constrained")
    axes = list(axes_[0])
    try:
        for ax, (lo, hi) in zip(axes, windows, strict=True):
            _draw_panel(ax, spans, events, row_of, colour, label, lo, hi, t0, scale)
            ax.set_xlabel(f"time ({unit})")
        axes[0].set_yticks(range(len(rows)))
        axes[0].set_yticklabels([f"GPU {g}" for g in rows], fontsize=8 if len(rows) <= 32 else 5)
        axes[0].set_ylim(-0.6, len(rows) - 0.4)
        axes[0].invert_yaxis()
        if split:
            axes[0].set_title(f"start-up ({(init_end - t0) / scale:.0f} {unit})", fontsize=9)
            axes[1].set_title("steps", fontsize=9)
            axes[1].tick_params(left=False)
        fig.suptitle(title or "GPU occupancy")
        handles = [Patch(facecolor=colour[p], label=label.get(p, p)) for p in pipelines]
        phases_seen = sorted({s.phase for s in spans}, key=list(PHASE_STYLE).index)
        handles += [
            Patch(facecolor="tab:grey", alpha=PHASE_STYLE[ph][1], edgecolor=PHASE_STYLE[ph][3],
                  hatch=PHASE_STYLE[ph][0], linewidth=PHASE_STYLE[ph][2],
                  label="training sN (step N)" if ph == "training" else ph)
            for ph in phases_seen
        ]
        if handles:
            axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        if not spans:
            axes[-1].text(0.5, 0.5, "no GPU occupancy in this trace", transform=axes[-1].transAxes, ha="center",
                          va="center")
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _draw_panel(ax: Any, spans: Sequence[Span], events: Sequence[TraceEvent], row_of: Mapping[int, int],
                colour: Mapping[str, Any], label: Mapping[str, str], lo: float, hi: float, t0: float,
                scale: float) -> None:
    """The spans and alerts of ``[lo, hi]`` (times relative to ``t0``, in units of ``scale`` seconds)."""
    width = max(hi - lo, 1e-9)
    lanes = _lanes(spans)
    for s, (k, n) in zip(spans, lanes, strict=True):
        if s.gpu not in row_of or s.end <= lo or s.start >= hi:
            continue
        a, b = max(s.start, lo), min(s.end, hi)
        hatch, alpha, lw, edge = PHASE_STYLE.get(s.phase, ("", 0.7, 0.3, "black"))
        x, w, y = (a - t0) / scale, (b - a) / scale, row_of[s.gpu]
        lane = (y - 0.4 + k * 0.8 / n, 0.8 / n)  # lane k of n (co-residence): training on top, rollouts below
        # Face and hatch drawn apart: a pale face keeps a dark hatch and outline.
        ax.broken_barh([(x, w)], lane, facecolors=colour[s.pipeline_id], alpha=alpha, linewidth=0)
        ax.broken_barh([(x, w)], lane, facecolors="none", hatch=hatch, edgecolor=edge, linewidth=lw)
        if s.step is not None and (b - a) / width > 0.012:
            ax.text(x + w / 2, lane[0] + lane[1] / 2, f"s{s.step}", ha="center", va="center", fontsize=7, color="white",
                    fontweight="bold", bbox={"boxstyle": "round,pad=0.1", "facecolor": "black", "alpha": 0.6,
                                             "linewidth": 0})
    for e in events:
        if e.op in ALERT_OPS and lo <= e.time <= hi and not _routine(e):
            x = (e.time - t0) / scale
            ax.axvline(x, color="red", linestyle="--", linewidth=0.8)
            ax.text(x, -0.5, f" {e.op} {label.get(e.pipeline_id, e.pipeline_id)}", color="red", fontsize=7,
                    va="bottom")
    ax.set_xlim((lo - t0) / scale, (hi - t0) / scale)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
