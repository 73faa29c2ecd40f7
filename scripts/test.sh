#!/usr/bin/env bash
# Set up (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# two workers (CI has 2 cores; tests/conftest.py groups the tests and orders the groups, longest
# first): TEST_WORKERS=0 runs in-process
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
