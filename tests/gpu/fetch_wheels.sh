#!/usr/bin/env bash
# Download, into .whl/, the wheels the device check needs on the GPU machine (which has no
# network and whose python3 is 3.12 with torch, CuPy, NCCL, msgpack and hypothesis, but not
# trio, zeroconf, blake3 or cryptography). Versions are those of this checkout's .venv, so
# the GPU machine runs what CI tested. NCCL comes with the machine's torch (ProcessGroupNCCL
# is ftmesh's one NCCL binding), so no NCCL binding is fetched.
# Run here, once per checkout; then name .whl in the device tool's carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
pin() {  # NAME -> NAME==VERSION installed in .venv (or NAME if it is not there)
  local v
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) \
    && echo "$1==$v" || echo "$1"
}
PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
get() {  # DIR SPEC...
  local dir=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$dir" "$@"
}
rm -rf .whl && mkdir -p .whl
for name in trio outcome sniffio zeroconf ifaddr blake3 cryptography cffi pycparser; do
  get .whl "$(pin "$name")"
done
du -sh .whl
ls .whl
