"""Run a NeMo RL entry script with every Ray actor on this interpreter (the GPU machine has no uv and no network).

NeMo RL starts its actors with ``uv run --extra <x>`` executables (``PY_EXECUTABLES``); ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1``
covers only the vLLM/Megatron/SGLang/TRT-LLM workers, not the DTensor policy worker (``PY_EXECUTABLES.FSDP``), the
collector and the replay buffer. This launcher points every ``PY_EXECUTABLES`` entry at ``sys.executable`` before
the registry reads them, then runs the script as ``__main__``. A GPU-kit tool, not part of the product:

    python3 tools/gpu-offline/gpu/nemo_rl_system_python.py examples/run_grpo.py --config ... key=value ...
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from nemo_rl.distributed import virtual_cluster

for name in dir(virtual_cluster.PY_EXECUTABLES):
    if name.isupper():
        setattr(virtual_cluster.PY_EXECUTABLES, name, sys.executable)

# NeMo RL's TransferQueue adapter gives TQ's controller and storage actors a runtime_env that pip-installs
# TransferQueue from git (its requirement read from the installed nemo-rl's metadata). Here NeMo RL runs from
# source, there is no network, and TransferQueue is already importable by every actor: mark that injection done
# so the actors inherit this interpreter, as NeMo RL's own docstring says they do once the image carries TQ.
try:
    from nemo_rl.data_plane.adapters import transfer_queue as _tq_adapter
except ImportError:  # no TransferQueue here: only the data-plane loop needs it
    pass
else:
    _tq_adapter._TQ_RUNTIME_ENV_PATCHED = True

if os.environ.get("RLIX_CONTROL_PLANE") == "rlix":  # rlix's own INFO lines (grants, expands) in the driver's log
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("rlix_plugins").addHandler(handler)
    logging.getLogger("rlix_plugins").setLevel(logging.INFO)

script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
