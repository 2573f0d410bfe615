#!/usr/bin/env bash
# One call on a GPU machine: build, GPU test suite, benchmarks, sanitizer; logs under $OUT.
# Uses the machine's own python3/PyTorch; CUTLASS comes from wheels in .whl/ when there is no
# registry (pip install --no-deps nvidia-cutlass==4.2.0.0 -d .whl).
#   OUT=/tmp/out bash tools/gpu_check.sh [build|test|bench|stages|tune|sanitize|cmake ...]
#   [host|warmup|oracle|vllm|cutlass ...]   (default: build test bench sanitize cmake)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hopper_moe_out}
mkdir -p "$OUT"
steps=${*:-build test bench sanitize cmake}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
# Build with the system compiler, whose libstdc++ is the shared one PyTorch loads. A compiler
# that links its own libstdc++ statically into the extension mixes two C++ runtimes in one
# process, and formatting a number into an error message then crashes (seen on the H200 image
# with /opt/gcc).
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi; ${CXX:-c++} --version | head -1; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } >"$OUT/env.txt" 2>&1
# The peer (benchmarks/peer_vllm.py): the engine's Triton kernel and config tables, extracted
# once from the carried vLLM bundle, so bench_moe times it beside hopper_moe's backends.
peer_prep() {
  if [ -z "${HOPPER_MOE_PEER_DIR:-}" ] && [ -f .vllm_bundle/vllm-0.33.0-py.tar.xz ]; then
    export HOPPER_MOE_PEER_DIR=/tmp/peer_vllm
    [ -f $HOPPER_MOE_PEER_DIR/fused_moe_kernel.py ] || python3 benchmarks/peer_vllm.py \
      extract .vllm_bundle/vllm-0.33.0-py.tar.xz --dest $HOPPER_MOE_PEER_DIR 2>&1 | tail -1
  fi
}
rc=0
for step in $steps; do
  t0=$(date +%s)
  case $step in
    build)
      python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
      python3 tools/check_ptxas.py "$OUT/build.log" | tee "$OUT/ptxas.txt" || rc=1
      ldd python/hopper_moe/_C*.so | grep -E "stdc\+\+|gcc_s" ;;
    test)
      # Each failure's report lands in failures.txt when it happens (a run stopped early still
      # says what failed); tests.log names every test. PYTEST_ARGS adds options, e.g.
      # "-n 12 --timeout 600" (pytest-xdist, pytest-timeout) or "-k fuzz".
      HOPPER_MOE_FAILURE_LOG="$OUT/failures.txt" python3 -m pytest tests -v -rfEs \
        -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/tests.log" 2>&1
      [ "$?" -eq 0 ] || rc=1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40 ;;
    bench)
      # The default is the two decode-critical shapes (a few minutes); BENCH_SHAPES=...
      # selects others (see benchmarks/README.md). Results go to one archive.
      peer_prep
      res=/tmp/hopper_moe_results; rm -rf $res; mkdir -p $res  # this run's results only
      # BENCH_OPS=0 skips the ops benchmark; BENCH_ARGS replaces bench_moe's arguments.
      [ "${BENCH_OPS:-1}" = 0 ] || python3 benchmarks/bench_ops.py --quick --out $res 2>&1 | tee "$OUT/bench_ops.log" | tail -30
      python3 benchmarks/bench_moe.py ${BENCH_ARGS:---shapes ${BENCH_SHAPES:-mixtral,qwen3_30b} --plot} \
        --out $res 2>&1 | tee "$OUT/bench_moe.log" | tail -60
      tar czf "$OUT/results.tgz" -C $res . ;;
    host)
      # Host cost per eager call and import times (benchmarks/bench_host.py); HOST_ARGS
      # replaces its arguments.
      python3 benchmarks/bench_host.py ${HOST_ARGS:---shapes qwen3_30b --dtypes bf16,fp8_tensor --profile} \
        --out "$OUT" 2>&1 | tail -40 ;;
    warmup)
      # After hopper_moe.warmup: compilations and first-call latency over random token counts
      # (benchmarks/bench_warmup.py); WARMUP_ARGS replaces its arguments.
      python3 benchmarks/bench_warmup.py ${WARMUP_ARGS:---shape qwen3_30b} --out "$OUT" 2>&1 | tail -30 ;;
    oracle)
      # The measured backend table of this GPU (python -m hopper_moe.oracle --measure) into
      # $OUT, then bench_moe with "auto" reading it (HOPPER_MOE_CONFIG_DIR=$OUT) beside every
      # backend; ORACLE_ARGS / CHECK_ARGS replace their arguments.
      python3 -m hopper_moe.oracle --measure ${ORACLE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/oracle.log" | tail -5
      res=/tmp/hopper_moe_auto; rm -rf $res; mkdir -p $res
      HOPPER_MOE_CONFIG_DIR="$OUT" python3 benchmarks/bench_moe.py ${CHECK_ARGS:---shapes mixtral,qwen3_30b,deepseek_v3_tp8 --dtypes bf16,fp8_tensor,fp8_channel,fp8_block --m 1,4,16,64,256,1024,4096 --backends torch,triton,cute,auto --iters 50} \
        --out $res --tag auto_check 2>&1 | tail -5
      python3 tools/auto_check.py $res/*auto_check.json | tee "$OUT/auto_check.md" | tail -15
      cp $res/*auto_check.md "$OUT/" ;;
    cutlass)
      # The CUTLASS grouped-GEMM peer (benchmarks/peer_cutlass.py: built here on first use)
      # beside the GEMM-only rows; CUTLASS_ARGS replaces bench_moe's arguments.
      python3 benchmarks/peer_cutlass.py build 2>&1 | tail -1
      res=/tmp/hopper_moe_cutlass; rm -rf $res; mkdir -p $res
      python3 benchmarks/bench_moe.py --gemm-only ${CUTLASS_ARGS:---shapes mixtral,qwen3_30b,deepseek_v3_tp8 --dtypes bf16,fp8_tensor --m 256,1024,4096 --backends cute,cutlass_coop,cutlass_coop_promoted,cutlass_pingpong,cutlass_engine} \
        --out $res --tag gemm_cutlass 2>&1 | tee "$OUT/bench_cutlass.log" | tail -30
      tar czf "$OUT/cutlass.tgz" -C $res . ;;
    stages)
      # The Triton layer stage by stage, replay by replay (benchmarks/bench_stages.py);
      # STAGES_ARGS replaces its arguments.
      python3 benchmarks/bench_stages.py ${STAGES_ARGS:---shape mixtral --dtype bf16 --m 1024 --iters 200} \
        --out "$OUT" 2>&1 | tee "$OUT/bench_stages.log" | tail -30 ;;
    tune)
      # Tuned Triton tables (hopper_moe.tune, quick space, configs compiled in TUNE_JOBS
      # processes first) for each shape:scheme pair of TUNE_PAIRS, into one archive (copy its
      # complete files to python/hopper_moe/configs/ to ship them). TUNE_SECONDS bounds the
      # step: a pair still running then is stopped; its file holds the M values done so far.
      cfg=/tmp/hopper_moe_configs; mkdir -p $cfg
      end=$(( $(date +%s) + ${TUNE_SECONDS:-100000} ))
      for pair in ${TUNE_PAIRS:-mixtral:bf16 mixtral:fp8_tensor qwen3_30b:bf16 qwen3_30b:fp8_tensor}; do
        left=$(( end - $(date +%s) )); [ $left -gt 30 ] || { echo "tune: no time left for $pair"; continue; }
        timeout $left python3 -m hopper_moe.tune --shape ${pair%%:*} --dtype ${pair##*:} \
          --space ${TUNE_SPACE:-quick} --jobs ${TUNE_JOBS:-12} --out $cfg --resume \
          2>>"$OUT/tune_progress.log" | tee -a "$OUT/tune.log" | grep -E "^(M=|compiled|wrote)"
      done
      tar czf "$OUT/configs.tgz" -C $cfg . ;;
    sanitize)
      # SANITIZE_TOOLS picks the tools; SANITIZE_SECONDS bounds each (a tool stopped there
      # prints no ERROR SUMMARY line); SANITIZE_ARGS=--gemm runs only the grouped GEMM part.
      # Every report is printed (the default limit of 100 hid all but the first kernel's).
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZE_SECONDS:-3600} compute-sanitizer \
          --tool $tool --print-limit ${SANITIZE_PRINT_LIMIT:-100000} \
          python3 tools/sanitize_ops.py ${SANITIZE_ARGS:-} >"$OUT/sanitize_$tool.log" 2>&1
        echo "$tool: $(grep -E "(ERROR|RACECHECK) SUMMARY" "$OUT/sanitize_$tool.log" | tail -1)"
      done | tee "$OUT/sanitize.txt" ;;
    vllm)
      # vLLM 0.33.0's own kernel tests against this build (tools/vllm_kernel_tests.sh), in an
      # environment made offline from the bundle of tools/vllm_offline_bundle.sh (carried as
      # .vllm_bundle). VLLM_KT_WORKERS: pytest-xdist workers (4: GPU memory); VLLM_KT_ARGS adds
      # arguments (e.g. "--files '*topk*'"); VLLM_KT_SECONDS: the harness's --seconds (set it
      # below the machine's limit per command, so the run still ends with its summary).
      EXTRA_SITE=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))') \
        bash tools/vllm_offline_env.sh .vllm_bundle /tmp/vllm_kt_venv >"$OUT/vllm_env.log" 2>&1 \
        || { tail -20 "$OUT/vllm_env.log"; echo "VLLM ENV FAILED"; rc=1; continue; }
      eval "set -- ${VLLM_KT_ARGS:-}"
      HOPPER_MOE_VLLM_OFFLINE=1 HOPPER_MOE_VLLM_KT_VENV=/tmp/vllm_kt_venv \
        HOPPER_MOE_VLLM_SDIST=.vllm_bundle/vllm-0.33.0-tests.tar.gz \
        bash tools/vllm_kernel_tests.sh --device cuda -n "${VLLM_KT_WORKERS:-4}" \
        ${VLLM_KT_SECONDS:+--seconds "$VLLM_KT_SECONDS"} \
        --log "$OUT/vllm_kernel_tests_h200.txt" "$@" >/dev/null 2>&1 || rc=1
      sed -n '/summary (hopper_moe/,$p' "$OUT/vllm_kernel_tests_h200.txt" | head -40 ;;
    cmake)
      ( cmake -S . -B /tmp/cmake_build -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
          -DPython3_EXECUTABLE="$(command -v python3)" \
        && cmake --build /tmp/cmake_build -j "$MAX_JOBS" \
        && python3 -c "import torch; torch.ops.load_library('/tmp/cmake_build/libhopper_moe.so'); print('cmake lib loaded; ops:', len([s for s in torch._C._jit_get_all_schemas() if s.name.startswith('hopper_moe::')]))"
      ) >"$OUT/cmake.log" 2>&1 && tail -1 "$OUT/cmake.log" || { tail -30 "$OUT/cmake.log"; echo "CMAKE FAILED"; rc=1; } ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
exit $rc
