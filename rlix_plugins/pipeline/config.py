"""Runtime configuration of one time-shared pipeline (frozen, validated at construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Final

from rlix_plugins.errors import RlixConfigError

SLEEP_LEVELS = (1, 2)
#: What a slept rank of vLLM tensor parallel > 1 keeps on each of its GPUs beyond a rank of one GPU: its TP
#: communicators (NCCL's buffers, vLLM's all-reduce buffers). TP-2 ranks kept 2.12-2.22 GiB per GPU on H200s (a tiny
#: model and Qwen2.5-1.5B under NeMo RL) where TP-1 ranks keep 0.96-1.18 GiB.
TP_COMMUNICATOR_BYTES: Final = 1 << 30


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of :class:`~rlix_plugins.pipeline.runtime.PipelineRuntime`. Every wait has a bound here."""

    #: vLLM sleep level for scheduler-driven shrinks: 2 drops weights and KV cache (default), 1 keeps weights
    #: in host memory (level 2's buffer restore poisoned a co-tenant's allocator on some stacks).
    sleep_level: int = 2
    #: After a sleep, a rank of one GPU must hold less than this on it (where measurable; None skips the check); a
    #: rank of TP > 1 gets :data:`TP_COMMUNICATOR_BYTES` more on each of its GPUs (:meth:`post_sleep_limit`). A
    #: slept engine keeps its CUDA context and what libraries loaded into it: 0.96 GiB on an H200 when it only took
    #: weights by host_pull, 1.18 GiB on an H100 once it had received them over NCCL (a 1 GiB limit failed two
    #: healthy pipelines there), 2.33 GiB on an H200 for an engine of 1,024 sequences with CUDA graphs (a 2 GiB limit
    #: failed a healthy pipeline; the reading now hands torch's cached blocks back first); a sleep that failed keeps
    #: the weights and the KV cache, several GiB at any real shape.
    post_sleep_max_bytes: int | None = 3 << 30
    #: Bound of every blocking GPU request (training, GENERATION).
    request_timeout_s: float = 1800.0
    #: Bound of the start-up phases (INITIALIZATION grants, cache bootstrap, fleet creation and prewarm).
    init_timeout_s: float = 900.0
    #: One weight sync (setup + buckets + finalize + verify) must finish within this.
    sync_timeout_s: float = 150.0
    #: Bound of abort + drain of a shrinking rank, and of sleep/wake calls.
    drain_timeout_s: float = 60.0
    #: A routed request waits at most this long for an active rank (routing blocks while none is active).
    route_timeout_s: float = 600.0
    #: Attempts of one request when shrinks abort it (default: max(DP ranks, router.MIN_ROUTE_ATTEMPTS)).
    max_route_attempts: int | None = None
    #: Wait for the coordinator's resize lock before the in-flight refresh.
    resize_lock_timeout_s: float = 180.0
    #: Planned shrink to zero at the end of the run.
    release_timeout_s: float = 300.0
    #: The watchdog re-requests GENERATION when no rank has been active for this long (grants are one-shot:
    #: a pipeline preempted to zero ranks would otherwise starve).
    watchdog_interval_s: float = 2.0
    #: ``step_target_estimate`` of GENERATION requests before real progress exists (>= 1: the planner never
    #: skips a pipeline that asks, or its ranks would never wake).
    step_target_estimate: int = 1
    #: Verify checksums on every target after each sync (the version the trainer built).
    verify: bool = True

    def post_sleep_limit(self, tp: int) -> int | None:
        """The most a slept rank of ``tp`` GPUs may hold on one of them (None: not checked)."""
        if self.post_sleep_max_bytes is None:
            return None
        return self.post_sleep_max_bytes + (TP_COMMUNICATOR_BYTES if tp > 1 else 0)

    def __post_init__(self) -> None:
        # Every message starts with the field's name (``load_run_config`` prefixes NeMo RL's section, ``rlix.``).
        if self.sleep_level not in SLEEP_LEVELS or isinstance(self.sleep_level, bool):
            raise RlixConfigError(f"sleep_level={self.sleep_level!r} must be one of {SLEEP_LEVELS} (2 frees weights "
                                  "and KV cache)")
        if self.post_sleep_max_bytes is not None and (not _is_int(self.post_sleep_max_bytes)
                                                      or self.post_sleep_max_bytes <= 0):
            raise RlixConfigError(f"post_sleep_max_bytes={self.post_sleep_max_bytes!r} must be an int > 0 or None")
        for f in fields(self):
            if f.name.endswith("_s"):
                value = getattr(self, f.name)
                if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value)
                                                   and value > 0):
                    raise RlixConfigError(f"{f.name}={value!r} must be a positive number of seconds")
        if not _is_int(self.step_target_estimate) or self.step_target_estimate < 1:
            raise RlixConfigError(f"step_target_estimate={self.step_target_estimate!r} must be an int >= 1 "
                                  "(a GENERATION request without demand never wakes a rank)")
        if self.max_route_attempts is not None and (not _is_int(self.max_route_attempts)
                                                    or self.max_route_attempts < 1):
            raise RlixConfigError(f"max_route_attempts={self.max_route_attempts!r} must be an int >= 1 or None")
        if not isinstance(self.verify, bool):
            raise RlixConfigError(f"verify={self.verify!r} must be true or false")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
