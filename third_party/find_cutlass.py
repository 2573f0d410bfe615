"""Locate the CUTLASS/CuTe headers hopper_moe compiles against.

hopper_moe vendors no CUTLASS code. The headers come from, in order:
  1. ``$CUTLASS_DIR`` -- a CUTLASS checkout (``$CUTLASS_DIR/include/cute``) or an unpacked
     ``nvidia-cutlass`` package (``$CUTLASS_DIR/source/include/cute``);
  2. the ``nvidia-cutlass`` Python package (pinned to 4.2.0.0 in pyproject.toml), whose
     ``cutlass_library/source/include`` holds ``cute/`` and ``cutlass/``.
Run ``python third_party/find_cutlass.py`` to print the include folders the build will use.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REQUIRED_VERSION = "4.2.0.0"


def _layouts(root: Path):
    yield root / "include", root / "tools" / "util" / "include"
    yield root / "source" / "include", root / "source" / "tools" / "util" / "include"


def cutlass_include_dirs() -> list[str]:
    """Return [include, tools/util/include] of the CUTLASS to build against, or raise."""
    env = os.environ.get("CUTLASS_DIR")
    if env:
        for inc, util in _layouts(Path(env)):
            if (inc / "cute" / "tensor.hpp").is_file():
                return [str(inc)] + ([str(util)] if util.is_dir() else [])
        raise RuntimeError(
            f"CUTLASS_DIR={env} holds no cute/tensor.hpp under include/ or source/include/")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "CUTLASS headers not found: `pip install --no-deps nvidia-cutlass=="
            f"{REQUIRED_VERSION}` or set CUTLASS_DIR to a CUTLASS checkout")
    root = Path(list(spec.submodule_search_locations)[0])
    for inc, util in _layouts(root):
        if (inc / "cute" / "tensor.hpp").is_file():
            return [str(inc)] + ([str(util)] if util.is_dir() else [])
    raise RuntimeError(f"the nvidia-cutlass package at {root} has no source/include/cute")


def nvidia_include_dirs() -> list[str]:
    """Headers PyTorch's CUDA headers include (cusparse.h, cublas_v2.h) that pip puts under
    site-packages/nvidia/*/include rather than in the CUDA toolkit (setup.py's build and the
    benchmarks' extension builds add them)."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    return sorted(str(p) for p in (site / "nvidia").glob("*/include") if p.is_dir())


if __name__ == "__main__":
    try:
        print("\n".join(cutlass_include_dirs()))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
