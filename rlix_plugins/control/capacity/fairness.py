"""Fairness of a run, read from its trace (``rlix simulate``, the demo summary, the NeMo RL GPU report).

The scheduler records ``wait`` events (``detail`` "begin"/"end") when a pipeline starts and stops waiting with
work (``scheduling.turns``), and a ``release`` of an ACTOR_TRAINING allocation when a pipeline completes a
training step. From those:

* ``max_steps_watched``: the most training steps one pipeline completed while another that shares a GPU with it
  waited with work, counted between two steps of the waiter (its turn window, as ``scheduling.turns`` counts; the
  policy bounds it by ``SchedulerConfig.fair_turn_steps``);
* ``longest_wait_s``: the longest such wait, and per pipeline its longest wait and number of waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlix_plugins.control.types import Priority, TraceEvent


@dataclass
class Fairness:
    max_steps_watched: int = 0
    #: (waiting pipeline, pipeline that completed the steps) of ``max_steps_watched``; empty when 0
    worst_pair: tuple[str, str] = ("", "")
    longest_wait_s: float = 0.0
    longest_waiter: str = ""
    waits: dict[str, int] = field(default_factory=dict)
    longest_wait_by_pipeline: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        who = f" ({self.worst_pair[1]} while {self.worst_pair[0]} waited)" if self.max_steps_watched else ""
        return (f"fairness: at most {self.max_steps_watched} steps of another pipeline while one waited{who}; "
                f"longest wait {self.longest_wait_s:.1f} s" + (f" ({self.longest_waiter})" if self.longest_waiter else ""))


def _gpus_by_pipeline(events: list[TraceEvent]) -> dict[str, set[int]]:
    """GPUs each pipeline registered (``register`` events), else every GPU it was seen on."""
    registered: dict[str, set[int]] = {}
    seen: dict[str, set[int]] = {}
    for e in events:
        if not e.pipeline_id:
            continue
        (registered if e.op == "register" else seen).setdefault(e.pipeline_id, set()).update(e.gpus)
    return {pid: registered.get(pid) or seen.get(pid, set()) for pid in registered.keys() | seen.keys()}


def fairness(events: Iterable[TraceEvent], gpus: Mapping[str, Iterable[int]] | None = None) -> Fairness:
    """The fairness figures of a trace (see the module docstring). ``gpus``: each pipeline's GPUs, when the trace
    has no ``register`` events and a pipeline may share GPUs it was never seen on."""
    evs = sorted(events, key=lambda e: e.time)
    shares = {p: set(g) for p, g in gpus.items()} if gpus is not None else _gpus_by_pipeline(evs)
    end = evs[-1].time if evs else 0.0
    out = Fairness()
    waiting: dict[str, float] = {}  # pipeline -> start of its current wait
    windows: dict[str, dict[str, int]] = {}  # as scheduling.turns.TurnLedger.windows

    def end_wait(pid: str, t: float) -> None:
        length = t - waiting.pop(pid)
        out.waits[pid] = out.waits.get(pid, 0) + 1
        out.longest_wait_by_pipeline[pid] = max(out.longest_wait_by_pipeline.get(pid, 0.0), length)
        if length > out.longest_wait_s:
            out.longest_wait_s, out.longest_waiter = length, pid

    for e in evs:
        pid = e.pipeline_id
        if e.op == "wait" and e.detail == "begin" and pid not in waiting:
            waiting[pid] = e.time
        elif e.op == "wait" and e.detail == "end" and pid in waiting:
            end_wait(pid, e.time)
        elif e.op == "release" and e.priority == Priority.ACTOR_TRAINING:
            out.steps[pid] = out.steps.get(pid, 0) + 1
            windows.pop(pid, None)
            for p in waiting:
                if p != pid and shares.get(p, set()) & shares.get(pid, set()):
                    watched = windows.setdefault(p, {})
                    watched[pid] = watched.get(pid, 0) + 1
                    if watched[pid] > out.max_steps_watched:
                        out.max_steps_watched, out.worst_pair = watched[pid], (p, pid)
        elif e.op in ("unregister", "fail"):
            windows.pop(pid, None)
            if pid in waiting:
                end_wait(pid, e.time)
    for pid in list(waiting):
        end_wait(pid, end)
    return out
