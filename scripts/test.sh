#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, and the whole pytest suite.
# The suite runs on 3 xdist workers (the lab and the heavy trainings each in one group, see
# tests/conftest.py) and prints its 30 slowest tests. Arguments go to pytest (`-n 0`: serial).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check ftmesh tests examples
.venv/bin/ruff format --check ftmesh tests examples
echo "== mypy"
.venv/bin/mypy
.venv/bin/lint-imports --no-logo  # the import contracts: layers and the pure core (pyproject.toml)
echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider -n 3 --dist loadgroup --durations=30 "$@"
