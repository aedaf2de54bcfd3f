"""``worker_cls`` for vLLM on GPU with the receiver built in: ``rlix_plugins.vllm.gpu_worker.RlixGPUWorker``.

This is the NeMo RL route: NeMo RL hard-codes ``worker_extension_cls`` to its own
``VllmInternalWorkerExtension`` but forwards ``policy.generation.vllm_kwargs`` into ``vllm.LLM`` /
``AsyncEngineArgs``, so ``vllm_kwargs.worker_cls`` selects this class. vLLM then appends NeMo's extension
to this class's bases; the receiver finds NeMo's ``_load_weights`` / ``_weight_update_lifecycle`` in the
MRO and uses them (see :mod:`rlix_plugins.vllm.loading`).
"""

from __future__ import annotations

from rlix_plugins.vllm import internals

# Before vLLM's class is imported: a vLLM without it (or without what the receiver reads) fails here with one line
# naming the version and the attribute, not with an ImportError deep in the first weight sync.
internals.check("cuda", imports=True, modules=internals.WORKER_MODULES)

from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from rlix_plugins.vllm.receiver import RlixReceiverMixin  # noqa: E402
from rlix_plugins.vllm.start import start_under_grant  # noqa: E402

__all__ = ["RlixGPUWorker"]


class RlixGPUWorker(RlixReceiverMixin, Worker):
    """vLLM's GPU worker plus the six receiver methods. Adds no state and no constructor."""

    def init_device(self) -> None:
        # A time-shared pipeline's engine touches the GPU only under its start-up grant (control.start_gate).
        start_under_grant(self)
        super().init_device()
