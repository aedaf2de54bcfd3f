"""Liveness of the real planner: any number of pipelines on any number of GPUs always makes progress.

A small state machine of pipelines shaped like the demo host and NeMo RL's async GRPO loop drives
``plan_cycle`` (and ``validate_plan``) tick by tick and executes each plan as the scheduler does (commit,
then signal grants):

    INITIALIZATION(train) -> INITIALIZATION(infer) -> GENERATION (blocks until >= 1 rank: attach)
    -> [start-up barrier: nobody trains before every pipeline attached] -> per step: roll out the batch
    (ranks produce; the collector may run one step ahead; progress = the current step's batch) ->
    ACTOR_TRAINING -> release -> ... -> planned release of the rollout ranks.

A pipeline without an active rank keeps a GENERATION request pending (the runtime's watchdog). A tick in which
nothing moves (no grant, no resize, no phase change, no trajectory, no timer running) while some pipeline is not
done is a deadlock: every pipeline waits on another. Issue 17 was exactly that with 3 pipelines on 2 GPUs: two
idle pipelines (batch complete, waiting at the barrier) each kept the last rollout rank the third one needed to
attach.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_plugins.control.scheduling.planner import plan_cycle, validate_cluster_specs, validate_plan
from rlix_plugins.control.types import (
    Allocation,
    ClusterSpec,
    PendingRequest,
    Priority,
    Progress,
    SchedulerSnapshot,
)

MAX_TICKS = 3000


@dataclass
class _Pipe:
    pid: str
    steps: int
    batch: int  #: trajectories per step
    hold: int  #: ticks an INITIALIZATION or training grant is held
    phase: str = "init_train"  # init_train, init_infer, attach, barrier, run, release, done
    collected: int = 0
    trained: int = 0
    timer: int | None = None  #: ticks left on the held non-generation grant
    progress_reported: bool = False

    @property
    def train(self) -> str:
        return f"{self.pid}_actor_train"

    @property
    def infer(self) -> str:
        return f"{self.pid}_actor_infer"

    def window_left(self) -> int:
        """Trajectories the collector may still produce (one step ahead of the trained weights)."""
        return max(min(self.trained + 2, self.steps) * self.batch - self.collected, 0)

    def current_done(self) -> int:
        return min(max(self.collected - self.trained * self.batch, 0), self.batch)


@dataclass
class _World:
    clusters: dict[str, ClusterSpec]
    pipes: list[_Pipe]
    barrier: bool
    gpus: frozenset[int]
    allocations: dict[str, Allocation] = field(default_factory=dict)
    pending: dict[str, PendingRequest] = field(default_factory=dict)
    planned: set[str] = field(default_factory=set)
    seq: int = 0

    def request(self, cid: str, prio: Priority, estimate: int | None = None) -> None:
        if cid not in self.pending:
            self.seq += 1
            self.pending[cid] = PendingRequest(cid, prio, self.seq, step_target_estimate=estimate)

    def active(self, cid: str) -> int:
        a = self.allocations.get(cid)
        return len(a.active_dp_ranks) if a is not None and a.priority == Priority.GENERATION else 0

    def snapshot(self) -> SchedulerSnapshot:
        progress = {
            p.pid: Progress(p.pid, p.batch, p.current_done(), p.trained)
            for p in self.pipes if p.progress_reported and p.phase not in ("release", "done")
        }
        return SchedulerSnapshot(self.gpus, 8, self.clusters, dict(self.allocations),
                                 tuple(sorted(self.pending.values(), key=lambda r: r.seq)), progress,
                                 frozenset(self.planned))

    def pipeline_tick(self, p: _Pipe) -> bool:
        """Advance ``p`` by one tick; True when anything moved."""
        moved = False
        if p.timer is not None:
            p.timer -= 1
            moved = True
            if p.timer == 0:
                p.timer = None
                del self.allocations[p.infer if p.phase == "init_infer" else p.train]
                if p.phase == "init_train":
                    p.phase = "init_infer"
                elif p.phase == "init_infer":
                    p.phase = "attach"
                else:
                    p.trained += 1
        if p.timer is not None and p.phase.startswith("init"):
            return moved
        if p.phase == "init_train":
            self.request(p.train, Priority.INITIALIZATION)
        elif p.phase == "init_infer":
            self.request(p.infer, Priority.INITIALIZATION)
        elif p.phase == "attach":
            self.request(p.infer, Priority.GENERATION, estimate=1)
        elif p.phase == "barrier" and (not self.barrier or all(q.phase not in ("init_train", "init_infer", "attach")
                                                                for q in self.pipes)):
            p.phase, moved = "run", True
        if p.phase in ("barrier", "run"):
            ranks = self.active(p.infer)
            made = min(ranks, p.window_left())  # one trajectory per active rank and tick
            if made:
                p.collected += made
                moved = True
            if not ranks and p.window_left():
                self.request(p.infer, Priority.GENERATION, estimate=1)  # the runtime's watchdog
        if p.phase == "run" and p.timer is None:
            if p.trained == p.steps:
                p.phase, moved = "release", True
                self.pending.pop(p.infer, None)  # await_release drops a waiting GENERATION request
                self.planned.add(p.infer)
            elif p.current_done() == p.batch:
                self.request(p.train, Priority.ACTOR_TRAINING)
        if p.phase == "release" and p.infer not in self.planned:
            p.phase, moved = "done", True
        return moved

    def schedule(self) -> bool:
        snap = self.snapshot()
        plan = plan_cycle(snap)
        validate_plan(snap, plan)
        self.allocations = dict(plan.allocations)
        by_cluster = {q.train: q for q in self.pipes} | {q.infer: q for q in self.pipes}
        for g in plan.grants:
            self.pending.pop(g.cluster_id, None)
            p = by_cluster[g.cluster_id]
            if g.priority == Priority.GENERATION:
                if p.phase == "attach":
                    p.phase, p.progress_reported = "barrier", True
            else:
                p.timer = p.hold
        self.planned -= plan.released
        return bool(plan.shrinks or plan.expands or plan.grants or plan.released)


@st.composite
def worlds(draw: st.DrawFn) -> _World:
    n_gpus = draw(st.integers(1, 5))
    tp = draw(st.sampled_from([1, 2])) if n_gpus >= 2 else 1
    infer = tuple(range(n_gpus - n_gpus % tp))
    clusters: dict[str, ClusterSpec] = {}
    pipes = []
    for i in range(draw(st.integers(1, 6))):
        pid = f"p{i}"
        train = draw(st.lists(st.sampled_from(infer), min_size=1, max_size=min(2, len(infer)), unique=True))
        clusters[f"{pid}_actor_train"] = ClusterSpec(f"{pid}_actor_train", pid, "actor_train", tuple(sorted(train)), 1)
        clusters[f"{pid}_actor_infer"] = ClusterSpec(f"{pid}_actor_infer", pid, "actor_infer", infer, tp)
        pipes.append(_Pipe(pid, steps=draw(st.integers(1, 3)), batch=draw(st.integers(1, 4)), hold=draw(st.integers(1, 3))))
    gpus = frozenset(range(n_gpus))
    validate_cluster_specs(clusters.values(), gpus, 8)
    return _World(clusters, pipes, barrier=draw(st.booleans()), gpus=gpus)


def _run(world: _World) -> int:
    for tick in range(MAX_TICKS):
        moved = False
        for p in world.pipes:
            moved |= world.pipeline_tick(p)
        moved |= world.schedule()
        if all(p.phase == "done" for p in world.pipes):
            return tick
        state = {p.pid: (p.phase, p.collected, p.trained) for p in world.pipes}
        assert moved, (
            f"deadlock at tick {tick}: every pipeline waits on another; pipelines {state}, allocations "
            f"{ {c: sorted(a.gpus) for c, a in world.allocations.items()} }, pending {sorted(world.pending)}"
        )
    raise AssertionError(f"not every pipeline finished within {MAX_TICKS} ticks (starvation)")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_any_pipelines_on_any_gpus_always_make_progress(world: _World) -> None:
    _run(world)


def test_three_pipelines_two_gpus_with_start_up_barrier_finish() -> None:
    """Issue 17's demo: p0, p1 finished their first batch and wait at the barrier, each holding one of the two
    rollout GPUs; p2 needs one rank to attach. The idle pipelines' last ranks must go to p2."""
    clusters: dict[str, ClusterSpec] = {}
    pipes = []
    for i, train in enumerate((0, 1, 0)):
        pid = f"p{i}"
        clusters[f"{pid}_actor_train"] = ClusterSpec(f"{pid}_actor_train", pid, "actor_train", (train,), 1)
        clusters[f"{pid}_actor_infer"] = ClusterSpec(f"{pid}_actor_infer", pid, "actor_infer", (0, 1), 1)
        pipes.append(_Pipe(pid, steps=2, batch=4, hold=3))
    _run(_World(clusters, pipes, barrier=True, gpus=frozenset({0, 1})))
