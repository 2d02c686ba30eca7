#!/usr/bin/env bash
# Idempotent setup: system packages the tests need (when root: iproute2 and nftables for the
# lab, prometheus for the metrics tests), a virtual environment in .venv (from the
# distribution's optimized Python where there is one)
# with ftmesh and its dev, torch, lightning and docs extras; torch pinned to the CPU build by
# scripts/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v nft >/dev/null 2>&1 || need_apt+=(nftables)
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
command -v prlimit >/dev/null 2>&1 || need_apt+=(util-linux)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)  # the metrics tests scrape with it
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]} (lab tests, clock-skew and descriptor-limit tests)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${need_apt[@]}" >/dev/null
  else
    echo "setup: ${need_apt[*]} missing and not root: the tests needing them will be skipped" >&2
  fi
fi

# The interpreter: $PYTHON if set, else the distribution's Python 3.11 where there is one
# (Debian builds it with PGO and LTO: the suite's processes, mostly Python, ran on 15-33 %
# less CPU than on a source build without them, such as pyenv's default), else python3.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x /usr/bin/python3.11 ] && /usr/bin/python3.11 -c 'import ensurepip, venv' 2>/dev/null; then
    PY=/usr/bin/python3.11
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ftmesh-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[dev,torch,lightning,docs]'
  touch "$stamp"
fi
