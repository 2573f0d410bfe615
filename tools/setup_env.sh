#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv, install what hopper_moe needs and build the
# extension in place. Idempotent: a second run only rebuilds what changed.
#
#   PYTHON=python3.11 bash tools/setup_env.sh      # choose the interpreter for the venv
#   HOPPER_MOE_VENV=/path/to/venv                   # use another venv location
# The build log (with ptxas' per-kernel registers and spills) is build/build.log; the build
# fails if any kernel spills or uses local memory, or if ptxas serializes its wgmma
# (tools/check_ptxas.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HOPPER_MOE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade "pip>=23" "setuptools>=64" wheel
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.14.1"
python -m pip install -q numpy pytest ninja matplotlib
python -m pip install -q --no-deps "nvidia-cutlass==4.2.0.0"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
  echo "setup_env: no nvcc found: building the CPU-only extension (HOPPER_MOE_CPU_ONLY=1)"
  export HOPPER_MOE_CPU_ONLY=1
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p build
echo "setup_env: building hopper_moe._C (MAX_JOBS=$MAX_JOBS; log: build/build.log)"
start=$(date +%s)
# An in-place build (ninja recompiles only what changed on later runs) and a .pth file that
# puts python/ on the venv's path: the same result as `pip install --no-build-isolation -e .`,
# which would rebuild everything in a fresh temporary folder each time.
if ! python setup.py build_ext --inplace >build/build.log 2>&1; then
  grep -E "error" build/build.log | head -40
  echo "setup_env: build failed, see build/build.log"; exit 1
fi
echo "$PWD/python" >"$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hopper_moe_dev.pth"
echo "setup_env: built in $(( $(date +%s) - start )) s"
python tools/check_ptxas.py build/build.log
