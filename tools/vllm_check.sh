#!/usr/bin/env bash
# Build an environment with vLLM 0.33.0 (its CPU platform is enough) and a CPU-only build of
# hopper_moe, and run the vLLM plugin tests (tests/test_vllm_plugin.py) in it.
#
#   bash tools/vllm_check.sh [extra pytest args]     (-vv: one line per test)
#   HOPPER_MOE_VLLM_VENV=/path    the environment (default build/vllm-venv; reused if present)
#   HOPPER_MOE_VLLM_WHEEL=/path   a local vllm-0.33.0 wheel to install instead of PyPI's
#   PYTHON=python3.11             the interpreter for a new environment
#
# vLLM 0.33.0 pins torch==2.14.0. The environment gets torch 2.14.1 instead (the version the
# project builds and tests against, and the newest one pip may install here), so vLLM is
# installed with --no-deps, plus only the packages importing vLLM's MoE layer, its FP8 method
# and its plugin loader needs, at the versions vLLM's own metadata asks for (VLLM_DEPS below,
# found by importing until nothing was missing). hopper_moe is copied to build/vllm-check/src
# and pip-installed from there with HOPPER_MOE_CPU_ONLY=1: a real distribution (so vLLM's
# plugin loader sees its entry point), built apart from the in-place CUDA build of .venv.
# The run's log is build/vllm-check/log.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HOPPER_MOE_VLLM_VENV:-build/vllm-venv}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.14.1
# Distribution names, in the order an import of vLLM's MoE modules asked for them (uvloop is
# imported but not among vLLM's requirements: any version).
VLLM_DEPS="packaging psutil pyzmq urllib3 regex numpy pydantic cbor2 transformers aiohttp
requests oss-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo
prometheus_client xgrammar fastapi partial-json-parser llguidance einops"
WORK=build/vllm-check
mkdir -p "$WORK"
LOG=$WORK/log.txt
exec > >(tee "$LOG") 2>&1
start=$(date +%s)
say() { echo "vllm_check: $*"; }

# --- the environment: torch, vLLM without its dependencies, the packages its MoE modules import
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY=$(cd "$VENV" && pwd)/bin/python
# pip install, quiet: on success without pip's notes about vLLM's unmet pins (expected here).
pip_q() {
  local out
  if ! out=$("$PY" -m pip install -q "$@" 2>&1); then echo "$out"; return 1; fi
  [ -z "$out" ] || echo "$out" | grep -v -e "^WARNING: Location" -e "requires" \
    -e "incompatible" -e "dependency resolver" || true
}
version_of() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
pip_q --upgrade "pip>=23" "setuptools>=64" wheel
[ "$(version_of torch)" = "$TORCH_VERSION" ] || pip_q "torch==$TORCH_VERSION"
[ "$(version_of vllm)" = "$VLLM_VERSION" ] || pip_q --no-deps "${HOPPER_MOE_VLLM_WHEEL:-vllm==$VLLM_VERSION}"
pip_q pytest ninja packaging
# shellcheck disable=SC2086
SPECS=$("$PY" - $VLLM_DEPS <<'EOF'
"""The requirement of each named package as vLLM's metadata states it (markers dropped)."""
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

reqs = {}
for text in md.requires("vllm") or []:
    req = Requirement(text)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        reqs[norm(req.name)] = f"{req.name}{req.specifier}"
print(" ".join(reqs.get(norm(name), name) for name in sys.argv[1:]))
EOF
)
# shellcheck disable=SC2086
pip_q $SPECS
[ "$(version_of torch)" = "$TORCH_VERSION" ] || { say "torch is $(version_of torch), not $TORCH_VERSION"; exit 1; }

# --- hopper_moe, CPU-only, from a copy of this checkout (rebuilt when the copy changes)
SRC=$WORK/src
rm -rf "$SRC.new" && mkdir -p "$SRC.new"
tar cf - --exclude='*.so' --exclude='__pycache__' --exclude='*.egg-info' \
  setup.py pyproject.toml python csrc third_party | tar xf - -C "$SRC.new"
DIGEST=$(cd "$SRC.new" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum)
if [ "$(cat "$VENV/hopper_moe.src.sha256" 2>/dev/null)" = "$DIGEST" ] && \
   "$PY" -c "import hopper_moe" 2>/dev/null; then
  rm -rf "$SRC.new"
  say "hopper_moe unchanged since the last build"
else
  rm -rf "$SRC" && mv "$SRC.new" "$SRC"
  say "building hopper_moe (CPU only; log: $WORK/build.log)"
  if ! (cd "$SRC" && HOPPER_MOE_CPU_ONLY=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        "$PY" -m pip install -v --no-build-isolation --no-deps . >"$ROOT/$WORK/build.log" 2>&1); then
    grep -E "error" "$WORK/build.log" | head -40
    say "hopper_moe build failed, see $WORK/build.log"; exit 1
  fi
  echo "$DIGEST" >"$VENV/hopper_moe.src.sha256"
fi
ready=$(date +%s)
say "environment ready in $((ready - start)) s"

# --- the tests, on vLLM's CPU platform, against the installed copy of hopper_moe
export VLLM_TARGET_DEVICE=cpu
"$PY" - <<'EOF'
import importlib.metadata as md, platform, sys, torch, hopper_moe
print(f"vllm_check: python {platform.python_version()}, torch {torch.__version__}, "
      f"vllm {md.version('vllm')} (pins torch{[r for r in md.requires('vllm') if r.startswith('torch=')][0][5:]}), "
      f"hopper_moe {hopper_moe.__version__} from {hopper_moe.__file__}, CUDA build: "
      f"{hopper_moe.built_with_cuda()}")
EOF
status=0
"$PY" -m pytest tests/test_vllm_plugin.py -q -rs -p no:cacheprovider "$@" || status=$?
end=$(date +%s)
say "tests in $((end - ready)) s; total $((end - start)) s; exit status $status"
exit $status
