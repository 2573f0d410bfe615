#!/usr/bin/env bash
# Build .vllm_bundle/: what an offline GPU machine needs to import vLLM 0.33.0's MoE layers and
# run tests/test_vllm_plugin.py and tools/vllm_kernel_tests.sh there. Run HERE (network: PyPI);
# install THERE with tools/vllm_offline_env.sh BUNDLE_DIR VENV_DIR.
#
#   bash tools/vllm_offline_bundle.sh [OUT_DIR]          (default: .vllm_bundle in the repo root)
#
#   PYTHON_VERSION=3.12    the target's Python (wheels are chosen for cp<version>)
#   GLIBC=2.28             the target's glibc: the newest manylinux_2_<minor> tag accepted
#   MAX_MIB=50             fail when the bundle is larger
#   PIP_PYTHON=python3     the interpreter whose pip (>= 22.2) resolves and downloads here
#   HOPPER_MOE_VLLM_WHEEL  a local vllm-0.33.0 wheel (else `pip download`, pip's cache helps)
#   HOPPER_MOE_VLLM_SDIST  a local vllm-0.33.0.tar.gz (else build/vllm-kernel-tests/'s, else PyPI)
#   VLLM_BUNDLE_WORK       scratch for the two big downloads (default build/vllm-offline-bundle)
#
# The bundle (idempotent: a rerun reuses the downloads, drops stale wheels, rewrites the rest):
#   wheels.tar.xz            wheels/*.whl: the packages importing vLLM's MoE layers and both test
#                            runs need, for the target (pip download --only-binary=:all:
#                            --platform manylinux...), their dependencies resolved, minus what the
#                            target's torch install brings (EXCLUDE); each re-zipped uncompressed
#                            so that xz compresses across them; installed there with
#                            pip --no-index --no-deps
#   vllm-0.33.0-py.tar.xz    site-packages/{vllm/, vllm-0.33.0.dist-info/} from the 336 MB wheel,
#                            Python only: no *.so, no vllm-rs, no web assets, no CUDA sources, no
#                            vllm/third_party/{deep_gemm,fmha_sm100} (the rest of third_party/ is
#                            small Python, and vllm.third_party.pynvml is imported by vLLM's CUDA
#                            platform)
#                            (RECORD rewritten to what is kept; METADATA and entry points as is)
#   vllm-0.33.0-tests.tar.gz tests/__init__.py, tests/utils.py and tests/kernels of the sdist, under
#                            the sdist's own prefix: tools/vllm_kernel_tests.sh takes it as
#                            HOPPER_MOE_VLLM_SDIST
#   TARGET                   cp312 (the Python the wheels are for)
#   MANIFEST.txt             what is in it, and for which target
#
# vLLM's compiled ops (vllm._C, _moe_C, ...) are left out on purpose: hopper_moe provides the ops
# under test, and vLLM's Python wrappers import without them (vllm._custom_ops warns only).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
GLIBC=${GLIBC:-2.28}
MAX_MIB=${MAX_MIB:-50}
PIP_PYTHON=${PIP_PYTHON:-python3}
VLLM_VERSION=0.33.0
OUT=${1:-$ROOT/.vllm_bundle}
WORK=${VLLM_BUNDLE_WORK:-$ROOT/build/vllm-offline-bundle}
say() { echo "vllm_offline_bundle: $*"; }

# Imported by vLLM's MoE/quantization modules, its plugin loader and the tests' helpers: the union
# of VLLM_DEPS in tools/vllm_check.sh and tools/vllm_kernel_tests.sh (vLLM's distribution name for
# the openai_harmony module is oss-harmony), plus pytest-xdist for the kernel tests' workers.
VLLM_DEPS="packaging psutil pyzmq urllib3 regex pydantic cbor2 transformers aiohttp requests
oss-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo
prometheus_client xgrammar fastapi partial-json-parser llguidance einops tblib pytest-xdist"
# Brought by the target's torch install (torch's own dependencies, numpy, pytest) or by the
# CUDA stack there: never bundled. nvidia-* is dropped as a prefix.
EXCLUDE="torch triton numpy sympy mpmath networkx jinja2 markupsafe filelock fsspec
typing-extensions setuptools cuda-bindings cuda-pathfinder cuda-toolkit pytest pluggy iniconfig
pygments"
# vLLM pins these to versions without a wheel for glibc $GLIBC: when resolution with the pin
# fails, the pin is dropped (the newest version with such a wheel is taken) and MANIFEST says so.
# (llguidance 1.7.x is manylinux_2_31 only; vLLM only needs `llguidance.LLMatcher` to exist at
# import.)
UNPIN="llguidance"
# Resolved but not bundled (DROP="a b" to leave out what the runs were checked to pass without).
DROP=${DROP-}

mkdir -p "$WORK" "$OUT/wheels"
PLATFORMS=()
for minor in $(seq "${GLIBC#2.}" -1 17); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
            --platform manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp "${PLATFORMS[@]}")

# --- 1. the vllm wheel (kept in WORK, never in the bundle)
WHEEL=$(ls "$WORK"/vllm-$VLLM_VERSION-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ]; then
  if [ -n "${HOPPER_MOE_VLLM_WHEEL:-}" ]; then
    cp "$HOPPER_MOE_VLLM_WHEEL" "$WORK/"
  else
    say "downloading vllm==$VLLM_VERSION (336 MB)"
    "$PIP_PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$WORK" "vllm==$VLLM_VERSION"
  fi
  WHEEL=$(ls "$WORK"/vllm-$VLLM_VERSION-*.whl | head -1)
fi
say "vllm wheel: $WHEEL"

# --- 2. the requirements, as vLLM's metadata states them for the target (markers evaluated)
spec_of() {  # spec_of WHEEL PYTHON_VERSION UNPIN-LIST NAME...
  "$PIP_PYTHON" - "$@" <<'EOF'
import re, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
whl, pyver, unpin, names = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
unpin = {norm(n) for n in unpin}
with zipfile.ZipFile(whl) as z:
    text = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
env = {"python_version": pyver, "python_full_version": pyver + ".0", "platform_machine": "x86_64",
       "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
reqs = {}
for line in text.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):
            reqs[norm(req.name)] = f"{req.name}{req.specifier}"  # extras dropped
print(" ".join(n if norm(n) in unpin else reqs.get(norm(n), n) for n in names))
EOF
}
# shellcheck disable=SC2086
SPECS=$(spec_of "$WHEEL" "$PYTHON_VERSION" "" $VLLM_DEPS)
UNPINNED=""
resolve() {  # the full closure, resolved for the target without installing anything
  # shellcheck disable=SC2086
  "$PIP_PYTHON" -m pip install -q --dry-run --ignore-installed "${TARGET[@]}" \
    --target "$WORK/dry-run-target" --report "$WORK/report.json" $1 >"$WORK/resolve.log" 2>&1
}
say "resolving for cp${PYTHON_VERSION/./} manylinux (glibc <= $GLIBC)"
if ! resolve "$SPECS"; then
  # shellcheck disable=SC2086
  SPECS=$(spec_of "$WHEEL" "$PYTHON_VERSION" "$UNPIN" $VLLM_DEPS)
  UNPINNED=$UNPIN
  say "resolution failed with vLLM's pins; again without the pins of: $UNPIN"
  resolve "$SPECS" || { grep -v "is ignored" "$WORK/resolve.log" | tail -20; exit 1; }
fi
# name==version for everything not excluded
"$PIP_PYTHON" - "$WORK/report.json" "$EXCLUDE" >"$WORK/requirements.txt" <<'EOF'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
exclude = {norm(n) for n in sys.argv[2].split()}
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if norm(name) in exclude or norm(name).startswith("nvidia-"):
        continue
    print(f"{name}=={version}")
EOF

# --- 3. the wheels: downloaded into WORK (pip's deflate wheels, kept between runs), then packed
# into one solid xz tarball as *stored* (uncompressed) zips, still valid wheels (RECORD hashes
# cover the files, not the zip): xz across all of them is far smaller than the wheels themselves
# (57 MiB of wheels for cp311 became 34 MiB), which is what keeps the bundle under 50 MiB.
WHEELS=$WORK/wheels-cp${PYTHON_VERSION/./}
mkdir -p "$WHEELS"
"$PIP_PYTHON" -m pip download -q --no-deps "${TARGET[@]}" -d "$WHEELS" \
  -r "$WORK/requirements.txt" 2>&1 | grep -v "is ignored: it is neither" || true
# drop wheels a former run left that the list no longer names (and fail on any missing)
"$PIP_PYTHON" - "$WORK/requirements.txt" "$WHEELS" "$DROP" <<'EOF'
import os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
drop = {norm(n) for n in sys.argv[3].split()}
want = {}
for line in open(sys.argv[1]):
    name, version = line.strip().split("==")
    if norm(name) not in drop:
        want[norm(name)] = version
seen = set()
for f in sorted(os.listdir(sys.argv[2])):
    name, version = f.split("-")[:2]
    if f.endswith(".whl") and want.get(norm(name)) == version:
        seen.add(norm(name))
    else:
        os.remove(os.path.join(sys.argv[2], f))
        print(f"vllm_offline_bundle: removed {f}")
missing = set(want) - seen
if missing:
    sys.exit(f"vllm_offline_bundle: no wheel for {sorted(missing)}")
EOF
rm -rf "$OUT/wheels"  # an earlier layout
WHEELS_TAR=$OUT/wheels.tar.xz
STAMP="$( (cd "$WHEELS" && sha256sum ./*.whl) | sha256sum | cut -c1-64) cp$PYTHON_VERSION"
if [ -f "$WHEELS_TAR" ] && [ "$(cat "$WORK/wheels.stamp" 2>/dev/null)" = "$STAMP" ]; then
  say "wheels.tar.xz is up to date"
else
  say "packing $(ls "$WHEELS" | wc -l) wheels into wheels.tar.xz (xz -9, one core: about 2 minutes)"
  "$PIP_PYTHON" - "$WHEELS" "$WHEELS_TAR.tmp" <<'EOF'
import io, lzma, os, sys, tarfile, zipfile
src, dest = sys.argv[1], sys.argv[2]
with open(dest, "wb") as raw, lzma.open(raw, "wb", preset=9) as xz, \
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name in sorted(os.listdir(src)):
        buf = io.BytesIO()
        with zipfile.ZipFile(os.path.join(src, name)) as zin, \
                zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                out.external_attr = info.external_attr
                zout.writestr(out, zin.read(info), compress_type=zipfile.ZIP_STORED)
        ti = tarfile.TarInfo(f"wheels/{name}")
        ti.size, ti.mode, ti.mtime = buf.tell(), 0o644, 0
        buf.seek(0)
        tar.addfile(ti, buf)
EOF
  mv "$WHEELS_TAR.tmp" "$WHEELS_TAR"
  echo "$STAMP" >"$WORK/wheels.stamp"
fi
echo "cp${PYTHON_VERSION/./}" >"$OUT/TARGET"

# --- 4. vllm itself, Python only
TARBALL=$OUT/vllm-$VLLM_VERSION-py.tar.xz
VSTAMP="$(basename "$WHEEL") $(stat -c %s "$WHEEL") $(sha256sum "$0" | cut -c1-16)"
if [ -f "$TARBALL" ] && [ "$(cat "$WORK/vllm-py.stamp" 2>/dev/null)" = "$VSTAMP" ]; then
  say "$(basename "$TARBALL") is up to date"
else
say "packing $(basename "$TARBALL") (xz; about a minute)"
"$PIP_PYTHON" - "$WHEEL" "$TARBALL.tmp" <<'EOF'
import base64, hashlib, io, lzma, re, sys, tarfile, zipfile
whl, dest = sys.argv[1], sys.argv[2]
SKIP = [
    re.compile(r".*\.so(\.[0-9.]+)?$"),            # compiled ops, flash-attn, ...
    # vendored DeepGEMM and SM100 FMHA: CUDA sources/headers for their JIT builds and .so files
    # (88 of 91 MB of vllm/third_party/). The rest of vllm/third_party/ is small Python and stays:
    # vllm/platforms/cuda.py imports vllm.third_party.pynvml at import (without it vLLM has no
    # CUDA platform), and vLLM probes triton_kernels, flash_linear_attention, ... by find_spec.
    re.compile(r"^vllm/third_party/(deep_gemm|fmha_sm100)/"),
    re.compile(r"^vllm/vllm-rs$"),                 # the Rust binary (58 MB)
    re.compile(r".*/static/"),                     # web assets (swagger UI, ...)
    re.compile(r".*\.(js|css|jpg|jpeg|png|ico|map|woff2?)$"),
    re.compile(r".*\.(cu|cuh|cpp|h|hpp)$"),        # kernel sources shipped for JIT builds
]
kept, dropped, dist_info = [], 0, None
with zipfile.ZipFile(whl) as z:
    infos = sorted(z.infolist(), key=lambda i: i.filename)
    for info in infos:
        name = info.filename
        if name.endswith("/"):
            continue
        top = name.split("/")[0]
        if top.endswith(".dist-info"):
            dist_info = top
        elif top != "vllm" or any(p.match(name) for p in SKIP):
            dropped += 1
            continue
        kept.append((info, z.read(info)))
    assert dist_info, "no .dist-info in the wheel"
    record = f"{dist_info}/RECORD"
    lines = []
    for info, data in kept:
        if info.filename == record:
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{info.filename},sha256={digest},{len(data)}")
    lines.append(f"{record},,")
    kept = [(i, d) for i, d in kept if i.filename != record]
    rec = type("I", (), {"filename": record, "external_attr": 0o644 << 16})
    kept.append((rec, ("\n".join(lines) + "\n").encode()))
with open(dest, "wb") as raw, lzma.open(raw, "wb", preset=9) as xz, \
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for info, data in kept:
        ti = tarfile.TarInfo(info.filename)
        ti.size, ti.mtime = len(data), 0
        ti.mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
        tar.addfile(ti, io.BytesIO(data))
print(f"vllm_offline_bundle: {len(kept)} files kept, {dropped} dropped")
EOF
mv "$TARBALL.tmp" "$TARBALL"
echo "$VSTAMP" >"$WORK/vllm-py.stamp"
fi

# --- 5. vLLM's kernel tests (the sdist's tests/ subset vllm_kernel_tests.sh extracts)
TESTS=$OUT/vllm-$VLLM_VERSION-tests.tar.gz
SDIST=${HOPPER_MOE_VLLM_SDIST:-$WORK/vllm-$VLLM_VERSION.tar.gz}
[ -f "$SDIST" ] || [ ! -f "$ROOT/build/vllm-kernel-tests/vllm-$VLLM_VERSION.tar.gz" ] || \
  SDIST=$ROOT/build/vllm-kernel-tests/vllm-$VLLM_VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
  say "downloading vllm-$VLLM_VERSION.tar.gz (the sdist, for its tests/)"
  "$PIP_PYTHON" "$ROOT/tools/vllm_sdist.py" "$SDIST" "$VLLM_VERSION"
fi
"$PIP_PYTHON" - "$SDIST" "$TESTS.tmp" "vllm-$VLLM_VERSION" <<'EOF'
import gzip, sys, tarfile
src, dest, prefix = sys.argv[1:]
want = (f"{prefix}/tests/__init__.py", f"{prefix}/tests/utils.py", f"{prefix}/tests/kernels/")
with tarfile.open(src, "r:gz") as tin, open(dest, "wb") as raw, \
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz, \
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tout:
    n = 0
    for m in tin.getmembers():
        if m.isfile() and (m.name in want or m.name.startswith(want[2])):
            tout.addfile(m, tin.extractfile(m)); n += 1
print(f"vllm_offline_bundle: {n} test files")
EOF
mv "$TESTS.tmp" "$TESTS"

# --- 6. the manifest and the size
{
  echo "vLLM $VLLM_VERSION offline bundle for cp${PYTHON_VERSION/./} x86_64 manylinux (glibc >= $GLIBC)"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) by tools/vllm_offline_bundle.sh; install: tools/vllm_offline_env.sh"
  echo "not bundled (expected on the target): $(echo $EXCLUDE) nvidia-*"
  [ -z "$DROP" ] || echo "not bundled (not needed): $DROP"
  echo "wheels.tar.xz:"
  (cd "$WHEELS" && ls -1 ./*.whl | sed 's|^\./|  |')
  [ -z "$UNPINNED" ] || echo "vLLM's pin dropped (no wheel for glibc $GLIBC): $UNPINNED"
  echo
  (cd "$OUT" && find . -type f ! -name MANIFEST.txt -printf '%s %P\n' | sort -k2 |
     awk '{printf "%10.1f KiB  %s\n", $1/1024, $2}')
} >"$OUT/MANIFEST.txt"
rm -rf "$WORK/dry-run-target"
BYTES=$(find "$OUT" -type f -printf '%s\n' | awk '{s+=$1} END {print s}')
MIB=$(awk -v b="$BYTES" 'BEGIN {printf "%.1f", b/1048576}')
say "$(ls "$WHEELS" | wc -l) wheels in wheels.tar.xz, $(basename "$TARBALL"), $(basename "$TESTS") in $OUT"
say "total size: $MIB MiB ($BYTES bytes; limit $MAX_MIB MiB)"
awk -v b="$BYTES" -v m="$MAX_MIB" 'BEGIN {exit !(b <= m*1048576)}' || {
  say "the bundle is larger than $MAX_MIB MiB"; exit 1; }
