#!/usr/bin/env bash
# Sets up (if needed) and runs every check: ruff, mypy, the import contracts, the docs site
# (strict) and the whole pytest suite (what CI runs), and prints its slowest tests and each
# stage's time; arguments go to pytest. The suite runs on FTMESH_TEST_WORKERS xdist workers
# (default 4; 0 runs it serially, about 36 minutes on 2 cores), then the tests marked `quiet`
# (timing that holds only where they get the CPU they ask for) in two lanes. In the parallel run
# each xdist group runs on one worker, one test at a time (tests/conftest.py says which test
# goes where): `lab` holds the lab tests marked `timing` (CPU throttles, fail-slow, loss
# rates, latency bounds, measured round trips), `lab-a` and `lab-b` split the functional lab
# tests (their namespaces never collide), `train` holds the trainings and benches whose
# assertions a second training beside them would bend and `train-b` the other trainings; the
# rest spreads. FTMESH_TEST_CPU=FILE writes each test's CPU seconds (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
t0=$SECONDS
stage() { echo "== $1 (at $((SECONDS - t0)) s)"; }
# Bytecode, written in the background while the linters run (on the other core): where Python
# writes none (PYTHONDONTWRITEBYTECODE, as on this project's CI hosts) every process the suite
# starts (hundreds of workers and nodes) would compile ftmesh's source again, about 0.4 s of
# CPU each (tests/test_node_procs.py: 22.1 / 26.3 s against 25.1 / 30.1 s without,
# interleaved), and every pytest worker would rewrite the test modules' asserts again (a
# collection with bytecode on keeps them: 6.1 s of CPU for a worker's collection, 11 s without).
# The same collection lists the quiet tail's tests, so that its two workers collect only their
# modules (a whole collection costs each about 7 s of CPU).
quiet_ids=$(mktemp)
trap 'rm -f "$quiet_ids"' EXIT
(
    .venv/bin/python -m compileall -q ftmesh tests examples > /dev/null
    env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -m pytest --co -q -p no:cacheprovider \
        -m quiet > "$quiet_ids" 2>/dev/null || true  # (a collection error shows in the run)
) &
bytecode=$!
stage ruff
.venv/bin/ruff check ftmesh tests examples
.venv/bin/ruff format --check ftmesh tests examples
stage mypy
.venv/bin/mypy
.venv/bin/lint-imports --no-logo  # the import contracts: layers and the pure core (pyproject.toml)
stage docs
# The site from docs/ and the docstrings (mkdocs.yml), offline; strict: a broken link, anchor
# or API reference fails. Not -q: mkdocs counts strict mode's warnings only when it logs them,
# so its INFO lines are kept back and shown, with the warnings, only when the build fails.
docs_site=$(mktemp -d)
if ! docs_log=$(NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$docs_site" 2>&1); then
    echo "$docs_log"
    rm -rf "$docs_site"
    exit 1
fi
rm -rf "$docs_site"
stage pytest
wait "$bytecode"
workers=${FTMESH_TEST_WORKERS:-4}
if [ "$workers" = 0 ]; then
    exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
fi
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "$workers" \
    --dist loadgroup -m "not quiet" "$@" || status=$?
if [ "$status" = 5 ]; then status=0; fi  # 5: the selection held only quiet tests
# The tests marked `quiet` hold only when they get the CPU they ask for: after the parallel
# run, on two workers, one test at a time in each of two lanes (tests/conftest.py,
# QUIET_LANES: never two lab timing tests at once). (Beside the parallel run at nice 10 they
# passed, but their CPU starved the lab's timing tests: fail-slow step-outs in the DiLoCo lab
# test, a throttled straggler's missed steps.)
stage "pytest: the quiet tail, two lanes"
tail=0
quiet=("$@")
if [ $# = 0 ]; then  # the whole suite: its quiet tests by id (none listed: all collected again)
    mapfile -t quiet < <(grep '::' "$quiet_ids" || true)
fi
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -n 2 --dist loadgroup \
    -m quiet "${quiet[@]}" || tail=$?
if [ "$tail" != 0 ] && [ "$tail" != 5 ]; then  # 5: the selection held no quiet test
    status=$tail
fi
stage "done: exit $status"
exit "$status"
