"""How received weights get into the running vLLM model: three loaders, picked per worker.

* :class:`NemoRlLoader` - the worker is NeMo RL's ``VllmInternalWorkerExtension`` (our mixin sits in
  front of it in the MRO, see :mod:`rlix_plugins.vllm`): ``self._load_weights(weights)`` per batch
  (Gemma3 name fix, draft/MTP split, FP8-aware load) and NeMo's finalize
  ``with self._weight_update_lifecycle(...) as finalize: finalize()``
  (``process_weights_after_loading`` + MTP post-processing, then the FP8 KV-cache pass). Identical to
  NeMo RL's own refit. Detected by duck typing on those two methods, so nothing imports NeMo RL.
* :class:`VllmInplaceLoader` - plain vLLM on GPU: ``model.load_weights`` per batch, then
  ``process_weights_after_loading`` once.
* :class:`VllmLayerwiseReloadLoader` - plain vLLM on CPU: vLLM-CPU repacks Linear weights after
  loading and leaves ``layer.weight`` empty, so ``model.load_weights`` fails on every Linear layer.
  ``model_runner.reload_weights(weights_iterator=...)`` re-materialises each layer, loads and repacks it;
  a layer must receive all of its tensors in one call (a half-loaded fused qkv layer would be processed
  with garbage), so this loader is ``whole_model_only`` and the receiver stages buckets until finalize.

All names are HF checkpoint names (``q_proj``/``k_proj``/``v_proj``; vLLM fuses them itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rlix_plugins.vllm.internals import runner_model

if TYPE_CHECKING:
    import torch

__all__ = [
    "NemoRlLoader",
    "VllmInplaceLoader",
    "VllmLayerwiseReloadLoader",
    "WeightLoader",
    "refresh_cpu_packed_copies",
    "select_loader",
]

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]

#: Transport label NeMo RL's ``_weight_update_lifecycle`` receives from us (it ignores the value at the pin).
NEMO_RL_TRANSPORT_LABEL = "rlix"


class WeightLoader(Protocol):
    """Loads named HF tensors into one vLLM worker's model. Runs on the worker's thread only."""

    #: short name reported by ``rlix_receiver_info`` and in errors
    name: str
    #: True when :meth:`load` must receive every tensor of a layer in one call (CPU layer-wise reload)
    whole_model_only: bool

    def load(self, worker: Any, weights: NamedTensors) -> None: ...

    def post_process(self, worker: Any) -> None:
        """Once per sync after the last :meth:`load`: kernel repacking, FP8 scales, drafter refresh."""
        ...


class NemoRlLoader:
    """NeMo RL's refit loading and finalize (see module docstring)."""

    name = "nemo_rl"
    whole_model_only = False

    def load(self, worker: Any, weights: NamedTensors) -> None:
        # NeMo's _load_weights mutates the list in place (Gemma3 rename): hand it a fresh list.
        worker._load_weights(list(weights))

    def post_process(self, worker: Any) -> None:
        with worker._weight_update_lifecycle(NEMO_RL_TRANSPORT_LABEL) as finalize:
            finalize()


class VllmInplaceLoader:
    """vLLM's own path on GPU: in-place ``load_weights`` then ``process_weights_after_loading``."""

    name = "vllm_inplace"
    whole_model_only = False

    def load(self, worker: Any, weights: NamedTensors) -> None:
        runner_model(worker).load_weights(weights=list(weights))

    def post_process(self, worker: Any) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        runner = worker.model_runner
        with set_current_vllm_config(runner.vllm_config):
            process_weights_after_loading(runner.model, runner.model_config, worker.device)


class VllmLayerwiseReloadLoader:
    """vLLM's layer-wise in-place reload (the working path on vLLM-CPU); post-processing is built in."""

    name = "vllm_layerwise_reload"
    whole_model_only = True

    def load(self, worker: Any, weights: NamedTensors) -> None:
        # Worker.reload_weights wraps model_runner.reload_weights in set_current_vllm_config.
        worker.reload_weights(weights_iterator=iter(list(weights)))

    def post_process(self, worker: Any) -> None:
        return None


def refresh_cpu_packed_copies(worker: Any) -> int:
    """vLLM-CPU only: re-pack every layer that keeps its ``weight`` next to a pre-packed GEMM copy.

    Hazard (vLLM-CPU 0.32, found by comparing with a fresh engine): with tied embeddings the layer-wise
    reload gives ``lm_head`` no tensor ("ParallelLMHead: Failed to load weights"), so its pre-packed
    ``cpu_linear`` keeps the OLD embedding while ``embed_tokens`` holds the new one: logits come from
    stale weights and greedy outputs differ from a fresh engine. Linear layers drop their ``weight``
    after packing (numel 0) and are skipped; embedding-style layers are cheap to re-pack. Returns the
    number of layers re-packed.
    """
    count = 0
    for module in runner_model(worker).modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if callable(getattr(module, "cpu_linear", None)) and method is not None and weight is not None \
                and getattr(weight, "numel", lambda: 0)() > 0:
            method.process_weights_after_loading(module)
            count += 1
    return count


def is_nemo_rl_worker(worker: Any) -> bool:
    """True when NeMo RL's ``VllmInternalWorkerExtension`` (or anything with its refit contract) is mixed in."""
    return callable(getattr(worker, "_load_weights", None)) and callable(
        getattr(worker, "_weight_update_lifecycle", None)
    )


def select_loader(worker: Any) -> WeightLoader:
    """Pick the loader for ``worker``: NeMo RL's when present, else vLLM's path for the platform."""
    if is_nemo_rl_worker(worker):
        return NemoRlLoader()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return VllmLayerwiseReloadLoader()
    return VllmInplaceLoader()
