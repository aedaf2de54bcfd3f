"""rlix-plugins: GPU time-sharing for NVIDIA NeMo RL.

Sub-packages (dependencies flow one way, top to bottom):

* ``control``   – the Ray control plane (planner, scheduler, orchestrator, coordinators, trace).
* ``transport`` – bucket format, versioned CPU bucket cache, weight transports.
* ``vllm``      – the vLLM worker-extension receiver and its ``vllm.general_plugins`` hook.
* ``nemo_rl``   – the NeMo RL hook implementation and pipeline runtime.

``control`` and ``transport`` never import NeMo RL or vLLM; nothing imports NeMo RL at import time.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
