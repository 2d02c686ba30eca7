#!/usr/bin/env bash
# The GPU device check, as one command on the one-GPU machine (see run_device_check.py):
#   device run, carry [".whl"]:  bash tests/gpu/run_device_check.sh
# Installs the wheels carried in .whl/ (tests/gpu/fetch_wheels.sh), runs the check under a
# 470 s limit and leaves the table, the rows (JSON) and the worker logs in $OUT. NCCL is the
# machine's torch's own (ProcessGroupNCCL, ftmesh's one NCCL binding): nothing to install.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ftmesh-devcheck}
mkdir -p "$OUT/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
{ nvidia-smi -L; python3 -c "import torch, cupy; print('torch', torch.__version__, \
  'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'cupy', cupy.__version__)"; \
} 2>&1 | tee "$OUT/logs/machine.txt"
timeout -k 10 470 python3 tests/gpu/run_device_check.py --logs "$OUT/logs" \
  --json "$OUT/rows.json" "$@" 2>"$OUT/logs/progress.txt" | tee "$OUT/table.txt"
rc=${PIPESTATUS[0]}
tail -n 3 "$OUT/logs/progress.txt" >&2
exit "$rc"
