"""The prefix-cache reset of a weight sync, done by ``EngineCore`` inside the sync's finish call.

A sync ends with one ``collective_rpc("rlix_finish_weight_update", ...)`` per engine (finalize + verify on every
worker). The prefix cache lives in the scheduler, in ``EngineCore``, which no worker reaches: without help the
sender needs one more round trip (``reset_prefix_cache``). :func:`install` wraps ``EngineCore.collective_rpc``
so that this one method resets the cache in the same call, first: no engine step runs inside one call, so no
request can cache a block between the reset and the workers' finalize, and the reset's host time (4-11 ms of
Python over every KV block) overlaps the tail of the sync's copies instead of following it. The cache is reset
whatever the workers then do (a verification that fails after the weights changed). Every other method passes
through untouched.

The reset is skipped when the block pool provably caches nothing (:func:`nothing_cached`): after a sleep (vLLM's
own sleep resets the cache) the reset would still walk every KV block of a cache that was just mapped again, 4-5 ms
of an expand's critical path on a 60 GB cache.

Each worker's result says whether the reset ran (``"prefix_cache_reset"``: the reset's own result; ``None`` where
no hook ran, e.g. the control plane is off in the engine's process): the sender resets through the engine's own
``reset_prefix_cache`` then. Installed by the general plugin (:mod:`.plugin`) with ``RLIX_CONTROL_PLANE=rlix``,
in every process where vLLM's ``EngineCore`` is already imported (vLLM loads plugins in ``EngineCore.__init__``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from rlix_plugins.vllm import internals

__all__ = ["FINISH_METHOD", "install", "nothing_cached"]

#: the worker method whose ``collective_rpc`` resets the prefix cache (``RlixReceiverMixin``)
FINISH_METHOD = "rlix_finish_weight_update"


def nothing_cached(core: Any) -> bool:
    """True when ``core``'s block pool holds no cached block: no hash maps to a block and none is kept per block (vLLM
    sets a block's hash only with an entry in ``cached_block_hash_to_block``, and clears both together), so its
    ``reset_prefix_cache`` would change nothing. With KV-cache events on, the reset also reports them: never skipped.
    False wherever vLLM's internals differ from these (another version): the engine then resets as always."""
    try:
        pool = internals.block_pool(core)
        return (len(pool.cached_block_hash_to_block) == 0 and not pool.cached_block_hashes_by_block
                and not pool.enable_kv_cache_events)
    except (AttributeError, TypeError):
        return False


def install() -> bool:
    """Wrap ``EngineCore.collective_rpc`` once per process; False when ``EngineCore`` is not imported here."""
    engine_core = internals.engine_core_class()
    if engine_core is None:
        return False
    original = getattr(engine_core, "collective_rpc", None)
    if getattr(original, "_rlix_finish", False):
        return True
    # first install in this process: EngineCore's internals (one line; a raise if the wrapper could not work, a
    # warning and no wrapper without collective_rpc: the sender then resets through the engine)
    internals.check(modules=internals.ENGINE_CORE_MODULES)
    if original is None:
        return False

    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method != FINISH_METHOD:
            return original(self, method, *args, **kwargs)
        started = time.perf_counter()
        skipped = nothing_cached(self)
        reset = skipped or bool(self.reset_prefix_cache())
        took = time.perf_counter() - started
        results = original(self, method, *args, **kwargs)
        return [{**r, "prefix_cache_reset": reset, "prefix_cache_reset_skipped": skipped, "prefix_cache_reset_s": took}
                for r in results]

    collective_rpc._rlix_finish = True  # type: ignore[attr-defined]
    engine_core.collective_rpc = collective_rpc
    return True
