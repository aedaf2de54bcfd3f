"""Routing over the active DP ranks of one pipeline: a named Ray actor plus a picklable client.

Why an actor: NeMo RL's trajectory collector routes with its own pickled copy of ``VllmGeneration``,
so routing state kept in a Python object is invisible to it after a resize. The state lives in exactly one
place, the :class:`RolloutRouter` actor ``rlix:router:<pid>`` in the pipeline's namespace, and every process
that routes holds a :class:`RouterClient` (a handle, nothing else).

* ``acquire(timeout_s)`` picks the least-outstanding ACTIVE rank and returns ``(rank, ticket)``; it BLOCKS while
  no rank is active (a pipeline whose ranks are all preempted waits, it does not fail), bounded by the timeout.
* ``release(ticket)`` returns whether the rank was deactivated (shrunk) while the ticket was out: the caller
  then retries the aborted request on another active rank, or on the same one once it is back (:meth:`RouterClient.route`,
  at most ``max_attempts``, default ``max(DP ranks, MIN_ROUTE_ATTEMPTS)``; a ``dp_size`` bound
  would never retry with one rank). Any other failure is re-raised unchanged.
* ``deactivate(ranks)`` (first step of a shrink) / ``activate(ranks)`` (last step of an expand);
  ``wait_drained(ranks, timeout_s)`` waits until no ticket is out on the ranks (shrink: abort → drain → sleep).

Asyncio actor: a waiting ``acquire`` (or ``wait_drained``) is a suspended coroutine, not a held thread. A shrink
that takes a pipeline's last active rank leaves a whole batch of aborted requests (32 prompts x 16 generations =
512 per batch, several batches queued) waiting here; as a threaded actor they filled its threads and the control
calls of the next resize (``release``, ``deactivate``, ``activate``, ``wait_drained``...) queued behind them until
the resize timed out. All state lives on the actor's one event loop and every method runs without an ``await``
between reading and changing it, so no lock is needed. Waiters park on per-waiter futures that ``activate`` /
``close`` (acquire) and ``release`` (drain) resolve; a release wakes only the few drain waiters, never the
thousands of acquire waiters. One concurrency group on purpose: Ray runs each group of an asyncio actor on its
own event loop thread, so a separate group for control calls would need locks and cross-loop wake-ups again.
Ray's ``max_concurrency`` of an asyncio actor bounds running coroutines; calls past it queue, control calls
included, hence :data:`ROUTER_MAX_CONCURRENCY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from rlix_plugins.control.rpc import ray_aget, ray_get
from rlix_plugins.control.timeouts import ROLLOUT_RPC_TIMEOUT_S
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, RlixTimeoutError
from rlix_plugins.pipeline.protocols import ShardPreemptedError

__all__ = ["MIN_ROUTE_ATTEMPTS", "ROUTER_MAX_CONCURRENCY", "RolloutRouter", "RouterClient", "router_name"]

#: ``max_concurrency`` of the router actor: concurrent calls (asyncio: coroutines, not threads). Effectively
#: unbounded on purpose: past the limit Ray queues calls, control calls behind the waiting ``acquire`` calls (the
#: resize deadlock again), and a queued call costs the actor most of what an admitted one does (Ray 2.60, measured:
#: ~30 KB queued vs ~55 KB waiting), so a lower limit saves nothing. The waiters are bounded by the requests the
#: pipeline's collectors keep out, and each gives up after its route timeout.
ROUTER_MAX_CONCURRENCY: Final = 1_000_000
#: Least default attempts of one request (default: max(DP ranks, this)). A retry follows only a shrink the router
#: confirmed, and each waits at most the route timeout for an active rank; but a request can be preempted once per
#: training step of any co-tenant on its rank's GPU (with one rank, the one-GPU topology, every retry waits for
#: that same rank), so "one attempt per rank" would fail requests that only waited their turn.
MIN_ROUTE_ATTEMPTS: Final = 8
T = TypeVar("T")


def router_name(pipeline_id: str) -> str:
    return f"rlix:router:{pipeline_id}"


@dataclass
class _Ticket:
    rank: int
    preempted: bool = False


class _Waiters:
    """Coroutines parked until the next :meth:`wake_all`: an ``asyncio.Condition`` without its lock (the router's
    state lives on one event loop and no method awaits between reading and changing it)."""

    def __init__(self) -> None:
        self._futures: set[asyncio.Future[None]] = set()

    async def wait(self, timeout_s: float) -> None:
        """Until the next wake or ``timeout_s``, whichever comes first; the caller re-checks its condition."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.add(future)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout_s)
        finally:
            self._futures.discard(future)

    def wake_all(self) -> None:
        for future in self._futures:
            if not future.done():
                future.set_result(None)
        self._futures.clear()


class RolloutRouter:
    """Active ranks and in-flight tickets of one pipeline (see the module docstring). All ranks start inactive."""

    def __init__(self, num_dp_ranks: int) -> None:
        if num_dp_ranks < 1:
            raise RlixConfigError(f"num_dp_ranks={num_dp_ranks} must be >= 1")
        self._n = num_dp_ranks
        self._active: set[int] = set()
        self._inflight = dict.fromkeys(range(num_dp_ranks), 0)
        self._served = dict.fromkeys(range(num_dp_ranks), 0)
        self._preempted = 0
        self._tickets: dict[int, _Ticket] = {}
        self._seq = itertools.count(1)
        self._closed: str | None = None
        self._acquirers = _Waiters()  # woken when a rank becomes active or the router is closed
        self._drainers = _Waiters()  # woken when a ticket ends

    async def ping(self) -> str:
        return "ok"

    async def close(self, reason: str) -> None:
        """The pipeline was failed: every routed request, waiting or new, raises ``PipelineUnregisteredError``
        (its collector stops at once instead of waiting for ranks that never come back)."""
        self._closed = reason
        self._acquirers.wake_all()

    def _check(self, ranks: list[int]) -> list[int]:
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self._n)]
        if bad:
            raise RlixConfigError(f"dp ranks {bad} are outside 0..{self._n - 1}")
        return sorted(set(ranks))

    async def acquire(self, timeout_s: float, exclude: list[int] | None = None) -> tuple[int, int]:
        """Least-outstanding active rank (ties: lowest rank), skipping ``exclude`` when another is active."""
        deadline = time.monotonic() + timeout_s
        skip = set(exclude or ())
        while True:
            if self._closed is not None:
                raise PipelineUnregisteredError(f"no rollout: {self._closed}")
            taken = self._take(skip)
            if taken is not None:
                return taken
            left = deadline - time.monotonic()
            if left <= 0:
                raise RlixTimeoutError(
                    f"no active rollout rank within {timeout_s:.0f} s (all {self._n} ranks asleep); the pipeline "
                    "has no GENERATION GPUs - see `rlix status` (RuntimeConfig.route_timeout_s)"
                )
            await self._acquirers.wait(left)

    async def release(self, ticket: int, ok: bool = True) -> bool:
        """End a ticket; returns True when its rank was shrunk while it was out (the request may be retried)."""
        t = self._tickets.pop(ticket, None)
        if t is None:
            return False
        self._inflight[t.rank] -= 1
        if ok and not t.preempted:
            self._served[t.rank] += 1
        self._drainers.wake_all()
        return t.preempted

    async def deactivate(self, ranks: list[int]) -> list[int]:
        """Stop routing to ``ranks``; their outstanding tickets are marked preempted. Returns the active ranks."""
        ranks = self._check(ranks)
        self._active -= set(ranks)
        for t in self._tickets.values():
            if t.rank in ranks and not t.preempted:
                t.preempted = True
                self._preempted += 1
        return sorted(self._active)

    async def activate(self, ranks: list[int]) -> list[int]:
        ranks = self._check(ranks)
        self._active |= set(ranks)
        self._acquirers.wake_all()
        return sorted(self._active)

    async def active(self) -> list[int]:
        return sorted(self._active)

    async def in_flight(self, ranks: list[int] | None = None) -> int:
        return sum(self._inflight[r] for r in (ranks if ranks is not None else range(self._n)))

    async def try_acquire(self, exclude: list[int] | None = None) -> tuple[int, int] | None:
        """:meth:`acquire` without waiting: None when no rank is active."""
        if self._closed is not None:
            raise PipelineUnregisteredError(f"no rollout: {self._closed}")
        return self._take(set(exclude or ()))

    def _take(self, skip: set[int]) -> tuple[int, int] | None:
        pool = (self._active - skip) or set(self._active)
        if not pool:
            return None
        rank = min(pool, key=lambda r: (self._inflight[r], r))
        ticket = next(self._seq)
        self._tickets[ticket] = _Ticket(rank)
        self._inflight[rank] += 1
        return rank, ticket

    async def wait_drained(self, ranks: list[int], timeout_s: float) -> None:
        """Wait until no ticket is out on ``ranks``; raise ``RlixTimeoutError`` naming what is still running."""
        ranks = self._check(ranks)
        deadline = time.monotonic() + timeout_s
        while any(self._inflight[r] for r in ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                busy = {r: self._inflight[r] for r in ranks if self._inflight[r]}
                raise RlixTimeoutError(
                    f"dp ranks did not drain within {timeout_s:.0f} s, requests still in flight: {busy}"
                )
            await self._drainers.wait(left)

    async def stats(self) -> dict[str, Any]:
        return {"active": sorted(self._active), "in_flight": dict(self._inflight),
                "served": dict(self._served), "preempted": self._preempted}


class RouterClient:
    """Picklable client of the router actor; what a collector (any process) holds to route requests."""

    def __init__(self, router: Any, num_dp_ranks: int, *, timeout_s: float = 600.0,
                 max_attempts: int | None = None) -> None:
        self.router = router
        self.num_dp_ranks = num_dp_ranks
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts or max(num_dp_ranks, MIN_ROUTE_ATTEMPTS)

    def _get(self, ref: Any, what: str, timeout_s: float) -> Any:
        return ray_get(ref, f"router: {what}", timeout_s, dead="the router actor is dead; the pipeline ended or crashed")


    def acquire(self, exclude: list[int] | None = None) -> tuple[int, int]:
        rank, ticket = self._get(self.router.acquire.remote(self.timeout_s, exclude), "acquire", self.timeout_s + ROLLOUT_RPC_TIMEOUT_S)
        return int(rank), int(ticket)

    def try_acquire(self) -> tuple[int, int] | None:
        """A ticket on an active rank, or None at once when every rank is asleep."""
        got = self._get(self.router.try_acquire.remote(), "try_acquire", ROLLOUT_RPC_TIMEOUT_S)
        return None if got is None else (int(got[0]), int(got[1]))

    def release(self, ticket: int, ok: bool = True) -> bool:
        return bool(self._get(self.router.release.remote(ticket, ok), "release", ROLLOUT_RPC_TIMEOUT_S))

    # Event-loop variants (a collector's ``async`` dispatch): no thread is held while they wait.
    async def acquire_async(self, exclude: list[int] | None = None) -> tuple[int, int]:
        """:meth:`acquire` awaited on the caller's loop. If the caller is cancelled (or times out) while the router
        still waits for an active rank, the ticket it grants later is handed straight back (never leaked)."""
        ref = self.router.acquire.remote(self.timeout_s, exclude)
        try:
            rank, ticket = await ray_aget(ref, "router: acquire", self.timeout_s + ROLLOUT_RPC_TIMEOUT_S,
                                          dead="the router actor is dead; the pipeline ended or crashed")
        except BaseException:
            ref.future().add_done_callback(self._give_back_granted)
            raise
        return int(rank), int(ticket)

    def _give_back_granted(self, future: Any) -> None:
        if not future.cancelled() and future.exception() is None:
            self.router.release.remote(int(future.result()[1]), False)

    async def release_async(self, ticket: int, ok: bool = True) -> bool:
        return bool(await ray_aget(self.router.release.remote(ticket, ok), "router: release", ROLLOUT_RPC_TIMEOUT_S,
                                   dead="the router actor is dead; the pipeline ended or crashed"))

    def release_nowait(self, ticket: int) -> None:
        """End a ticket without waiting for the answer (a cancelled request: nobody retries it)."""
        self.router.release.remote(ticket, False)

    def route(self, call: Callable[[int], T], *, is_aborted: Callable[[T], bool] | None = None) -> T:
        """Run ``call(dp_rank)`` on an active rank; retry a request a shrink aborted on another active rank.

        ``is_aborted(result)`` tells an aborted result from a complete one (engines that return instead of
        raising). A failure on a rank that was NOT shrunk meanwhile is re-raised unchanged.
        """
        tried: list[int] = []
        for _attempt in range(self.max_attempts):
            rank, ticket = self.acquire(exclude=tried)
            preempted = False
            try:
                result = call(rank)
            except BaseException:
                preempted = self.release(ticket, ok=False)
                if not preempted:
                    raise
                tried.append(rank)
                continue
            aborted = is_aborted(result) if is_aborted is not None else False
            preempted = self.release(ticket, ok=not aborted)
            if not aborted:
                return result
            if not preempted:
                raise ShardPreemptedError(rank, "aborted although the router did not shrink it (aborted elsewhere?)")
            tried.append(rank)
        raise ShardPreemptedError(tried[-1] if tried else -1,
                                  f"aborted by shrinks on {self.max_attempts} attempts (ranks {tried})")
