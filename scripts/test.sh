#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, and the whole pytest suite (what CI
# runs). The suite runs on FTMESH_TEST_WORKERS xdist workers (default 3: the lab's network
# namespaces and the heavy trainings each in one group, the rest spread, see
# tests/conftest.py; about 17 minutes on 2 cores, against about 40 serially;
# FTMESH_TEST_WORKERS=0 runs it serially) and prints its 30 slowest tests; arguments go to
# pytest.
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
workers="${FTMESH_TEST_WORKERS:-3}"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" --dist loadgroup "$@"
