"""benchmarks/bench_stages.py end to end on the tiny shape (Triton's interpreter on the CPU, the
compiled layer on a GPU): every stage of every call timed, the stages adding up to the call,
and the result files written."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import HAS_CUDA

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_stages  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available() and not HAS_CUDA,
                    reason="a GPU without a CUDA build of hopper_moe")
def test_bench_stages_times_every_stage(tmp_path, capsys):
    rc = bench_stages.main(["--shape", "tiny", "--dtype", "fp8_tensor", "--m", "5",
                            "--iters", "2", "--warmup", "1", "--out", str(tmp_path),
                            "--tag", "t"])
    assert rc == 0
    printed = capsys.readouterr().out
    for stage in bench_stages.STAGES:
        assert f"| {stage}" in printed
    (js,) = tmp_path.glob("*_t.json")
    rows = json.loads(js.read_text())["rows"]
    assert [r["M"] for r in rows] == [5]
    for r in rows:
        samples = r["samples_us"]
        assert set(samples) == set(bench_stages.STAGES) | {"total"}
        assert all(len(v) == 2 for v in samples.values())
        assert all(t > 0 for s in ("gemm1", "gemm2") for t in samples[s])
        for i, total in enumerate(samples["total"]):
            assert total == pytest.approx(sum(samples[s][i] for s in bench_stages.STAGES))
        assert sum(r["rows_per_expert"]) == r["M"] * 2  # tiny: top-2
        assert r["layer_us"] > 0
    md = (tmp_path / js.name.replace(".json", ".md")).read_text()
    assert md.count(" histogram (µs: calls): ") == 3  # gemm1, gemm2, total


def test_histogram_counts_every_sample():
    xs = [1.0, 1.1, 1.2, 5.0, 5.1, 9.0]
    hist = bench_stages.histogram(xs, bins=4)
    assert sum(c for _, _, c in hist) == len(xs)
    assert hist[0][0] == 1.0 and hist[-1][1] == pytest.approx(9.0)
    assert [c for _, _, c in hist] == [3, 0, 2, 1]
    assert bench_stages.histogram([2.0, 2.0], bins=3)[0][2] == 2  # all equal: one bin
