"""Test double of NeMo RL's ``VllmInternalWorkerExtension`` refit contract (NeMo RL cannot be installed here).

Implements exactly the two members our receiver relies on at the pinned NeMo RL commit
(``nemo_rl/models/generation/vllm/vllm_backend.py``: ``_load_weights(self, weights)`` and the context
manager ``_weight_update_lifecycle(self, transport)`` yielding ``finalize``); ``test_vllm_nemo_contract``
checks those signatures against the real source when ``NEMO_RL_SRC`` is set. Loading delegates to
vLLM's real layer-wise reload (the CPU path), so the engine's outputs are real.

Passed to vLLM as ``worker_extension_cls`` next to ``worker_cls=rlix_plugins.vllm.cpu_worker.RlixCPUWorker``:
the same composition NeMo RL gets with ``vllm_kwargs.worker_cls`` (vLLM appends the extension to our
worker class's bases).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class NemoContractExtension:
    def _standin_calls(self) -> dict[str, Any]:
        calls = getattr(self, "_standin_calls_dict", None)
        if calls is None:
            calls = {"load_batches": 0, "loaded_names": 0, "finalize": 0, "lifecycle_exit": 0, "transports": []}
            self._standin_calls_dict = calls
        return calls

    def _load_weights(self, weights: list[tuple[str, Any]]) -> None:
        calls = self._standin_calls()
        calls["load_batches"] += 1
        calls["loaded_names"] += len(weights)
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]

    @contextmanager
    def _weight_update_lifecycle(self, transport: str) -> Iterator[Any]:
        calls = self._standin_calls()
        calls["transports"].append(transport)

        def finalize() -> None:
            calls["finalize"] += 1

        yield finalize
        calls["lifecycle_exit"] += 1

    def standin_report(self) -> dict[str, Any]:
        return dict(self._standin_calls())
