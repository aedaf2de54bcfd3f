"""A minimal Ray actor that owns one ``vllm.LLM`` (one DP rank) with the receiver extension.

Used by the demo and the tests where NeMo RL's own vLLM workers are not available; its RPC surface
mirrors theirs (``rlix_rpc(method, args)`` ~ ``checkpoint_engine_rpc(method, method_args)``), so
:class:`~rlix_plugins.vllm.driver.RayEngineRpc` drives either. Decorate at use:
``ray.remote(num_cpus=..., num_gpus=...)(RlixEngineActor)``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["RlixEngineActor"]


class RlixEngineActor:
    """Owns ``vllm.LLM(**llm_kwargs)``; ``env`` is applied before vLLM is imported."""

    def __init__(self, llm_kwargs: dict[str, Any], env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        from vllm import LLM

        from rlix_plugins.transport import export_node_env

        export_node_env()  # the engine core and its workers are child processes: they report this Ray node

        self.llm = LLM(**llm_kwargs)

    def rlix_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """``collective_rpc(method, args)`` on every worker of this engine."""
        return self.llm.collective_rpc(method, args=tuple(args))

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def generate_greedy(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        """Token ids of a greedy completion per prompt."""
        from vllm import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)

    def pid(self) -> int:
        return os.getpid()
