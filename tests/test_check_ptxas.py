"""tools/check_ptxas.py: the build check on made-up ptxas logs (CPU)."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_ptxas  # noqa: E402

KERNEL = "_ZN10hopper_moe4gemm20moe_gemm_sm90_kernelIiEEvv"


def log(tmp_path, *, serialized=False, spill=0, lmem=0):
    lines = [f"ptxas info    : Compiling entry function '{KERNEL}' for 'sm_90a'",
             "ptxas info    : Function properties for " + KERNEL]
    if serialized:
        lines.append("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async "
                     "instructions are serialized due to non wgmma instructions defining "
                     "accumulator registers of a wgmma between start and end of the pipeline "
                     f"stage in the function '{KERNEL}'")
    lines += [f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads",
              "ptxas info    : Used 168 registers, used 10 barriers"
              + (f", {lmem} bytes lmem" if lmem else "")]
    path = tmp_path / "build.log"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_clean_kernel_passes(tmp_path, capsys):
    assert check_ptxas.main(log(tmp_path)) == 0
    assert "1 kernels, 0 with spills or local memory, 0 with serialized wgmma" in \
        capsys.readouterr().out


def test_serialized_wgmma_fails(tmp_path, capsys):
    assert check_ptxas.main(log(tmp_path, serialized=True)) == 1
    out = capsys.readouterr().out
    assert "1 with serialized wgmma" in out and f"SERIALIZED WGMMA {KERNEL}" in out


def test_spills_and_local_memory_fail(tmp_path, capsys):
    assert check_ptxas.main(log(tmp_path, spill=8)) == 1
    assert "8 B spill stores" in capsys.readouterr().out
    assert check_ptxas.main(log(tmp_path, lmem=16)) == 1
    assert "16 B local memory" in capsys.readouterr().out
