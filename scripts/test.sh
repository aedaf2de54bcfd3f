#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: lint, types, then pytest without GPU tests (what CI runs).
# --quick: the lane for iterating (about 4 minutes on 2 cores once .venv exists): no set-up when .venv is
# there, and only the tests that need neither vLLM nor the session's Ray cluster nor are marked slow.
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
# pytest exit code 5 (no tests collected) fails, never passes silently.
lane() {
  set +e
  .venv/bin/python -m pytest "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then echo "pytest collected no tests ($*): failing on purpose" >&2; return 1; fi
  return "$rc"
}
if [ "$#" -gt 0 ]; then
  lane -m "$markers" "$@"
  exit $?
fi
# The whole suite: the modules that start a Ray cluster of their own (marker own_cluster) run in a second pytest
# process, so that no long-lived driver switches between clusters.
# --durations: the slowest tests of each process, to keep the suite within CI's time.
rc=0
lane -m "$markers and not own_cluster" --durations=25 || rc=$?
lane -m "$markers and own_cluster" --durations=10 || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
exit "$rc"
