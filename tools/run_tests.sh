#!/usr/bin/env bash
# Install everything, build hopper_moe and run the test suite (GPU tests skip without a GPU).
#   bash tools/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. "${HOPPER_MOE_VENV:-.venv}/bin/activate"
python -m pytest tests -q -rs "$@"
