"""The pipeline's resize handler: a Ray actor the coordinator calls for every shrink and expand.

Registered with ``PipelineHandle.set_resize_handler``; the scheduler reaches it only through the pipeline's
coordinator (which holds the resize lock around each call and signals grants after it returned).

* **shrink** ``resize_infer(remove, [])``: remove from routing → abort in-flight requests → drain → sleep
  (configured level) → measure the rank's device memory after the sleep and check it is below
  ``RuntimeConfig.post_sleep_limit`` of its TP size (where measurable; recorded as ``memory_after``).
* **expand** ``resize_infer([], add)``: wake the weights → sync them from the CPU cache while the KV cache wakes
  (``WeightSource.sync(wake_tags=["kv_cache"])``: buckets →
  finalize once per target rank → verify checksums) → publish the CURRENT version (no bump) → activate routing.
  Atomic: if any step before activation fails the ranks are NOT routed to; they are put back to sleep (best
  effort), marked dirty, and the error propagates so the scheduler fails this pipeline only.
* **refresh** ``refresh_active()``: the in-flight refresh of the still-active ranks after a training step (no
  drain; called by the runtime while it holds the coordinator's resize lock, so no expand or shrink interleaves).
  If it fails, its ranks are unrouted and marked dirty before the error propagates.

Lifetime: created by the pipeline's driver (owned by it, dies with it). Threaded (``max_concurrency`` 4) so
``history``/``ping`` answer during a long sync; resizes themselves are serialised by ``_op_lock`` (bounded wait).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Final

from rlix_plugins.control.rpc import ray_get
from rlix_plugins.control.timeouts import ROLLOUT_RPC_TIMEOUT_S
from rlix_plugins.errors import RlixError, RlixTimeoutError, SchedulerError, WeightVerificationError
from rlix_plugins.pipeline.config import RuntimeConfig
from rlix_plugins.pipeline.protocols import RolloutFleet, SyncResult, VersionPublisher, WeightSource
from rlix_plugins.pipeline.versions import VersionLedger, published_version
from rlix_plugins.transport import wait_all

__all__ = ["FleetResizer", "resizer_name"]

#: A shrink re-aborts its ranks this often while their tickets are still out (see ``_abort_and_drain``).
ABORT_REPEAT_S: Final = 1.0


def resizer_name(pipeline_id: str) -> str:
    return f"rlix:resizer:{pipeline_id}"


class FleetResizer:
    """See the module docstring. Construct through ``PipelineRuntime`` (it names and places the actor)."""

    def __init__(self, pipeline_id: str, fleet: RolloutFleet, weights: WeightSource, router: Any,
                 config: RuntimeConfig) -> None:
        self._pid = pipeline_id
        self._fleet = fleet
        self._weights = weights
        self._router = router
        self._cfg = config
        self._publisher: VersionPublisher | None = None
        self._versions = VersionLedger()  # read-only here: the ledger the runtime sent last (set_versions)
        self._op_lock = threading.Lock()
        self._state = threading.Lock()
        self._dirty: set[int] = set()
        self._history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ wiring
    def ping(self) -> str:
        return "ok"

    def set_publisher(self, publisher: VersionPublisher) -> None:
        self._publisher = publisher

    def set_versions(self, versions: VersionLedger) -> None:
        """The runtime's ledger after it changed (collector attached; after a step, inside the resize lock): every
        later expand publishes its ``published`` version."""
        with self._state:
            self._versions = versions

    def history(self, since: int = 0) -> list[dict[str, Any]]:
        with self._state:
            return list(self._history[since:])

    def dirty(self) -> list[int]:
        with self._state:
            return sorted(self._dirty)

    def _record(self, **event: Any) -> dict[str, Any]:
        event.setdefault("time", time.time())
        with self._state:
            self._history.append(event)
        return event

    def _router_call(self, method: str, *args: Any, timeout_s: float = ROLLOUT_RPC_TIMEOUT_S) -> Any:
        return ray_get(getattr(self._router, method).remote(*args), f"pipeline {self._pid}: router.{method}",
                       timeout_s, dead="the router actor is dead; the pipeline ended or crashed")

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Serialise resizes/refreshes; a stuck earlier operation fails this one instead of piling up threads."""
        wait_s = self._cfg.sync_timeout_s + self._cfg.drain_timeout_s
        if not self._op_lock.acquire(timeout=wait_s):
            raise RlixTimeoutError(f"pipeline {self._pid}: {what} waited {wait_s:.0f} s for the previous resize or "
                                   "refresh to finish (a stuck weight sync or drain?)")
        try:
            yield
        finally:
            self._op_lock.release()

    # ------------------------------------------------------------------ scheduler entry point
    def resize_infer(self, dp_ranks_to_remove: list[int], dp_ranks_to_add: list[int]) -> None:
        if bool(dp_ranks_to_remove) == bool(dp_ranks_to_add):
            raise SchedulerError(
                f"resize_infer(remove={dp_ranks_to_remove}, add={dp_ranks_to_add}): exactly one list must be non-empty"
            )
        with self._exclusive("resize_infer"):
            if dp_ranks_to_remove:
                self._shrink(sorted(dp_ranks_to_remove), reason="scheduler")
            else:
                self._expand(sorted(dp_ranks_to_add))

    # ------------------------------------------------------------------ shrink
    def _abort_and_drain(self, ranks: list[int]) -> dict[int, int] | None:
        """Abort, then wait for the router's tickets on ``ranks``; abort again every ``ABORT_REPEAT_S`` until they
        are back or ``drain_timeout_s`` is spent. Again, because a request that took its ticket just before the
        deactivation can reach the engine just after an abort: it would otherwise run to its full length. Returns
        the first abort's per-rank count of requests the engines held. The timeout error says which side kept
        them: requests still in the engine, or an engine that holds none while tickets are out (the caller's
        process did not return them: a blocked event loop, or a request that never reached the engine)."""
        cfg = self._cfg
        deadline = time.monotonic() + cfg.drain_timeout_s
        first: dict[int, int] | None = None
        while True:
            held = self._fleet.abort(ranks, cfg.drain_timeout_s)
            first = held if first is None else first
            wait_s = min(ABORT_REPEAT_S, max(deadline - time.monotonic(), 0.0))
            try:
                self._router_call("wait_drained", ranks, wait_s, timeout_s=wait_s + ROLLOUT_RPC_TIMEOUT_S)
                return first
            except RlixTimeoutError:
                if time.monotonic() < deadline:
                    continue
                out = self._router_call("stats")["in_flight"]
                where = ("the engines held no request at the last abort: the callers did not return their tickets "
                         "(their process is blocked, or the requests never reached the engine)"
                         if held is not None and not any(held.values()) else
                         f"the engines still held {held} request(s) at the last abort: vLLM did not finish them"
                         if held is not None else "this fleet cannot count the engines' requests")
                raise RlixTimeoutError(
                    f"dp ranks did not drain within {cfg.drain_timeout_s:.0f} s, router tickets still out: "
                    f"{ {r: out[r] for r in ranks if out.get(r)} }; the first abort found {first}; {where}") from None

    def _shrink(self, ranks: list[int], reason: str) -> dict[str, Any]:
        cfg = self._cfg
        t0 = time.perf_counter()
        self._router_call("deactivate", ranks)
        t_route = time.perf_counter()
        aborted = self._abort_and_drain(ranks)
        t_drain = time.perf_counter()
        self._fleet.sleep(ranks, cfg.sleep_level, cfg.drain_timeout_s)
        t_sleep = time.perf_counter()
        # Only AFTER the sleep: it is what the next tenant gets (checked below, reported per shrink). A probe
        # before the sleep would only feed the history, on the critical path of every preemption.
        after = self._fleet.memory_in_use(ranks, cfg.drain_timeout_s)
        event = self._record(op="shrink", ranks=ranks, reason=reason, seconds=t_sleep - t0, aborted=aborted,
                             drain_s=t_drain - t_route, sleep_s=t_sleep - t_drain, level=cfg.sleep_level,
                             memory_after=after, memory_s=time.perf_counter() - t_sleep)
        limits = {r: cfg.post_sleep_limit(len(self._fleet.devices(r))) for r in after}
        high = {r: b for r, b in after.items() if b is not None and (lim := limits[r]) is not None and b > lim}
        if high:
            raise RlixError(
                f"pipeline {self._pid}: dp ranks {sorted(high)} still hold {high} bytes on a GPU after sleep(level="
                f"{cfg.sleep_level}) (limit { {r: limits[r] for r in high} }: RuntimeConfig.post_sleep_max_bytes, "
                "plus pipeline.config.TP_COMMUNICATOR_BYTES for a rank of TP > 1): the GPU is not free for the next "
                "tenant; check enable_sleep_mode and that no request was left running. The rank's workers log what "
                "live tensors they still hold after each sleep ('after sleep: ... in live tensors'); where that is what "
                "the engine keeps by design, raise the limit (rlix.post_sleep_max_bytes, in bytes)"
            )
        return event

    # ------------------------------------------------------------------ expand
    def _targets(self, ranks: list[int]) -> dict[int, tuple[Any, list[tuple[int, int]]]]:
        return {r: (self._fleet.engine_rpc(r), self._fleet.devices(r)) for r in ranks}

    def _sync(self, ranks: list[int], wake_tags: list[str] | None = None) -> SyncResult:
        result = self._weights.sync(self._targets(ranks), self._cfg.sync_timeout_s, self._cfg.verify, wake_tags)
        if sorted(result.dp_ranks) != sorted(ranks):
            raise RlixError(f"pipeline {self._pid}: weight sync covered ranks {list(result.dp_ranks)}, asked {ranks}")
        if self._cfg.verify and not result.verified:
            raise WeightVerificationError(
                f"pipeline {self._pid}: sync of version {result.version} to ranks {ranks} was not verified on every "
                f"rank (verified parameters per rank: {result.verified_params})"
            )
        return result

    def _expand(self, ranks: list[int]) -> dict[str, Any]:
        cfg = self._cfg
        t0 = time.perf_counter()
        # Never route to a rank before its weights are verified: it may serve dummy, stale or half-loaded weights.
        self._router_call("deactivate", ranks)
        try:
            if cfg.sleep_level == 1:  # the sync overwrites the weights right after the wake: never restore the old ones
                wait_all({r: self._fleet.engine_rpc(r).call("rlix_discard_weight_backup", ()) for r in ranks},
                         cfg.drain_timeout_s, f"discarding the level-1 weight copy of dp ranks {ranks}")
            # The weights first; the KV cache wakes while the new weights are copied in (the sync wakes it, on failure
            # too: vLLM ignores a sleep while a tag still sleeps).
            self._fleet.wake_up(ranks, ["weights"], cfg.drain_timeout_s)
            t_wake = time.perf_counter()
            result = self._sync(ranks, ["kv_cache"])
            t_sync = time.perf_counter()
            with self._state:
                version = self._versions.published
            if version is None:
                version = published_version(result.version)
            if self._publisher is not None:
                # The version the pipeline already published (no bump: one number per cache).
                self._publisher.set_weight_version(version, ROLLOUT_RPC_TIMEOUT_S)
        except BaseException as exc:
            with self._state:
                self._dirty |= set(ranks)
            try:
                self._fleet.sleep(ranks, cfg.sleep_level, cfg.drain_timeout_s)
            except Exception as sleep_exc:  # keep the original error; the ranks stay unrouted either way
                exc.add_note(f"putting ranks {ranks} back to sleep also failed: {sleep_exc}")
            self._record(op="expand_failed", ranks=ranks, error=f"{type(exc).__name__}: {exc}")
            raise
        self._router_call("activate", ranks)
        t_done = time.perf_counter()
        with self._state:
            self._dirty -= set(ranks)
        return self._record(op="expand", ranks=ranks, seconds=t_done - t0, wake_s=t_wake - t0,
                            sync_s=t_sync - t_wake, activate_s=t_done - t_sync, version=result.version,
                            published=version, verified=result.verified, verified_params=result.verified_params,
                            verified_workers=result.verified_workers, payload_bytes=result.payload_bytes,
                            broadcast_ranks=list(result.broadcast_dp_ranks))

    # ------------------------------------------------------------------ runtime entry points
    def refresh_active(self) -> dict[str, Any]:
        """Sync the cache to every ACTIVE rank in flight (no drain). Caller holds the coordinator's resize lock."""
        with self._exclusive("refresh_active"):
            active = list(self._router_call("active"))
            if not active:
                return self._record(op="refresh", ranks=[], seconds=0.0, version=None, verified=True)
            t0 = time.perf_counter()
            try:
                result = self._sync(active)
            except BaseException as exc:
                # A failed in-flight sync may leave a rank half-loaded (eager apply): stop routing to every target.
                with self._state:
                    self._dirty |= set(active)
                self._router_call("deactivate", active)
                self._record(op="refresh_failed", ranks=active, error=f"{type(exc).__name__}: {exc}")
                raise
            return self._record(op="refresh", ranks=active, seconds=time.perf_counter() - t0,
                                version=result.version, verified=result.verified,
                                verified_params=result.verified_params, verified_workers=result.verified_workers,
                                payload_bytes=result.payload_bytes, broadcast_ranks=list(result.broadcast_dp_ranks))

    def prewarm_and_sleep(self, ranks: list[int]) -> dict[str, Any]:
        """Start-up: wake, sync the start-up cache and sleep every rank once while the pipeline holds its inference
        GPUs (a rank's first wake on a GPU another pipeline's Megatron had used once hit an illegal memory access).
        The sync pays what a first sync pays once per engine (mapping and pinning the cache's
        pages, first kernels, the loader's first call) here instead of in the pipeline's first expand."""
        with self._exclusive("prewarm"):
            cfg = self._cfg
            t0 = time.perf_counter()
            self._fleet.wake_up(ranks, None, cfg.drain_timeout_s)
            warm = self._sync(ranks)
            self._fleet.sleep(ranks, cfg.sleep_level, cfg.drain_timeout_s)
            after = self._fleet.memory_in_use(ranks, cfg.drain_timeout_s)
            return self._record(op="prewarm", ranks=ranks, seconds=time.perf_counter() - t0, memory_after=after,
                                sync_s=warm.seconds, version=warm.version)

