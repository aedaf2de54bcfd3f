"""The scheduler actor (``rlix:scheduler`` in namespace ``rlix``): state, blocking requests, the cycle.

Why an asyncio actor: every blocked ``request_gpus`` is an awaiting coroutine (no thread per waiter; thousands
are fine), all state lives on one event loop so mutations are atomic between ``await``s without locks, and
every wait is bounded with ``asyncio.wait_for``. The only blocking calls are name lookups in the GCS.

One cycle (run by a single background task, never two at once)::

    snapshot → plan_cycle → validate_plan → shrinks (concurrent, awaited) → commit → signal → launch expands

* Waiters are signalled only after the resize calls they depend on returned: a training grant or a planned
  release after the shrinks (the donor ranks slept), a GENERATION grant of ranks woken by the plan when their
  expand returns. Expands run outside the cycle: the cycle launches them and ends, their ranks count as allocated
  (in transit: ``SchedulerSnapshot.expanding``), and later cycles plan and signal without waiting for them; a
  cluster with an expand in flight is neither shrunk, released nor granted GENERATION until it returns. A
  returning expand signals its GENERATION grants (or fails its pipeline) and starts a cycle.
* Calls that arrive while a cycle executes are applied at once: a release or unregister is remembered in
  ``_removed_in_cycle`` and wins over the plan at commit; a timed-out request that the running plan grants
  waits for that plan to finish (bounded by the resize timeout) and gets its GPUs.
* Failure isolation: a resize call that fails (dead coordinator, timeout, handler exception) fails THAT pipeline
  only (``fail``: waiters get ``PipelineUnregisteredError``, its GPUs return to the pool). If a shrink failed,
  the successful shrinks are committed, nothing else is, and the next cycle re-plans. A pipeline that is already
  unregistered is never failed again (a finished pipeline's dead coordinator, or its own unregister racing the
  scheduler's, is no error). Nothing here stops Ray or other pipelines.
* Background: every ``poll_interval_s`` a cycle runs when requests wait or ``rebalance_reason`` says a suspended
  generation cluster has demand (nothing else wakes it) or shares drifted; every ``health_interval_s``
  coordinators are probed and a dead one fails its pipeline (so a crashed driver's GPUs return).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlix_plugins.control.scheduling import planner
from rlix_plugins.control.scheduling.config import SchedulerConfig, check_timeout, to_priority
from rlix_plugins.control.scheduling.cycle import SchedulerCycle, _Pipeline, _Waiter, failed_text
from rlix_plugins.control.scheduling.status import status_dict
from rlix_plugins.control.types import (
    ClusterSpec,
    PendingRequest,
    Priority,
    Progress,
    TraceEvent,
    parse_cluster_id,
)
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, RlixTimeoutError, SchedulerError


class Scheduler(SchedulerCycle):
    """GPU scheduler actor. Create through the orchestrator (``client.connect``); all methods are coroutines.

    Subclass only to split the module: ``SchedulerCycle`` holds state and the cycle, this class the public API.
    """

    # ------------------------------------------------------------------ lifecycle / introspection
    async def ping(self) -> str:
        self._ensure_loop()
        return "ok"

    async def get_config(self) -> SchedulerConfig:
        return self._cfg

    async def status(self) -> dict[str, Any]:
        self._ensure_loop()
        clusters = {cid: s for p in self._pipelines.values() for cid, s in p.clusters.items()}
        return status_dict(
            gpus=self._gpus,
            gpus_per_node=self._gpus_per_node,
            pipelines={pid: {"admitted": p.admitted, "registered_at": p.registered_at}
                       for pid, p in self._pipelines.items()},
            clusters=clusters,
            allocations=self._allocations,
            pending=[(w.request, w.since) for w in self._pending.values()],
            progress=self._progress,
            planned_releases=self._planned,
            now=time.time(),
            extra={"cycles": self._cycles, "last_plan_ms": round(self._last_plan_ms, 3),
                   "trace_events": len(self._trace), "trace_dropped": self._trace.dropped,
                   "failed": {pid: dict(f) for pid, f in self._failed.items()},
                   "fences": {key: f.status() for key, f in self._fences.items()},
                   "expanding": [{"cluster_id": t.cluster_id, "ranks": list(t.ranks),
                                  "seconds": round(time.monotonic() - t.since, 3)} for t in self._transit.values()],
                   "invariant_checks": self._invariant_checks,
                   "invariant_violations": list(self._invariant_violations)},
        )

    async def get_trace(self, since: float | None = None, limit: int | None = None) -> list[TraceEvent]:
        return self._trace.events(since, limit)

    async def shutdown(self, reason: str = "control plane shut down") -> None:
        """Stop the loop and fail every waiter (used by ``rlix down`` before the actor is killed)."""
        self._stopped = True
        err = SchedulerError(f"{reason}; restart it with `rlix up` and re-register the pipeline")
        for pid in list(self._pipelines):
            self._drop_pipeline(pid, err, op="unregister", detail=reason)
        if self._loop_task is not None:
            self._loop_task.cancel()
        for transit in list(self._transit.values()):
            if transit.task is not None:
                transit.task.cancel()

    # ------------------------------------------------------------------ registration
    async def register_pipeline(self, pipeline_id: str, clusters: list[ClusterSpec], job_id: str | None = None) -> None:
        self._ensure_loop()
        if pipeline_id in self._pipelines:
            raise RlixConfigError(
                f"pipeline {pipeline_id} is already registered; unregister it first or allocate a new id"
            )
        if not clusters or any(s.pipeline_id != pipeline_id for s in clusters):
            raise RlixConfigError(f"pipeline {pipeline_id}: clusters must be non-empty and belong to the pipeline")
        # The one place specs are validated (pool bounds included): they are frozen, so no cycle re-checks them.
        planner.validate_cluster_specs(clusters, self._gpus, self._gpus_per_node)
        self._pipelines[pipeline_id] = _Pipeline(clusters={s.cluster_id: s for s in clusters}, job_id=job_id)
        self._failed.pop(pipeline_id, None)
        gpus = {g for s in clusters for g in s.device_mapping}
        self._trace.record("register", pipeline_id=pipeline_id, gpus=gpus,
                           detail=", ".join(f"{s.name}:tp{s.tp_size}" for s in clusters))

    async def admit_pipeline(self, pipeline_id: str) -> None:
        self._ensure_loop()
        pipe = self._require_pipeline(pipeline_id)
        if not pipe.admitted:
            pipe.admitted = True
            self._trace.record("admit", pipeline_id=pipeline_id,
                               gpus={g for s in pipe.clusters.values() for g in s.device_mapping})

    async def unregister_pipeline(self, pipeline_id: str, reason: str = "unregistered") -> bool:
        """Remove the pipeline: its waiters get ``PipelineUnregisteredError``, its GPUs become idle.

        Idempotent: returns False when it is not registered (a racing auto-unregister already ran).
        The pipeline should ``await_release`` its generation cluster first; this call only does bookkeeping.
        """
        self._ensure_loop()
        err = PipelineUnregisteredError(f"pipeline {pipeline_id} was unregistered ({reason}) while this call waited")
        return self._drop_pipeline(pipeline_id, err, op="unregister", detail=reason)

    async def fail_pipeline(self, pipeline_id: str, reason: str) -> bool:
        self._ensure_loop()
        return self._fail(pipeline_id, reason)

    async def lift_fences(self, pipeline_id: str | None = None) -> list[str]:
        """Lift the fences of ``pipeline_id`` (every fence when None) on an operator's word (``scheduling.fences``)."""
        self._ensure_loop()
        lifted = [k for k, f in self._fences.items() if pipeline_id is None or f.pipeline_id == pipeline_id]
        for key in lifted:
            fence = self._fences.pop(key)
            self._trace.record("unfence", pipeline_id=fence.pipeline_id, gpus=fence.gpus, detail="lifted by request")
        if lifted:
            self._kick()
        return lifted

    # ------------------------------------------------------------------ requests
    async def request_gpus(
        self,
        cluster_id: str,
        priority: int,
        step: int | None = None,
        step_target_estimate: int | None = None,
        timeout_s: float | None = None,
    ) -> list[int]:
        """Block until ``cluster_id`` holds GPUs at ``priority``; return them (sorted).

        Non-generation priorities get the whole device mapping (GENERATION ranks of any pipeline are preempted);
        GENERATION returns once at least one DP rank is active (partial grant; the scheduler keeps resizing it).
        """
        self._ensure_loop()
        timeout = check_timeout(timeout_s, self._cfg.default_request_timeout_s, f"request_gpus({cluster_id})")
        return await self._request(cluster_id, to_priority(priority), step, step_target_estimate, timeout)

    async def release_gpus(self, cluster_id: str, step: int | None = None, timeout_s: float | None = None) -> list[int]:
        """Give back the cluster's allocation; returns the GPUs released ([] when it held none).

        For a GENERATION allocation this is a planned shrink to zero (see ``await_release``).
        """
        self._ensure_loop()
        spec = self._require_cluster(cluster_id)
        alloc = self._allocations.get(cluster_id)
        if (alloc is not None and alloc.priority == Priority.GENERATION) or (alloc is None and cluster_id in self._gen_open):
            return await self.await_release(cluster_id, timeout_s)
        return self._release(spec, step)

    async def release_then_request(
        self,
        release_cluster_id: str,
        request_cluster_id: str,
        priority: int,
        step: int | None = None,
        step_target_estimate: int | None = None,
        timeout_s: float | None = None,
    ) -> list[int]:
        """Atomically release one (non-generation) allocation and queue a request; block like ``request_gpus``."""
        self._ensure_loop()
        timeout = check_timeout(timeout_s, self._cfg.default_request_timeout_s, "release_then_request")
        prio = to_priority(priority)
        spec = self._require_cluster(release_cluster_id)
        held = self._allocations.get(release_cluster_id)
        if held is not None and held.priority == Priority.GENERATION:
            raise SchedulerError(
                f"release_then_request cannot release GENERATION cluster {release_cluster_id}; call "
                "await_release for it first"
            )
        self._require_cluster(request_cluster_id)
        if request_cluster_id == release_cluster_id and held is not None and held.priority == prio:
            raise SchedulerError(f"{release_cluster_id} already holds priority {prio.name}; nothing to switch")
        # No await between the release and the enqueue (``_request`` enqueues before it first awaits): atomic.
        self._release(spec, step)
        return await self._request(request_cluster_id, prio, step, step_target_estimate, timeout)

    async def await_release(self, cluster_id: str, timeout_s: float | None = None) -> list[int]:
        """Planned shrink of a GENERATION cluster to zero; blocks until committed. Returns the GPUs freed.

        Also clears the pipeline's rollout demand (progress, estimate) so the rebalance does not wake it again;
        a later GENERATION request re-opens it. On timeout raises ``RlixTimeoutError``; nothing is stopped.
        """
        self._ensure_loop()
        spec = self._require_cluster(cluster_id)
        if not spec.is_generation:
            raise SchedulerError(f"await_release is for generation clusters; {cluster_id} is {spec.name}; "
                                 "use release_gpus")
        timeout = check_timeout(timeout_s, self._cfg.default_request_timeout_s, f"await_release({cluster_id})")
        held = self._allocations.get(cluster_id)
        if held is not None and held.priority != Priority.GENERATION:
            raise SchedulerError(
                f"{cluster_id} holds GPUs {sorted(held.gpus)} at {Priority(held.priority).name}, not GENERATION; "
                "give them back with release_gpus"
            )
        self._progress.pop(spec.pipeline_id, None)
        self._close_gen(cluster_id)
        for seq, waiter in list(self._pending.items()):
            if waiter.request.cluster_id == cluster_id and seq not in self._inflight_seqs:
                del self._pending[seq]
                if not waiter.future.done():
                    waiter.future.set_exception(SchedulerError(
                        f"{cluster_id} was released (await_release) while this GENERATION request waited"))
        alloc = self._allocations.get(cluster_id)
        busy = cluster_id in self._inflight_clusters or self._in_transit(cluster_id)
        if alloc is None or (not alloc.active_dp_ranks and not busy):
            if alloc is not None:
                del self._allocations[cluster_id]
                self._note_removed(cluster_id)
            self._trace.record("release", pipeline_id=spec.pipeline_id, cluster_id=cluster_id, detail="planned")
            return []
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._planned.setdefault(cluster_id, []).append(fut)
        self._kick()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if cluster_id in self._inflight_clusters or self._in_transit(cluster_id):  # released once it returns
                return await asyncio.wait_for(asyncio.shield(fut), self._cfg.resize_timeout_s * 2 + 10)
            waiters = self._planned.get(cluster_id, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._planned.pop(cluster_id, None)
            self._trace.record("timeout", pipeline_id=spec.pipeline_id, cluster_id=cluster_id, detail="await_release")
            raise RlixTimeoutError(
                f"await_release({cluster_id}) was not committed within {timeout:.1f} s; the shrink of its ranks "
                f"{sorted(alloc.active_dp_ranks)} did not complete (coordinator busy or hung?); check `rlix status`"
            ) from None

    # ------------------------------------------------------------------ progress
    async def report_progress(self, pipeline_id: str, step_target: int, completed: int, step: int | None = None,
                              report_seq: int | None = None) -> None:
        """Rollout progress of the pipeline's current step (``completed`` is clamped to ``[0, step_target]``).

        ``report_seq`` (set by the coordinator, which sends fire-and-forget from several threads) orders reports:
        one not newer than the last seen for the pipeline is dropped.
        """
        self._ensure_loop()
        self._require_pipeline(pipeline_id)
        if not self._newer_report(pipeline_id, report_seq):
            return
        if not isinstance(step_target, int) or step_target < 0 or not isinstance(completed, int):
            raise RlixConfigError(
                f"report_progress({pipeline_id}): step_target={step_target!r} must be an int >= 0 and "
                f"completed={completed!r} an int"
            )
        self._progress[pipeline_id] = Progress(pipeline_id, step_target, min(max(completed, 0), step_target), step)
        self._kick()

    async def clear_progress(self, pipeline_id: str, report_seq: int | None = None) -> None:
        if self._newer_report(pipeline_id, report_seq):
            self._progress.pop(pipeline_id, None)

    def _newer_report(self, pipeline_id: str, report_seq: int | None) -> bool:
        if report_seq is None:
            return True
        if report_seq <= self._progress_seq.get(pipeline_id, -1):
            return False
        self._progress_seq[pipeline_id] = report_seq
        return True

    # ------------------------------------------------------------------ internals: requests
    def _require_pipeline(self, pipeline_id: str) -> _Pipeline:
        pipe = self._pipelines.get(pipeline_id)
        if pipe is None:
            raise PipelineUnregisteredError(self._failed_text(pipeline_id) or (
                f"pipeline {pipeline_id!r} is not registered (unregistered, failed, or never registered); "
                f"registered: {sorted(self._pipelines)}"
            ))
        return pipe

    def _failed_text(self, pipeline_id: str) -> str:
        """Why the pipeline was failed ("" when it was not): its later calls say so rather than "not registered"."""
        failed = self._failed.get(pipeline_id)
        return "" if failed is None else failed_text(pipeline_id, failed["reason"])

    def _require_cluster(self, cluster_id: str) -> ClusterSpec:
        for pipe in self._pipelines.values():
            if cluster_id in pipe.clusters:
                return pipe.clusters[cluster_id]
        known = sorted(c for p in self._pipelines.values() for c in p.clusters)
        try:
            failed = self._failed_text(parse_cluster_id(cluster_id)[0])
        except ValueError:  # not a cluster id of ours at all
            failed = ""
        raise PipelineUnregisteredError(failed or (
            f"cluster {cluster_id!r} is not registered (its pipeline was unregistered or failed?); known: {known}"
        ))

    async def _request(self, cluster_id: str, prio: Priority, step: int | None, estimate: int | None,
                       timeout: float) -> list[int]:
        """Queue a request and wait for its grant (or return at once what the cluster already holds)."""
        result = self._enqueue(cluster_id, prio, step, estimate)
        if isinstance(result, list):
            return result
        return await self._await_grant(result, timeout)

    def _enqueue(self, cluster_id: str, prio: Priority, step: int | None, estimate: int | None) -> list[int] | _Waiter:
        spec = self._require_cluster(cluster_id)
        if not self._pipelines[spec.pipeline_id].admitted:
            raise SchedulerError(f"pipeline {spec.pipeline_id} is registered but not admitted; call admit_pipeline")
        if prio == Priority.GENERATION and not spec.is_generation:
            raise SchedulerError(f"{cluster_id} is a {spec.name} cluster; only generation clusters request GENERATION")
        if estimate is not None and (prio != Priority.GENERATION or not isinstance(estimate, int) or estimate < 1):
            raise RlixConfigError(
                f"step_target_estimate={estimate!r} is only for GENERATION requests and must be an int >= 1"
            )
        held = self._allocations.get(cluster_id)
        if held is not None:
            if held.priority != prio:
                raise SchedulerError(
                    f"{cluster_id} already holds GPUs {sorted(held.gpus)} at {Priority(held.priority).name}; "
                    f"release them (or use release_then_request) before requesting {prio.name}"
                )
            # (a GENERATION allocation whose ranks all wake now waits for them, like the grant that woke them)
            if prio != Priority.GENERATION or held.active_dp_ranks - self._transit_ranks(cluster_id):
                return sorted(held.gpus)
        waiting = next((w for w in self._pending.values() if w.request.cluster_id == cluster_id), None)
        if waiting is not None:
            if prio == Priority.INITIALIZATION and waiting.request.priority == prio:
                return waiting  # a pipeline's processes (its vLLM ranks, its driver) share one start-up request
            raise SchedulerError(f"{cluster_id} already has a pending request; wait for it before asking again")
        if prio == Priority.GENERATION:
            self._gen_open[cluster_id] = (estimate or 1, step)
        req = PendingRequest(cluster_id, prio, next(self._seq), step, estimate)
        waiter = _Waiter(req, spec.pipeline_id, asyncio.get_running_loop().create_future())
        self._pending[req.seq] = waiter
        self._trace.record("request", pipeline_id=spec.pipeline_id, cluster_id=cluster_id,
                           gpus=spec.device_mapping, priority=prio, detail=f"step={step}")
        self._kick()
        return waiter

    async def _await_grant(self, waiter: _Waiter, timeout: float) -> list[int]:
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            req = waiter.request
            # the running cycle grants it, or an expand in flight wakes its ranks: let it finish (bounded)
            if req.seq in self._inflight_seqs or any(req.seq in t.grants for t in self._transit.values()):
                return await asyncio.wait_for(asyncio.shield(waiter.future), self._cfg.resize_timeout_s * 2 + 10)
            self._pending.pop(req.seq, None)
            self._trace.record("timeout", pipeline_id=waiter.pipeline_id, cluster_id=req.cluster_id,
                               priority=req.priority, detail="request_gpus")
            raise RlixTimeoutError(
                f"request_gpus({req.cluster_id}, {Priority(req.priority).name}) was not granted within "
                f"{timeout:.1f} s; {self._blockers(req)}"
            ) from None

    def _blockers(self, req: PendingRequest) -> str:
        spec = self._require_cluster(req.cluster_id)
        clusters = {cid: s for p in self._pipelines.values() for cid, s in p.clusters.items()}
        owed = sorted(self._turns.owed(clusters).get(spec.pipeline_id, ()))
        if owed and req.priority != Priority.GENERATION:
            return (f"its pipeline owes {owed} a turn (fair turns: they waited while it completed "
                    f"{self._cfg.fair_turn_steps} steps); it runs after them")
        holders = sorted(
            f"{cid} ({Priority(a.priority).name}) holds {sorted(a.gpus & set(spec.device_mapping))}"
            for cid, a in self._allocations.items()
            if a.gpus & set(spec.device_mapping) and cid != req.cluster_id
        )
        if not holders:
            return "no other cluster holds its GPUs (is the scheduler loop alive? see `rlix status`)"
        return "blocked by: " + "; ".join(holders) + " (release them or raise the timeout)"

    def _release(self, spec: ClusterSpec, step: int | None) -> list[int]:
        alloc = self._allocations.pop(spec.cluster_id, None)
        if alloc is None:
            return []
        self._note_removed(spec.cluster_id)
        self._start_grace(alloc.gpus, spec.pipeline_id)
        if alloc.priority == Priority.ACTOR_TRAINING:
            self._turns.step_done(spec.pipeline_id)
        self._trace.record("release", pipeline_id=spec.pipeline_id, cluster_id=spec.cluster_id, gpus=alloc.gpus,
                           priority=alloc.priority, detail=f"step={step}")
        self._kick()
        return sorted(alloc.gpus)

