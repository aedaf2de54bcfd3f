"""The scheduler's state and its cycle (snapshot → plan → execute → commit → signal); base of ``scheduler.Scheduler``.

``SchedulerCycle`` owns every field of the scheduler, runs the background loop and executes plans (resize calls to
the pipelines' coordinators, health probes); ``scheduler.Scheduler`` adds the public coroutine API on top.
Single-threaded by construction: everything runs on the actor's asyncio event loop, and only ``_execute`` awaits
(the shrinks' resize RPCs) in the middle of a cycle; what may change during those awaits is listed in
``scheduler.py``'s docstring. Expands run outside the cycle (``_Transit``): a cycle launches them and goes on, later
cycles plan around them (``SchedulerSnapshot.expanding``), and each one's result is folded in when it returns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from rlix_plugins.control.scheduling import planner
from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.scheduling.fences import Fence, fenced_gpus, live_processes
from rlix_plugins.control.scheduling.gap_ratio import note_generation_waits
from rlix_plugins.control.scheduling.invariants import PlanInvariantError, validate_snapshot
from rlix_plugins.control.scheduling.rebalance import rebalance_reason
from rlix_plugins.control.scheduling.turns import TurnLedger
from rlix_plugins.control.trace import TraceRecorder
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    CyclePlan,
    ExpandOp,
    Grant,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
    ShrinkOp,
    coordinator_name,
    pipeline_namespace,
)
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, RlixTimeoutError, SchedulerError

logger = logging.getLogger(__name__)

#: Failed pipelines kept for ``rlix status`` (the oldest are dropped first).
FAILED_KEPT = 256


def failed_text(pipeline_id: str, reason: str) -> str:
    """What a failed pipeline's pending and later calls raise (``PipelineUnregisteredError``)."""
    return (f"pipeline {pipeline_id} was failed by the scheduler: {reason}. Its GPUs were returned to the pool; "
            "fix the cause and re-register the pipeline")


@dataclass
class _Waiter:
    request: PendingRequest
    pipeline_id: str
    future: asyncio.Future[list[int]]
    since: float = field(default_factory=time.time)


@dataclass
class _Transit:
    """An expand launched by a cycle that has not returned: its ranks are committed as active (their GPUs taken), but
    no plan shrinks its cluster or grants it GENERATION until it returns (``SchedulerSnapshot.expanding``)."""

    cluster_id: str
    pipeline_id: str
    ranks: tuple[int, ...]
    gpus: frozenset[int]
    #: GENERATION waiters (seq -> GPUs) the launching plan granted: signalled when the ranks are awake
    grants: dict[int, frozenset[int]]
    since: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None


@dataclass
class _Pipeline:
    clusters: dict[str, ClusterSpec]  # by cluster id
    admitted: bool = False
    registered_at: float = field(default_factory=time.time)
    job_id: str | None = None  #: the Ray job of the driver that registered it (``fences``)


class SchedulerCycle:
    """Scheduler state plus the cycle (snapshot → plan → execute → commit → signal). Not an actor itself."""

    def __init__(self, num_gpus: int, gpus_per_node: int, config: SchedulerConfig | None = None) -> None:
        if num_gpus <= 0 or gpus_per_node <= 0:
            raise RlixConfigError(f"scheduler needs a GPU pool, got num_gpus={num_gpus}, gpus_per_node={gpus_per_node}")
        self._gpus = frozenset(range(num_gpus))
        self._gpus_per_node = gpus_per_node
        self._cfg = config or SchedulerConfig()
        self._pipelines: dict[str, _Pipeline] = {}
        self._allocations: dict[str, Allocation] = {}
        self._init_since: dict[str, float] = {}  #: cluster -> when its INITIALIZATION allocation began (monotonic)
        self._pending: dict[int, _Waiter] = {}
        self._progress: dict[str, Progress] = {}
        self._progress_seq: dict[str, int] = {}  # last coordinator report_seq per pipeline
        # Generation clusters that asked for GENERATION and did not release it: cid -> (estimate, step). While one
        # has no active rank, the snapshot carries a standing GENERATION request for it (GENERATION is
        # asked for once: without it, a pipeline preempted to zero would starve).
        self._gen_open: dict[str, tuple[int, int | None]] = {}
        self._standing_seq: dict[str, int] = {}
        self._gen_waiting: dict[str, int] = {}  # generation cluster -> when it started waiting for a rank (turns)
        self._slept_at: dict[str, int] = {}  # generation cluster -> when a grant last preempted a rank of it
        self._turns = TurnLedger(self._cfg.fair_turn_steps)  # steps done and open waits (fair turns)
        self._planned: dict[str, list[asyncio.Future[list[int]]]] = {}
        self._grace: dict[int, tuple[float, str]] = {}  # GPU -> (monotonic end of its grace window, releasing pipeline)
        self._coordinators: dict[str, Any] = {}
        self._seq = itertools.count()
        self._trace = TraceRecorder(self._cfg.trace_capacity)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._inflight_seqs: set[int] = set()
        self._transit: dict[int, _Transit] = {}  #: expands in flight, by launch number
        self._transit_ids = itertools.count()
        self._inflight_clusters: set[str] = set()
        self._removed_in_cycle: set[str] | None = None
        self._cycles = 0
        self._last_plan_ms = 0.0
        self._stopped = False
        #: pipelines the scheduler failed, and why (newest last; ``rlix status`` names them)
        self._failed: dict[str, dict[str, Any]] = {}
        #: failed pipelines whose GPUs take no new grant until their processes are gone (``fences``)
        self._fences: dict[str, Fence] = {}
        #: committed states checked against the invariants after a cycle, and those that broke one
        self._invariant_checks = 0
        self._invariant_violations: list[str] = []

    def _ensure_loop(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if not self._stopped and (self._loop_task is None or self._loop_task.done()):
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    def _kick(self) -> None:
        self._ensure_loop()
        assert self._wake is not None
        self._wake.set()

    # ------------------------------------------------------------------ state changes shared by API and cycle
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
        awake: list[int] = []
        for cid in pipe.clusters:
            alloc = self._allocations.pop(cid, None)
            if alloc is not None:
                freed |= alloc.gpus
                if alloc.priority == Priority.GENERATION:
                    awake += sorted(alloc.active_dp_ranks)
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
        self._progress_seq.pop(pipeline_id, None)
        for cid in pipe.clusters:
            self._close_gen(cid)
            self._slept_at.pop(cid, None)
        self._coordinators.pop(pipeline_id, None)
        self._end_grace(pipeline_id)  # nobody is coming back for those GPUs
        self._turns.forget(pipeline_id)
        if awake:
            # These ranks may still hold memory a peer's wake-up needs; a graceful end calls await_release first
            # (advice for an unregister only: a failed pipeline's reason is its failure, not a missed call).
            detail += (f" (rollout ranks {awake} were still active: call await_release before unregistering)"
                       if op != "fail" else f" (rollout ranks {awake} were active)")
            logger.warning("rlix scheduler: pipeline %s left with active rollout ranks %s", pipeline_id, awake)
        self._trace.record(op, pipeline_id=pipeline_id, gpus=freed, detail=detail)
        if op == "fail":
            self._failed[pipeline_id] = {"reason": detail, "time": time.time(), "gpus_freed": sorted(freed)}
            while len(self._failed) > FAILED_KEPT:
                del self._failed[next(iter(self._failed))]
            if freed and pipe.job_id is not None:  # its processes may still hold the memory: the health check lifts it
                self._fences[f"{pipeline_id}/{pipe.job_id}"] = Fence(pipeline_id, pipe.job_id, frozenset(freed), detail)
                self._trace.record("fence", pipeline_id=pipeline_id, gpus=freed,
                                   detail=f"until the processes of Ray job {pipe.job_id} are gone")
        if self._wake is not None:
            self._wake.set()
        return True

    def _fail(self, pipeline_id: str, reason: str) -> bool:
        """Fail one pipeline (skip when already gone: its own unregister may race this). Never touches other
        pipelines or Ray."""
        logger.warning("rlix scheduler: failing pipeline %s: %s", pipeline_id, reason)
        err = PipelineUnregisteredError(failed_text(pipeline_id, reason))
        return self._drop_pipeline(pipeline_id, err, op="fail", detail=reason)

    # ------------------------------------------------------------------ the cycle
    def _snapshot(self) -> SchedulerSnapshot:
        clusters = {cid: s for p in self._pipelines.values() if p.admitted for cid, s in p.clusters.items()}
        pids = {s.pipeline_id for s in clusters.values()}
        pending = [w.request for w in self._pending.values() if w.request.cluster_id in clusters]
        waiting = {r.cluster_id for r in pending}
        for cid, (estimate, step) in self._gen_open.items():
            # GENERATION is asked for once, but demand lasts. An open generation cluster keeps a
            # standing request (no waiter) while its pipeline has work left (or reported none), so the planner
            # wakes its ranks again after a preemption, even from zero. Its grants signal nobody.
            prog = self._progress.get(clusters[cid].pipeline_id) if cid in clusters else None
            if cid in clusters and cid not in waiting and (prog is None or prog.remaining > 0):
                seq = self._standing_seq.setdefault(cid, next(self._seq))
                pending.append(PendingRequest(cid, Priority.GENERATION, seq, step, estimate))
        snap = SchedulerSnapshot(
            gpus=self._gpus,
            gpus_per_node=self._gpus_per_node,
            clusters=clusters,
            allocations={cid: a for cid, a in self._allocations.items() if cid in clusters},
            pending=tuple(sorted(pending, key=lambda r: (r.priority, r.seq))),
            progress={pid: p for pid, p in self._progress.items() if pid in pids},
            planned_releases=frozenset(cid for cid in self._planned if cid in clusters),
        )
        note_generation_waits(self._gen_waiting, snap, self._seq)
        for pid, begins in self._turns.note(snap):
            self._trace.record("wait", pipeline_id=pid, detail="begin" if begins else "end")
        owed = self._turns.owed(clusters)
        # A pipeline that owes a turn keeps no grace window: the waiter takes its GPUs at once.
        grace = frozenset(g for g, (_, pid) in self._grace.items() if pid not in owed)
        fenced = fenced_gpus(self._fences, (p.job_id for p in self._pipelines.values())) if self._fences else frozenset()
        expanding: dict[str, frozenset[int]] = {}
        for t in self._transit.values():
            alloc = snap.allocations.get(t.cluster_id)
            if alloc is not None and alloc.priority == Priority.GENERATION:
                expanding[t.cluster_id] = expanding.get(t.cluster_id, frozenset()) | frozenset(t.ranks)
            else:  # its pipeline left while the ranks wake: nobody takes those GPUs until the expand returns
                fenced |= t.gpus
        return replace(snap, generation_waiting_since=dict(self._gen_waiting), turns_owed=owed,
                       release_grace_gpus=grace - fenced, fenced_gpus=fenced, expanding=expanding,
                       rollout_slept_at=dict(self._slept_at))

    def _start_grace(self, gpus: frozenset[int], pipeline_id: str) -> None:
        if self._cfg.release_grace_s > 0:
            until = time.monotonic() + self._cfg.release_grace_s
            for g in gpus:
                self._grace[g] = (until, pipeline_id)

    def _end_grace(self, pipeline_id: str | None = None) -> bool:
        """Drop ended grace windows (and every window of ``pipeline_id``, which left); True when one ended: its
        GPUs may now be lent to rollout, so a cycle should run."""
        now = time.monotonic()
        ended = [g for g, (until, pid) in self._grace.items() if until <= now or pid == pipeline_id]
        for g in ended:
            del self._grace[g]
        return bool(ended)

    def _next_wait_s(self) -> float:
        wait = self._cfg.poll_interval_s
        if self._grace:
            first = min(until for until, _ in self._grace.values())
            wait = min(wait, max(first - time.monotonic(), 0.0) + 0.01)
        return wait

    async def _run_loop(self) -> None:
        assert self._wake is not None
        busy = 0
        next_health = time.monotonic() + self._cfg.health_interval_s
        while not self._stopped:
            try:
                await asyncio.wait_for(self._wake.wait(), self._next_wait_s())
                woken = True
            except TimeoutError:
                woken = False
            self._wake.clear()
            woken = self._end_grace() or woken
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
        self._check_committed()
        return True

    def _check_committed(self) -> None:
        """Check the state a cycle committed (the plan was validated before it ran; this catches what changed
        while it executed: releases, unregisters, failures). Counted for ``rlix status`` and the chaos soak."""
        self._invariant_checks += 1
        clusters = {cid: s for p in self._pipelines.values() for cid, s in p.clusters.items()}
        try:
            validate_snapshot(SchedulerSnapshot(gpus=self._gpus, gpus_per_node=self._gpus_per_node, clusters=clusters,
                                                allocations=dict(self._allocations), pending=(), progress={},
                                                planned_releases=frozenset()))
        except PlanInvariantError as exc:
            logger.error("rlix scheduler: committed state breaks an invariant: %s", exc)
            self._trace.record("error", detail=f"committed state: {exc}")
            self._invariant_violations = [*self._invariant_violations[-99:], str(exc)]

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
        """Shrinks (awaited) → commit → signal → launch the expands (not awaited: ``_run_expand`` folds each result
        in when it returns, so no waiter and no later cycle waits for another pipeline's wake-up)."""
        shrinks, expands = merge_ops(plan.shrinks), merge_ops(plan.expands)
        failed: dict[str, str] = {}
        done = await self._resize_all(snapshot, shrinks, expand=False, failed=failed)
        if failed:
            # Commit only what happened (the successful shrinks), fail the culprits, re-plan next cycle.
            self._commit_shrinks(snapshot, done)
            for cid, ranks in done.items():
                spec = snapshot.clusters[cid]
                self._trace.record("shrink", pipeline_id=spec.pipeline_id, cluster_id=cid,
                                   gpus=spec.gpus_of(ranks), detail=f"ranks={list(ranks)} partial-plan")
            for pid, reason in failed.items():
                self._fail(pid, reason)
            return
        self._trace_shrinks(snapshot, plan, shrinks)
        planner.note_preemptions(self._slept_at, plan, self._seq)  # the ranks that sleep beside grants take turns
        removed = self._removed_in_cycle or set()
        alive = {cid for p in self._pipelines.values() for cid in p.clusters}
        # Nothing awaits from here on: the commit, the signals and the launches are one atomic step.
        self._allocations = {cid: a for cid, a in plan.allocations.items() if cid not in removed and cid in alive}
        self._note_init_holds()
        launched = {cid: ranks for cid, ranks in expands.items() if cid in self._allocations}
        # A GENERATION grant of a cluster woken now returns once its ranks are awake (when its expand returns).
        deferred = {g.seq: g for g in plan.grants if g.priority == Priority.GENERATION and g.cluster_id in launched}
        self._trace_plan(snapshot, plan, launched, alive, deferred)
        for grant in plan.grants:
            if grant.seq in deferred:
                continue
            waiter = self._pending.pop(grant.seq, None)
            if waiter is not None and not waiter.future.done() and grant.cluster_id in alive:
                waiter.future.set_result(sorted(grant.gpus))
        for cid in plan.released:
            self._close_gen(cid)
            for fut in self._planned.pop(cid, []):
                if not fut.done():
                    fut.set_result(sorted(snapshot.allocations[cid].gpus) if cid in snapshot.allocations else [])
        for cid, ranks in launched.items():
            spec = snapshot.clusters[cid]
            grants = {g.seq: g.gpus for g in deferred.values() if g.cluster_id == cid}
            self._launch_expand(_Transit(cid, spec.pipeline_id, ranks, spec.gpus_of(ranks), grants))

    def _launch_expand(self, transit: _Transit) -> None:
        key = next(self._transit_ids)
        self._transit[key] = transit
        transit.task = asyncio.get_running_loop().create_task(self._run_expand(key, transit))

    async def _run_expand(self, key: int, transit: _Transit) -> None:
        """One expand in flight (bounded by ``resize_timeout_s`` in ``_resize``). Success signals the GENERATION
        grants that waited for these ranks; failure fails this pipeline only. Either way a cycle runs next: the
        cluster may now be shrunk, released or granted."""
        error: Exception | None = None
        try:
            await self._resize(transit.pipeline_id, transit.ranks, True)
        except Exception as exc:  # the coordinator failed, died or timed out: that pipeline's problem only
            error = exc
        finally:
            self._transit.pop(key, None)
        if error is not None:
            self._fail(transit.pipeline_id, f"expand of {transit.cluster_id} ranks {list(transit.ranks)} failed: "
                                            f"{_describe(error)}")
        else:
            for seq, gpus in transit.grants.items():
                waiter = self._pending.pop(seq, None)
                if waiter is not None and not waiter.future.done():
                    self._trace.record("grant", pipeline_id=transit.pipeline_id, cluster_id=transit.cluster_id,
                                       gpus=gpus, priority=Priority.GENERATION, detail=f"seq={seq}")
                    waiter.future.set_result(sorted(gpus))
        if self._wake is not None:
            self._wake.set()

    def _in_transit(self, cluster_id: str) -> bool:
        """Whether an expand of ``cluster_id`` is in flight."""
        return any(t.cluster_id == cluster_id for t in self._transit.values())

    def _transit_ranks(self, cluster_id: str) -> set[int]:
        """The DP ranks of ``cluster_id`` that expands in flight are waking."""
        return {r for t in self._transit.values() if t.cluster_id == cluster_id for r in t.ranks}

    def _trace_shrinks(self, snapshot: SchedulerSnapshot, plan: CyclePlan,
                       shrinks: dict[str, tuple[int, ...]]) -> None:
        reasons: dict[str, set[str]] = {}
        for op in plan.shrinks:
            reasons.setdefault(op.cluster_id, set()).add(op.reason)
        for cid, ranks in shrinks.items():
            spec = snapshot.clusters[cid]
            self._trace.record("shrink", pipeline_id=spec.pipeline_id, cluster_id=cid, gpus=spec.gpus_of(ranks),
                               priority=Priority.GENERATION,
                               detail=f"{'+'.join(sorted(reasons[cid]))} ranks={list(ranks)}")

    def _commit_shrinks(self, snapshot: SchedulerSnapshot, shrinks: dict[str, tuple[int, ...]]) -> None:
        """Take the DP ranks put to sleep out of the committed allocations (before the rest of the plan commits)."""
        for cid, ranks in shrinks.items():
            if cid in self._allocations:
                left = apply_shrink(self._allocations[cid], snapshot.clusters[cid], ranks)
                if left.active_dp_ranks:
                    self._allocations[cid] = left
                else:
                    del self._allocations[cid]

    def _trace_plan(self, snapshot: SchedulerSnapshot, plan: CyclePlan, expands: dict[str, tuple[int, ...]],
                    alive: set[str], deferred: dict[int, Grant]) -> None:
        for cid, ranks in expands.items():
            if cid in alive:
                spec = snapshot.clusters[cid]
                self._trace.record("expand", pipeline_id=spec.pipeline_id, cluster_id=cid,
                                   gpus=spec.gpus_of(ranks), priority=Priority.GENERATION, detail=f"ranks={list(ranks)}")
        for grant in plan.grants:
            spec = snapshot.clusters[grant.cluster_id]
            if grant.cluster_id in alive and grant.seq in self._pending and grant.seq not in deferred:
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

    def _holds_resources(self, pipeline_id: str) -> bool:
        clusters = self._pipelines[pipeline_id].clusters
        return any(cid in self._allocations or cid in self._gen_open for cid in clusters) or any(
            w.pipeline_id == pipeline_id for w in self._pending.values()
        )

    def _note_init_holds(self) -> None:
        """Keep when each INITIALIZATION allocation began (a new grant starts the clock, a release drops it)."""
        now = time.monotonic()
        held = {cid for cid, a in self._allocations.items() if a.priority == Priority.INITIALIZATION}
        self._init_since = {cid: self._init_since.get(cid, now) for cid in held}

    def _check_init_holds(self) -> None:
        self._note_init_holds()
        limit = self._cfg.init_hold_timeout_s
        for cid, since in sorted(self._init_since.items()):
            spec = next((p.clusters[cid] for p in self._pipelines.values() if cid in p.clusters), None)
            if spec is not None and time.monotonic() - since > limit:
                self._fail(spec.pipeline_id, f"{cid} held its INITIALIZATION grant for more than {limit:g} s "
                                             "(SchedulerConfig.init_hold_timeout_s): its start hangs")

    async def _health_check(self) -> None:
        """Fail pipelines whose coordinator actor died (e.g. the driver that owned it exited), or whose coordinator
        reports that the driver stopped renewing its lease (a driver that hangs or was stopped while it holds GPUs).

        A coordinator is found by name once and its handle kept; a driver that dies before that lookup takes its
        (driver-owned) coordinator with it, so "no such actor" for a pipeline registered longer than the grace below
        means its driver is gone: fail it where it holds GPUs or waits for them, or its GPUs never return; and where
        it holds nothing after twice the grace too (a driver killed between its registration and its first request,
        the demo's deadline at start-up), or its registration stays for ever. ``client.register_pipeline`` creates
        the coordinator and waits for it to answer before it returns, so a live pipeline has one within seconds.
        """
        self._check_init_holds()
        await self._check_fences()
        grace_s = 2 * self._cfg.health_interval_s + self._cfg.health_timeout_s
        probes: dict[str, Any] = {}
        for pid, pipe in list(self._pipelines.items()):
            try:
                probes[pid] = self._coordinator(pid).ping.remote()
            except SchedulerError:
                age = time.time() - pipe.registered_at
                if age > grace_s and self._holds_resources(pid):
                    self._fail(pid, f"no coordinator actor {coordinator_name(pid)!r} {grace_s:.0f} s after "
                                    "registration while holding or awaiting GPUs (its driver exited?)")
                elif age > 2 * grace_s:
                    self._fail(pid, f"no coordinator actor {coordinator_name(pid)!r} {2 * grace_s:.0f} s after "
                                    "registration (its driver exited before it asked for GPUs?)")
                continue
        if not probes:
            return
        results = await asyncio.gather(
            *(asyncio.wait_for(ref, self._cfg.health_timeout_s) for ref in probes.values()), return_exceptions=True
        )
        for pid, res in zip(probes, results, strict=True):
            if isinstance(res, ray.exceptions.RayActorError):
                self._fail(pid, f"coordinator died: {_describe(res)}")
            elif isinstance(res, str) and res != "ok":  # the coordinator's verdict: its driver's lease expired
                self._fail(pid, res)
            elif isinstance(res, BaseException):
                self._trace.record("error", pipeline_id=pid, detail=f"health probe: {_describe(res)}")


    async def _check_fences(self) -> None:
        """Lift each fence whose job has no live process left (``fences``); keep the ones still seen, and any whose
        check did not answer (the GPUs stay fenced: granting them could run the next tenant out of memory)."""
        for key, fence in list(self._fences.items()):
            try:
                alive = await asyncio.wait_for(asyncio.to_thread(live_processes, fence.job_id),
                                               self._cfg.health_timeout_s)
            except Exception as exc:
                self._trace.record("error", pipeline_id=fence.pipeline_id, detail=f"fence check: {_describe(exc)}")
                continue
            if alive:
                fence.processes = alive
                continue
            del self._fences[key]
            self._trace.record("unfence", pipeline_id=fence.pipeline_id, gpus=fence.gpus,
                               detail=f"the processes of Ray job {fence.job_id} are gone")
            if self._wake is not None:
                self._wake.set()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:500]
    if isinstance(exc, ray.exceptions.RayActorError):
        return "coordinator actor died (RayActorError)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:500]


def merge_ops(ops: Iterable[ShrinkOp | ExpandOp]) -> dict[str, tuple[int, ...]]:
    """DP ranks per cluster, merged over several ops of one kind (one ``resize_infer`` call per cluster)."""
    merged: dict[str, set[int]] = {}
    for op in ops:
        merged.setdefault(op.cluster_id, set()).update(op.dp_ranks)
    return {cid: tuple(sorted(ranks)) for cid, ranks in merged.items()}


def apply_shrink(alloc: Allocation, spec: ClusterSpec, ranks: Iterable[int]) -> Allocation:
    """``alloc`` after the given DP ranks went to sleep (used when only part of a plan was executed)."""
    ranks = frozenset(ranks)
    return Allocation(
        cluster_id=alloc.cluster_id,
        priority=alloc.priority,
        gpus=alloc.gpus - spec.gpus_of(ranks),
        active_dp_ranks=alloc.active_dp_ranks - ranks,
    )
