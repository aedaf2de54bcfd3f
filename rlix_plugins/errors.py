"""Typed errors. Messages name the offending value, the valid choices and the key or flag to change."""

from __future__ import annotations


class RlixError(Exception):
    """Base class of every error rlix-plugins raises on purpose."""


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


class PatchError(RlixError):
    """The NeMo RL patch series cannot be applied, checked or reverted."""
