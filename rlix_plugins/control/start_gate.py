"""The start-up gate: only the part of a pipeline's start that needs the GPU waits for it.

A pipeline's start is mostly CPU work: imports, tokenizer, dataset, conversion, worker processes. What must not run
next to another pipeline's GPU work is a vLLM engine's memory setup: vLLM checks at ``init_device`` that
``gpu_memory_utilization`` of the GPU is free, and its memory profile fails when a co-tenant frees memory meanwhile.
So setup() registers the pipeline and creates its workers at once, and each vLLM rank of a time-shared pipeline asks
for the pipeline's INITIALIZATION grant (every GPU it uses) right before it touches the device
(:func:`hold_start_grant`, called from the receiver workers' ``init_device``). The driver's own start phase (cache
of the start weights, prewarm, sleep) runs under the same grant and releases it (``PipelineRuntime.start``); several
ranks of one pipeline join one request (the scheduler merges a pipeline's INITIALIZATION requests).

The worker learns its pipeline from :data:`PIPELINE_ENV` (set by the NeMo RL placement hook through
``policy.generation.vllm_cfg.env_vars``); without it (standalone vLLM, the demo, tests) nothing waits.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from rlix_plugins import envs

__all__ = ["INIT_TIMEOUT_ENV", "PIPELINE_ENV", "hold_start_grant"]

logger = logging.getLogger(__name__)

#: The pipeline a vLLM worker serves (its start-up waits for the pipeline's INITIALIZATION grant).
PIPELINE_ENV: Final = envs.RLIX_PIPELINE_ID
#: How long that wait may take (seconds; default: ``RuntimeConfig.init_timeout_s``'s default).
INIT_TIMEOUT_ENV: Final = envs.RLIX_INIT_TIMEOUT_S


def hold_start_grant() -> float | None:
    """Block until this process's pipeline (:data:`PIPELINE_ENV`) holds INITIALIZATION of its GPUs; return the
    seconds waited, or None when the process serves no time-shared pipeline. Raises ``RlixTimeoutError`` (bounded by
    :data:`INIT_TIMEOUT_ENV`) and ``PipelineUnregisteredError`` (the pipeline was failed meanwhile)."""
    pipeline_id = envs.pipeline_id()
    if not pipeline_id:
        return None
    from rlix_plugins.control import client
    from rlix_plugins.control.types import GENERATION_CLUSTER, Priority

    timeout_s = envs.init_timeout_s()
    t0 = time.perf_counter()
    pipe = client.connect(create_if_missing=False).pipeline(pipeline_id)
    pipe.request_gpus(GENERATION_CLUSTER, Priority.INITIALIZATION, step=-1, timeout_s=timeout_s)
    waited = time.perf_counter() - t0
    logger.info("rlix %s: start-up grant held after %.1f s; initialising the vLLM engine", pipeline_id, waited)
    return waited
