#!/usr/bin/env bash
# The NeMo RL conformance suite in one command (see patches/nemo-rl/7ea279a/README.md).
#
#   NEMO_RL_SRC=/path/to/RL scripts/conformance.sh [--nemo-rl-version V] [--quick] [extra pytest args]
#
# NEMO_RL_SRC: a git checkout of NVIDIA-NeMo/RL at a supported version (main at 7ea279a, or v0.7.0), left untouched:
# the suite works on clones of its HEAD, patched with that version's series. --nemo-rl-version (0.7.0, 7ea279a)
# refuses a checkout of another version. Builds .venv (scripts/setup.sh) and the conformance venv .venv-nemo
# (scripts/setup_nemo_rl_env.sh) when missing. --quick skips NeMo RL's slow test_async_utils.py (~8 min per run).
# Runs every NeMo RL test, all three parts of tests/nemo_rl (tests/nemo_rl/README.md), and the patch tool's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NEMO_RL_SRC:?set NEMO_RL_SRC to a NeMo RL checkout at a supported version (main at 7ea279a, or v0.7.0)}"
WANT=""
if [ "${1:-}" = "--nemo-rl-version" ]; then WANT="${2:?--nemo-rl-version needs a value: 0.7.0 or 7ea279a}"; shift 2; fi
export NEMO_RL_SRC
[ -x .venv/bin/python ] || bash scripts/setup.sh
NEMO_PY="${RLIX_NEMO_PYTHON:-$PWD/.venv-nemo/bin/python}"
[ -x "$NEMO_PY" ] || bash scripts/setup_nemo_rl_env.sh
# Keep the conformance venv's editable install (and its entry points) current.
"$NEMO_PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
SELECT="not gpu"
if [ "${1:-}" = "--quick" ]; then SELECT="not gpu and not slow"; shift; fi
.venv/bin/python - <<PY
from rlix_plugins.patching import find_checkout, series_status
root, head = find_checkout("$NEMO_RL_SRC")
status = series_status(root, head)
print(status.report())
want = "$WANT"
if want and want.lstrip("v") != (status.series.release or "") and not status.series.name.startswith(want):
    raise SystemExit(f"--nemo-rl-version {want}: NEMO_RL_SRC is {status.series.describes}; check out {want} there")
PY
exec .venv/bin/python -m pytest tests/nemo_rl tests/test_patching.py -m "$SELECT" -s -rA -p no:cacheprovider "$@"
