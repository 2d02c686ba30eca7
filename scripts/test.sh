#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, and the whole pytest suite.
# The suite runs serially by default (what CI runs) and prints its 30 slowest tests; arguments
# go to pytest. `bash scripts/test.sh -n 3 --dist loadgroup` runs it on 3 xdist workers (the
# lab and the heavy trainings each in one group, see tests/conftest.py): about 20 minutes
# instead of about 35 on 2 cores, not yet as reliable (docs/STATUS.md).
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
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
