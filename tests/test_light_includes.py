"""The C++ and CUDA sources include only the ATen/c10 headers they use.

<ATen/ATen.h>, <torch/extension.h> and the other umbrella headers parse every ATen operator
(and pybind11) and made each host file several times slower to compile; a fresh build on a
2-core machine took about twice as long. The build defines TORCH_ASSERT_ONLY_METHOD_OPERATORS,
which turns an include of ATen/Functions.h into a compile error; this test names the offending
file:line without a compiler, and checks that both build files keep the define."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}
# Umbrella headers: each includes ATen/Functions.h (all operators) or pybind11.
HEAVY = re.compile(
    r'#\s*include\s*[<"]('
    r"ATen/ATen\.h|ATen/Functions\.h|ATen/NativeFunctions\.h|ATen/TensorOperators\.h|"
    r"torch/extension\.h|torch/all\.h|torch/torch\.h|torch/python\.h|pybind11/[^>\"]*"
    r')[>"]')


def heavy_includes() -> list[str]:
    """``file:line: text`` of every umbrella-header include under csrc/."""
    found = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if not (path.is_file() and path.suffix in SUFFIXES):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if HEAVY.search(line):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}")
    return found


def test_sources_include_no_umbrella_header():
    found = heavy_includes()
    assert not found, ("include the ATen/c10 headers the file uses instead (<ATen/core/Tensor.h>, "
                       "<ATen/ops/<op>.h>, <c10/...>, <torch/library.h>):\n" + "\n".join(found))


def test_the_pattern_catches_each_form():
    for line in ("#include <ATen/ATen.h>", '#include "torch/extension.h"', "# include <torch/all.h>",
                 "#include <pybind11/pybind11.h>", "#include <ATen/Functions.h>"):
        assert HEAVY.search(line), line
    for line in ("#include <ATen/core/Tensor.h>", "#include <ATen/ops/empty.h>",
                 "#include <torch/library.h>", "#include <ATen/Dispatch.h>"):
        assert not HEAVY.search(line), line


def test_builds_forbid_the_operator_headers():
    assert "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS" in (ROOT / "setup.py").read_text()
    assert "TORCH_ASSERT_ONLY_METHOD_OPERATORS" in (ROOT / "CMakeLists.txt").read_text()
