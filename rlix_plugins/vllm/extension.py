"""``worker_extension_cls`` for plain vLLM: ``rlix_plugins.vllm.extension.RlixWorkerExtension``.

``vllm.LLM(..., worker_extension_cls="rlix_plugins.vllm.extension.RlixWorkerExtension")`` appends this
class to the worker's bases in every worker process; ``llm.collective_rpc("<method>", args=...)`` then
reaches the six receiver methods. vLLM never runs its ``__init__`` (there is none): state is lazy.
"""

from __future__ import annotations

from rlix_plugins.vllm.receiver import RlixReceiverMixin

__all__ = ["RlixWorkerExtension"]


class RlixWorkerExtension(RlixReceiverMixin):
    """The receiver as a vLLM worker extension (plain vLLM, GPU or CPU)."""
