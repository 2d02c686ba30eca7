#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, and the whole pytest suite (what CI
# runs) and prints its 30 slowest tests; arguments go to pytest. The suite runs serially by
# default (about 40 minutes on 2 cores). FTMESH_TEST_WORKERS=3 runs it on 3 xdist workers
# (the lab's network namespaces and the heavy trainings each in one group, the rest spread,
# see tests/conftest.py): 12-17 minutes on 2 cores, but not yet reliable enough for CI: at
# that load some end-to-end tests that assume a lightly loaded host fail now and then
# (docs/STATUS.md names them).
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
parallel=()
if [ "${FTMESH_TEST_WORKERS:-0}" != 0 ]; then
    parallel=(-n "$FTMESH_TEST_WORKERS" --dist loadgroup)
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "${parallel[@]}" "$@"
