"""Fences: a failed pipeline's GPUs take no new grant while its processes may still hold their memory.

The scheduler fails a pipeline whose driver stopped renewing its lease or whose start hangs; its GPUs return to the
pool at once in the bookkeeping, but a hung driver's workers (vLLM engines, training workers) are still alive and
still hold GPU memory: the next tenant's wake-up would run out of memory. So the GPUs it held are *fenced*: no
allocation lands on them (idle, they are not lent; a request that needs them waits) until none of the job's
processes is alive (a driver's non-detached actors die with it; stopping the hung driver frees them).

* A fence is known only for a pipeline registered with its Ray job id (``register_pipeline(job_id=...)``; the client
  always passes it).
* A job that still has a registered pipeline is trusted with its own memory: its fences do not hold (several
  pipelines of one driver process, as in tests and ``rlix demo``, keep today's behaviour).
* The scheduler's health check asks the GCS for the job's live actors (:func:`live_processes`) and lifts the fence
  once there are none; ``rlix status`` shows each fence with the processes that keep it and how to end them.
  ``ControlPlane.lift_fences`` lifts one on an operator's word (its processes were killed outside Ray, say).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Actor states whose process may hold GPU memory (everything but DEAD).
_LIVE_STATES = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING"})


@dataclass
class Fence:
    pipeline_id: str
    job_id: str
    gpus: frozenset[int]
    reason: str
    since: float = field(default_factory=time.time)
    #: the live processes last seen ("<class> pid <pid> on <ip>"); empty until the first check
    processes: list[str] = field(default_factory=list)

    def status(self) -> dict[str, object]:
        return {"gpus": sorted(self.gpus), "job_id": self.job_id, "reason": self.reason, "since": self.since,
                "processes": list(self.processes)}


def fenced_gpus(fences: Mapping[str, Fence], registered_jobs: Iterable[str | None]) -> frozenset[int]:
    """The GPUs no allocation may newly take: those of fences whose job has no registered pipeline."""
    trusted = set(registered_jobs)
    out: set[int] = set()
    for f in fences.values():
        if f.job_id not in trusted:
            out |= f.gpus
    return frozenset(out)


def live_processes(job_id: str) -> list[str]:
    """The job's actors that are not dead and not detached (a detached actor outlives its driver by design and
    holds no worker of a pipeline), as readable strings.

    Reads the GCS actor table directly: Ray's public state API needs the dashboard, which clusters started with
    ``--include-dashboard=false`` do not run. Blocking (one GCS call): run it off the event loop, with a timeout.
    """
    import ray
    from ray._private import state

    table = state.actors(job_id=ray.JobID.from_hex(job_id))
    return sorted(f"{a.get('ActorClassName') or 'actor'} pid {a.get('Pid')} on {a['Address']['IPAddress']}"
                  for a in table.values() if a.get("State") in _LIVE_STATES and not a.get("IsDetached"))
