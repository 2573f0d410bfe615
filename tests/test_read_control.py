"""benchmarks/read_control.py, the GEMM-only rows' bandwidth control: its kernel reads exactly
the touched experts' w1 and w2 bytes (each chunk's XOR against torch's), on the CPU in
Triton's interpreter (conftest.py) or on a GPU; and bench_moe.py's wiring of backend 'read'
(GEMM-only only, never a row's best)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_moe  # noqa: E402
import read_control as R  # noqa: E402

FP8 = torch.float8_e4m3fn


def device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or Triton's interpreter (TRITON_INTERPRET=1)")
    return "cpu"


@pytest.fixture
def small_chunks(monkeypatch):
    """Two load steps per program, so a small slice spans several chunks and a ragged last
    one (the interpreter runs every program in Python)."""
    monkeypatch.setattr(R, "STEPS", 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("ids", [[[2, 0], [2, 3]], [[1, 1]], [[3, 0], [1, 2]]],
                         ids=["three-experts", "one-expert", "all-experts"])
def test_reads_every_touched_byte(small_chunks, dtype, ids):
    dev = device()
    gen = torch.Generator().manual_seed(len(ids) * 7 + 1)
    # 96 x 72 bf16 per expert = 3456 words: one full 2048-word chunk and a ragged one
    w1 = torch.randn(4, 96, 72, generator=gen).to(dtype).to(dev)
    w2 = torch.randn(4, 40, 48, generator=gen).to(dtype).to(dev)
    ti = torch.tensor(ids, device=dev)
    got = R.make_weight_read(w1, w2, ti)().cpu()
    want = R.expected_xor(w1, w2, ti)
    assert got.shape == want.shape and torch.equal(got, want)
    # an untouched expert's bytes change nothing; a touched one's change its chunk
    experts = R.touched_experts(ti, 4)
    untouched = [e for e in range(4) if e not in experts]
    w1b = w1.clone()
    if untouched:
        w1b[untouched[0]] = torch.randn(96, 72, generator=gen).to(dtype).to(dev)
        assert torch.equal(R.make_weight_read(w1b, w2, ti)().cpu(), want)
    w1b[experts[-1], -1, -1] = torch.tensor(1.5).to(dtype) if w1b[experts[-1], -1, -1] != 1.5 \
        else torch.tensor(-1.5).to(dtype)
    changed = R.make_weight_read(w1b, w2, ti)().cpu()
    assert not torch.equal(changed, want)


def test_chunk_table_covers_each_slice_once(small_chunks):
    words = R.BLOCK * R.STEPS
    starts, ends = R.chunk_table([0, 2], 2 * words + 5)
    covered = [w for s, t in zip(starts, ends) for w in range(s, t)]
    expect = list(range(0, 2 * words + 5)) + list(range(2 * (2 * words + 5), 3 * (2 * words + 5)))
    assert covered == expect
    assert all(t - s <= words for s, t in zip(starts, ends))


def test_touched_experts_ignores_out_of_range_ids():
    assert R.touched_experts(torch.tensor([[3, -1], [3, 8], [0, 1]]), 8) == [0, 1, 3]


def test_words_rejects_what_it_cannot_view():
    with pytest.raises(RuntimeError, match="contiguous"):
        R.words(torch.zeros(8, 8, dtype=torch.bfloat16).t())
    with pytest.raises(RuntimeError, match="multiple of 4"):
        R.words(torch.zeros(3, dtype=torch.bfloat16))


def test_bench_moe_read_backend_is_gemm_only_and_never_best():
    fn, how = bench_moe.row_fn(None, bench_moe.READ_CONTROL, "bf16", None, None, None, False,
                               None, None, None)
    assert fn is None and "--gemm-only" in how
    rows = [dict(shape="s", dtype="bf16", M=1, backend=b, us=us, pct_floor=1.0, floor_us=1.0,
                 rel_err=None) for b, us in (("cute", 10.0), (bench_moe.READ_CONTROL, 5.0))]
    _, table = bench_moe.compact_table(rows, ["cute", bench_moe.READ_CONTROL])
    assert table[0][6] == "cute"
