"""The prefix-cache reset of a weight sync, done by ``EngineCore`` inside the sync's finish call.

A sync ends with one ``collective_rpc("rlix_finish_weight_update", ...)`` per engine (finalize + verify on every
worker). The prefix cache lives in the scheduler, in ``EngineCore``, which no worker reaches: without help the
sender needs one more round trip (``reset_prefix_cache``). :func:`install` wraps ``EngineCore.collective_rpc``
so that this one method resets the cache in the same call, first: no engine step runs inside one call, so no
request can cache a block between the reset and the workers' finalize, and the reset's host time (4-11 ms of
Python over every KV block) overlaps the tail of the sync's copies instead of following it. The cache is reset
whatever the workers then do (a verification that fails after the weights changed). Every other method passes
through untouched.

Each worker's result says whether the reset ran (``"prefix_cache_reset"``: the reset's own result; ``None`` where
no hook ran, e.g. the control plane is off in the engine's process): the sender resets through the engine's own
``reset_prefix_cache`` then. Installed by the general plugin (:mod:`.plugin`) with ``RLIX_CONTROL_PLANE=rlix``,
in every process where vLLM's ``EngineCore`` is already imported (vLLM loads plugins in ``EngineCore.__init__``).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

__all__ = ["FINISH_METHOD", "install"]

#: the worker method whose ``collective_rpc`` resets the prefix cache (``RlixReceiverMixin``)
FINISH_METHOD = "rlix_finish_weight_update"


def install() -> bool:
    """Wrap ``EngineCore.collective_rpc`` once per process; False when ``EngineCore`` is not imported here."""
    core = sys.modules.get("vllm.v1.engine.core")
    engine_core = getattr(core, "EngineCore", None)
    if engine_core is None:
        return False
    original = engine_core.collective_rpc
    if getattr(original, "_rlix_finish", False):
        return True

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method != FINISH_METHOD:
            return original(self, method, *args, **kwargs)
        started = time.perf_counter()
        reset = bool(self.reset_prefix_cache())
        took = time.perf_counter() - started
        results = original(self, method, *args, **kwargs)
        return [{**r, "prefix_cache_reset": reset, "prefix_cache_reset_s": took} for r in results]

    collective_rpc._rlix_finish = True  # type: ignore[attr-defined]
    engine_core.collective_rpc = collective_rpc
    return True
