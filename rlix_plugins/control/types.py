"""Control-plane records shared by the planner (pure), the scheduler actor, the simulator and the CLI.

Everything here is plain Python (no Ray, no torch) and frozen, so a snapshot can be handed to the planner,
hashed, compared in property tests and pickled across Ray without surprises.

Vocabulary
----------
* A **pipeline** is one training run (``pipeline_id`` like ``ft_0123456789ab``; never contains ``:``).
* A **cluster** is one role of a pipeline that needs GPUs: ``actor_train`` (Megatron/DTensor workers, one GPU
  each, ``tp_size=1``) or ``actor_infer`` (vLLM, ``tp_size = vllm TP``), ... Its id is
  ``f"{pipeline_id}_{cluster_name}"`` and is parsed by suffix only.
* A cluster's **device mapping** is the ordered tuple of GPU ids it may use. It is cut into **bundles** of
  ``tp_size`` consecutive entries; bundle ``i`` is **DP rank** ``i``. A generation cluster is granted GPUs one
  bundle (DP rank) at a time; every other cluster gets its whole mapping or nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final


class Priority(enum.IntEnum):
    """Lower value wins. GENERATION is the only preemptable, partially-grantable priority."""

    INITIALIZATION = 0
    ACTOR_TRAINING = 1
    CRITIC_TRAINING = 2
    OLD_LOG_PROBS = 3
    REF_LOG_PROBS = 4
    VALUE_COMPUTE = 5
    GENERATION = 6


#: Cluster names a pipeline may register, with whether they are generation (vLLM) clusters.
CLUSTER_NAMES: Final[dict[str, bool]] = {
    "actor_train": False,
    "actor_infer": True,
    "critic": False,
    "reference": False,
}
GENERATION_CLUSTER: Final = "actor_infer"
TRAIN_CLUSTER: Final = "actor_train"

#: Namespace of the singleton actors (orchestrator, scheduler).
RLIX_NAMESPACE: Final = "rlix"
ORCHESTRATOR_NAME: Final = "rlix:orchestrator"
SCHEDULER_NAME: Final = "rlix:scheduler"


def pipeline_namespace(pipeline_id: str) -> str:
    """Ray namespace of a pipeline's own actors (coordinator, pipeline-side helpers)."""
    return f"pipeline_{pipeline_id}_NS"


def coordinator_name(pipeline_id: str) -> str:
    return f"rlix:coordinator:{pipeline_id}"


def cluster_id(pipeline_id: str, cluster_name: str) -> str:
    return f"{pipeline_id}_{cluster_name}"


def parse_cluster_id(cid: str) -> tuple[str, str]:
    """Split ``<pipeline>_<cluster_name>`` by known suffix. Raises ValueError for an unknown suffix."""
    for name in CLUSTER_NAMES:
        suffix = "_" + name
        if cid.endswith(suffix) and len(cid) > len(suffix):
            return cid[: -len(suffix)], name
    raise ValueError(
        f"cluster id {cid!r} does not end with a known cluster name; expected '<pipeline>_<name>' with "
        f"name in {sorted(CLUSTER_NAMES)}"
    )


@dataclass(frozen=True)
class ClusterMemory:
    """What one cluster keeps on each GPU of its mapping (GiB), for co-residence (``scheduling.coresidence``).

    ``awake_gib``: its largest footprint while it holds the GPU (a vLLM engine awake; a training step), everything it
    keeps there included; ``asleep_gib``: what it keeps there while it does not (a slept engine's or an offloaded
    trainer's context and leftovers); ``gpu_gib``: the memory its pipeline may plan for on that GPU.
    """

    gpu_gib: float
    awake_gib: float
    asleep_gib: float


@dataclass(frozen=True)
class ClusterSpec:
    """One registered cluster of a pipeline."""

    cluster_id: str
    pipeline_id: str
    name: str  #: one of CLUSTER_NAMES
    device_mapping: tuple[int, ...]  #: GPU ids, canonical (sorted) order
    tp_size: int  #: GPUs per bundle (DP rank); 1 for training clusters
    #: Memory figures; None: unknown, so nothing runs next to this cluster on a GPU (exclusive turns only).
    memory: ClusterMemory | None = None

    @property
    def is_generation(self) -> bool:
        return CLUSTER_NAMES[self.name]

    @property
    def num_dp_ranks(self) -> int:
        return len(self.device_mapping) // self.tp_size

    def bundle(self, dp_rank: int) -> tuple[int, ...]:
        """GPU ids of DP rank ``dp_rank``."""
        start = dp_rank * self.tp_size
        return self.device_mapping[start : start + self.tp_size]

    def gpus_of(self, dp_ranks: Iterable[int]) -> frozenset[int]:
        """GPU ids of the bundles of ``dp_ranks`` (the one place that maps a set of DP ranks to GPUs)."""
        m, tp = self.device_mapping, self.tp_size
        if tp == 1:
            return frozenset(m[r] for r in dp_ranks)
        return frozenset(g for r in dp_ranks for g in m[r * tp : (r + 1) * tp])


@dataclass(frozen=True)
class Allocation:
    """GPUs a cluster currently holds. For generation clusters ``active_dp_ranks`` says which bundles.

    A GPU is held by at most one non-GENERATION allocation and at most one GENERATION rank; both only when that
    rank co-resides with another pipeline's training-type work (``scheduling.coresidence``)."""

    cluster_id: str
    priority: Priority
    gpus: frozenset[int]
    active_dp_ranks: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PendingRequest:
    """A blocked ``request_gpus`` call. ``seq`` gives FIFO order within a priority."""

    cluster_id: str
    priority: Priority
    seq: int
    step: int | None = None
    step_target_estimate: int | None = None  #: GENERATION only: trajectories the step needs (>= 1)


@dataclass(frozen=True)
class Progress:
    """Aggregated rollout progress of one pipeline for its current step.

    ``completed`` is already clamped to ``step_target`` by the coordinator (raw ``collected`` may overshoot).
    """

    pipeline_id: str
    step_target: int
    completed: int
    step: int | None = None

    @property
    def remaining(self) -> int:
        return max(self.step_target - min(self.completed, self.step_target), 0)


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Everything the planner needs, nothing it may mutate."""

    gpus: frozenset[int]  #: every GPU of the pool
    gpus_per_node: int  #: GPU ``g`` is on node ``g // gpus_per_node``
    clusters: dict[str, ClusterSpec]  #: by cluster id (registered and admitted pipelines only)
    allocations: dict[str, Allocation]  #: by cluster id
    pending: tuple[PendingRequest, ...] = ()
    progress: dict[str, Progress] = field(default_factory=dict)  #: by pipeline id
    planned_releases: frozenset[str] = frozenset()  #: generation cluster ids to shrink to zero now
    #: Idle GPUs a non-generation cluster released moments ago. Rollout ranks are not woken on them yet (the
    #: releasing pipeline usually asks again within a second, e.g. back-to-back async steps; lending them would
    #: cost a wake + weight sync + shrink for nothing). Non-generation requests may take them at once.
    release_grace_gpus: frozenset[int] = frozenset()
    #: GPUs a failed pipeline held whose processes may still hold their memory (``scheduling.fences``): no
    #: allocation newly takes them (holders keep them); a request that needs one waits.
    fenced_gpus: frozenset[int] = frozenset()
    #: Generation clusters that want rollout and have no active rank -> when they started waiting (a logical
    #: clock: smaller = waiting longer; ``scheduling.gap_ratio.note_generation_waits`` keeps it). When bundles are too few
    #: for every waiting cluster (two pipelines on one GPU) the longest waiter is woken first, so co-tenants take
    #: turns. Absent clusters count as waiting longest; an empty map leaves the pipeline-id order.
    generation_waiting_since: dict[str, int] = field(default_factory=dict)
    #: Fair turns (``scheduling.turns``): pipeline id -> the waiting pipelines it owes a turn (it completed
    #: ``fair_turn_steps`` training steps while they waited with work on a GPU it shares). Such a pipeline gets no
    #: training-type grant on GPUs they could use, and they may take its last rollout rank.
    turns_owed: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Expands in flight (the scheduler launched them in an earlier cycle and they have not returned): generation
    #: cluster -> its DP ranks being woken. Those ranks are in ``allocations`` (their GPUs are taken), but the
    #: cluster's coordinator is busy: none of its ranks is shrunk (preempted, rebalanced, released) and no GENERATION
    #: request of it is granted until the expand returns (the return starts a cycle).
    expanding: dict[str, frozenset[int]] = field(default_factory=dict)
    #: Generation clusters -> when a training-type grant last put one of their ranks to sleep (a logical clock:
    #: larger = more recent; absent: never). Where not every rollout rank fits beside a grant, the ranks slept most
    #: recently stay first, so the ranks that must sleep take turns (``planner._preemptions``).
    rollout_slept_at: dict[str, int] = field(default_factory=dict)

    @property
    def idle_gpus(self) -> frozenset[int]:
        used: set[int] = set()
        for alloc in self.allocations.values():
            used |= alloc.gpus
        return self.gpus - used


@dataclass(frozen=True)
class ShrinkOp:
    """Put DP ranks of a generation cluster to sleep (remove from routing → abort → drain → sleep)."""

    cluster_id: str
    dp_ranks: tuple[int, ...]
    reason: str  #: "preempt" (for a higher priority), "rebalance" (gap ratio) or "release" (planned)


@dataclass(frozen=True)
class ExpandOp:
    """Wake DP ranks of a generation cluster (wake → sync weights → finalize → publish version → route)."""

    cluster_id: str
    dp_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Grant:
    """A pending request that this cycle satisfies; its waiter is signalled after all resize calls returned."""

    cluster_id: str
    priority: Priority
    seq: int
    gpus: frozenset[int]


@dataclass(frozen=True)
class CyclePlan:
    """What one scheduling cycle decided. Executed as: all shrinks → training-type grants → all expands → commit →
    GENERATION grants."""

    shrinks: tuple[ShrinkOp, ...] = ()
    expands: tuple[ExpandOp, ...] = ()
    grants: tuple[Grant, ...] = ()
    allocations: dict[str, Allocation] = field(default_factory=dict)  #: the complete allocation table after
    released: frozenset[str] = frozenset()  #: planned releases completed by this plan

    @property
    def is_noop(self) -> bool:
        return not (self.shrinks or self.expands or self.grants or self.released)


@dataclass(frozen=True)
class TraceEvent:
    """One recorded decision or state change, rendered by ``rlix timeline``."""

    time: float  #: seconds since the epoch
    pipeline_id: str
    cluster_id: str
    op: str  #: "allocate", "release", "shrink", "expand", "register", "unregister", "fail", ...
    gpus: tuple[int, ...]
    priority: int | None = None
    detail: str = ""
