#!/usr/bin/env bash
# Before/after on one GPU machine: the SM90 layer and GEMM-only timings of this tree against a
# baseline tree (a checkout of another commit in BASE, built in place), in alternating passes
# of each tree's own benchmarks/bench_moe.py, one process per pass; then a table of the ratio
# per row (tools/ab_table.py). The baseline must already be built (tools/gpu_check.sh build
# there) and this tree too.
#   OUT=/tmp/out BASE=.base SECONDS_LEFT=500 bash tools/gpu_ab.sh [gemm|layer ...]
# AB_ARGS replaces the passes' common bench_moe arguments; AB_BACKENDS the layer's backends.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hopper_moe_out}
BASE=${BASE:-.base}
mkdir -p "$OUT/ab"
kinds=${*:-gemm layer}
end=$(( $(date +%s) + ${SECONDS_LEFT:-500} ))
args=${AB_ARGS:---shapes mixtral,qwen3_30b --dtypes bf16,fp8_tensor --iters 50 --m 1,2,4,8,16,32,64,128,256,512,1024,2048,4096}
pass() {  # tree label kind
  local tree=$1 label=$2 kind=$3 extra="--backends ${AB_BACKENDS:-cute}"
  [ "$kind" = gemm ] && extra="--gemm-only --backends cute"
  local left=$(( end - $(date +%s) ))
  [ $left -gt 20 ] || { echo "ab: no time left for $label $kind"; return 1; }
  local t0=$(date +%s)
  ( cd "$tree" && PYTHONPATH=$PWD/python timeout $left python3 benchmarks/bench_moe.py $args $extra \
      --out "$OUT/ab" --tag "${kind}_${label}" ) >"$OUT/ab/${kind}_${label}.log" 2>&1
  echo "ab: $kind $label rc=$? $(( $(date +%s) - t0 )) s"
}
for round in 1 2; do
  for kind in $kinds; do
    pass "$BASE" "base$round" "$kind" || break 2
    pass . "new$round" "$kind" || break 2
  done
done
python3 tools/ab_table.py "$OUT/ab" | tee "$OUT/ab_table.md"
tar czf "$OUT/ab.tgz" -C "$OUT" ab
