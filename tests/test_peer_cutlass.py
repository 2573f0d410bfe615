"""benchmarks/peer_cutlass.py: the CUTLASS 3.x grouped GEMM peer (GEMM-only, measuring only).

The routing and variant choice run anywhere; the kernels need an SM90 GPU (they compile on
first use, a few minutes on a large machine) and are checked there against an fp32 matmul.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_moe  # noqa: E402
import peer_cutlass  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_each_backend_names_the_variant_of_each_scheme():
    want = {("cutlass_coop", "bf16"): "bf16_coop", ("cutlass_coop", "fp8_tensor"): "fp8_coop",
            ("cutlass_coop", "fp8_channel"): "fp8_coop",
            ("cutlass_pingpong", "bf16"): "bf16_pingpong",
            ("cutlass_pingpong", "fp8_tensor"): "fp8_pingpong",
            ("cutlass_coop_promoted", "fp8_tensor"): "fp8_coop_promoted",
            ("cutlass_coop_promoted", "bf16"): None, ("cutlass_coop", "fp8_block"): None,
            ("cutlass_engine", "fp8_tensor"): "fp8_engine_default",
            ("cutlass_engine", "bf16"): None, ("triton", "bf16"): None}
    for (backend, scheme), variant in want.items():
        assert peer_cutlass.variant_for(backend, scheme) == variant, (backend, scheme)
    sources = {p.stem for p in peer_cutlass.SOURCES.glob("*.cu")} - {"bindings"}
    named = {peer_cutlass.variant_for(b, s) for b in peer_cutlass.BACKENDS
             for s in ("bf16", "fp8_tensor")} | {
        peer_cutlass.engine_variant(rows, n, k) for rows in (64, 65, 8192)
        for n in (4096, 8192) for k in (4096, 8192)}
    assert named - {None} == sources  # every variant has its file, every file a backend


def test_the_engine_rule_per_gemm():
    """vLLM's cutlass_moe_mm on SM90 for more than 64 rows: N >= 8192 first, then K >= 8192;
    64 rows or fewer is its swap-AB kernels, which the peer does not build."""
    v = peer_cutlass.engine_variant
    assert v(64, 28672, 4096) is None
    assert v(8192, 28672, 4096) == "fp8_engine_n8192"      # mixtral GEMM1
    assert v(8192, 4096, 14336) == "fp8_engine_k8192"      # mixtral GEMM2
    assert v(8192, 8192, 8192) == "fp8_engine_n8192"
    assert v(65, 1536, 2048) == "fp8_engine_default"       # qwen3_30b GEMM1
    x = torch.zeros(2, 128)
    w1, w2 = torch.zeros(4, 64, 128), torch.zeros(4, 128, 32)
    with pytest.raises(NotImplementedError, match="swap-AB"):
        peer_cutlass.gemm_pair("cutlass_engine", "fp8_tensor", x, w1, w2,
                               torch.zeros(2, 1, dtype=torch.long))


def test_rows_are_grouped_by_expert_and_bad_ids_left_out():
    ids = torch.tensor([[2, 0], [5, 2], [1, -1], [2, 9]])
    tok, counts = peer_cutlass.expert_rows(ids, 6)
    assert counts == [1, 1, 3, 0, 0, 1]
    assert tok.tolist() == [0, 2, 0, 1, 3, 1]  # expert 0, 1, 2 (tokens 0, 1, 3), 5


def test_no_variant_is_a_clear_refusal():
    x = torch.zeros(2, 128)
    w1, w2 = torch.zeros(4, 64, 128), torch.zeros(4, 128, 32)
    with pytest.raises(NotImplementedError, match="no fp8_block variant"):
        peer_cutlass.gemm_pair("cutlass_coop", "fp8_block", x, w1, w2,
                               torch.zeros(2, 1, dtype=torch.long))


def test_a_row_a_backend_cannot_run_is_not_attempted_and_reads_n_a():
    """No variant (CUTLASS) or not supported (hopper_moe's backend, asked as "auto" asks):
    the row is never called and the table says n/a, not fail."""
    x = torch.zeros(2, 128)
    w1, w2 = torch.zeros(4, 64, 128), torch.zeros(4, 128, 32)
    ti = torch.zeros(2, 1, dtype=torch.long)
    lib = bench_moe.Lib(selftest=False)
    fn, how = bench_moe.row_fn(lib, "cutlass_coop_promoted", "bf16", x, None, ti, True, w1,
                               w2, None)
    assert fn is None and how.startswith(bench_moe.NOT_APPLICABLE)
    from hopper_moe.quant import make_quant_config
    w1q, w2q, quant = make_quant_config(torch.randn(4, 256, 128), torch.randn(4, 128, 128),
                                        "fp8_block")
    fn, how = bench_moe.row_fn(lib, "cute", "fp8_block", x.bfloat16(), None, ti, False, w1q,
                               w2q, quant)
    assert fn is None and how.startswith(bench_moe.NOT_APPLICABLE)  # no block FP8 in sm90
    rows = [dict(shape="s", dtype="bf16", M=2, backend=b, us=us, pct_floor=1.0, floor_us=1.0,
                 rel_err=None, error=err) for b, us, err in
            (("triton", 10.0, None), ("cute", None, "x" + how),
             ("cutlass_coop", None, "failed: boom"))]
    headers, table = bench_moe.compact_table(rows, ["triton", "cute", "cutlass_coop"])
    line = dict(zip(headers, table[0]))
    assert line["cute µs (%fl)"] == "n/a" and line["cutlass_coop µs (%fl)"] == "fail"


def test_the_summary_compares_against_the_fastest_cutlass_row():
    def row(backend, us):
        return dict(shape="s", dtype="bf16", M=64, backend=backend, us=us, pct_floor=50.0,
                    floor_us=10.0, rel_err=None)
    rows = [row("cute", 100.0), row("triton", 80.0), row("cutlass_coop", 120.0),
            row("cutlass_pingpong", 90.0)]
    headers, table = bench_moe.compact_table(
        rows, ["cute", "triton", "cutlass_coop", "cutlass_pingpong"])
    line = dict(zip(headers, table[0]))
    assert line["best"] == "triton"  # a CUTLASS row is never the best of ours
    assert line["best × cutlass"] == "1.12"  # 90 / 80


@pytest.mark.skipif(not SM90, reason="an SM90 GPU runs the CUTLASS peer")
@pytest.mark.parametrize("backend", sorted(peer_cutlass.BACKENDS))
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor"])
def test_the_peer_computes_each_group(backend, scheme):
    """GEMM1 and GEMM2 of every expert with rows (an empty expert between them, a group of
    one row, one not a multiple of the tile) against fp32 matmuls, after a launch by run()."""
    if peer_cutlass.variant_for(backend, scheme) is None:
        pytest.skip(f"{backend} has no {scheme} variant (by design)")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    e, h, i = 5, 256, 384
    dtype = torch.bfloat16 if scheme == "bf16" else torch.float8_e4m3fn
    w1 = (torch.randn(e, 2 * i, h, device=dev, generator=g) / 8).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev, generator=g) / 8).to(dtype)
    ids = torch.tensor([[0, 4]] * 130 + [[1, 4]] + [[3, 0]] * 7, device=dev)
    x = torch.randn(ids.shape[0], h, device=dev, generator=g).to(torch.bfloat16)
    run = peer_cutlass.gemm_pair(backend, scheme, x, w1, w2, ids)  # checks two groups
    d1, d2 = run()
    torch.cuda.synchronize()
    tok, counts = peer_cutlass.expert_rows(ids, e)
    assert counts == [137, 1, 0, 7, 131]
    a1 = x.index_select(0, tok).float().clamp(-448, 448).to(dtype).float()
    start = 0
    for ex, c in enumerate(counts):
        ref = a1[start:start + c] @ w1[ex].float().t()
        err = ((d1[start:start + c].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        assert c == 0 or err < 2e-2, (ex, err)
        start += c
    assert torch.isfinite(d2.float()).all()
