"""The three seams a host implements for the pipeline runtime (NeMo RL adapters, the demo host, tests).

All three are **picklable handles** (plain objects holding Ray actor handles): the runtime ships them to its
resize-handler actor, which calls them from another process. Every method blocks, and is bounded by the
``timeout_s`` it gets; errors are raised (typed rlix errors preferred), never swallowed.

* :class:`RolloutFleet` - the vLLM DP ranks of one pipeline, addressed by DP rank (NeMo RL: VllmGeneration's
  DP-leader Ray workers; demo: one engine actor per rank).
* :class:`WeightSource` - the training side that owns the CPU bucket cache (NeMo RL: the rank-0 Megatron
  or DTensor policy worker; demo: the trainer actor). ``sync`` runs ``rlix_plugins.vllm.driver.sync_engines`` in the owner's
  process, where the cache lives; the fleet's ``engine_rpc`` handles travel there.
* :class:`VersionPublisher` - whatever collects trajectories (NeMo RL: AsyncTrajectoryCollector; demo: its
  collector actor).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlix_plugins.errors import RlixError

__all__ = ["RolloutFleet", "ShardPreemptedError", "SyncResult", "VersionPublisher", "WeightSource"]


class ShardPreemptedError(RlixError):
    """A request was aborted because a shrink took its DP rank; the router retries it on another active rank."""

    def __init__(self, dp_rank: int, detail: str = "") -> None:
        super().__init__(f"dp rank {dp_rank} was preempted (shrunk) while serving the request{': ' + detail if detail else ''}")
        self.dp_rank = dp_rank


@runtime_checkable
class RolloutFleet(Protocol):
    """The pipeline's inference DP ranks. Methods taking several ranks act on them concurrently."""

    def dp_ranks(self) -> list[int]:
        """All DP ranks of the fleet (0..dp-1)."""
        ...

    def devices(self, dp_rank: int) -> list[tuple[int, int]]:
        """``(node, gpu)`` of each worker of the rank, in local (TP) rank order: the comm plan's targets."""
        ...

    def engine_rpc(self, dp_rank: int) -> Any:
        """A picklable ``rlix_plugins.vllm.driver.EngineRpc`` reaching the rank's engine (for ``sync_engines``)."""
        ...

    def abort(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int] | None:
        """Abort every in-flight request on the ranks; the aborted callers must return (not hang until the
        drain times out). Returns how many requests each rank's engine held (None where the fleet cannot count
        them)."""
        ...

    def sleep(self, dp_ranks: list[int], level: int, timeout_s: float) -> None:
        """Put the ranks to sleep at ``level`` (vLLM ``sleep``); idempotent."""
        ...

    def wake_up(self, dp_ranks: list[int], tags: list[str] | None, timeout_s: float) -> None:
        """Wake the ranks (vLLM ``wake_up(tags)``); idempotent."""
        ...

    def memory_in_use(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int | None]:
        """Device bytes each rank holds now on the one of its GPUs where it holds the most; None where not
        measurable (vLLM-CPU, where sleep is a no-op)."""
        ...


@dataclass(frozen=True)
class SyncResult:
    """One weight sync from the cache to some DP ranks (picklable)."""

    version: int
    dp_ranks: tuple[int, ...]
    seconds: float
    #: checksums verified per rank (parameters compared); empty when verification was off
    verified_params: dict[int, int] = field(default_factory=dict)
    payload_bytes: int = 0
    ipc_dp_ranks: tuple[int, ...] = ()
    broadcast_dp_ranks: tuple[int, ...] = ()
    #: workers per rank (its vLLM TP workers) whose own checks passed; empty when verification was off
    verified_workers: dict[int, int] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return bool(self.dp_ranks) and all(self.verified_params.get(r, 0) > 0 for r in self.dp_ranks)

    @classmethod
    def of_report(cls, report: Any, dp_ranks: Iterable[int], seconds: float) -> SyncResult:
        """From ``vllm.driver.sync_engines``' report: a rank counts the parameters its least-verified worker
        checked (every TP worker verifies what it received), and the workers that verified any."""
        per_rank = report.verified  # dp rank -> each worker's verify_model result, in TP-rank order
        params = {dp: min(int(w.get("received", 0)) for w in per) if per else 0 for dp, per in per_rank.items()}
        workers = {dp: sum(1 for w in per if int(w.get("received", 0)) > 0) for dp, per in per_rank.items()}
        t = report.transport
        return cls(version=t.version, dp_ranks=tuple(sorted(dp_ranks)), seconds=seconds, verified_params=params,
                   payload_bytes=t.payload_bytes, ipc_dp_ranks=t.ipc_dp_ranks,
                   broadcast_dp_ranks=t.broadcast_dp_ranks, verified_workers=workers)


@runtime_checkable
class WeightSource(Protocol):
    """The cache owner (and its peers). Both methods are remote calls, bounded by ``timeout_s``."""

    def build_cache(self, version: int, timeout_s: float) -> int:
        """Build the CPU bucket cache ``version`` from the trainer's current named tensors.

        Every training rank iterates (collectives inside); only the owner keeps buckets. Must run while the
        parameters are on the device (before any offload: offloaded parameters read as empty storage). Returns the
        published version.
        """
        ...

    def sync(self, targets: dict[int, tuple[Any, list[tuple[int, int]]]], timeout_s: float, verify: bool,
             wake_tags: list[str] | None = None) -> SyncResult:
        """Push the cache's version to ``targets`` (dp rank -> (EngineRpc, devices)), finalize them once each and
        verify checksums; raise on any failure (nothing is finalized then). ``wake_tags``: vLLM sleep tags to wake on
        every target while the bytes move (``sync_engines(wake_tags=...)``; woken on failure too)."""
        ...


@runtime_checkable
class VersionPublisher(Protocol):
    """Tells the trajectory collector which weight version generation now uses."""

    def set_weight_version(self, version: int, timeout_s: float) -> None: ...

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the collector answers: the first expand publishes to it, and must not hold the GPU while the
        collector's actor is still starting."""
        ...
