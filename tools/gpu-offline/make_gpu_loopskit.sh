#!/usr/bin/env bash
# Build .gpukit/loopskit: the wheels tools/gpu-offline/gpu_nemo_rl_loops.sh needs beyond .gpukit/nemokit (the GPU machine has
# no network). Run here, from the repo root, with PyPI reachable:
#   bash tools/gpu-offline/make_gpu_loopskit.sh
# TransferQueue: NeMo RL pins git c516143, the commit of the v0.1.9 release (PyPI transferqueue==0.1.9); msgspec:
# its one dependency that neither the GPU image nor the kits provide (the others: ray, tensordict, pyzmq, hydra-core,
# omegaconf, numpy, psutil, prometheus-client). Not here: the Megatron stack the SingleController needs (see the
# header of tools/gpu-offline/gpu_nemo_rl_loops.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.gpukit/loopskit
PY=${PYTHON:-python3}
rm -rf "$KIT" && mkdir -p "$KIT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$KIT" "transferqueue==0.1.9" msgspec
ls -l "$KIT"
