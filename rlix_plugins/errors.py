"""Typed errors. Messages name the offending value, the valid choices and the key or flag to change.

Errors keep their type and fields across process hops. Pickling hops (Ray, multiprocessing) keep them as they
are: Ray raises ``RayTaskError(<cause type>)`` with the original error in ``.cause``. Hops that forward only
an error's text (vLLM's ``collective_rpc``: ``Exception("... failed: <str(error)>")``) keep them when the raiser
wraps the error in :func:`carried_in_text`. A caller recovers the typed error with :func:`typed_error`, never by
matching names in messages.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import ClassVar


class RlixError(Exception):
    """Base class of every error rlix-plugins raises on purpose.

    A subclass with fields takes them as keyword arguments after the message and names them in ``FIELDS``
    (plain JSON values), so that pickling and :func:`carried_in_text` keep them.
    """

    FIELDS: ClassVar[tuple[str, ...]] = ()


class RlixConfigError(RlixError, ValueError):
    """A configuration, registration or command-line value is invalid."""


class RlixTimeoutError(RlixError, TimeoutError):
    """A bounded wait ran out. The message says what was awaited, for how long and the likely cause."""


class SchedulerError(RlixError):
    """The control plane refused or could not complete a request."""


class ActorDeadError(SchedulerError):
    """An actor a call needed is dead (e.g. the scheduler: restart the control plane with ``rlix up``)."""


class PipelineUnregisteredError(SchedulerError):
    """The pipeline was unregistered (or failed) while a request of it was pending."""


class TransportError(RlixError):
    """A weight transfer failed; the receiver keeps serving the weights it had."""


class WeightVerificationError(TransportError):
    """Checksums after loading differ from the sender's; the message names the first differing parameter."""

    FIELDS = ("parameter", "dp_rank")

    def __init__(self, message: str, *, parameter: str | None = None, dp_rank: int | None = None) -> None:
        super().__init__(message)
        #: the first differing parameter (None: the receiver holds parameters the sender never sent)
        self.parameter = parameter
        #: the target dp rank that failed, once the sender knows it
        self.dp_rank = dp_rank


class PatchError(RlixError):
    """The NeMo RL patch series cannot be applied, checked or reverted."""


#: ``[rlix-error:<urlsafe base64 of {"type", "message", "fields"}>]`` at the start of a carried error's message
_TAG = re.compile(r"\[rlix-error:([A-Za-z0-9_-]+=*)\]")


def carried_in_text(exc: RlixError) -> RlixError:
    """``exc`` rebuilt with its type, message and fields encoded at the start of its message (then the readable
    ``Type: message``): raise this where the error crosses a hop that forwards only its text."""
    if _TAG.match(str(exc)):
        return exc
    fields = {f: getattr(exc, f) for f in type(exc).FIELDS}
    record = {"type": type(exc).__name__, "message": str(exc), "fields": fields}
    blob = base64.urlsafe_b64encode(json.dumps(record).encode()).decode("ascii")
    return type(exc)(f"[rlix-error:{blob}] {type(exc).__name__}: {exc}", **fields)


def typed_error(exc: BaseException) -> RlixError | None:
    """The rlix error that ``exc`` is or carries, with its fields; None when it carries none.

    Ray's ``RayTaskError`` is read through its ``.cause`` (the raiser's own exception object). An ``RlixError``
    is itself, or the error encoded at the start of its message by :func:`carried_in_text`. Any other exception
    (the text of a hop like vLLM's ``collective_rpc``) carries the first error encoded in its text; a name
    merely mentioned in a message is never taken for a type.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, RlixError):
        return _decode(_TAG.match(str(exc))) or exc
    return _decode(_TAG.search(str(exc)))


def _decode(tag: re.Match[str] | None) -> RlixError | None:
    if tag is None:
        return None
    try:
        record = json.loads(base64.urlsafe_b64decode(tag.group(1)))
        cls = _error_types().get(record["type"])
        return None if cls is None else cls(str(record["message"]), **record["fields"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        return None


def _error_types() -> dict[str, type[RlixError]]:
    """Every loaded ``RlixError`` class by name (only these are ever rebuilt from a tag)."""
    found: dict[str, type[RlixError]] = {}
    todo: list[type[RlixError]] = [RlixError]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found
