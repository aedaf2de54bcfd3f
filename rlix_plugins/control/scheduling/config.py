"""The scheduler's settings (:class:`SchedulerConfig`) and the checks of its call arguments (pure, no Ray)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlix_plugins.control.types import Priority
from rlix_plugins.errors import RlixConfigError


def is_duration(value: Any) -> bool:
    """Whether ``value`` is a usable timeout or interval: a finite number of seconds > 0."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_durations(config: object, *names: str) -> None:
    """Raise ``RlixConfigError`` naming the first field of ``config`` among ``names`` that is no duration."""
    for name in names:
        value = getattr(config, name)
        if not is_duration(value):
            raise RlixConfigError(f"{type(config).__name__}.{name}={value!r} must be a positive number of seconds")


@dataclass(frozen=True)
class SchedulerConfig:
    """Timeouts and cadence of the scheduler actor. Only used when the actor is created."""

    #: One coordinator ``resize_infer`` call (lock wait + sleep/wake + weight sync) must return within this.
    #: Must exceed the coordinator's ``lock_timeout_s + handler_timeout_s``.
    resize_timeout_s: float = 400.0
    #: Background rebalance poll (a pipeline preempted to zero ranks asks nothing again: it must not starve).
    poll_interval_s: float = 1.0
    #: Liveness probe of every registered pipeline's coordinator (a dead one frees its pipeline's GPUs).
    health_interval_s: float = 5.0
    health_timeout_s: float = 10.0
    #: Default wait of ``request_gpus`` / ``await_release`` when the caller gives none.
    default_request_timeout_s: float = 1800.0
    #: A pipeline that holds an INITIALIZATION grant longer than this is failed and its GPUs return: its start hangs
    #: (a driver stuck in worker creation keeps its heartbeat thread, so its lease alone would never expire).
    init_hold_timeout_s: float = 1800.0
    #: Relative drift (0..1) of a pipeline's rollout GPUs from its fair share that triggers a poll cycle
    #: (``rebalance.rebalance_reason``). Among the least-complete half of the pipelines with rollout work, each one's
    #: fair share is ``fair = its remaining work x TP / the sum of theirs x their active rollout GPUs``; a cycle runs
    #: when ``|active - fair| >= max(tp_size, drift_threshold x fair)`` GPUs. Relative to the pipeline's own share,
    #: so 0.10 means 10% of what it should hold at 4 GPUs and at 2,048 (never less than one rank, the planner's unit).
    drift_threshold: float = 0.10
    #: After a non-generation cluster releases GPUs, rollout ranks are not woken on them for this long. Back-to-back
    #: training steps then keep their GPUs instead of paying a wake + weight sync + shrink per step (0 disables).
    release_grace_s: float = 2.0
    #: Fair turns (``scheduling.turns``): a pipeline with work waiting never watches a pipeline it shares a GPU
    #: with complete more than this many training steps.
    fair_turn_steps: int = 2
    #: Consecutive non-empty cycles run back to back before falling back to the poll cadence.
    max_busy_cycles: int = 20
    trace_capacity: int = 100_000

    def __post_init__(self) -> None:
        check_durations(self, "resize_timeout_s", "poll_interval_s", "health_interval_s", "health_timeout_s",
                        "default_request_timeout_s", "init_hold_timeout_s")
        if not (isinstance(self.release_grace_s, (int, float)) and 0 <= self.release_grace_s < math.inf):
            raise RlixConfigError(f"SchedulerConfig.release_grace_s={self.release_grace_s!r} must be >= 0 seconds")
        drift = self.drift_threshold
        if isinstance(drift, bool) or not isinstance(drift, (int, float)) or not 0 < drift < 1:
            raise RlixConfigError(f"SchedulerConfig.drift_threshold={drift!r} must be in (0, 1): the fraction of a "
                                  "pipeline's fair share of rollout GPUs it may drift by before a rebalance")
        if not isinstance(self.fair_turn_steps, int) or self.fair_turn_steps < 1:
            raise RlixConfigError(f"SchedulerConfig.fair_turn_steps={self.fair_turn_steps!r} must be an int >= 1")
        if self.max_busy_cycles < 1 or self.trace_capacity < 1:
            raise RlixConfigError("SchedulerConfig.max_busy_cycles and trace_capacity must be >= 1")


def check_timeout(timeout_s: float | None, default: float, what: str) -> float:
    if timeout_s is None:
        return default
    if not is_duration(timeout_s):
        raise RlixConfigError(f"{what}: timeout_s={timeout_s!r} must be a positive finite number of seconds")
    return float(timeout_s)


def to_priority(priority: Any) -> Priority:
    try:
        return Priority(int(priority))
    except (TypeError, ValueError):
        names = ", ".join(f"{p.name}={p.value}" for p in Priority)
        raise RlixConfigError(f"unknown priority {priority!r}; valid: {names}") from None
