#!/usr/bin/env bash
# Create .venv (Python 3.12) with the pinned versions of the GPU machine, and install the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python" python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "need Python >= 3.12 (set PYTHON=...)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
# the package is installed editable: pip runs again only when the dependencies change
stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat .venv/.dsv41-installed 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # PYTHONWARNINGS: quiets setuptools' generic note on editable installs (a build-time warning)
  PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  echo "$stamp" > .venv/.dsv41-installed
fi
# the reference fixtures the tests read: verified and extracted once into .fixtures-cache/
.venv/bin/python -m dsv41_jax.testing.fixtures >/dev/null
