#!/usr/bin/env bash
# Make a virtual environment with vLLM 0.33.0 on a machine WITHOUT network access, from the
# bundle tools/vllm_offline_bundle.sh made (with network) and the working tree carried along:
#
#   bash tools/vllm_offline_env.sh BUNDLE_DIR VENV_DIR        (e.g. .vllm_bundle build/vllm-venv)
#
#   PYTHON=python3        the interpreter the environment is made from: the one whose site-packages
#                         hold torch (+ triton, numpy, pytest, ...), seen via --system-site-packages
#   SYSTEM_SITE=1         0: make the environment without --system-site-packages (tests)
#   EXTRA_SITE=dir[:dir]  site-packages directories added to the environment before installing,
#                         through a .pth file (site.addsitedir), after the environment's own:
#                         for a torch that lives in another virtual environment
#
# Steps: `$PYTHON -m venv --system-site-packages VENV_DIR`; the bundle's wheels (wheels.tar.xz)
# pip-installed with --no-index --no-deps; vllm-0.33.0-py.tar.xz (vllm/ without its compiled
# ops, and vllm-0.33.0.dist-info) unpacked into the environment's site-packages; then a report:
# the vllm version importlib.metadata sees, and `import vllm.model_executor.layers.fused_moe` and
# `import vllm._custom_ops`, each with its full traceback when it fails. A failed import does
# not fail the script (exit 0 once the environment is installed): the report is the point.
# Rerunning it on the same VENV_DIR reinstalls (idempotent).
#
# hopper_moe is NOT installed: put this checkout's python/ on the path, where its in-place CUDA
# build (python/hopper_moe/_C*.so) lies:
#
#   export PYTHONPATH=$PWD/python                                   (from the repository root)
#   VENV_DIR/bin/python -m pytest tests/test_vllm_plugin.py -q -p no:cacheprovider
#
# (with only PYTHONPATH, hopper_moe's vllm.general_plugins entry point is invisible, so
# test_vllm_loads_the_entry_point skips, saying so; every other test runs.)
#
# vLLM's kernel tests (tools/vllm_kernel_tests.sh) offline: HOPPER_MOE_VLLM_KT_VENV=VENV_DIR and
# HOPPER_MOE_VLLM_SDIST=BUNDLE_DIR/vllm-0.33.0-tests.tar.gz (the sdist's tests/ only, same
# prefix); pytest-xdist and tblib are among the bundle's wheels.
set -euo pipefail
[ $# -eq 2 ] || { sed -n '2,4p' "$0"; exit 2; }
BUNDLE=$(cd "$1" && pwd)
VENV=$2
PYTHON=${PYTHON:-python3}
SYSTEM_SITE=${SYSTEM_SITE:-1}
VLLM_VERSION=0.33.0
say() { echo "vllm_offline_env: $*"; }
untar() {  # untar ARCHIVE DIR, with Python (no xz binary needed); tarfile's "data" filter
  "$PYTHON" - "$1" "$2" <<'EOF'
import sys, tarfile
kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], **kw)
EOF
}
for f in TARGET wheels.tar.xz "vllm-$VLLM_VERSION-py.tar.xz"; do
  [ -f "$BUNDLE/$f" ] || { say "$BUNDLE/$f is missing (tools/vllm_offline_bundle.sh makes it)"; exit 1; }
done
TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ "$TAG" != "$(cat "$BUNDLE/TARGET")" ]; then
  say "the bundle is for $(cat "$BUNDLE/TARGET"), $PYTHON is $TAG"
  say "(rebuild it where there is network: PYTHON_VERSION=3.${TAG#cp3} bash tools/vllm_offline_bundle.sh)"
  exit 1
fi

# --- the environment
VENV_ARGS=()
[ "$SYSTEM_SITE" = 0 ] || VENV_ARGS+=(--system-site-packages)
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV" 2>/dev/null; then
    # e.g. Debian/Ubuntu without python3-venv (no ensurepip): an environment without pip,
    # driven by the base interpreter's pip (--python needs pip >= 22.3)
    rm -rf "$VENV"
    "$PYTHON" -m venv --without-pip "${VENV_ARGS[@]}" "$VENV"
  fi
fi
VENV=$(cd "$VENV" && pwd)
PY=$VENV/bin/python
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -n "${EXTRA_SITE:-}" ]; then
  # zz_: after the environment's own .pth files; addsitedir also runs the directories' .pth files
  "$PY" - "$SITE/zz_vllm_offline_extra_site.pth" "$EXTRA_SITE" <<'EOF'
import sys
dirs = [d for d in sys.argv[2].split(":") if d]
open(sys.argv[1], "w").write(
    "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
fi
if "$PY" -m pip --version >/dev/null 2>&1; then
  PIP=("$PY" -m pip)
else
  PIP=("$PYTHON" -m pip --python "$PY")
fi

# --- the wheels (unpacked next to the environment, removed afterwards)
TMP=$(mktemp -d "$VENV/.bundle-wheels.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
untar "$BUNDLE/wheels.tar.xz" "$TMP"
say "installing $(ls "$TMP"/wheels/*.whl | wc -l) wheels (pip --no-index --no-deps)"
"${PIP[@]}" install -q --no-index --no-deps --disable-pip-version-check --no-warn-script-location \
  --force-reinstall "$TMP"/wheels/*.whl

# --- vllm itself: the Python files of the 0.33.0 wheel and its dist-info, unpacked as is
rm -rf "$SITE/vllm" "$SITE"/vllm-*.dist-info
untar "$BUNDLE/vllm-$VLLM_VERSION-py.tar.xz" "$SITE"
printf 'vllm_offline_env\n' >"$SITE/vllm-$VLLM_VERSION.dist-info/INSTALLER"
say "vllm unpacked into $SITE"

# --- the report (never fails the script)
echo
say "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
"$PY" -c "import torch, triton; print('vllm_offline_env: torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| triton', triton.__version__)" \
  || say "torch/triton do not import (see above)"
printf 'vllm_offline_env: vllm version (importlib.metadata): '
"$PY" -c "import vllm, importlib.metadata as m; print(m.version('vllm'))" || true
status=0
for mod in vllm.model_executor.layers.fused_moe vllm._custom_ops; do
  if out=$("$PY" -c "import $mod" 2>&1); then
    say "import $mod: OK"
    [ -z "$out" ] || echo "$out" | sed 's/^/    /'
  else
    status=1
    say "import $mod: FAILED"
    echo "$out" | sed 's/^/    /'
  fi
done
"$PY" -c "import importlib.metadata as m; print('vllm_offline_env: vllm.general_plugins entry points:', sorted(e.name for e in m.entry_points(group='vllm.general_plugins')))" || true
echo
if [ $status = 0 ]; then
  say "ready: $VENV (add this checkout's python/ to PYTHONPATH for hopper_moe)"
else
  say "installed in $VENV, but an import failed (tracebacks above)"
fi
exit 0
