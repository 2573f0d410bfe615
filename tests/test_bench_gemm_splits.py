"""benchmarks/bench_gemm_splits.py: without an SM90 GPU it says so and exits 0; on one, every
GEMM row carries the heuristic's split and the four forced splits, each with a time."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from conftest import HAS_CUDA

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_gemm_splits  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(SM90, reason="an SM90 GPU runs the benchmark (the test below)")
def test_without_sm90_says_so(capsys):
    assert bench_gemm_splits.main(["--m", "1"]) == 0
    assert "needs an SM90 GPU" in capsys.readouterr().out


@pytest.mark.skipif(not (SM90 and HAS_CUDA), reason="needs an SM90 GPU and the CUDA build")
def test_times_every_split(capsys):
    os.environ.pop(bench_gemm_splits.ENV, None)
    assert bench_gemm_splits.main(["--shapes", "qwen3_30b", "--dtypes", "bf16,fp8", "--m", "1",
                                   "--iters", "3", "--warmup", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " M=1 " in line]
    assert len(rows) == 4  # 2 dtypes x 2 GEMMs
    for line in rows:
        cells = re.findall(r"(auto|\d): (\d+\.\d) \((\d+)%\)", line)
        assert [c[0] for c in cells] == ["auto", "1", "2", "3", "4", "8"], line
        assert all(float(c[1]) > 0 for c in cells), line
    assert bench_gemm_splits.ENV not in os.environ, "the override is restored"
