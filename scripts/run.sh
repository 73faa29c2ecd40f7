#!/usr/bin/env bash
# Set up (idempotent) and run the main job: tokenize, CED prefill, decode, report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/generate.py "$@"
