"""Fair turns between pipelines that share GPUs (pure; kept by the scheduler and the simulator alike).

The policy (DESIGN §4, "Fair turns"): **a pipeline that has work waiting never watches a pipeline it shares a GPU
with complete more than ``limit`` training steps** (``SchedulerConfig.fair_turn_steps``, 2 by default).

* A pipeline *waits with work* (:func:`waiting_pipelines`) while it holds no training-type allocation and either a
  training-type request of it is pending (ACTOR_TRAINING .. VALUE_COMPUTE), or its generation cluster asks for
  rollout (a real or standing GENERATION request) with no active rank while its pipeline has rollout work left
  (progress unknown, or ``remaining > 0``). INITIALIZATION is start-up, not a turn.
* A pipeline *completes a step* when it releases an ACTOR_TRAINING allocation (:meth:`TurnLedger.step_done`).
* :class:`TurnLedger` counts, for every pipeline ``p``, the steps each other pipeline completed *while ``p`` waited*
  since ``p``'s own last completed step (its turn window; a short spell with a rank that is taken away again does
  not reset it, only a step of its own does). Once ``x`` has completed ``limit`` such steps and shares a GPU with
  ``p``, ``x`` *owes* ``p`` a turn (:meth:`TurnLedger.owed`, carried to the planner as
  ``SchedulerSnapshot.turns_owed``) until ``p`` completes a step. The planner then (a) grants no training-type
  request of ``x`` that needs any GPU of ``p`` (:func:`owed_gpus`), without reserving it, and (b) serves ``p``, while
  it has no rollout rank, before the other acceptors and lets it take ``x``'s last rollout rank. So ``p`` rolls out
  and trains its step before ``x`` trains again on a GPU they share. Not only on ``p``'s rollout GPUs: a step ``x``
  began beside them while ``p`` rolled out still completes if a third pipeline's training then takes ``p``'s last
  rank and ``p`` waits again (the property found such runs: 3 steps watched), and while ``p`` waits with a rank its
  rollout GPUs are not its turn at all.

Why the training step is the unit: a step is the work one turn buys, and it is the thing users count. Async GRPO
lets a pipeline queue several batches, so without turns one pipeline trains back to back (each training grant
preempts the other's rollout) while the other never finishes a batch. No deadlock: a debt needs the debtor's
steps inside the creditor's window, and a step of the debtor's own closes the debtor's window, so debts never form
a cycle (two pipelines never owe each other, nor three in a ring).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from rlix_plugins.control.types import ClusterSpec, PendingRequest, Priority, SchedulerSnapshot

#: Default bound: steps another pipeline may complete while one waits with work.
FAIR_TURN_STEPS: Final = 2
#: Priorities of a "turn": training-type work (not start-up, not rollout).
TURN_PRIORITIES: Final = frozenset(p for p in Priority if Priority.INITIALIZATION < p < Priority.GENERATION)


def waiting_pipelines(snap: SchedulerSnapshot) -> set[str]:
    """Pipelines of ``snap`` that wait with work (see the module docstring)."""
    clusters = snap.clusters
    training = {clusters[cid].pipeline_id for cid, a in snap.allocations.items()
                if cid in clusters and a.priority in TURN_PRIORITIES}
    out: set[str] = set()
    for req in snap.pending:
        spec = clusters.get(req.cluster_id)
        if spec is None or spec.pipeline_id in training:
            continue
        if req.priority in TURN_PRIORITIES:
            out.add(spec.pipeline_id)
        elif req.priority == Priority.GENERATION:
            alloc = snap.allocations.get(req.cluster_id)
            if alloc is not None and alloc.priority == Priority.GENERATION and alloc.active_dp_ranks:
                continue
            progress = snap.progress.get(spec.pipeline_id)
            if progress is None or progress.remaining > 0:
                out.add(spec.pipeline_id)
    return out


def pipeline_gpus(clusters: Iterable[ClusterSpec]) -> dict[str, frozenset[int]]:
    """Every GPU each pipeline may use (union of its clusters' mappings), by pipeline id."""
    out: dict[str, set[int]] = {}
    for spec in clusters:
        out.setdefault(spec.pipeline_id, set()).update(spec.device_mapping)
    return {pid: frozenset(g) for pid, g in out.items()}


def owed_gpus(snap: SchedulerSnapshot) -> dict[str, frozenset[int]]:
    """Pipeline id -> the GPUs its debts hold (``SchedulerSnapshot.turns_owed``): every GPU of each pipeline it owes,
    until that pipeline's next step (see the module docstring for why not only the GPUs it rolls out on)."""
    if not snap.turns_owed:
        return {}
    gpus = pipeline_gpus(snap.clusters.values())
    return {x: frozenset().union(*(gpus.get(p, frozenset()) for p in owed)) for x, owed in snap.turns_owed.items()}


def deferred(snap: SchedulerSnapshot, owed: Mapping[str, frozenset[int]], req: PendingRequest) -> bool:
    """Whether fair turns hold ``req`` back: a training-type request of a pipeline that owes a waiter a GPU it needs
    (``owed``: :func:`owed_gpus` of ``snap``). Such a request is not granted and reserves nothing."""
    spec = snap.clusters[req.cluster_id]
    return req.priority in TURN_PRIORITIES and bool(owed.get(spec.pipeline_id, frozenset()) & set(spec.device_mapping))


@dataclass
class TurnLedger:
    """The open turn windows (see the module docstring). Pure state, no clock of its own."""

    limit: int = FAIR_TURN_STEPS
    #: pipelines waiting with work as of the last :meth:`note`
    waiting: set[str] = field(default_factory=set)
    #: pipeline -> steps each other pipeline completed while it waited, since its own last completed step
    windows: dict[str, dict[str, int]] = field(default_factory=dict)

    def step_done(self, pipeline_id: str) -> None:
        """``pipeline_id`` completed a training step: its window closes, every waiter watched it."""
        self.windows.pop(pipeline_id, None)
        for p in self.waiting:
            if p != pipeline_id:
                watched = self.windows.setdefault(p, {})
                watched[pipeline_id] = watched.get(pipeline_id, 0) + 1

    def forget(self, pipeline_id: str) -> None:
        """The pipeline left: nobody owes it a turn, and what it watched goes."""
        self.waiting.discard(pipeline_id)
        self.windows.pop(pipeline_id, None)
        for watched in self.windows.values():
            watched.pop(pipeline_id, None)

    def note(self, snap: SchedulerSnapshot) -> list[tuple[str, bool]]:
        """The waiting set for ``snap``; returns its changes as ``(pipeline id, waiting)`` in id order."""
        waiting = waiting_pipelines(snap)
        changes = [(p, True) for p in sorted(waiting - self.waiting)] + [(p, False) for p in sorted(self.waiting - waiting)]
        self.waiting = waiting
        return changes

    def owed(self, clusters: Mapping[str, ClusterSpec]) -> dict[str, frozenset[str]]:
        """Pipeline ``x`` -> the pipelines it owes a turn: it completed ``limit`` steps while they waited since
        their last step, and shares a GPU with them."""
        gpus = pipeline_gpus(clusters.values())
        out: dict[str, set[str]] = {}
        for p, watched in self.windows.items():
            for x, n in watched.items():
                if n >= self.limit and gpus.get(x, frozenset()) & gpus.get(p, frozenset()):
                    out.setdefault(x, set()).add(p)
        return {x: frozenset(ps) for x, ps in out.items()}
