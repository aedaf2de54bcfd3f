"""``worker_cls`` for vLLM-CPU with the receiver built in: ``rlix_plugins.vllm.cpu_worker.RlixCPUWorker``.

The CPU twin of :class:`rlix_plugins.vllm.gpu_worker.RlixGPUWorker` (same route, used by the CPU tests
and the CPU demo to exercise the ``worker_cls`` composition that NeMo RL uses on GPU).
"""

from __future__ import annotations

from rlix_plugins.vllm import internals

# Before vLLM's class is imported: a vLLM without it (or without what the receiver reads) fails here with one line
# naming the version and the attribute, not with an ImportError deep in the first weight sync.
internals.check("cpu", imports=True, modules=internals.WORKER_MODULES)

from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

from rlix_plugins.vllm.receiver import RlixReceiverMixin  # noqa: E402
from rlix_plugins.vllm.start import start_under_grant  # noqa: E402

__all__ = ["RlixCPUWorker"]


class RlixCPUWorker(RlixReceiverMixin, CPUWorker):
    """vLLM's CPU worker plus the six receiver methods. Adds no state and no constructor."""

    def init_device(self) -> None:
        # A time-shared pipeline's engine touches the GPU only under its start-up grant (control.start_gate).
        start_under_grant(self)
        super().init_device()
