"""benchmarks/bench_host.py: without a GPU it says so and exits 0; on one, each row has a
host time per call and a device time, and the import times are in the file."""
from __future__ import annotations

import os
import re
import sys

import pytest

from conftest import HAS_CUDA, gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_host  # noqa: E402


@pytest.mark.skipif(HAS_CUDA, reason="a GPU runs the benchmark (the test below)")
def test_without_a_gpu_says_so(capsys):
    assert bench_host.main([]) == 0
    assert "NO GPU FOUND" in capsys.readouterr().out


@gpu
def test_rows_have_host_and_device_times(tmp_path):
    assert bench_host.main(["--shapes", "qwen3_30b", "--dtypes", "bf16", "--backends",
                            "torch,triton", "--calls", "20", "--out", str(tmp_path),
                            "--tag", "t"]) == 0
    (path,) = tmp_path.glob("*_t.md")
    text = path.read_text()
    assert re.search(r"import.*hopper_moe \d+\.\d\d", text)
    rows = [line for line in text.splitlines() if line.startswith("| qwen3_30b")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) > 0 and float(cells[6]) > 0, row  # host, event span


@gpu
def test_sm90_rows_and_their_op_profile(tmp_path):
    """The op (sm90) beside its Python composition (sm90_steps), and the torch.profiler file."""
    import torch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 layer needs an SM90 GPU")
    assert bench_host.main(["--shapes", "qwen3_30b", "--dtypes", "bf16", "--backends",
                            "sm90,sm90_steps", "--calls", "20", "--op-profile", "--out",
                            str(tmp_path), "--tag", "t"]) == 0
    (path,) = tmp_path.glob("*_t.md")
    rows = [line for line in path.read_text().splitlines() if line.startswith("| qwen3_30b")]
    assert [r.split("|")[4].strip() for r in rows] == ["sm90", "sm90_steps"]
    for row in rows:
        assert float(row.split("|")[5]) > 0, row
    (ops_path,) = tmp_path.glob("*_t_ops.txt")
    assert "fused_experts_sm90" in ops_path.read_text()
