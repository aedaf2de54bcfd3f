"""Gantt chart of GPU occupancy from scheduler trace events (``rlix timeline``, ``rlix simulate``).

One row per GPU, time on x, one colour per pipeline, a hatch per phase (init / training / log-probs / rollout).
Occupancy is reconstructed from the trace: ``allocate``/``expand`` start a span for the event's cluster on its
GPUs, ``release``/``shrink``/``unregister``/``fail`` end it (see ``control/trace.py``). ``fail``/``timeout``/
``error`` events are marked with red ticks. matplotlib (Agg) is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from rlix_plugins.control.types import Priority, TraceEvent, parse_cluster_id

OCCUPY_OPS = frozenset({"allocate", "expand"})
VACATE_OPS = frozenset({"release", "shrink", "unregister", "fail"})
ALERT_OPS = frozenset({"fail", "timeout", "error"})

#: phase name -> (hatch, alpha). Rollout is drawn solid and lighter; everything else is hatched.
PHASE_STYLE: dict[str, tuple[str, float]] = {
    "rollout": ("", 0.55),
    "training": ("///", 0.95),
    "log-probs": ("...", 0.9),
    "init": ("xx", 0.9),
}


@dataclass(frozen=True)
class Span:
    gpu: int
    start: float
    end: float
    pipeline_id: str
    cluster_id: str
    phase: str


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
    open_: dict[int, tuple[float, str, str, str]] = {}  # gpu -> (start, pipeline, cluster, phase)
    spans: list[Span] = []

    def close(g: int, t: float) -> None:
        start, pid, cid, phase = open_.pop(g)
        if t > start:
            spans.append(Span(g, start, t, pid, cid, phase))

    for e in ordered:
        if e.op in OCCUPY_OPS:
            phase = phase_of(e.priority if e.op == "allocate" else Priority.GENERATION, e.cluster_id)
            for g in e.gpus:
                if g in open_:
                    close(g, e.time)
                open_[g] = (e.time, e.pipeline_id, e.cluster_id, phase)
        elif e.op in VACATE_OPS:
            targets = e.gpus
            if not targets and e.op in ("unregister", "fail"):
                targets = tuple(g for g, cur in open_.items() if cur[1] == e.pipeline_id)
            for g in targets:
                cur = open_.get(g)
                if cur is None:
                    continue
                same = cur[2] == e.cluster_id if e.cluster_id else cur[1] == e.pipeline_id
                if same or (e.op in ("unregister", "fail") and cur[1] == e.pipeline_id):
                    close(g, e.time)
    end = ordered[-1].time
    for g in list(open_):
        close(g, end)
    return spans


def render_timeline(
    events: Sequence[TraceEvent],
    out: str | os.PathLike[str],
    *,
    gpus: Sequence[int] | int | None = None,
    title: str = "",
) -> pathlib.Path:
    """Write the Gantt chart of ``events`` to ``out`` (format from the suffix, e.g. ``.png``); return the path.

    ``gpus``: the rows to draw (a count means ``range(count)``); default: every GPU seen in the trace.
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

    pipelines = sorted({s.pipeline_id for s in spans} | {e.pipeline_id for e in events if e.pipeline_id})
    cmap = plt.get_cmap("tab10" if len(pipelines) <= 10 else "tab20")
    colour = {pid: cmap(i % cmap.N) for i, pid in enumerate(pipelines)}
    row_of = {g: i for i, g in enumerate(rows)}

    height = min(max(2.5, 0.32 * len(rows) + 1.8), 40.0)
    fig, ax = plt.subplots(figsize=(13, height))
    try:
        groups: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        for s in spans:
            if s.gpu in row_of:
                groups.setdefault((s.gpu, s.pipeline_id, s.phase), []).append(
                    ((s.start - t0) / scale, (s.end - s.start) / scale)
                )
        for (g, pid, phase), xr in sorted(groups.items()):
            hatch, alpha = PHASE_STYLE.get(phase, ("", 0.7))
            ax.broken_barh(
                xr,
                (row_of[g] - 0.4, 0.8),
                facecolors=colour[pid],
                alpha=alpha,
                hatch=hatch,
                edgecolor="black",
                linewidth=0.3,
            )
        for e in events:
            if e.op in ALERT_OPS:
                x = (e.time - t0) / scale
                ax.axvline(x, color="red", linestyle="--", linewidth=0.8)
                ax.text(x, len(rows) - 0.5, f" {e.op} {e.pipeline_id}", color="red", fontsize=7, va="bottom")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"GPU {g}" for g in rows], fontsize=8 if len(rows) <= 32 else 5)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon / scale)
        ax.set_xlabel(f"time ({unit})")
        ax.grid(axis="x", linestyle=":", linewidth=0.5)
        ax.set_title(title or "GPU occupancy")
        handles = [Patch(facecolor=colour[p], label=p) for p in pipelines]
        phases_seen = sorted({s.phase for s in spans}, key=list(PHASE_STYLE).index)
        handles += [
            Patch(facecolor="lightgrey", alpha=PHASE_STYLE[ph][1], edgecolor="black", hatch=PHASE_STYLE[ph][0], label=ph)
            for ph in phases_seen
        ]
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        if not spans:
            ax.text(0.5, 0.5, "no GPU occupancy in this trace", transform=ax.transAxes, ha="center", va="center")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
