#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: examples/train_digits.py trained on a local mesh
# of 4 workers that find each other with no configuration; one worker is killed with SIGKILL
# at step 20 and a new one joins at step 40. Ends with "test accuracy: 0.NNN".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ftmesh launch -n 4 --kill-at 20 --join-at 40 examples/train_digits.py "$@"
