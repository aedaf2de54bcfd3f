"""rlix-plugins: GPU time-sharing for NVIDIA NeMo RL.

Sub-packages (dependencies flow one way: the later ones use the earlier ones); each ``__init__`` says what it
offers and what it must never import:

* ``control``   - the Ray control plane (planner, scheduler, orchestrator, coordinators, trace).
* ``transport`` - bucket format, versioned CPU bucket cache, weight transports.
* ``vllm``      - the vLLM worker-extension receiver and its ``vllm.general_plugins`` hook.
* ``pipeline``  - the host-independent pipeline runtime (routing, resizing, per-step weight sync).
* ``nemo_rl``   - the NeMo RL hook implementation (adapters of NeMo RL objects to the runtime).
* ``demo``      - the built-in GRPO-shaped host behind ``rlix demo``, and its tiny local Qwen2 model.
* ``testing``   - test and benchmark endpoints, not product API (nothing in the core package imports it).

Modules: ``errors`` (every error raised on purpose derives from ``RlixError``), ``cli`` (the ``rlix`` command),
``patching`` (``rlix patch``: the NeMo RL patch series shipped in ``patches/``).

Entry points (``pyproject.toml``): ``nemo_rl.rlix_hooks`` → ``rlix_plugins.nemo_rl.hooks:NemoRLHooks``,
``vllm.general_plugins`` → ``rlix_plugins.vllm.plugin:register``, the ``rlix`` script → ``rlix_plugins.cli:main``.

``control`` and ``transport`` never import NeMo RL or vLLM; nothing imports NeMo RL at import time. Importing
this package imports nothing at all: vLLM imports it in every process for the general plugin, NeMo RL's loader
for the hooks, NeMo RL's Ray workers for ``nemo_rl.worker_ops`` (``tests/test_public_api.py``).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
