#!/usr/bin/env bash
# Run vLLM 0.33.0's own kernel tests (tests/kernels/{moe,quantization,core}), unchanged, against
# hopper_moe: the sdist is fetched from PyPI at run time (never stored in this repository), the
# test files for the ops hopper_moe provides are taken from it (tests/vllm_compat/skips.py,
# SELECTED), and pytest runs them with the shim tests/vllm_compat/hopper_moe_vllm_shim.py,
# which redirects torch.ops._moe_C / torch.ops._C and vLLM's fused_experts to hopper_moe and,
# on the CPU, maps the tests' "cuda" device onto the CPU. Tests of features hopper_moe does not
# claim are skipped with the reason from the table in skips.py.
#
#   bash tools/vllm_kernel_tests.sh [--device cpu|cuda] [-n WORKERS] [--log FILE]
#                                   [--files 'glob ...'] [-- extra pytest args]
#
#   --device   cpu (default without a GPU) or cuda (a Hopper GPU and a CUDA build of hopper_moe)
#   -n         pytest-xdist workers (default: cores on cpu; 4 on cuda, each worker holds its own
#              CUDA context and caches, which bounds GPU memory)
#   --log      also write the whole log to FILE (e.g. benchmarks/results/vllm_kernel_tests_cpu.txt)
#   --files    run only the SELECTED files matching these globs (e.g. '*topk*')
#   --seconds  a time budget for the whole script, setup included: no test starts later than 20 s
#              before it ends; the tests left are reported as not run ("time budget" in the
#              summary's skip reasons) and the run fails as incomplete (status 3), so a machine
#              with a time limit per command still gets the results file and the summary
#   --all      on the CPU, also run the GPU-sized cases skipped there by default (skips.py,
#              CPU_GPU_SIZED: 32768/40000-token test_fused_moe shapes, the int64-overflow test,
#              2048/8192-token block-FP8 layers, whose fp32 torch references take minutes to
#              tens of minutes each on a CPU)
#   HOPPER_MOE_VLLM_KT_VENV=path  the environment (default build/vllm-kt-venv; made if missing)
#   HOPPER_MOE_VLLM_SDIST=path    a vllm-0.33.0.tar.gz already downloaded (skips the download)
#   HOPPER_MOE_VLLM_WHEEL=path    a local vllm-0.33.0 wheel to install instead of PyPI's
#   PYTHON=python3.11             the interpreter for a new environment
#   HOPPER_MOE_VLLM_OFFLINE=1     install nothing: the environment was made offline by
#                                 tools/vllm_offline_env.sh (the machine's torch is used)
#
# The environment: torch 2.14.1 (vLLM pins 2.14.0; 2.14.1 is the version hopper_moe is built
# against, the documented deviation), vLLM 0.33.0 with --no-deps, the pure-Python packages
# importing vLLM's MoE layers and the tests' helpers needs, pytest and pytest-xdist, and this
# checkout's python/ on the path through a .pth file (hopper_moe's in-place build).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VLLM_VERSION=0.33.0
TORCH_VERSION=2.14.1
DEVICE=""
WORKERS=""
LOG=""
FILES=""
ALL=0
SECONDS_BUDGET=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    -n) WORKERS=$2; shift 2 ;;
    --log) LOG=$2; shift 2 ;;
    --files) FILES=$2; shift 2 ;;
    --all) ALL=1; shift ;;
    --seconds) SECONDS_BUDGET=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
VENV=${HOPPER_MOE_VLLM_KT_VENV:-build/vllm-kt-venv}
WORK=build/vllm-kernel-tests
mkdir -p "$WORK"
if [ -n "$LOG" ]; then
  mkdir -p "$(dirname "$LOG")"
  exec > >(tee "$LOG") 2>&1
fi
say() { echo "vllm_kernel_tests: $*"; }
start=$(date +%s)

# --- the environment
if [ ! -x "$VENV/bin/python" ]; then "${PYTHON:-python3}" -m venv "$VENV"; fi
PY=$(cd "$VENV" && pwd)/bin/python
pip_q() {
  local out
  if ! out=$("$PY" -m pip install -q "$@" 2>&1); then echo "$out"; return 1; fi
  echo "$out" | grep -v -e "^WARNING: Location" -e "requires" -e "incompatible" \
    -e "dependency resolver" || true
}
version_of() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
if [ "${HOPPER_MOE_VLLM_OFFLINE:-0}" = 1 ]; then
  # An environment made without network by tools/vllm_offline_env.sh: nothing is installed,
  # the torch it sees is the machine's own (the version is printed below).
  [ "$(version_of vllm)" = "$VLLM_VERSION" ] || { say "vllm $VLLM_VERSION missing in $VENV"; exit 1; }
  touch "$VENV/.vllm_kt_deps"
else
  [ "$(version_of torch)" = "$TORCH_VERSION" ] || pip_q "torch==$TORCH_VERSION"
  [ "$(version_of vllm)" = "$VLLM_VERSION" ] || pip_q --no-deps "${HOPPER_MOE_VLLM_WHEEL:-vllm==$VLLM_VERSION}"
  [ -n "$(version_of pytest-xdist)" ] || pip_q pytest pytest-xdist
fi
# Imported by vLLM's MoE/quantization modules and by the tests' helpers (tblib: the tests'
# utils); versions as vLLM's metadata states them.
VLLM_DEPS="packaging psutil pyzmq urllib3 regex numpy pydantic cbor2 transformers aiohttp
requests oss-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo
prometheus_client fastapi partial-json-parser einops xgrammar llguidance tblib"
if [ ! -f "$VENV/.vllm_kt_deps" ]; then
  # shellcheck disable=SC2086
  SPECS=$("$PY" - $VLLM_DEPS <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
reqs = {}
for text in md.requires("vllm") or []:
    req = Requirement(text)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        reqs[norm(req.name)] = f"{req.name}{req.specifier}"
print(" ".join(reqs.get(norm(n), n) for n in sys.argv[1:]))
EOF
  ) || SPECS=$VLLM_DEPS
  # shellcheck disable=SC2086
  pip_q $SPECS && touch "$VENV/.vllm_kt_deps"
fi
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$ROOT/python" >"$SITE/hopper_moe_checkout.pth"
if [ -z "$DEVICE" ]; then
  DEVICE=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
fi
[ -n "$WORKERS" ] || { if [ "$DEVICE" = cuda ]; then WORKERS=4; else WORKERS=$(nproc); fi; }

# --- vLLM's tests: the sdist from PyPI (pip's simple index, hash checked), tests/ only
SDIST=${HOPPER_MOE_VLLM_SDIST:-$WORK/vllm-$VLLM_VERSION.tar.gz}
if [ ! -f "$SDIST" ]; then
  say "downloading vllm-$VLLM_VERSION.tar.gz from PyPI"
  "$PY" "$ROOT/tools/vllm_sdist.py" "$SDIST" "$VLLM_VERSION"
fi
SRC=$WORK/vllm-$VLLM_VERSION
if [ ! -d "$SRC/tests/kernels" ]; then
  rm -rf "$SRC" && mkdir -p "$WORK"
  # tests/conftest.py (the end-to-end fixtures: models, servers) is not taken; the kernel
  # tests' own conftests are.
  tar xzf "$SDIST" -C "$WORK" "vllm-$VLLM_VERSION/tests/__init__.py" \
    "vllm-$VLLM_VERSION/tests/utils.py" "vllm-$VLLM_VERSION/tests/kernels"
fi
# pytest's rootdir: the extracted sdist (not this repository, whose pytest settings are its own).
printf '[pytest]\n' >"$SRC/pytest.ini"
mapfile -t SELECTED < <("$PY" - "$FILES" <<EOF
import fnmatch, sys
sys.path.insert(0, "$ROOT/tests/vllm_compat")
import skips
globs = sys.argv[1].split()
for path in skips.SELECTED:
    if not globs or any(fnmatch.fnmatch(path, g) for g in globs):
        print(path)
EOF
)
say "device $DEVICE, $WORKERS workers, ${#SELECTED[@]} upstream files"
"$PY" - <<'EOF'
import importlib.metadata as md, platform, torch, hopper_moe
print(f"vllm_kernel_tests: python {platform.python_version()}, torch {torch.__version__}, "
      f"vllm {md.version('vllm')}, hopper_moe {hopper_moe.__version__} from "
      f"{hopper_moe.__file__}, CUDA build: {hopper_moe.built_with_cuda()}")
EOF
ready=$(date +%s)

# --- the run
export HOPPER_MOE_VLLM_DEVICE=$DEVICE
export PYTHONPATH="$ROOT/tests/vllm_compat${PYTHONPATH:+:$PYTHONPATH}"
[ "$DEVICE" = cpu ] && export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
XML=$ROOT/$WORK/results.xml
export HOPPER_MOE_VLLM_ALL=$ALL
if [ -n "$SECONDS_BUDGET" ]; then
  # No test starts later than 20 s before the budget ends (counted from the script's start,
  # setup included): the rest are reported as not run, and the summary still gets written.
  export HOPPER_MOE_VLLM_DEADLINE=$((start + SECONDS_BUDGET - 20))
  say "time budget: ${SECONDS_BUDGET} s from the start; no test starts after $(date -u -d "@$HOPPER_MOE_VLLM_DEADLINE" +%H:%M:%S) UTC"
fi
if [ "$DEVICE" = cpu ] && [ "$ALL" = 0 ]; then
  say "CPU run: GPU-sized cases skipped for time (skips.py CPU_GPU_SIZED; --all runs them)"
fi
status=0
(cd "$SRC" && "$PY" -m pytest -p hopper_moe_vllm_shim -p no:cacheprovider -n "$WORKERS" \
   -q -rfEs --tb=line --durations=20 --junitxml="$XML" -o junit_family=xunit1 \
   "${SELECTED[@]}" "${EXTRA[@]}") || status=$?
end=$(date +%s)
say "pytest exit status $status; tests in $((end - ready)) s, total $((end - start)) s"
echo
say "summary (hopper_moe vs vLLM $VLLM_VERSION kernel tests, device $DEVICE)"
"$PY" "$ROOT/tests/vllm_compat/summarize.py" "$XML" "$SRC"
# Tests the time budget left out make the run incomplete: it fails even without a failure.
not_run=$("$PY" - "$XML" <<'EOF'
import sys, xml.etree.ElementTree as ET
print(sum("the time budget (--seconds) ran out" in (s.get("message") or "")
          for s in ET.parse(sys.argv[1]).getroot().iter("skipped")))
EOF
) || not_run=0
if [ "${not_run:-0}" -gt 0 ]; then
  say "INCOMPLETE: $not_run tests not run (the time budget ran out); rerun with a larger --seconds or fewer --files"
  [ "$status" -ne 0 ] || status=3
fi
# Any failure outside the skip table fails the run (pytest's own status).
exit "$status"
