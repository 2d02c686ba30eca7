#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, and the whole pytest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check ftmesh tests examples
.venv/bin/ruff format --check ftmesh tests examples
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
