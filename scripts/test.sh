#!/usr/bin/env bash
# Set up (idempotent) and run the test suite: lint, types, then pytest without GPU tests.
# pytest exit code 5 ("no tests collected") is a failure here, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check rlix_plugins tests benchmarks
.venv/bin/mypy
set +e
.venv/bin/python -m pytest -m "not gpu" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi
exit "$rc"
