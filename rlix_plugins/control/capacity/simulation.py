"""Time-stepped simulation of async-GRPO pipelines sharing GPUs through the real planner (pure Python).

Model (one pipeline = one ``JobSpec``):

* **Rollout**: a step needs ``step_target`` trajectories. A trajectory takes ``traj_time_s`` of decoding and a
  DP rank decodes ``seqs_per_rank`` of them at once, so throughput is ``min(ranks x seqs_per_rank, open + k0) /
  traj_time_s`` where ``open`` is the number of trajectories the pipeline may still produce and ``k0 =
  seqs_per_rank / 4``: near the end of a batch fewer sequences remain than slots (the rollout long tail).
  Only woken, weight-synced ranks produce: an expanded rank serves after ``expand_time_s`` (wake + sync).
* **Async GRPO window** (``max_age`` = NeMo RL's ``max_trajectory_age_steps``): with weights of version ``v``
  (``v`` steps trained) trajectories are produced for steps ``<= v + max_age``, as NeMo RL's trajectory
  collector does; so with ``max_age=1`` the next batch is generated while the current one waits or trains.
* **Training** of step ``s`` starts when batch ``s`` is complete (the first step: batch 1 too, where the start-up
  barrier applies) and the ACTOR_TRAINING request for the whole
  ``actor_train`` mapping is granted (the planner preempts overlapping rollout ranks, but those that fit beside the
  step by ``JobSpec.memory`` stay and keep producing, the pipeline's own included); it holds the GPUs for
  ``train_time_s + sync_time_s`` (train, build the CPU cache, refresh the active ranks, publish) and releases.
* **Synchronous** jobs (``sync=True``, the stock colocated baseline) roll out step ``s+1`` only after step ``s``
  trained: no overlap of rollout and training.
* **Initialisation**: an INITIALIZATION request for the training mapping held ``init_time_s``.
* A pipeline keeps a GENERATION request pending whenever it has open rollout work but no active rank (the
  "watchdog" re-request), reports progress every cycle as the NeMo RL adapter does (the trajectories of the batch
  its trainer waits for: none while a step trains, the next step's batch too before the first step where NeMo RL's
  start-up barrier applies, ``JobSpec.startup_lookahead``), and asks for a planned release (shrink to zero) once its
  last batch is complete.

The scheduler side runs ``plan_cycle`` (and ``validate_plan``) whenever a pipeline changed state and at least
every ``tick_s``, then executes the plan exactly like the scheduler actor: shrinks, expands, commit, grants.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from rlix_plugins.control.capacity.fairness import Fairness, fairness
from rlix_plugins.control.registration import pipeline_clusters, validate_spec
from rlix_plugins.control.scheduling.config import SchedulerConfig
from rlix_plugins.control.scheduling.gap_ratio import note_generation_waits
from rlix_plugins.control.scheduling.planner import note_preemptions, plan_cycle, validate_plan
from rlix_plugins.control.scheduling.turns import FAIR_TURN_STEPS, TurnLedger
from rlix_plugins.control.types import (
    Allocation,
    ClusterMemory,
    ClusterSpec,
    CyclePlan,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
    TraceEvent,
    cluster_id,
)
from rlix_plugins.errors import RlixError

EPS = 1e-6


@dataclass(frozen=True)
class JobSpec:
    """Phase durations of one async-GRPO pipeline (see the module docstring for the model)."""

    name: str
    train_gpus: int = 2
    tp: int = 1
    step_target: int = 512  #: trajectories per step
    traj_time_s: float = 30.0  #: decode time of one trajectory
    seqs_per_rank: int = 64  #: trajectories one DP rank decodes concurrently
    train_time_s: float = 60.0  #: training step (incl. log-probs) on ``train_gpus``
    sync_time_s: float = 6.0  #: CPU cache + active refresh + publish, before the training GPUs are released
    expand_time_s: float = 3.0  #: wake + weight sync of a woken rank
    init_time_s: float = 30.0
    steps: int = 10
    max_age: int = 1
    start_s: float = 0.0  #: admission time (staggered admission, as the reference launcher's admit delay)
    sync: bool = False  #: synchronous (colocated) GRPO: roll out step s+1 only after step s trained
    #: memory figures of (its rollout cluster, its training cluster), as ``rlix recipe`` writes ``rlix.memory``:
    #: with them the planner lets phases share a GPU where they fit (co-residence); None: whole-GPU turns
    memory: tuple[ClusterMemory, ClusterMemory] | None = None
    #: NeMo RL's start-up barrier (async GRPO at the pinned main, not v0.7.0): the first step trains only once the
    #: next step's batch is complete too (where ``max_age`` > 0 and the run has a next step)
    startup_lookahead: bool = True


@dataclass(frozen=True)
class Placement:
    train: tuple[int, ...]
    infer: tuple[int, ...]


@dataclass
class SimRun:
    makespan_s: float
    steps: int
    busy_gpu_s: float
    num_gpus: int
    finish_s: dict[str, float]
    cycles: int
    events: list[TraceEvent] = field(default_factory=list)

    @property
    def steps_per_hour(self) -> float:
        return self.steps / self.makespan_s * 3600.0 if self.makespan_s > 0 else 0.0

    @property
    def busy_share(self) -> float:
        return self.busy_gpu_s / (self.num_gpus * self.makespan_s) if self.makespan_s > 0 else 0.0

    def fairness(self) -> Fairness:
        """Steps another pipeline completed while one waited, and the longest wait (from the recorded events)."""
        return fairness(self.events)


@dataclass
class _Pipe:
    job: JobSpec
    pid: str
    train_cid: str
    infer_cid: str
    state: str = "new"  # new -> init -> run -> done
    collected: float = 0.0
    steps_started: int = 0
    steps_done: int = 0
    busy_until: float | None = None  # end of init or of the current training step
    release_asked: bool = False
    finished_at: float | None = None

    @property
    def total(self) -> float:
        return float(self.job.steps * self.job.step_target)

    def batches_for_next_step(self) -> int:
        """Batches complete before the trainer's next step (steps are numbered from 0): its own, and before the first
        step also the next one where the start-up barrier asks for it."""
        job = self.job
        barrier = job.startup_lookahead and not job.sync and job.max_age > 0 and job.steps > 1
        return self.steps_started + 1 + (1 if barrier and self.steps_started == 0 else 0)

    def progress_remaining(self) -> int:
        """What the NeMo RL adapter reports as left (``nemo_rl.loops``): trajectories of the batch the trainer waits
        for, none while a step trains (the collector meanwhile fills the next batch: work, but no trainer waits on
        it)."""
        if self.state == "run" and self.busy_until is not None:
            return 0
        missing = self.batches_for_next_step() * self.job.step_target - self.collected
        return min(max(math.ceil(missing - EPS), 0), self.job.step_target)

    def open_work(self) -> float:
        # NeMo RL's collector (trajectory_collector._calculate_target_weights): with weights of version v (= steps
        # trained) it produces batches for steps <= v + max_age. Synchronous GRPO only for step v.
        batches = self.steps_done + (1 if self.job.sync else self.job.max_age + 1)
        cap = min(batches, self.job.steps) * self.job.step_target
        return max(cap - self.collected, 0.0)


class Simulation:
    """One run of ``jobs`` placed on ``placements`` over a pool of ``num_gpus`` GPUs."""

    def __init__(
        self,
        jobs: list[JobSpec],
        placements: list[Placement],
        num_gpus: int,
        gpus_per_node: int,
        *,
        dt_s: float = 1.0,
        tick_s: float = 5.0,
        validate: bool = True,
        record: bool = True,
        max_time_s: float = 30 * 24 * 3600.0,
        fair_turn_steps: int = FAIR_TURN_STEPS,
        release_grace_s: float = SchedulerConfig.release_grace_s,
    ) -> None:
        self.dt, self.tick, self.validate, self.record, self.max_time = dt_s, tick_s, validate, record, max_time_s
        self.gpus = frozenset(range(num_gpus))
        self.gpus_per_node = gpus_per_node
        self.clusters: dict[str, ClusterSpec] = {}
        self.pipes: list[_Pipe] = []
        for job, pl in zip(jobs, placements, strict=True):
            pid = job.name
            specs = pipeline_clusters(pid, pl.train, pl.infer, job.tp)
            if job.memory is not None:
                specs = {cid: replace(sp, memory=job.memory[0] if sp.is_generation else job.memory[1])
                         for cid, sp in specs.items()}
            self.clusters.update(specs)
            self.pipes.append(_Pipe(job, pid, cluster_id(pid, "actor_train"), cluster_id(pid, "actor_infer")))
        # Registration-time check, as in the scheduler: cycles never re-check the (frozen) specs. Per spec only:
        # the baseline placements (static partition, one after another) train on GPUs their rollout does not use.
        for s in self.clusters.values():
            validate_spec(s, self.gpus, gpus_per_node)
        self.by_cluster = {p.train_cid: p for p in self.pipes} | {p.infer_cid: p for p in self.pipes}
        self.allocations: dict[str, Allocation] = {}
        self.pending: dict[str, PendingRequest] = {}
        self.planned: set[str] = set()
        self.warm_until: dict[tuple[str, int], float] = {}
        self.events: list[TraceEvent] = []
        self.seq = 0
        self.waiting_since: dict[str, int] = {}
        self.clock = itertools.count()
        self.slept_at: dict[str, int] = {}  # generation cluster -> when a grant last preempted a rank of it
        self.turns = TurnLedger(fair_turn_steps)
        self.now = 0.0
        self.release_grace_s = release_grace_s
        self.grace: dict[int, tuple[float, str]] = {}  # GPU -> (end of its grace window, releasing pipeline)
        self.cycles = 0
        self.busy = 0.0

    # ---- trace & requests ----------------------------------------------------------------------------
    def _trace(self, t: float, cid: str, op: str, gpus: tuple[int, ...], prio: int | None, detail: str = "") -> None:
        if self.record:
            pid = self.clusters[cid].pipeline_id if cid in self.clusters else cid
            self.events.append(TraceEvent(t, pid, cid, op, tuple(sorted(gpus)), prio, detail))

    def _request(self, cid: str, prio: Priority, estimate: int | None = None) -> None:
        self.seq += 1
        self.pending[cid] = PendingRequest(cid, prio, self.seq, step_target_estimate=estimate)

    def _release(self, t: float, cid: str) -> None:
        alloc = self.allocations.pop(cid)
        if alloc.priority == Priority.ACTOR_TRAINING:
            self.turns.step_done(self.clusters[cid].pipeline_id)
        if alloc.priority != Priority.GENERATION and self.release_grace_s > 0:
            for g in alloc.gpus:
                self.grace[g] = (t + self.release_grace_s, self.clusters[cid].pipeline_id)
        self._trace(t, cid, "release", tuple(alloc.gpus), int(alloc.priority))

    def _active_ranks(self, cid: str) -> frozenset[int]:
        a = self.allocations.get(cid)
        return a.active_dp_ranks if a is not None and a.priority == Priority.GENERATION else frozenset()

    # ---- pipeline side -------------------------------------------------------------------------------
    def _update(self, t: float, p: _Pipe) -> bool:
        """Advance ``p``'s state machine at time ``t``; True when anything the scheduler sees changed."""
        changed = False
        job = p.job
        if p.state == "new":
            if t < job.start_s - EPS:
                return False
            p.state = "init"
            if job.init_time_s > 0:
                self._request(p.train_cid, Priority.INITIALIZATION)
            else:
                p.busy_until = t
            changed = True
        if p.state == "init" and p.busy_until is not None and t >= p.busy_until - EPS:
            if p.train_cid in self.allocations:
                self._release(t, p.train_cid)
            p.state, p.busy_until, changed = "run", None, True
        if p.state != "run":
            return changed
        if p.busy_until is not None and t >= p.busy_until - EPS:
            self._release(t, p.train_cid)
            p.steps_done += 1
            p.busy_until, changed = None, True
        training = p.busy_until is not None or p.train_cid in self.pending
        if not training and p.steps_started < job.steps and p.collected >= p.batches_for_next_step() * job.step_target - EPS:
            self._request(p.train_cid, Priority.ACTOR_TRAINING)
            changed = True
        open_work = p.open_work()
        if open_work > EPS and not self._active_ranks(p.infer_cid) and p.infer_cid not in self.pending:
            self._request(p.infer_cid, Priority.GENERATION, estimate=job.step_target)
            changed = True
        if p.collected >= p.total - EPS and not p.release_asked:
            p.release_asked = True
            self.planned.add(p.infer_cid)
            changed = True
        if p.steps_done == job.steps and p.infer_cid not in self.planned and not self._active_ranks(p.infer_cid):
            p.state, p.finished_at, changed = "done", t, True
        return changed

    def _on_grant(self, t: float, p: _Pipe, prio: Priority) -> None:
        if prio == Priority.INITIALIZATION:
            p.busy_until = t + p.job.init_time_s
        elif prio == Priority.ACTOR_TRAINING:
            p.steps_started += 1
            p.busy_until = t + p.job.train_time_s + p.job.sync_time_s

    # ---- scheduler side ------------------------------------------------------------------------------
    def _snapshot(self) -> SchedulerSnapshot:
        progress = {}
        for p in self.pipes:
            if p.state in ("run", "init"):
                progress[p.pid] = Progress(p.pid, p.job.step_target, p.job.step_target - p.progress_remaining())
        snap = SchedulerSnapshot(
            gpus=self.gpus,
            gpus_per_node=self.gpus_per_node,
            clusters=self.clusters,
            allocations=dict(self.allocations),
            pending=tuple(sorted(self.pending.values(), key=lambda r: r.seq)),
            progress=progress,
            planned_releases=frozenset(self.planned),
        )
        note_generation_waits(self.waiting_since, snap, self.clock)  # as the scheduler does
        for pid, waiting in self.turns.note(snap):
            self._trace(self.now, cluster_id(pid, "actor_train"), "wait", (), None, "begin" if waiting else "end")
        owed = self.turns.owed(self.clusters)
        grace = frozenset(g for g, (until, pid) in self.grace.items() if until > self.now + EPS and pid not in owed)
        return replace(snap, generation_waiting_since=dict(self.waiting_since), turns_owed=owed,
                       release_grace_gpus=grace, rollout_slept_at=dict(self.slept_at))

    def _execute(self, t: float, plan: CyclePlan) -> None:
        """Shrinks -> expands -> commit -> grants and releases, like the scheduler actor."""
        for op in plan.shrinks:
            spec = self.clusters[op.cluster_id]
            for r in op.dp_ranks:
                self.warm_until.pop((op.cluster_id, r), None)
            gpus = tuple(sorted(spec.gpus_of(op.dp_ranks)))
            self._trace(t, op.cluster_id, "shrink", gpus, int(Priority.GENERATION), f"{op.reason} ranks={list(op.dp_ranks)}")
        for eop in plan.expands:
            spec = self.clusters[eop.cluster_id]
            for r in eop.dp_ranks:
                self.warm_until[(eop.cluster_id, r)] = t + self.by_cluster[eop.cluster_id].job.expand_time_s
            gpus = tuple(sorted(spec.gpus_of(eop.dp_ranks)))
            self._trace(t, eop.cluster_id, "expand", gpus, int(Priority.GENERATION), f"ranks={list(eop.dp_ranks)}")
        note_preemptions(self.slept_at, plan, self.clock)  # as the scheduler does
        self.allocations = dict(plan.allocations)
        for g in plan.grants:
            self.pending.pop(g.cluster_id, None)
            if g.priority != Priority.GENERATION:
                self._trace(t, g.cluster_id, "allocate", tuple(g.gpus), int(g.priority))
                self._on_grant(t, self.by_cluster[g.cluster_id], g.priority)
        for cid in plan.released:
            self.planned.discard(cid)
            self._trace(t, cid, "release", (), int(Priority.GENERATION), "planned")

    def _schedule(self, t: float) -> None:
        self.now = t
        for _ in range(8):
            snap = self._snapshot()
            plan = plan_cycle(snap)
            self.cycles += 1
            if self.validate:
                validate_plan(snap, plan)
            if plan.is_noop:
                return
            self._execute(t, plan)
            for p in self.pipes:
                self._update(t, p)

    # ---- rollout integration -------------------------------------------------------------------------
    def _produce(self, t: float, p: _Pipe) -> None:
        job = p.job
        open_work = p.open_work()
        if open_work <= EPS:
            return
        ranks = [r for r in self._active_ranks(p.infer_cid) if self.warm_until.get((p.infer_cid, r), 0.0) <= t + EPS]
        if not ranks:
            return
        slots = len(ranks) * job.seqs_per_rank
        in_flight = min(slots, open_work + job.seqs_per_rank / 4.0)
        produced = min(in_flight / job.traj_time_s * self.dt, open_work)
        p.collected += produced
        if p.open_work() < 1e-3:  # float dust
            p.collected += p.open_work()
        # useful rollout GPU-seconds: each trajectory occupies one decode slot of a rank for traj_time_s
        self.busy += produced * job.traj_time_s / job.seqs_per_rank * job.tp

    def run(self) -> SimRun:
        t, next_tick = 0.0, 0.0
        while True:
            changed = False
            for p in self.pipes:
                changed |= self._update(t, p)
            ended = [g for g, (until, _) in self.grace.items() if until <= t + EPS]
            for g in ended:  # the scheduler wakes when a grace window ends: its GPUs may go to rollout now
                del self.grace[g]
            if changed or ended or t >= next_tick - EPS:
                self._schedule(t)
                next_tick = t + self.tick
            if all(p.state == "done" for p in self.pipes):
                break
            if t > self.max_time:
                stuck = [f"{p.pid}: {p.state}, step {p.steps_done}/{p.job.steps}" for p in self.pipes if p.state != "done"]
                raise RlixError(f"simulation made no progress within {self.max_time:.0f} s: {stuck}")
            for p in self.pipes:
                self._produce(t, p)
                if p.busy_until is not None and p.state == "run":
                    self.busy += len(self.clusters[p.train_cid].device_mapping) * self.dt
            t += self.dt
        for p in self.pipes:
            for cid in (p.train_cid, p.infer_cid):
                if cid in self.allocations:
                    self._release(t, cid)
        return SimRun(
            makespan_s=t,
            steps=sum(p.steps_done for p in self.pipes),
            busy_gpu_s=self.busy,
            num_gpus=len(self.gpus),
            finish_s={p.pid: float(p.finished_at or t) for p in self.pipes},
            cycles=self.cycles,
            events=self.events,
        )
