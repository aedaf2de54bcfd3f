#!/usr/bin/env bash
# Build the conformance venv for NeMo RL's own CPU unit tests (default: .venv-nemo in the repo root).
#
# NeMo RL at the pin asks for Python 3.13 and is not pip-installable; its CPU unit tests run on Python 3.11
# with the CPU-importable subset of its dependencies (see rlix_plugins/patches/nemo-rl/7ea279a/README.md).
# NeMo RL itself is NOT installed: the conformance suite puts a (patched) copy of the checkout on PYTHONPATH.
#
# Usage: scripts/setup_nemo_rl_env.sh [VENV_DIR]          (idempotent; re-running only tops up)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${RLIX_NEMO_VENV:-$ROOT/.venv-nemo}}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
fi
PIP=("$VENV/bin/pip" install -q)

# torch first: CPU build (pip's find-links serves the local +cpu wheel where there is one).
"${PIP[@]}" "torch==2.13.0"

# The CPU-importable subset of NeMo RL's dependencies + its test group. GPU-only packages (nccl4py,
# cuda-bindings, nixl, flash-attn, mooncake, nvidia-*) are left out on purpose. TransferQueue: NeMo RL pins git
# c516143, the commit of PyPI's 0.1.9.
"${PIP[@]}" \
  "ray[default]>=2.55" wandb numpy datasets rich math-verify accelerate tensorboard omegaconf torchdata \
  nvidia-ml-py hydra-core tiktoken sentencepiece blobfile sympy pillow "transformers==5.8.1" pyzmq pybase64 \
  zstandard tensordict pydantic matplotlib plotly uvicorn fastapi soundfile scipy swanlab mlflow \
  "colored==2.2.3" pytest pytest-timeout pytest-asyncio pluggy typing_extensions "transferqueue==0.1.9"

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `transformers` model imports on CPU.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Python 3.11 shim: pydantic refuses typing.TypedDict fields before 3.12. A .pth-loaded module aliases it to
# typing_extensions.TypedDict in every process of this venv (Ray workers included).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/_rlix_py311_typeddict_shim.py" <<'PY'
"""Python 3.11 shim for NeMo RL's pydantic TypedDict configs (conformance venv only)."""
import sys
import typing

if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
PY
echo "import _rlix_py311_typeddict_shim" > "$SITE/_rlix_py311_typeddict_shim.pth"

# rlix-plugins itself, editable, so its entry points (rlix_plugins.nemo_rl hooks) are registered here.
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import ray, torch, transformers, pluggy, rlix_plugins  # noqa: F401
eps = [e.name for e in md.entry_points(group="nemo_rl.rlix_hooks")]
print(f"conformance venv ready: torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}, "
      f"pluggy {pluggy.__version__}, nemo_rl.rlix_hooks entry points {eps}")
PY
