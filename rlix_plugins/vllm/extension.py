"""``worker_extension_cls`` for plain vLLM: ``rlix_plugins.vllm.extension.RlixWorkerExtension``.

``vllm.LLM(..., worker_extension_cls="rlix_plugins.vllm.extension.RlixWorkerExtension")`` appends this
class to the worker's bases in every worker process; ``llm.collective_rpc("<method>", args=...)`` then
reaches the six receiver methods. vLLM never runs its ``__init__`` (there is none): state is lazy.
"""

from __future__ import annotations

from rlix_plugins.vllm import internals
from rlix_plugins.vllm.receiver import RlixReceiverMixin

# vLLM imports this class inside a worker process, which has loaded the worker modules: check what is loaded (no
# import; the worker_cls route imports and checks them itself).
internals.check(internals.current_platform_name(), modules=internals.WORKER_MODULES)

__all__ = ["RlixWorkerExtension"]


class RlixWorkerExtension(RlixReceiverMixin):
    """The receiver as a vLLM worker extension (plain vLLM, GPU or CPU)."""
