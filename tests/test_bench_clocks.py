"""benchmarks/bench_clocks.py: nvidia-smi's CSV lines are parsed (bad lines skipped), the
quantiles are the ones the report prints, and without a GPU the script says so and exits 0."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_clocks  # noqa: E402


def test_read_samples_skips_unparsable_lines(tmp_path):
    f = tmp_path / "smi.csv"
    f.write_text("2026/12/01 10:00:00.125, 1980, 650.25, 45, 0x0000000000000004\n"
                 "garbage\n"
                 "2026/12/01 10:00:00.130, [N/A], 600, 45, 0x0\n"
                 "2026/12/01 10:00:00.135, 1755, 700.5, 46, 0x0000000000000000\n")
    got = bench_clocks.read_samples(str(f))
    assert [(s[1], s[2], s[3]) for s in got] == [(1980.0, 650.25, "0x0000000000000004"),
                                                 (1755.0, 700.5, "0x0000000000000000")]
    assert got[1][0] - got[0][0] == pytest.approx(0.010)


def test_quantiles():
    assert bench_clocks.quantiles([float(i) for i in range(100)]) == (10.0, 50.0, 90.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the benchmark")
def test_without_gpu_says_so(capsys):
    assert bench_clocks.main(["--iters", "2"]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available() or bench_clocks.shutil.which("nvidia-smi")
                    is None, reason="needs a CUDA GPU and nvidia-smi")
def test_reports_both_passes(tmp_path, capsys):
    from conftest import HAS_CUDA
    if not HAS_CUDA:
        pytest.skip("a GPU without a CUDA build of hopper_moe")
    assert bench_clocks.main(["--shape", "tiny", "--m", "5", "--iters", "20",
                              "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sync: p10" in out and "burst: p10" in out
    assert list(tmp_path.glob("clocks_tiny_bf16_m5.csv"))
