"""Built-in demo host: tiny Qwen2 pipelines time-sharing GPUs through the shared pipeline runtime.

It is the worked example of a host (:mod:`rlix_plugins.pipeline`) and the machine the fault matrix and the chaos
soak break (their fault injection is test harness, outside the package: ``tests/harness``). ``rlix demo`` →
:func:`run_demo` (:mod:`.run`).

What it offers (the names below are importable from here; each is loaded on first use)
------------------------------------------------------------------------------------
* :func:`run_demo` (:mod:`.run`); it first refuses what :func:`check_fits` (:mod:`.capacity`) finds too many
  for G GPUs of this machine, saying why.
* :func:`build_tiny_qwen2`, :func:`write_tiny_qwen2_variant`, :func:`tiny_qwen2_weights` (:mod:`.tiny_model`) -
  the demo's model, built locally without the hub; the tests, benchmarks and GPU scripts build theirs with it.
* The pieces of a pipeline: :mod:`.engine` (vLLM DP-rank actors and the fleet), :mod:`.trainer`
  (policy-gradient step + CPU bucket cache owner), :mod:`.collector` (async-GRPO-shaped rollout through the
  router), :mod:`.pipeline` (the driver loop, in the patched NeMo RL hook order).

What it must never import
-------------------------
NeMo RL (the demo is the host that runs without it). Importing this package imports none of Ray, torch or vLLM:
its modules are imported where they run (vLLM worker processes import their ``worker_cls`` by qualified name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlix_plugins._lazy import lazy_exports

if TYPE_CHECKING:
    from rlix_plugins.demo.capacity import check_fits
    from rlix_plugins.demo.run import run_demo
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2, tiny_qwen2_weights, write_tiny_qwen2_variant

_MODULES = {
    "run_demo": "run", "check_fits": "capacity",
    "build_tiny_qwen2": "tiny_model", "tiny_qwen2_weights": "tiny_model", "write_tiny_qwen2_variant": "tiny_model",
}

__getattr__ = lazy_exports(__name__, _MODULES)


__all__ = ["build_tiny_qwen2", "check_fits", "run_demo", "tiny_qwen2_weights", "write_tiny_qwen2_variant"]
