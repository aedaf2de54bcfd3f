#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: lint, types, then pytest without GPU tests (what CI runs).
# --quick: the lane for iterating (about 4 minutes on 2 cores once .venv exists): no set-up when .venv is
# there, and only the tests that need neither vLLM nor the session's Ray cluster nor are marked slow.
# pytest exit code 5 ("no tests collected") is a failure here, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
markers="not gpu"
if [ "${1:-}" = "--quick" ]; then
  shift
  markers="not gpu and not slow and not vllm and not ray"
  [ -x .venv/bin/python ] || bash scripts/setup.sh
else
  bash scripts/setup.sh
fi
.venv/bin/ruff check rlix_plugins tests benchmarks
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -m "$markers" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi
exit "$rc"
