"""``ray.get`` with a timeout whose failures come back as rlix errors: the one place that maps Ray's exceptions."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from typing import Any

import ray

from rlix_plugins.errors import ActorDeadError, RlixTimeoutError


def actor_death_reason(exc: BaseException) -> str:
    """The rlix error that killed an actor in its constructor, else the first line of Ray's message."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        match = re.match(r"^rlix_plugins\.errors\.(\w+): (.*)$", line.strip())
        if match:
            return f"{match.group(1)}: {match.group(2)}"[:500]
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


_Unwrap = type[BaseException] | tuple[type[BaseException], ...]


@contextlib.contextmanager
def _as_rlix_errors(what: str, timeout_s: float, dead: str, hint: str, unwrap: _Unwrap) -> Iterator[None]:
    """The one mapping of Ray's failures (see :func:`ray_get`). A remote exception is checked first: Ray makes a
    remote ``TimeoutError`` an instance of ``TimeoutError`` too, and it is not ours."""
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, unwrap):
            raise exc.cause from None
        raise
    except ray.exceptions.RayActorError as exc:
        raise ActorDeadError(f"{what}: {dead} ({actor_death_reason(exc)})") from None
    except (ray.exceptions.GetTimeoutError, TimeoutError):
        raise RlixTimeoutError(f"{what}: no answer within {timeout_s:.0f} s{hint}") from None


def ray_get(
    refs: Any,
    what: str,
    timeout_s: float,
    *,
    dead: str = "the actor serving it is dead",
    hint: str = "",
    unwrap: _Unwrap = Exception,
) -> Any:
    """``ray.get(refs, timeout=timeout_s)``. A timeout raises ``RlixTimeoutError`` ("<what>: no answer within N s
    <hint>"), a dead actor ``ActorDeadError`` (a ``SchedulerError``) ("<what>: <dead> (<reason>)"); an exception raised by the remote call
    is re-raised as itself when it is an ``unwrap`` instance (else Ray's ``RayTaskError`` propagates)."""
    with _as_rlix_errors(what, timeout_s, dead, hint, unwrap):
        return ray.get(refs, timeout=timeout_s)


async def ray_aget(
    ref: Any,
    what: str,
    timeout_s: float,
    *,
    dead: str = "the actor serving it is dead",
    hint: str = "",
    unwrap: _Unwrap = Exception,
) -> Any:
    """:func:`ray_get` for code running on an event loop: awaits ``ref`` without blocking the loop and without a
    thread of the loop's default executor (code that waits for a rank or a grant there can fill that pool; a
    request that needs a thread to return its router ticket would then never return it). Cancelling the caller
    does not cancel the remote call."""
    inner = asyncio.wrap_future(ref.future())
    # A cancelled caller leaves the call running (shield); if it fails later, nobody would read its exception and
    # asyncio would log "Future exception was never retrieved" for it (every abandoned router call at a teardown).
    inner.add_done_callback(_read_outcome)
    with _as_rlix_errors(what, timeout_s, dead, hint, unwrap):
        return await asyncio.wait_for(asyncio.shield(inner), timeout_s)


def _read_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
