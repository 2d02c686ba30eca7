#!/usr/bin/env bash
# Sets up (if needed) and runs the main demo: a local mesh that finds itself with no
# configuration, loses a member to kill -9, and notices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/membership_demo.py "$@"
