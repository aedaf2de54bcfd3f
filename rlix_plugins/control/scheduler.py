"""The scheduler actor (``rlix:scheduler`` in namespace ``rlix``): state, blocking requests, the cycle.

Why an asyncio actor: every blocked ``request_gpus`` is an awaiting coroutine (no thread per waiter; thousands
are fine), all state lives on one event loop so mutations are atomic between ``await``s without locks, and
every wait is bounded with ``asyncio.wait_for``. The only blocking calls are name lookups in the GCS.

One cycle (run by a single background task, never two at once)::

    snapshot → plan_cycle → validate_plan → shrinks (concurrent) → expands (concurrent) → commit → signal

* Waiters (grants, planned releases) are signalled only after every resize call of the plan returned, so a
  training grant returns after the donor ranks slept and a GENERATION grant after its ranks woke.
* Calls that arrive while a cycle executes are applied at once: a release or unregister is remembered in
  ``_removed_in_cycle`` and wins over the plan at commit; a timed-out request that the running plan grants
  waits for that plan to finish (bounded by the resize timeout) and gets its GPUs.
* Failure isolation: a resize call that fails (dead coordinator, timeout, handler exception) fails THAT pipeline
  only (``fail``: waiters get ``PipelineUnregisteredError``, its GPUs return to the pool). If a shrink failed,
  the successful shrinks are committed, nothing else is, and the next cycle re-plans. A pipeline that is already
  unregistered is never failed again (debug #50, #66). Nothing here stops Ray or other pipelines.
* Background: every ``poll_interval_s`` a cycle runs when requests wait or ``rebalance_reason`` says a suspended
  generation cluster has demand or shares drifted (debug #32); every ``health_interval_s`` coordinators are
  probed and a dead one fails its pipeline (so a crashed driver's GPUs return).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from rlix_plugins.control import planner
from rlix_plugins.control.scheduler_state import (
    SchedulerConfig,
    apply_shrink,
    check_timeout,
    merge_ops,
    ranks_gpus,
    rebalance_reason,
    status_dict,
    to_priority,
)
from rlix_plugins.control.trace import TraceRecorder
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    CyclePlan,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
    TraceEvent,
    coordinator_name,
    pipeline_namespace,
)
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, RlixTimeoutError, SchedulerError

logger = logging.getLogger(__name__)


@dataclass
class _Waiter:
    request: PendingRequest
    pipeline_id: str
    future: asyncio.Future[list[int]]
    since: float = field(default_factory=time.time)


@dataclass
class _Pipeline:
    clusters: dict[str, ClusterSpec]  # by cluster id
    admitted: bool = False
    registered_at: float = field(default_factory=time.time)


class Scheduler:
    """GPU scheduler. Create through the orchestrator (``client.connect``); all methods are coroutines."""

    def __init__(self, num_gpus: int, gpus_per_node: int, config: SchedulerConfig | None = None) -> None:
        if num_gpus <= 0 or gpus_per_node <= 0:
            raise RlixConfigError(f"scheduler needs a GPU pool, got num_gpus={num_gpus}, gpus_per_node={gpus_per_node}")
        self._gpus = frozenset(range(num_gpus))
        self._gpus_per_node = gpus_per_node
        self._cfg = config or SchedulerConfig()
        self._pipelines: dict[str, _Pipeline] = {}
        self._allocations: dict[str, Allocation] = {}
        self._pending: dict[int, _Waiter] = {}
        self._progress: dict[str, Progress] = {}
        # Generation clusters that asked for GENERATION and did not release it: cid -> (estimate, step). While one
        # has no active rank, the snapshot carries a standing GENERATION request for it (debug #27, #32).
        self._gen_open: dict[str, tuple[int, int | None]] = {}
        self._standing_seq: dict[str, int] = {}
        self._planned: dict[str, list[asyncio.Future[list[int]]]] = {}
        self._coordinators: dict[str, Any] = {}
        self._seq = itertools.count()
        self._trace = TraceRecorder(self._cfg.trace_capacity)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._inflight_seqs: set[int] = set()
        self._inflight_clusters: set[str] = set()
        self._removed_in_cycle: set[str] | None = None
        self._cycles = 0
        self._last_plan_ms = 0.0
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle / introspection
    def _ensure_loop(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if not self._stopped and (self._loop_task is None or self._loop_task.done()):
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    def _kick(self) -> None:
        self._ensure_loop()
        assert self._wake is not None
        self._wake.set()

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
                   "trace_events": len(self._trace), "trace_dropped": self._trace.dropped},
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

    # ------------------------------------------------------------------ registration
    async def register_pipeline(self, pipeline_id: str, clusters: list[ClusterSpec]) -> None:
        self._ensure_loop()
        if pipeline_id in self._pipelines:
            raise RlixConfigError(
                f"pipeline {pipeline_id} is already registered; unregister it first or allocate a new id"
            )
        if not clusters or any(s.pipeline_id != pipeline_id for s in clusters):
            raise RlixConfigError(f"pipeline {pipeline_id}: clusters must be non-empty and belong to the pipeline")
        outside = sorted({g for s in clusters for g in s.device_mapping} - self._gpus)
        if outside:
            raise RlixConfigError(
                f"pipeline {pipeline_id}: GPUs {outside} are outside the pool 0..{len(self._gpus) - 1}"
            )
        planner.validate_cluster_specs(clusters, self._gpus, self._gpus_per_node)
        self._pipelines[pipeline_id] = _Pipeline(clusters={s.cluster_id: s for s in clusters})
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

        Idempotent: returns False when it is not registered (a racing auto-unregister already ran, debug #66).
        The pipeline should ``await_release`` its generation cluster first; this call only does bookkeeping.
        """
        self._ensure_loop()
        err = PipelineUnregisteredError(f"pipeline {pipeline_id} was unregistered ({reason}) while this call waited")
        return self._drop_pipeline(pipeline_id, err, op="unregister", detail=reason)

    async def fail_pipeline(self, pipeline_id: str, reason: str) -> bool:
        self._ensure_loop()
        return self._fail(pipeline_id, reason)

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
        result = self._enqueue(cluster_id, to_priority(priority), step, step_target_estimate)
        if isinstance(result, list):
            return result
        return await self._await_grant(result, timeout)

    async def release_gpus(self, cluster_id: str, step: int | None = None, timeout_s: float | None = None) -> list[int]:
        """Give back the cluster's allocation; returns the GPUs released ([] when it held none).

        For a GENERATION allocation this is a planned shrink to zero (see ``await_release``).
        """
        self._ensure_loop()
        spec = self._require_cluster(cluster_id)
        alloc = self._allocations.get(cluster_id)
        if alloc is not None and alloc.priority == Priority.GENERATION:
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
        # No await between the release and the enqueue: atomic on the event loop.
        self._release(spec, step)
        result = self._enqueue(request_cluster_id, prio, step, step_target_estimate)
        if isinstance(result, list):
            return result
        return await self._await_grant(result, timeout)

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
        self._progress.pop(spec.pipeline_id, None)
        self._close_gen(cluster_id)
        alloc = self._allocations.get(cluster_id)
        if alloc is None or (not alloc.active_dp_ranks and cluster_id not in self._inflight_clusters):
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
            if cluster_id in self._inflight_clusters:
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
    async def report_progress(self, pipeline_id: str, step_target: int, completed: int, step: int | None = None) -> None:
        """Rollout progress of the pipeline's current step (``completed`` is clamped to ``[0, step_target]``)."""
        self._ensure_loop()
        self._require_pipeline(pipeline_id)
        if not isinstance(step_target, int) or step_target < 0 or not isinstance(completed, int):
            raise RlixConfigError(
                f"report_progress({pipeline_id}): step_target={step_target!r} must be an int >= 0 and "
                f"completed={completed!r} an int"
            )
        self._progress[pipeline_id] = Progress(pipeline_id, step_target, min(max(completed, 0), step_target), step)
        self._kick()

    async def clear_progress(self, pipeline_id: str) -> None:
        self._progress.pop(pipeline_id, None)

    # ------------------------------------------------------------------ internals: requests
    def _require_pipeline(self, pipeline_id: str) -> _Pipeline:
        pipe = self._pipelines.get(pipeline_id)
        if pipe is None:
            raise PipelineUnregisteredError(
                f"pipeline {pipeline_id!r} is not registered (unregistered, failed, or never registered); "
                f"registered: {sorted(self._pipelines)}"
            )
        return pipe

    def _require_cluster(self, cluster_id: str) -> ClusterSpec:
        for pipe in self._pipelines.values():
            if cluster_id in pipe.clusters:
                return pipe.clusters[cluster_id]
        known = sorted(c for p in self._pipelines.values() for c in p.clusters)
        raise PipelineUnregisteredError(
            f"cluster {cluster_id!r} is not registered (its pipeline was unregistered or failed?); known: {known}"
        )

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
            if prio != Priority.GENERATION or held.active_dp_ranks:
                return sorted(held.gpus)
        if any(w.request.cluster_id == cluster_id for w in self._pending.values()):
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
            if req.seq in self._inflight_seqs:  # the running cycle grants it: let it finish (bounded)
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
        self._trace.record("release", pipeline_id=spec.pipeline_id, cluster_id=spec.cluster_id, gpus=alloc.gpus,
                           priority=alloc.priority, detail=f"step={step}")
        self._kick()
        return sorted(alloc.gpus)

    def _close_gen(self, cluster_id: str) -> None:
        self._gen_open.pop(cluster_id, None)
        self._standing_seq.pop(cluster_id, None)

    def _note_removed(self, cluster_id: str) -> None:
        if self._removed_in_cycle is not None:
            self._removed_in_cycle.add(cluster_id)

    def _drop_pipeline(self, pipeline_id: str, error: Exception, *, op: str, detail: str) -> bool:
        pipe = self._pipelines.pop(pipeline_id, None)
        if pipe is None:
            return False
        freed: set[int] = set()
        for cid in pipe.clusters:
            alloc = self._allocations.pop(cid, None)
            if alloc is not None:
                freed |= alloc.gpus
            self._note_removed(cid)
            for fut in self._planned.pop(cid, []):
                if not fut.done():
                    fut.set_exception(error)
        for seq, waiter in list(self._pending.items()):
            if waiter.pipeline_id == pipeline_id:
                del self._pending[seq]
                if not waiter.future.done():
                    waiter.future.set_exception(error)
        self._progress.pop(pipeline_id, None)
        for cid in pipe.clusters:
            self._close_gen(cid)
        self._coordinators.pop(pipeline_id, None)
        self._trace.record(op, pipeline_id=pipeline_id, gpus=freed, detail=detail)
        if self._wake is not None:
            self._wake.set()
        return True

    def _fail(self, pipeline_id: str, reason: str) -> bool:
        """Fail one pipeline (skip when already gone: debug #66). Never touches other pipelines or Ray."""
        logger.warning("rlix scheduler: failing pipeline %s: %s", pipeline_id, reason)
        err = PipelineUnregisteredError(
            f"pipeline {pipeline_id} was failed by the scheduler: {reason}. Its GPUs were returned to the pool; "
            "fix the cause and re-register the pipeline"
        )
        return self._drop_pipeline(pipeline_id, err, op="fail", detail=reason)

    # ------------------------------------------------------------------ the cycle
    def _snapshot(self) -> SchedulerSnapshot:
        clusters = {cid: s for p in self._pipelines.values() if p.admitted for cid, s in p.clusters.items()}
        pids = {s.pipeline_id for s in clusters.values()}
        pending = [w.request for w in self._pending.values() if w.request.cluster_id in clusters]
        waiting = {r.cluster_id for r in pending}
        for cid, (estimate, step) in self._gen_open.items():
            # debug #27/#32: GENERATION is asked for once, but demand lasts. An open generation cluster keeps a
            # standing request (no waiter) while its pipeline has work left (or reported none), so the planner
            # wakes its ranks again after a preemption, even from zero. Its grants signal nobody.
            prog = self._progress.get(clusters[cid].pipeline_id) if cid in clusters else None
            if cid in clusters and cid not in waiting and (prog is None or prog.remaining > 0):
                seq = self._standing_seq.setdefault(cid, next(self._seq))
                pending.append(PendingRequest(cid, Priority.GENERATION, seq, step, estimate))
        return SchedulerSnapshot(
            gpus=self._gpus,
            gpus_per_node=self._gpus_per_node,
            clusters=clusters,
            allocations={cid: a for cid, a in self._allocations.items() if cid in clusters},
            pending=tuple(sorted(pending, key=lambda r: (r.priority, r.seq))),
            progress={pid: p for pid, p in self._progress.items() if pid in pids},
            planned_releases=frozenset(cid for cid in self._planned if cid in clusters),
        )

    async def _run_loop(self) -> None:
        assert self._wake is not None
        busy = 0
        next_health = time.monotonic() + self._cfg.health_interval_s
        while not self._stopped:
            try:
                await asyncio.wait_for(self._wake.wait(), self._cfg.poll_interval_s)
                woken = True
            except TimeoutError:
                woken = False
            self._wake.clear()
            try:
                if time.monotonic() >= next_health:
                    await self._health_check()
                    next_health = time.monotonic() + self._cfg.health_interval_s
                snapshot = self._snapshot()
                if woken or snapshot.pending or snapshot.planned_releases or \
                        rebalance_reason(snapshot, self._cfg.drift_threshold):
                    changed = await self._cycle(snapshot)
                    busy = busy + 1 if changed else 0
                    if changed and busy < self._cfg.max_busy_cycles:
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must survive anything; one bad cycle never stops the service
                logger.exception("rlix scheduler loop error")
                self._trace.record("error", detail=f"loop: {type(exc).__name__}: {exc}")
                await asyncio.sleep(self._cfg.poll_interval_s)

    async def _cycle(self, snapshot: SchedulerSnapshot) -> bool:
        t0 = time.perf_counter()
        try:
            plan = planner.plan_cycle(snapshot)
            planner.validate_plan(snapshot, plan)
        except Exception as exc:
            self._on_planner_error(snapshot, exc)
            return False
        finally:
            self._last_plan_ms = (time.perf_counter() - t0) * 1e3
        self._cycles += 1
        real_grants = [g for g in plan.grants if g.seq in self._pending]
        if not (plan.shrinks or plan.expands or plan.released or real_grants) and \
                plan.allocations == snapshot.allocations:
            return False  # nothing to do (standing requests' grants alone change nothing)
        self._inflight_seqs = {g.seq for g in plan.grants}
        self._inflight_clusters = {o.cluster_id for o in plan.shrinks} | {o.cluster_id for o in plan.expands}
        self._inflight_clusters |= set(plan.released)
        self._removed_in_cycle = set()
        try:
            await self._execute(snapshot, plan)
        finally:
            self._inflight_seqs, self._inflight_clusters, self._removed_in_cycle = set(), set(), None
        return True

    def _on_planner_error(self, snapshot: SchedulerSnapshot, exc: Exception) -> None:
        """A planner bug: execute nothing, fail the waiters of this snapshot (they would only time out)."""
        logger.error("rlix planner error: %s", exc, exc_info=exc)
        self._trace.record("error", detail=f"planner: {type(exc).__name__}: {exc}")
        err = SchedulerError(f"the planner rejected this cycle ({type(exc).__name__}: {exc}); nothing was changed. "
                             "This is an rlix bug: report it with `rlix status --json` and `rlix timeline`")
        for req in snapshot.pending:
            waiter = self._pending.pop(req.seq, None)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_exception(err)
        for cid in snapshot.planned_releases:
            for fut in self._planned.pop(cid, []):
                if not fut.done():
                    fut.set_exception(err)

    async def _execute(self, snapshot: SchedulerSnapshot, plan: CyclePlan) -> None:
        shrinks, expands = merge_ops(plan.shrinks), merge_ops(plan.expands)
        failed: dict[str, str] = {}
        done = await self._resize_all(snapshot, shrinks, expand=False, failed=failed)
        if failed:
            # Commit only what happened (the successful shrinks), fail the culprits, re-plan next cycle.
            for cid, ranks in done.items():
                spec = snapshot.clusters[cid]
                if cid in self._allocations:
                    self._allocations[cid] = apply_shrink(self._allocations[cid], spec, ranks)
                self._trace.record("shrink", pipeline_id=spec.pipeline_id, cluster_id=cid,
                                   gpus=ranks_gpus(spec, ranks), detail=f"ranks={list(ranks)} partial-plan")
            for pid, reason in failed.items():
                self._fail(pid, reason)
            return
        await self._resize_all(snapshot, expands, expand=True, failed=failed)
        for pid, reason in failed.items():
            self._fail(pid, reason)
        removed = self._removed_in_cycle or set()
        alive = {cid for p in self._pipelines.values() for cid in p.clusters}
        self._allocations = {cid: a for cid, a in plan.allocations.items() if cid not in removed and cid in alive}
        self._trace_plan(snapshot, plan, shrinks, expands, alive)
        for grant in plan.grants:
            waiter = self._pending.pop(grant.seq, None)
            if waiter is not None and not waiter.future.done() and grant.cluster_id in alive:
                waiter.future.set_result(sorted(grant.gpus))
        for cid in plan.released:
            self._close_gen(cid)
            for fut in self._planned.pop(cid, []):
                if not fut.done():
                    fut.set_result(sorted(snapshot.allocations[cid].gpus) if cid in snapshot.allocations else [])

    def _trace_plan(self, snapshot: SchedulerSnapshot, plan: CyclePlan, shrinks: dict[str, tuple[int, ...]],
                    expands: dict[str, tuple[int, ...]], alive: set[str]) -> None:
        reasons: dict[str, set[str]] = {}
        for op in plan.shrinks:
            reasons.setdefault(op.cluster_id, set()).add(op.reason)
        for cid, ranks in shrinks.items():
            spec = snapshot.clusters[cid]
            self._trace.record("shrink", pipeline_id=spec.pipeline_id, cluster_id=cid, gpus=ranks_gpus(spec, ranks),
                               priority=Priority.GENERATION,
                               detail=f"{'+'.join(sorted(reasons[cid]))} ranks={list(ranks)}")
        for cid, ranks in expands.items():
            if cid in alive:
                spec = snapshot.clusters[cid]
                self._trace.record("expand", pipeline_id=spec.pipeline_id, cluster_id=cid,
                                   gpus=ranks_gpus(spec, ranks), priority=Priority.GENERATION, detail=f"ranks={list(ranks)}")
        for grant in plan.grants:
            spec = snapshot.clusters[grant.cluster_id]
            if grant.cluster_id in alive and grant.seq in self._pending:
                kind = "grant" if grant.priority == Priority.GENERATION else "allocate"
                self._trace.record(kind, pipeline_id=spec.pipeline_id, cluster_id=grant.cluster_id, gpus=grant.gpus,
                                   priority=grant.priority, detail=f"seq={grant.seq}")
        for cid in plan.released:
            spec = snapshot.clusters[cid]
            self._trace.record("release", pipeline_id=spec.pipeline_id, cluster_id=cid, detail="planned")

    async def _resize_all(self, snapshot: SchedulerSnapshot, ops: dict[str, tuple[int, ...]], *, expand: bool,
                          failed: dict[str, str]) -> dict[str, tuple[int, ...]]:
        """Run one ``resize_infer`` per cluster concurrently; failures land in ``failed`` (pid -> reason)."""
        items = [(cid, ranks) for cid, ranks in ops.items() if snapshot.clusters[cid].pipeline_id not in failed]
        results = await asyncio.gather(
            *(self._resize(snapshot.clusters[cid].pipeline_id, ranks, expand) for cid, ranks in items),
            return_exceptions=True,
        )
        done: dict[str, tuple[int, ...]] = {}
        for (cid, ranks), res in zip(items, results, strict=True):
            pid = snapshot.clusters[cid].pipeline_id
            if isinstance(res, BaseException):
                what = "expand" if expand else "shrink"
                failed[pid] = f"{what} of {cid} ranks {list(ranks)} failed: {_describe(res)}"
            else:
                done[cid] = ranks
        return done

    async def _resize(self, pipeline_id: str, ranks: tuple[int, ...], expand: bool) -> None:
        coord = self._coordinator(pipeline_id)
        remove, add = ([], list(ranks)) if expand else (list(ranks), [])
        try:
            await asyncio.wait_for(coord.resize_infer.remote(remove, add), self._cfg.resize_timeout_s)
        except TimeoutError:
            raise RlixTimeoutError(
                f"coordinator did not finish resize_infer(remove={remove}, add={add}) within "
                f"{self._cfg.resize_timeout_s:.0f} s (SchedulerConfig.resize_timeout_s)"
            ) from None

    def _coordinator(self, pipeline_id: str) -> Any:
        handle = self._coordinators.get(pipeline_id)
        if handle is None:
            try:
                handle = ray.get_actor(coordinator_name(pipeline_id), namespace=pipeline_namespace(pipeline_id))
            except ValueError:
                raise SchedulerError(
                    f"no coordinator actor {coordinator_name(pipeline_id)!r} in namespace "
                    f"{pipeline_namespace(pipeline_id)!r}; create it (client.register_pipeline does) before "
                    "requesting GENERATION"
                ) from None
            self._coordinators[pipeline_id] = handle
        return handle

    async def _health_check(self) -> None:
        """Fail pipelines whose coordinator actor died (e.g. the driver that owned it exited)."""
        probes: dict[str, Any] = {}
        for pid in list(self._pipelines):
            try:
                probes[pid] = self._coordinator(pid).ping.remote()
            except SchedulerError:
                continue  # not created yet: nothing to probe
        if not probes:
            return
        results = await asyncio.gather(
            *(asyncio.wait_for(ref, self._cfg.health_timeout_s) for ref in probes.values()), return_exceptions=True
        )
        for pid, res in zip(probes, results, strict=True):
            if isinstance(res, ray.exceptions.RayActorError):
                self._fail(pid, f"coordinator died: {_describe(res)}")
            elif isinstance(res, BaseException):
                self._trace.record("error", pipeline_id=pid, detail=f"health probe: {_describe(res)}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:500]
    if isinstance(exc, ray.exceptions.RayActorError):
        return "coordinator actor died (RayActorError)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]
