"""Build hopper_moe._C: the CUDA kernels (sm_90a), their CPU definitions and the op registry.

    pip install --no-build-isolation -v -e .

Environment:
  CUTLASS_DIR          CUTLASS checkout to use instead of the nvidia-cutlass package
  HOPPER_MOE_CPU_ONLY  1: build only the CPU implementations (no nvcc needed)
  HOPPER_MOE_CXX_FLAGS   extra host C++ compiler flags, space-separated (e.g. -g for full debug
                       info: host files get -g1, line tables only, by default)
  HOPPER_MOE_NVCC_FLAGS  extra nvcc flags, space-separated
  MAX_JOBS             parallel compile jobs (ninja)
ptxas prints registers, shared memory and spills of every kernel (-Xptxas=-v); with `pip -v`
that lands in the build log, which tools/check_ptxas.py reads to fail a build that spills.
"""
import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "third_party"))
from find_cutlass import cutlass_include_dirs, nvidia_include_dirs  # noqa: E402

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / pattern), recursive=True))


cpu_only = os.environ.get("HOPPER_MOE_CPU_ONLY", "0") == "1"
if not cpu_only and shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
    raise RuntimeError("nvcc not found: set CUDA_HOME, or HOPPER_MOE_CPU_ONLY=1 for a CPU build")

cpp_sources = ["csrc/torch_bindings.cpp", "csrc/settings.cpp"] + _sources("csrc/checks/*.cpp") + _sources("csrc/cpu/*.cpp") + _sources("csrc/layer/*.cpp")
include_dirs = [str(ROOT / "csrc"), str(ROOT / "csrc" / "include")]
# Every source includes only the ATen/c10 headers it uses (<ATen/core/Tensor.h>, per-op headers
# such as <ATen/ops/empty.h>), never <ATen/ATen.h> or <torch/extension.h>: those parse all of
# ATen's operators and made each host file several times slower to compile. This define turns
# an include of ATen/Functions.h (which they pull in) into a compile error.
only_method_operators = "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"
# -g1: line tables (backtraces, perf) without the full debug info of every ATen template the
# Python build's -g would emit, which took as long as the rest of each host file's compile.
cxx_flags = ["-O3", "-g1", "-DHOPPER_MOE_PYTHON_MODULE", only_method_operators]
cxx_flags += os.environ.get("HOPPER_MOE_CXX_FLAGS", "").split()

if cpu_only:
    ext = CppExtension(
        "hopper_moe._C", cpp_sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags})
else:
    include_dirs += cutlass_include_dirs() + nvidia_include_dirs()
    cuda_sources = _sources("csrc/ops/*.cu") + _sources("csrc/instantiations/*.cu")
    defines = ["-DHOPPER_MOE_WITH_CUDA"]
    nvcc_flags = [
        "-O3",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-lineinfo",
        "-Xptxas=-v",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-DNDEBUG",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ] + defines + [only_method_operators] + os.environ.get("HOPPER_MOE_NVCC_FLAGS", "").split()
    ext = CUDAExtension(
        "hopper_moe._C", cpp_sources + cuda_sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags + defines, "nvcc": nvcc_flags})

setup(
    packages=["hopper_moe", "hopper_moe.reference", "hopper_moe.backends", "hopper_moe.kernels"],
    package_dir={"": "python"},
    package_data={"hopper_moe": ["configs/*.json"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
)
