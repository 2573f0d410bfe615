#!/usr/bin/env bash
# Install everything, build hopper_moe and run the MoE-layer benchmark: latency and % of the
# roofline floor per backend on the GPU; on a machine without a GPU a small layer through the
# CPU path. Extra arguments go to benchmarks/bench_moe.py (see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. "${HOPPER_MOE_VENV:-.venv}/bin/activate"
python benchmarks/bench_moe.py "$@"
