"""The scheduler's decision trace: a bounded, in-memory list of :class:`TraceEvent`.

Ownership: one :class:`TraceRecorder` lives inside the scheduler actor; only the scheduler's event loop writes it
(no locking needed). Readers get copies through ``Scheduler.get_trace`` (``rlix timeline``, tests).

Ops recorded (``TraceEvent.op``) and what ``gpus`` means for each:

==============  ==========================================================================================
``register``    the pipeline's registered GPUs (union of its device mappings)
``admit``       same
``request``     a blocked ``request_gpus`` call was queued; ``gpus`` = the cluster's device mapping
``allocate``    a NON-generation cluster now holds ``gpus`` (whole mapping), until ``release``/``unregister``
``grant``       a GENERATION request was signalled; ``gpus`` = its active GPUs (occupancy comes from ``expand``)
``expand``      these GPUs of a generation cluster were woken (DP ranks in ``detail``)
``shrink``      these GPUs of a generation cluster were put to sleep (reason + ranks in ``detail``)
``release``     the cluster gave back ``gpus`` (``detail`` = "planned" for ``await_release``)
``unregister``  the pipeline left; ``gpus`` = GPUs it still held, now idle
``fail``        the pipeline was failed by the scheduler (dead/failing coordinator); ``gpus`` as unregister
``fence``       the failed pipeline's ``gpus`` take no new grant until its Ray job's processes are gone
``unfence``     they are gone; ``gpus`` may be granted again
``wait``        the pipeline began (``detail`` "begin") or stopped ("end") waiting with work (fair turns)
``timeout``     a request or planned release ran out of time; nothing changed
``error``       the planner or the loop raised; nothing was executed
==============  ==========================================================================================

So the occupancy of a GPU over time is: ``allocate``/``expand`` start a span for the event's cluster,
``release``/``shrink``/``unregister``/``fail`` end it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from rlix_plugins.control.types import TraceEvent

#: Default capacity: at ~20 events per training step and 4 pipelines this keeps many hours.
DEFAULT_TRACE_CAPACITY: Final = 100_000

#: Ops that start a GPU occupancy span / end one (see the module docstring).
OCCUPY_OPS: Final = frozenset({"allocate", "expand"})
VACATE_OPS: Final = frozenset({"release", "shrink", "unregister", "fail"})


class TraceRecorder:
    """Bounded FIFO of trace events; the oldest are dropped first (``dropped`` counts them)."""

    def __init__(self, capacity: int = DEFAULT_TRACE_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"trace capacity must be positive, got {capacity}")
        self._events: deque[TraceEvent] = deque(maxlen=capacity)
        self.dropped = 0

    def record(
        self,
        op: str,
        *,
        pipeline_id: str = "",
        cluster_id: str = "",
        gpus: Iterable[int] = (),
        priority: int | None = None,
        detail: str = "",
    ) -> TraceEvent:
        event = TraceEvent(
            time=time.time(),
            pipeline_id=pipeline_id,
            cluster_id=cluster_id,
            op=op,
            gpus=tuple(sorted(gpus)),
            priority=None if priority is None else int(priority),
            detail=detail,
        )
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)
        return event

    def events(self, since: float | None = None, limit: int | None = None) -> list[TraceEvent]:
        """Events (oldest first) with ``time >= since``; the newest ``limit`` of them when given."""
        out = [e for e in self._events if since is None or e.time >= since]
        if limit is not None and limit >= 0:
            out = out[len(out) - limit :] if limit else []
        return out

    def __len__(self) -> int:
        return len(self._events)


def event_to_dict(event: TraceEvent) -> dict[str, Any]:
    """Plain-JSON form of an event (``rlix status --json`` and external tools)."""
    return {
        "time": event.time,
        "pipeline_id": event.pipeline_id,
        "cluster_id": event.cluster_id,
        "op": event.op,
        "gpus": list(event.gpus),
        "priority": event.priority,
        "detail": event.detail,
    }
