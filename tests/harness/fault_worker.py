"""vLLM-CPU ``worker_cls`` that breaks on demand: the chaos tools' receiver, sleep and wake faults.

``FaultCPUWorker`` is :class:`~rlix_plugins.vllm.cpu_worker.RlixCPUWorker` (the demo's own worker) plus one
check at three points: a bucket arriving at the receiver (``update``: both transports pass ``_rlix_accept``),
``sleep`` and ``wake``. The check (:func:`~tests.harness.fault_file.claim_fault`) reads the JSON file named by ``RLIX_FAULT_FILE`` (written by
:mod:`tests.harness.chaos` when it injects a fault), e.g. ``{"op": "update", "action": "hang"}``:

* ``hang``: never return (a receiver that stops answering); ``slow``: sleep ``seconds`` first (a window in
  which the chaos tools kill a process mid-operation); ``corrupt``: flip one byte of the received bucket
  before it is checksummed and staged (the sender's checksums must catch it).

A fault fires once: the worker claims it by renaming the file (atomic), then puts its record, pid included, at
``<file>.hit``, which is how the injector knows the operation is in progress.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rlix_plugins.vllm.cpu_worker import RlixCPUWorker
from tests.harness.fault_file import claim_fault

if TYPE_CHECKING:
    import torch

__all__ = ["FaultCPUWorker"]

def _act(fault: dict[str, Any] | None) -> str | None:
    if fault is None:
        return None
    if fault["action"] == "hang":
        while True:
            time.sleep(3600)
    if fault["action"] == "slow":
        time.sleep(float(fault.get("seconds", 5.0)))
    return str(fault["action"])


class FaultCPUWorker(RlixCPUWorker):
    """See the module docstring."""

    def sleep(self, level: int = 1) -> None:
        _act(claim_fault("sleep"))
        super().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        _act(claim_fault("wake"))
        super().wake_up(tags)

    def _rlix_accept(self, sync: Any, named: list[tuple[str, torch.Tensor]], *, borrowed: bool) -> int:
        if _act(claim_fault("update")) == "corrupt" and named:
            import torch

            name, tensor = named[0]
            flipped = tensor.clone()
            flipped.view(-1).view(torch.uint8)[0] ^= 0xFF
            named = [(name, flipped), *named[1:]]
        return super()._rlix_accept(sync, named, borrowed=borrowed)
