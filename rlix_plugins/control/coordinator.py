"""Per-pipeline coordinator actor: ``rlix:coordinator:<pid>`` in namespace ``pipeline_<pid>_NS``.

It sits between the scheduler and the pipeline:

* the scheduler calls ``resize_infer(remove, add)``; the coordinator forwards it to the pipeline's resize handler
  (any Ray actor with the :class:`ResizeHandler` method, set with ``set_resize_handler``) under the **resize lock**
  and keeps the set of active DP ranks;
* the pipeline takes the same lock (``acquire_resize_lock`` → refresh the active ranks in flight →
  ``release_resize_lock``) so an active-rank weight refresh never races an expand or shrink.
  Never call the scheduler while holding the lock: a shrink the scheduler is executing may be waiting for it;
* the pipeline reports raw rollout progress (``report_progress``); the coordinator clamps it and forwards it to
  the scheduler only when the 2 % bucket changes or a new batch starts (``miles`` wire format).

Threaded actor (``max_concurrency >= 4``) so a progress report or a lock call runs next to a long resize.
Lifetime: owned by the process that created it (normally the pipeline's driver, via ``client.register_pipeline``),
so it dies with its pipeline; the scheduler's health probe then fails the pipeline and frees its GPUs.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import ray

from rlix_plugins.control.scheduling.config import check_durations
from rlix_plugins.control.types import RLIX_NAMESPACE, SCHEDULER_NAME
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, SchedulerError

logger = logging.getLogger(__name__)

#: Progress is forwarded when ``int(completed / step_target * PROGRESS_BUCKETS)`` changes (2 % steps).
PROGRESS_BUCKETS = 50
#: Completed resizes kept for ``resize_history`` (diagnostics).
RESIZE_HISTORY = 1000


@runtime_checkable
class ResizeHandler(Protocol):
    """What the pipeline side implements (as a Ray actor method; NeMo RL hooks, the demo host, tests).

    ``resize_infer(remove, [])``: remove from routing → abort → drain → sleep the DP ranks.
    ``resize_infer([], add)``: wake → sync weights → finalize → publish version → route the DP ranks.
    Exactly one list is non-empty. It must be idempotent per rank and raise on failure (the rank then counts as
    not changed and the scheduler fails the pipeline).
    """

    def resize_infer(self, dp_ranks_to_remove: list[int], dp_ranks_to_add: list[int]) -> None: ...


def _older(last: tuple[int, int, int | None], new: tuple[int, int, int | None]) -> bool:
    """Whether progress ``new`` (completed, step_target, step) is older than ``last`` (see ``report_progress``)."""
    if new[2] is None or last[2] is None:
        return False
    return new[2] < last[2] or (new[2] == last[2] and new[1] == last[1] and new[0] < last[0])


@dataclass(frozen=True)
class CoordinatorConfig:
    #: Wait for the resize lock (an in-flight refresh or another resize) before giving up.
    lock_timeout_s: float = 180.0
    #: One handler ``resize_infer`` call (sleep, or wake + weight sync) must return within this.
    handler_timeout_s: float = 180.0
    #: A lock taken with ``acquire_resize_lock`` expires after this (a crashed holder cannot block resizes forever).
    lock_lease_s: float = 600.0
    #: Once the driver sent a ``heartbeat``, it must send the next within this; otherwise ``ping`` reports the
    #: lease expired and the scheduler fails the pipeline, returning its GPUs (a driver that hangs or was stopped
    #: while it holds a grant). The runtime beats every quarter of it.
    heartbeat_lease_s: float = 120.0

    def __post_init__(self) -> None:
        check_durations(self, "lock_timeout_s", "handler_timeout_s", "lock_lease_s", "heartbeat_lease_s")


class _ResizeLock:
    """A lock whose holder is a token (it is taken and given back in different RPCs/threads), with a lease."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._token: str | None = None
        self._holder = ""
        self._expires = 0.0

    def acquire(self, timeout_s: float, lease_s: float, holder: str) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._token is not None:
                now = time.monotonic()
                if now >= self._expires:
                    logger.warning("rlix coordinator: resize lock lease of %r expired; taking it over", self._holder)
                    break
                if now >= deadline:
                    raise RlixTimeoutError(
                        f"resize lock not acquired within {timeout_s:.1f} s: held by {self._holder!r} "
                        f"(lease ends in {self._expires - now:.0f} s); a refresh or resize is stuck"
                    )
                self._cond.wait(min(deadline, self._expires) - now)
            self._token = uuid.uuid4().hex
            self._holder = holder
            self._expires = time.monotonic() + lease_s
            return self._token

    def release(self, token: str) -> None:
        with self._cond:
            if token != self._token:
                raise SchedulerError(
                    "release_resize_lock: token does not hold the lock (already released, or the lease expired "
                    "and another caller took it)"
                )
            self._token = None
            self._holder = ""
            self._cond.notify_all()


class Coordinator:
    """One per pipeline. Create with ``client.register_pipeline`` (it sets name, namespace, concurrency)."""

    def __init__(self, pipeline_id: str, num_dp_ranks: int, config: CoordinatorConfig | None = None) -> None:
        self._pid = pipeline_id
        self._num_dp_ranks = num_dp_ranks
        self._cfg = config or CoordinatorConfig()
        self._lock = _ResizeLock()
        self._state = threading.Lock()  # guards the fields below (short critical sections only)
        self._active: set[int] = set()
        self._handler: Any = None
        self._scheduler: Any = None
        self._bucket: int | None = None
        self._last_progress: tuple[int, int, int | None] | None = None
        self._report_seq = 0
        self._resizes: deque[tuple[float, list[int], list[int]]] = deque(maxlen=RESIZE_HISTORY)
        self._last_beat: float | None = None

    def ping(self) -> str:
        """``"ok"``, or why the pipeline's driver is presumed dead (the scheduler's health probe fails it then)."""
        with self._state:
            last = self._last_beat
        if last is not None and time.monotonic() - last > self._cfg.heartbeat_lease_s:
            return (f"driver lease expired: no heartbeat for {time.monotonic() - last:.0f} s "
                    f"(CoordinatorConfig.heartbeat_lease_s={self._cfg.heartbeat_lease_s:g}); the driver hangs or was stopped")
        return "ok"

    def heartbeat(self) -> None:
        """Renew the driver's lease (the runtime calls it every quarter of ``heartbeat_lease_s``)."""
        with self._state:
            self._last_beat = time.monotonic()

    def lease_age_s(self) -> float | None:
        """Seconds since the driver's last heartbeat (None: it never sent one, so no lease runs yet)."""
        with self._state:
            last = self._last_beat
        return None if last is None else time.monotonic() - last

    def heartbeat_interval_s(self) -> float:
        return self._cfg.heartbeat_lease_s / 4

    def set_resize_handler(self, handle: Any) -> None:
        """Set the pipeline-side actor whose ``resize_infer(remove, add)`` does the sleeping and waking."""
        if not hasattr(handle, "resize_infer"):
            raise RlixConfigError(
                f"resize handler {handle!r} has no resize_infer method; pass a Ray actor handle implementing "
                "rlix_plugins.control.coordinator.ResizeHandler"
            )
        with self._state:
            self._handler = handle

    def get_active_ranks(self) -> list[int]:
        with self._state:
            return sorted(self._active)

    def resize_infer(self, dp_ranks_to_remove: list[int], dp_ranks_to_add: list[int]) -> list[int]:
        """Forward one shrink or expand to the handler under the resize lock; return the active ranks after."""
        remove, add = self._check_ranks(dp_ranks_to_remove, dp_ranks_to_add)
        with self._state:
            handler = self._handler
        if handler is None:
            raise SchedulerError(
                f"pipeline {self._pid}: no resize handler set; call coordinator.set_resize_handler(actor) before "
                "requesting GENERATION"
            )
        token = self._lock.acquire(self._cfg.lock_timeout_s, self._cfg.handler_timeout_s * 2,
                                   holder=f"resize(remove={remove}, add={add})")
        try:
            with self._state:
                bad = sorted(set(remove) - self._active) + sorted(set(add) & self._active)
            if bad:
                raise SchedulerError(
                    f"pipeline {self._pid}: resize_infer(remove={remove}, add={add}) conflicts with the active ranks "
                    f"{sorted(self._active)} (ranks {bad}); the scheduler and coordinator disagree"
                )
            try:
                ray.get(handler.resize_infer.remote(remove, add), timeout=self._cfg.handler_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RlixTimeoutError(
                    f"pipeline {self._pid}: resize handler did not finish resize_infer(remove={remove}, add={add}) "
                    f"within {self._cfg.handler_timeout_s:.0f} s (CoordinatorConfig.handler_timeout_s)"
                ) from None
            except ray.exceptions.RayTaskError as exc:
                # First: Ray makes a task's error an instance of its cause's class too, so a handler that raised
                # ActorDiedError (one of its engines died) would otherwise read as "the handler died".
                raise SchedulerError(
                    f"pipeline {self._pid}: resize handler raised in resize_infer(remove={remove}, add={add}): "
                    f"{type(exc.cause).__name__}: {str(exc.cause).splitlines()[0] if str(exc.cause) else ''}"
                ) from None
            except ray.exceptions.RayActorError:
                raise SchedulerError(f"pipeline {self._pid}: the resize handler actor died") from None
            with self._state:
                self._active -= set(remove)
                self._active |= set(add)
                self._resizes.append((time.time(), remove, add))
                return sorted(self._active)
        finally:
            self._lock.release(token)

    def acquire_resize_lock(self, timeout_s: float | None = None, lease_s: float | None = None) -> tuple[str, list[int]]:
        """Take the resize lock (for an in-flight refresh of the active ranks); returns (token, active ranks).

        Give it back with ``release_resize_lock(token)`` within ``lease_s`` (default ``lock_lease_s``).
        """
        token = self._lock.acquire(timeout_s or self._cfg.lock_timeout_s, lease_s or self._cfg.lock_lease_s,
                                   holder="pipeline refresh")
        return token, self.get_active_ranks()

    def release_resize_lock(self, token: str) -> None:
        self._lock.release(token)

    def report_progress(self, collected: int, step_target: int, step: int | None = None,
                        new_batch: bool = False) -> bool:
        """Raw rollout progress of the current step. Returns True when it was forwarded to the scheduler.

        Forwarded when ``new_batch``, when the 2 % bucket of ``min(collected, step_target) / step_target``
        changes, or when ``step``/``step_target`` change; otherwise dropped (the hot path stays cheap).

        A report older than the last one kept is dropped too: one for an earlier step, or one with fewer
        trajectories for the same step (this actor is threaded, so reports sent in order may run out of order;
        a late "3 of 4" after "4 of 4" made an idle pipeline look busy forever, issue 17). Within a run steps
        only grow and a step's count only grows (a count that drops because the trainer took the batch does
        not mean work came back).
        """
        if not isinstance(collected, int) or not isinstance(step_target, int) or collected < 0 or step_target < 0:
            raise RlixConfigError(
                f"report_progress: collected={collected!r} and step_target={step_target!r} must be ints >= 0"
            )
        completed = min(collected, step_target)
        bucket = int(completed / step_target * PROGRESS_BUCKETS) if step_target else PROGRESS_BUCKETS
        with self._state:
            last = self._last_progress
            if last is not None and _older(last, (completed, step_target, step)):
                return False
            if not new_batch and last is not None and bucket == self._bucket and last[1:] == (step_target, step):
                return False
            self._bucket = bucket
            self._last_progress = (completed, step_target, step)
            self._report_seq += 1
            seq = self._report_seq
        # Fire and forget: progress must never block the rollout path. Calls from several threads may arrive out
        # of order; the scheduler drops any report older than the last by ``report_seq``.
        self._sched().report_progress.remote(self._pid, step_target, completed, step, report_seq=seq)
        return True

    def clear_progress(self) -> None:
        with self._state:
            self._bucket = None
            self._last_progress = None
            self._report_seq += 1
            seq = self._report_seq
        self._sched().clear_progress.remote(self._pid, report_seq=seq)

    def resize_history(self) -> list[tuple[float, list[int], list[int]]]:
        """(time, removed, added) of the last ``RESIZE_HISTORY`` completed resizes (diagnostics, tests)."""
        with self._state:
            return list(self._resizes)

    def _sched(self) -> Any:
        if self._scheduler is None:
            self._scheduler = ray.get_actor(SCHEDULER_NAME, namespace=RLIX_NAMESPACE)
        return self._scheduler

    def _check_ranks(self, remove: Any, add: Any) -> tuple[list[int], list[int]]:
        def clean(name: str, value: Any) -> list[int]:
            if not isinstance(value, (list, tuple)) or any(
                isinstance(r, bool) or not isinstance(r, int) for r in value
            ):
                raise RlixConfigError(f"resize_infer: {name}={value!r} must be a list of DP ranks (ints)")
            out = sorted(set(value))
            bad = [r for r in out if not 0 <= r < self._num_dp_ranks]
            if bad:
                raise RlixConfigError(
                    f"resize_infer: {name} has ranks {bad} outside 0..{self._num_dp_ranks - 1} of pipeline {self._pid}"
                )
            return out

        r, a = clean("dp_ranks_to_remove", remove), clean("dp_ranks_to_add", add)
        if bool(r) == bool(a):
            raise RlixConfigError(
                f"resize_infer: exactly one of dp_ranks_to_remove={r} and dp_ranks_to_add={a} must be non-empty"
            )
        return r, a
