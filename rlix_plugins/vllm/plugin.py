"""The ``vllm.general_plugins`` entry point: ``rlix = "rlix_plugins.vllm.plugin:register"``.

vLLM calls :func:`register` in every process that loads plugins (the driver, ``EngineCore``, each
worker, the model-registry probe subprocess), possibly several times; it must be cheap and idempotent.

* Always, first: asks Linux for the AMX tile state of this process (:mod:`rlix_plugins.vllm.amx`; x86-64
  Linux CPUs with AMX only, never raises). vLLM-CPU runs AMX attention kernels without asking, which
  kills a worker with SIGILL when its first forward is small. On CPUs without AMX it only reads
  ``/proc/cpuinfo``; on AMX hosts of GPU machines the grant is harmless (torch's oneDNN asks the same on
  its first AMX GEMM).
* ``RLIX_CONTROL_PLANE`` unset (or anything but ``rlix``): nothing else. No environment variable,
  registry, logger or class is touched: plain vLLM and standalone NeMo RL behave as without the package
  (except that an AMX CPU no longer crashes them).
* ``RLIX_CONTROL_PLANE=rlix``: imports the receiver module once per process, so a broken install fails
  at engine start (vLLM logs the exception and names the plugin) instead of at the first weight sync,
  checks the vLLM internals we rely on (:mod:`rlix_plugins.vllm.internals`, in the modules the process already
  imported; a missing one raises one line naming the vLLM version and the attribute), and records that the plugin
  ran here (``rlix_receiver_info()["plugin_loaded"]`` reports it per worker).
  Where vLLM's ``EngineCore`` is imported (vLLM loads plugins in its ``__init__``), it lets a sync's finish
  call reset the prefix cache (:mod:`rlix_plugins.vllm.engine_hook`; only that rlix method is affected). In a
  time-shared NeMo RL engine it moves ``VLLM_PORT`` to the engine's own port window (:mod:`rlix_plugins.vllm.ports`).

The entry point does not inject the receiver into engines: an engine gets it from its construction
arguments (see :mod:`rlix_plugins.vllm`), because vLLM resolves ``worker_extension_cls`` /
``worker_cls`` per engine and a process-global patch would leak into engines that did not ask for it.
"""

from __future__ import annotations

import logging
import os

__all__ = ["CONTROL_PLANE_ENV", "enabled", "loaded_here", "register"]

#: Environment variable that switches rlix-plugins on; any other value than ``"rlix"`` means standalone.
CONTROL_PLANE_ENV = "RLIX_CONTROL_PLANE"

_loaded = False


def enabled() -> bool:
    """True when this process runs under the rlix control plane. Read here, not through ``rlix_plugins.envs``: vLLM
    imports this module in every process, standalone ones included, where nothing else of ours may be imported."""
    return os.environ.get(CONTROL_PLANE_ENV) == "rlix"


def loaded_here() -> bool:
    """True once :func:`register` ran in this process with the control plane enabled."""
    return _loaded


def register() -> None:
    """vLLM general-plugin hook (see module docstring). Safe to call any number of times."""
    global _loaded
    from rlix_plugins.vllm.amx import request_amx_permission

    request_amx_permission()  # before any model code of this process runs (see rlix_plugins.vllm.amx)
    if not enabled():
        return
    from rlix_plugins.vllm import engine_hook

    engine_hook.install()  # each call: an in-process EngineCore is imported after the driver's first call
    from rlix_plugins.vllm.ports import apply_port_window

    apply_port_window()  # before this process's engine picks ports (vLLM reads VLLM_PORT lazily until it is up)
    if _loaded:
        return
    from rlix_plugins.vllm import internals, receiver  # fail at engine start, not mid-sync

    # The vLLM internals we rely on, in the modules this process has imported (no import: this runs in every vLLM
    # process); a missing required one raises one line naming the vLLM version and the attribute.
    internals.check(internals.current_platform_name())
    _loaded = True
    logging.getLogger(__name__).info(
        "rlix vLLM plugin loaded in pid %d (receiver %s)", os.getpid(), receiver.__name__
    )
