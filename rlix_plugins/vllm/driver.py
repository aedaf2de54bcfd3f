"""Sending side: drive a set of vLLM engines (one per DP rank) through one weight sync.

``sync_engines(cache, plan, engines)``::

    transport.sync_weights (setup -> buckets -> destroy -> rlix_finish_weight_update, cache lock held)

Engine round trips per sync and target: where its workers run (``rlix_report_place``, checked against the plan; asked
at an engine's first sync from this process only), the buckets (one host_pull call for all of them; per bucket otherwise),
the group's setup and teardown (broadcast targets only), and ONE finish call: finalize, verify and - through
``EngineCore`` (:mod:`.engine_hook`) - the prefix-cache reset, answered with the verification's result. An
engine without the hook (``RLIX_CONTROL_PLANE`` not ``rlix`` in its process) gets one more call,
``reset_prefix_cache``, where weights changed.

An engine is reached through an :class:`EngineRpc` - ``collective_rpc`` on every worker of the engine:

* :class:`LLMEngineRpc` - an in-process ``vllm.LLM``. Its ``collective_rpc`` blocks, so calls run on one
  thread per engine (calls to one engine stay ordered; different engines overlap, which the broadcast
  needs: the sender broadcasts while every receiver sits in ``broadcast_parameter``).
* :class:`RayEngineRpc` - a Ray actor that owns an engine and forwards ``(method, args)`` to its
  ``collective_rpc``: NeMo RL's vLLM workers through ``checkpoint_engine_rpc`` (sync engine) or
  ``checkpoint_engine_rpc_async`` (async engine), or our :class:`~rlix_plugins.vllm.engine_actor.RlixEngineActor`.

Failure: any error or timeout aborts the sync on every target (staged tensors dropped, groups destroyed by
the transport), nothing is finalized, and the error is raised; engines keep serving the weights they
had (staged mode) or are reported ``dirty`` (eager mode) and must not be routed to until a later sync. A
verification that fails in the finish call (after its finalize) raises ``WeightVerificationError``; the prefix
cache of every engine whose finish call ran is reset either way.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, final

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError
from rlix_plugins.transport import (
    CommPlan,
    PendingCall,
    SyncReport,
    VersionedBucketCache,
    sync_weights,
    wait_all,
)
from rlix_plugins.vllm.engine_hook import FINISH_METHOD

__all__ = ["EngineRpc", "EngineSyncReport", "LLMEngineRpc", "RayEngineRpc", "sync_engines"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class EngineRpc(Protocol):
    """One engine (DP rank). ``call`` starts ``collective_rpc(method, args)`` on all its workers and
    returns at once; the result is the list of per-worker return values. Optional: ``place_key() -> str | None``,
    a stable name of the engine under which its workers' places are asked once (else: every sync)."""

    def call(self, method: str, args: tuple[Any, ...]) -> PendingCall: ...

    def reset_prefix_cache(self) -> PendingCall: ...

    def wake_up(self, tags: list[str]) -> PendingCall:
        """The engine's own ``wake_up(tags)`` (its sleep bookkeeping included), for ``sync_engines(wake_tags=...)``."""
        ...


@final
class LLMEngineRpc:
    """An in-process ``vllm.LLM`` (default multiprocess engine or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Do not call ``llm.generate`` concurrently with a sync: ``vllm.LLM`` is not thread-safe.
    """

    def __init__(self, llm: Any, rpc_timeout_s: float = 300.0) -> None:
        self.llm = llm
        self._place_key = f"llm:{uuid.uuid4().hex}"
        #: vLLM's own bound on one ``collective_rpc``: a stuck worker frees this engine's RPC thread
        #: (the caller's wait is bounded separately, by the sync's per-phase timeout)
        self.rpc_timeout_s = rpc_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlix-engine-rpc")

    def call(self, method: str, args: tuple[Any, ...]) -> Future[Any]:
        return self._pool.submit(self.llm.collective_rpc, method, timeout=self.rpc_timeout_s, args=args)

    def reset_prefix_cache(self) -> Future[Any]:
        return self._pool.submit(self.llm.reset_prefix_cache)

    def wake_up(self, tags: list[str]) -> Future[Any]:
        return self._pool.submit(self.llm.wake_up, tags=tags)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def place_key(self) -> str:
        """This engine, for the cache of its workers' places (``_SyncEndpoint.report_places``)."""
        return self._place_key


@final
class RayEngineRpc:
    """A Ray actor that owns an engine.

    :param rpc_method: actor method taking ``(method, args)`` and returning ``collective_rpc``'s list:
        ``"checkpoint_engine_rpc"`` / ``"checkpoint_engine_rpc_async"`` on NeMo RL's vLLM workers,
        ``"rlix_rpc"`` on :class:`~rlix_plugins.vllm.engine_actor.RlixEngineActor`.
    :param reset_method: actor method that resets the engine's prefix cache
        (NeMo RL: ``"reset_prefix_cache"`` / ``"reset_prefix_cache_async"``).
    :param wake_method: actor method taking ``tags=`` that wakes the engine (NeMo RL: ``"wake_up"`` /
        ``"wake_up_async"``).
    """

    def __init__(self, actor: Any, rpc_method: str = "rlix_rpc", reset_method: str = "reset_prefix_cache",
                 wake_method: str = "wake_up") -> None:
        self.actor = actor
        self.rpc_method = rpc_method
        self.reset_method = reset_method
        self.wake_method = wake_method

    def call(self, method: str, args: tuple[Any, ...]) -> PendingCall:
        return getattr(self.actor, self.rpc_method).remote(method, args).future()

    def reset_prefix_cache(self) -> PendingCall:
        return getattr(self.actor, self.reset_method).remote().future()

    def wake_up(self, tags: list[str]) -> PendingCall:
        return getattr(self.actor, self.wake_method).remote(tags=tags).future()

    def place_key(self) -> str | None:
        """The actor, for the cache of its workers' places (a handle is pickled anew for every sync; its id stays)."""
        actor_id = getattr(self.actor, "_actor_id", None)
        return None if actor_id is None else f"ray:{actor_id.hex()}"


#: engine key (``EngineRpc.place_key``) -> its workers' place reports
_PLACES: dict[str, list[Any]] = {}
_PLACES_LOCK = threading.Lock()


@final
class _Remembered:
    """A started place report that is kept once it arrived."""

    def __init__(self, call: PendingCall, key: str | None) -> None:
        self.call, self.key = call, key

    def result(self, timeout: float | None = None) -> Any:
        value = self.call.result(timeout=timeout)
        if self.key is not None:
            with _PLACES_LOCK:
                _PLACES[self.key] = list(value)
        return value


@final
class _SyncEndpoint:
    """``transport.ReceiverEndpoint`` for one engine and one sync: adds ``sync_id`` and ``apply_mode``."""

    def __init__(self, rpc: EngineRpc, sync_id: str, apply_mode: str) -> None:
        self.rpc, self.sync_id, self.apply_mode = rpc, sync_id, apply_mode
        #: the finish call was started (the weights may have changed: a failed sync still resets the prefix cache)
        self.finishing = False

    def setup_collective_group(
        self, group_name: str, master_addr: str, master_port: int, ranks_by_local_rank: dict[int, int],
        world_size: int, backend: str, timeout_s: float,
    ) -> PendingCall:
        ranks = {str(k): int(v) for k, v in ranks_by_local_rank.items()}  # str keys: msgpack-safe everywhere
        return self.rpc.call(
            "setup_collective_group", (group_name, master_addr, master_port, ranks, world_size, backend, timeout_s)
        )

    def update_parameter_in_bucket(self, payload: dict[str, Any], ipc_local_ranks: list[int]) -> PendingCall:
        return self.rpc.call(
            "update_parameter_in_bucket", (payload, list(ipc_local_ranks), self.sync_id, self.apply_mode)
        )

    def broadcast_parameter(
        self, group_name: str, bucket_meta: dict[str, Any], broadcast_local_ranks: list[int]
    ) -> PendingCall:
        return self.rpc.call(
            "broadcast_parameter",
            (group_name, bucket_meta, list(broadcast_local_ranks), self.sync_id, self.apply_mode),
        )

    def destroy_collective_group(self, group_name: str) -> PendingCall:
        return self.rpc.call("destroy_collective_group", (group_name,))

    def verify_model(self, expected_checksums: dict[str, list[int]]) -> PendingCall:
        return self.rpc.call("verify_model", (expected_checksums,))

    def report_places(self) -> PendingCall:
        """Where the engine's workers run: asked once per engine and sender process (an engine's workers never move),
        so that an awake sync stays two round trips (pull, finish)."""
        key_fn = getattr(self.rpc, "place_key", None)
        key = key_fn() if callable(key_fn) else None
        if key is not None:
            with _PLACES_LOCK:
                known = _PLACES.get(key)
            if known is not None:
                done: Future[Any] = Future()
                done.set_result(known)
                return done
        return _Remembered(self.rpc.call("rlix_report_place", ()), key)

    def finish(self, expected_checksums: Mapping[str, list[int]] | None) -> PendingCall:
        self.finishing = True
        expected = None if expected_checksums is None else dict(expected_checksums)
        return self.rpc.call(FINISH_METHOD, (self.sync_id, expected))


@final
@dataclass(frozen=True)
class EngineSyncReport:
    """What one :func:`sync_engines` call did."""

    sync_id: str
    transport: SyncReport
    #: dp ranks where at least one worker finalized new weights (prefix cache reset there)
    finalized_dp_ranks: tuple[int, ...]
    #: the finish call (finalize + verify + prefix-cache reset; a deferred pull's last copies land in it), plus a
    #: separate ``reset_prefix_cache`` where an engine had no hook
    finalize_seconds: float
    #: dp rank -> per-worker ``verify_model`` results (empty when ``verify=False``)
    verified: dict[int, list[dict[str, int]]]
    #: dp ranks that needed the separate ``reset_prefix_cache`` call (no :mod:`.engine_hook` in their EngineCore)
    separate_reset_dp_ranks: tuple[int, ...] = ()


def _bounded(fn: Callable[[], _T], deadline_s: float, what: str) -> _T:
    """Run ``fn`` on a daemon thread; raise ``RlixTimeoutError`` if it has not returned after ``deadline_s``."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="rlix-weight-sync", daemon=True).start()
    if not done.wait(deadline_s):
        raise RlixTimeoutError(
            f"{what} did not finish within {deadline_s:.0f} s: a collective or RPC is stuck (NCCL communicator "
            "init ignores timeouts; check NCCL_DEBUG=INFO on both sides); the sync thread was abandoned"
        )
    if "error" in box:
        raise box["error"]
    value: _T = box["value"]
    return value


def _abort(engines: Mapping[int, EngineRpc], dp_ranks: list[int], sync_id: str, timeout_s: float,
           reset: list[int]) -> None:
    """Drop the sync on ``dp_ranks``; reset the prefix cache of ``reset`` (their finish call ran: weights may have
    changed before it failed; the hook resets too, a second reset is harmless)."""
    try:
        calls = {dp: engines[dp].call("rlix_abort_weight_update", (sync_id,)) for dp in dp_ranks}
        wait_all(calls, timeout_s, f"abort of sync {sync_id}")
        wait_all({dp: engines[dp].reset_prefix_cache() for dp in reset}, timeout_s, "reset_prefix_cache")
    except Exception as exc:  # never mask the error that caused the abort
        log.warning("rlix: abort of sync %s failed on some engine: %s", sync_id, exc)


def sync_engines(
    cache: VersionedBucketCache,
    plan: CommPlan,
    engines: Mapping[int, EngineRpc],
    *,
    staging_device: str = "cpu",
    backend: str | None = None,
    master_addr: str | None = None,
    timeout_s: float = 150.0,
    verify: bool = True,
    apply_mode: str = "auto",
    overall_timeout_s: float | None = None,
    wake_tags: list[str] | None = None,
) -> EngineSyncReport:
    """Push the cache's published version to the plan's target engines; see the module docstring.

    ``engines`` maps dp rank -> :class:`EngineRpc`; only ``plan``'s targets are touched. The plan is checked against
    where each engine's workers run (``rlix_report_place``) before anything is sent. ``master_addr``: the broadcast
    rendezvous address, default this process's Ray node IP (required without Ray; see ``transport.rendezvous_address``). ``timeout_s``
    bounds each phase (setup, each bucket, teardown, the finish call). ``apply_mode``: ``"auto"``,
    ``"staged"`` (atomic) or ``"eager"`` (see :mod:`rlix_plugins.vllm.receiver`).
    ``overall_timeout_s`` (default ``timeout_s * (buckets + 4)``) bounds the sync as a whole (finish included):
    some blocking calls cannot honour a timeout (NCCL communicator init blocks in the calling thread), so
    the transport runs on a helper thread; past the deadline ``RlixTimeoutError`` is raised and the thread
    is abandoned (it keeps the cache lock until its call returns, so later syncs fail fast on the lock).
    ``wake_tags``: wake these tags of every target while the weights are copied (an expand: the weights were woken
    before the sync, the KV cache wakes during it); the engines are woken through ``EngineRpc.wake_up``. They are
    woken on failure too, so that a failed sync leaves whole engines the caller can put back to sleep (vLLM ignores
    a sleep while any tag still sleeps).
    """
    from rlix_plugins.vllm.receiver import APPLY_MODES

    if apply_mode not in APPLY_MODES:
        raise RlixConfigError(f"apply_mode={apply_mode!r} is not one of {APPLY_MODES}")
    missing = [t.dp_rank for t in plan.targets if t.dp_rank not in engines]
    if missing:
        raise RlixConfigError(f"no engine for target dp ranks {missing}; engines given: {sorted(engines)}")
    sync_id = uuid.uuid4().hex[:12]
    targets = [t.dp_rank for t in plan.targets]
    endpoints = {dp: _SyncEndpoint(engines[dp], sync_id, apply_mode) for dp in targets}
    num_buckets = max(cache.num_buffers, 1)  # >= the buckets of any version (buffers are reused, never shrunk)
    deadline_s = overall_timeout_s if overall_timeout_s is not None else timeout_s * (num_buckets + 4)

    woken = threading.Event()

    def wake() -> None:
        woken.set()  # before the calls: a wake that fails half-way is not repeated (a tag wakes once)
        wait_all({dp: engines[dp].wake_up(list(wake_tags or ())) for dp in targets}, timeout_s,
                 f"wake_up({wake_tags}) of dp ranks {targets} during sync {sync_id}")

    try:
        report = _bounded(
            lambda: sync_weights(
                cache, plan, endpoints, staging_device=staging_device, master_addr=master_addr,
                backend=backend, timeout_s=timeout_s, verify=verify, group_prefix=f"rlix_{sync_id}",
                after_issue=wake if wake_tags else None, finish=True,
            ),
            deadline_s, f"weight sync {sync_id} (up to {num_buckets} buckets)",
        )
    except BaseException:
        _abort(engines, targets, sync_id, timeout_s, [dp for dp in targets if endpoints[dp].finishing])
        if wake_tags and not woken.is_set():
            try:
                wake()
            except Exception as exc:  # never mask the error that failed the sync
                log.warning("rlix: waking %s of dp ranks %s after failed sync %s failed: %s", wake_tags, targets,
                            sync_id, exc)
        raise
    t0 = time.perf_counter()
    finished: dict[int, list[dict[str, Any]]] = {dp: list(r) for dp, r in report.finished.items()}
    changed = [dp for dp in targets if any(w["finalized"] for w in finished[dp])]
    unhooked = [dp for dp in changed if any(w["prefix_cache_reset"] is None for w in finished[dp])]
    wait_all({dp: engines[dp].reset_prefix_cache() for dp in unhooked}, timeout_s, "reset_prefix_cache")
    verified = {dp: [w["verified"] for w in per] for dp, per in finished.items()} if verify else {}
    return EngineSyncReport(
        sync_id=sync_id, transport=report, finalized_dp_ranks=tuple(changed),
        finalize_seconds=report.finish_seconds + time.perf_counter() - t0, verified=verified,
        separate_reset_dp_ranks=tuple(unhooked),
    )
