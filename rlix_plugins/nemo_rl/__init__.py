"""NeMo RL host: the hook implementation patched NeMo RL loads, and the adapters of NeMo RL's objects to the
shared pipeline runtime (:mod:`rlix_plugins.pipeline`).

Patched NeMo RL (series ``rlix_plugins/patches/nemo-rl/``) resolves the ``nemo_rl.rlix_hooks`` entry point
(``rlix = "rlix_plugins.nemo_rl.hooks:NemoRLHooks"``) when ``RLIX_CONTROL_PLANE=rlix`` and calls the hooks at
``setup()`` and in its GRPO loop; everything of NeMo RL reaches this package as hook arguments.

What it offers (the names below are importable from here; each is loaded on first use)
------------------------------------------------------------------------------------
* :class:`NemoRLHooks` (:mod:`.hooks`) - the hook implementation; :mod:`.hookspec` is the hook specification,
  the one source of patch 0001's seam (``python -m rlix_plugins._seam_patch``).
* :class:`RlixRunConfig`, :func:`load_run_config` (:mod:`.config`) - the ``rlix:`` section of NeMo RL's config;
  :func:`validate_topology`, :func:`grpo_loop` (:mod:`.topology`) - the start-up checks and the loop kind;
  :func:`write_overlays` (:mod:`.recipe`) - ``rlix recipe``.
* :class:`NemoRuntime` (:mod:`.runtime_adapter`) - NeMo RL's objects plugged into the pipeline runtime, with
  :class:`NemoVllmFleet`, :class:`RouterShardSelector`, :func:`install_routing` (:mod:`.generation`),
  :class:`PolicyWeightSource` (:mod:`.weights`), :func:`nemo_rl_placement` (:mod:`.placement`) and the
  per-loop surfaces of :mod:`.loops`.
* Code that runs inside NeMo RL's Ray workers: :mod:`.worker_ops` (through ``__ray_call__``) and
  :mod:`.megatron_nccl` (Megatron's process groups torn down and rebuilt).

What it must never import
-------------------------
NeMo RL, at any module's import time (NeMo RL imports us, never the reverse; its objects arrive as arguments).
Importing this package (not its modules) imports none of Ray, torch, vLLM or pluggy: NeMo RL's loader resolves
the entry point in its driver, and its Ray workers import :mod:`.worker_ops` from their own virtualenvs through
the PYTHONPATH route (``tests/nemo_rl/without_nemo/test_pythonpath_route.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlix_plugins._lazy import lazy_exports

if TYPE_CHECKING:
    from rlix_plugins.nemo_rl.config import RlixRunConfig, load_run_config
    from rlix_plugins.nemo_rl.generation import NemoVllmFleet, RouterShardSelector, install_routing
    from rlix_plugins.nemo_rl.hooks import NemoRLHooks
    from rlix_plugins.nemo_rl.placement import nemo_rl_placement
    from rlix_plugins.nemo_rl.recipe import write_overlays
    from rlix_plugins.nemo_rl.runtime_adapter import NemoRuntime
    from rlix_plugins.nemo_rl.topology import grpo_loop, validate_topology
    from rlix_plugins.nemo_rl.weights import PolicyWeightSource

_MODULES = {
    "NemoRLHooks": "hooks", "RlixRunConfig": "config", "load_run_config": "config",
    "grpo_loop": "topology", "validate_topology": "topology", "write_overlays": "recipe",
    "NemoRuntime": "runtime_adapter", "NemoVllmFleet": "generation", "RouterShardSelector": "generation",
    "install_routing": "generation", "PolicyWeightSource": "weights", "nemo_rl_placement": "placement",
}

__getattr__ = lazy_exports(__name__, _MODULES)


__all__ = [
    "NemoRLHooks",
    "NemoRuntime",
    "NemoVllmFleet",
    "PolicyWeightSource",
    "RlixRunConfig",
    "RouterShardSelector",
    "grpo_loop",
    "install_routing",
    "load_run_config",
    "nemo_rl_placement",
    "validate_topology",
    "write_overlays",
]
