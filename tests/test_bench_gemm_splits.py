"""benchmarks/bench_gemm_splits.py: without an SM90 GPU it says so and exits 0; on one, every
GEMM row carries the heuristic's split and the forced splits, each with a time. The forced
splits reach the op as its config (k_splits=N), checked on the CPU."""
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


def test_split_configs():
    assert [bench_gemm_splits.split_config(s) for s in bench_gemm_splits.SPLITS] == \
        ["", "k_splits=1", "k_splits=2", "k_splits=3", "k_splits=4", "k_splits=8"]


def test_split_configs_are_accepted_by_the_op():
    """Each config the benchmark passes is one the op takes (the CPU validates configs)."""
    from hopper_moe import ops
    a = torch.randn(3, 64).bfloat16()
    b = torch.randn(2, 32, 64).bfloat16()
    offs = torch.tensor([0, 1, 3])
    want = ops.moe_grouped_gemm(a, b, offs)
    for s in bench_gemm_splits.SPLITS:
        config = bench_gemm_splits.split_config(s)
        assert torch.equal(ops.moe_grouped_gemm(a, b, offs, config=config), want), config


@pytest.mark.skipif(SM90, reason="an SM90 GPU runs the benchmark (the test below)")
def test_without_sm90_says_so(capsys):
    assert bench_gemm_splits.main(["--m", "1"]) == 0
    assert "needs an SM90 GPU" in capsys.readouterr().out


@pytest.mark.skipif(not (SM90 and HAS_CUDA), reason="needs an SM90 GPU and the CUDA build")
def test_times_every_split(capsys):
    assert bench_gemm_splits.main(["--shapes", "qwen3_30b", "--dtypes", "bf16,fp8", "--m", "1",
                                   "--iters", "3", "--warmup", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " M=1 " in line]
    assert len(rows) == 4  # 2 dtypes x 2 GEMMs
    for line in rows:
        cells = re.findall(r"(auto|\d): (\d+\.\d) \((\d+)%\)", line)
        assert [c[0] for c in cells] == ["auto", "1", "2", "3", "4", "8"], line
        assert all(float(c[1]) > 0 for c in cells), line
