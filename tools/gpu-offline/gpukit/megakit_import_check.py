"""Import the Megatron stack of .gpukit/megakit as far as this machine allows and say where each import stops.

Run by tools/gpu-offline/make_gpu_megakit.sh with the kit's trees and wheels on PYTHONPATH (on a CPU machine the TE extension
is absent, so whatever imports ``transformer_engine.pytorch`` stops there); on the GPU machine everything must pass.
"""

from __future__ import annotations

import importlib
import sys
import traceback

MODULES = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.datasets.utils",
    "transformer_engine",
    "transformer_engine.pytorch",
    "megatron.core.transformer.transformer_config",
    "megatron.bridge",
    "megatron.bridge.models",
    "nemo_rl.models.megatron.setup",
    "nemo_rl.models.policy.workers.megatron_policy_worker",
)


def main() -> int:
    failed = 0
    for name in sys.argv[1:] or MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report and go on: the point is how far the stack imports
            failed += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:160]} ({where.filename}:{where.lineno})")
        else:
            print(f"OK   {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
