"""benchmarks/bench_trace.py: without a GPU it says so and exits 0; on an SM90 GPU every
profiled replay of the cute layer lists its kernels (the two grouped GEMMs among them) with a
device time, also when the replays rotate through weight copies (--evict rotate), and the
read control is printed when asked for."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from conftest import HAS_CUDA

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_trace  # noqa: E402
import common  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("clean", [False, True])
def test_l2_evictor_writes_then_reads(clean):
    # (on the CPU: the calls the benchmarks make between replays, with a small buffer)
    evict = common.L2Evictor(torch.device("cpu"), nbytes=1 << 16, clean=clean)
    evict()
    evict()
    assert bool((evict.buf == 2).all())
    if clean:
        assert int(evict._sink) == 0  # the sum of the zero-filled read buffer


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the trace (the test below)")
def test_without_gpu_says_so(capsys):
    assert bench_trace.main(["--m", "1"]) == 0
    assert "needs a GPU" in capsys.readouterr().out


@pytest.mark.skipif(not (SM90 and HAS_CUDA), reason="needs an SM90 GPU and the CUDA build")
@pytest.mark.parametrize("extra", [[], ["--gemm-only", "--clean-l2", "--read-control"],
                                   ["--gemm-only", "--evict", "rotate", "--read-control"]])
def test_lists_the_kernels_of_a_replay(capsys, extra):
    assert bench_trace.main(["--shapes", "qwen3_30b", "--dtypes", "bf16", "--m", "2",
                             "--iters", "3"] + extra) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| `(.+?)` \| (\d+\.\d) \|", out, flags=re.M)
    gemms = [r for r in rows if "moe_gemm_sm90_kernel" in r[1]]
    assert len(gemms) == 2, out
    assert all(float(r[2]) > 0 for r in rows), out
    assert [int(r[0]) for r in rows] == list(range(len(rows))), out
    if "--gemm-only" in extra:
        assert all("moe_gemm" in r[1] for r in rows) and "read control" in out, out
    else:  # the layer also permutes and unpermutes
        assert any("unpermute" in r[1] for r in rows), out
    assert "device span" in out
    if "rotate" in extra:
        assert re.search(r"rotating R = \d+ weight copies", out), out
        assert re.search(r"read control: .* R = \d+ buffers in turn", out), out


def test_summary_of_synthetic_replays():
    # (on the CPU) two replays of two kernels; medians of durations, gaps, span, lead, tail
    replays = []
    for shift, lead, tail in ((0.0, 3.0, 1.0), (100.0, 5.0, 2.0)):
        r = bench_trace.Replay([("gemm_a(int)", shift + 10.0, shift + 30.0),
                                ("gemm_b(int)", shift + 25.0, shift + 45.0 + lead)])
        r.begin_end = shift + 10.0 - lead
        r.end_start = shift + 45.0 + lead + tail
        replays.append(r)
    lines = bench_trace.summarize(replays)
    assert lines[2] == "| 0 | `gemm_a` | 20.0 |  |", lines
    assert lines[3].startswith("| 1 | `gemm_b` | 24.0 | -5.0 |"), lines
    assert "device span 39.0 us" in lines[-1], lines
    assert "4.0 us from the marker kernel before it" in lines[-1], lines
    assert "1.5 us from its last kernel's end" in lines[-1], lines
    odd = bench_trace.Replay([("k", 0.0, 1.0)])
    assert "different kernel counts" in bench_trace.summarize(replays + [odd])[0]
