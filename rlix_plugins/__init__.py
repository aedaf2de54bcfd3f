"""rlix-plugins: GPU time-sharing for NVIDIA NeMo RL.

Sub-packages (dependencies flow one way: the later ones use the earlier ones):

* ``control``   - the Ray control plane (planner, scheduler, orchestrator, coordinators, trace).
* ``transport`` - bucket format, versioned CPU bucket cache, weight transports.
* ``vllm``      - the vLLM worker-extension receiver and its ``vllm.general_plugins`` hook.
* ``pipeline``  - the host-independent pipeline runtime (routing, resizing, per-step weight sync).
* ``nemo_rl``   - the NeMo RL hook implementation (adapters of NeMo RL objects to the runtime).
* ``demo``      - the built-in GRPO-shaped host behind ``rlix demo``.

``control`` and ``transport`` never import NeMo RL or vLLM; nothing imports NeMo RL at import time.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
