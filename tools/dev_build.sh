#!/usr/bin/env bash
# Incremental in-place build of hopper_moe._C for development (ninja recompiles only what
# changed). Serialized with a lock so several shells can call it. The full log, ptxas report
# included, goes to build/build.log; tools/check_ptxas.py fails the build on any spill or
# serialized wgmma.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-2}
mkdir -p build
exec 9>build/.dev_build.lock
flock 9
"$PY" setup.py build_ext --inplace >build/build.log 2>&1
rc=$?
grep -E "error|warning" build/build.log | grep -v -E "deprecated|^ptxas info" | head -40
if [ $rc -ne 0 ]; then echo "build failed (exit $rc): see build/build.log"; exit $rc; fi
"$PY" tools/check_ptxas.py build/build.log
