"""torch.compile(fullgraph=True, dynamic=True) over the layer API: equal to eager, one graph
for several token counts, no graph breaks.

On CPU the per-scheme tests compile with the "aot_eager" backend (Dynamo + fake tensors + AOT
functionalization: where graph breaks and fake-kernel gaps show up) and one small case with
the default Inductor backend, to keep CI in seconds; on the GPU everything runs with Inductor.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch._dynamo
import torch._inductor.exc
from torch._dynamo.utils import counters

from hopper_moe import fused_experts, fused_topk

from conftest import gpu, seeded
from test_fused_moe import TOL, base_scheme, check_close_requant, make_problem

fm = importlib.import_module("hopper_moe.api")

# > 1 (Dynamo specializes 0 and 1) and unlike every other size of the problem: Dynamo gives
# equal sizes one symbol, and the expert count is specialized (loops over experts).
M_VALUES = (5, 17, 40)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    torch._dynamo.reset()


def _layer(x, w1, w2, tw, ti, expert_map, quant):
    return fused_experts(x, w1, w2, tw, ti, expert_map=expert_map, quant=quant, backend="torch")


def _check_compiled_layer(scheme, device, backend, dtype, e=3, num_local=None, h=128, i=128,
                          topk=2):
    compiled = torch.compile(_layer, fullgraph=True, dynamic=True, backend=backend)
    atol = TOL[base_scheme(scheme)][0]
    for m in M_VALUES:
        p = make_problem(m, e, topk, h, i, scheme=scheme, dtype=dtype, seed=m,
                         num_local=num_local, invalid_ids=True).to(device)
        args = (*p.args(), p.expert_map, p.quant)
        got = compiled(*args)
        want = _layer(*args)
        assert got.shape == want.shape and got.dtype == want.dtype
        if base_scheme(scheme) == "bf16" or backend != "inductor":
            # Same math; the compiled graph may only reorder fp32 reductions.
            torch.testing.assert_close(got.float(), want.float(), atol=min(atol, 1e-2) / 4,
                                       rtol=0)
        else:
            # Inductor generates its own kernels for the FP8 quantizations (a reciprocal for a
            # division, fused multiply-adds), which may round a value to the neighbouring FP8
            # code: on the H200 that moved 12-24% of the outputs by up to 0.023. Held to the
            # allowance for requantization steps (test_fused_moe.check_close_requant).
            check_close_requant(got, want, scheme, f"compiled vs eager, m={m}")
        assert got.float().abs().max() > 0
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor_static", "fp8_tensor_dynamic",
                                    "fp8_channel", "fp8_block"])
def test_compile_fused_experts_cpu(scheme):
    _check_compiled_layer(scheme, "cpu", "aot_eager", torch.bfloat16, num_local=2)


@pytest.mark.parametrize("scheme", ["bf16", "fp8_block"])
def test_compile_auto_choice_cpu(scheme):
    """backend="auto" asks every backend's support check while Dynamo traces (sm90's looks at
    the weights' addresses only outside tracing: there are none there): one graph, no graph
    break, equal to eager."""
    def layer(x, w1, w2, tw, ti, expert_map, quant):
        return fused_experts(x, w1, w2, tw, ti, expert_map=expert_map, quant=quant)

    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    p = make_problem(5, 3, 2, 128, 128, scheme=scheme, dtype=torch.bfloat16, seed=5,
                     num_local=2, invalid_ids=True)
    args = (*p.args(), p.expert_map, p.quant)
    torch.testing.assert_close(compiled(*args).float(), layer(*args).float(),
                               atol=min(TOL[base_scheme(scheme)][0], 1e-2) / 4, rtol=0)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])


def test_compile_fused_experts_cpu_inductor():
    _check_compiled_layer("bf16", "cpu", "inductor", torch.float32, e=2)


def test_compile_explain_no_graph_breaks():
    p = make_problem(5, 4, 2, 128, 128, scheme="fp8_channel", seed=1)
    explanation = torch._dynamo.explain(_layer)(*p.args(), p.expert_map, p.quant)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _topk(hidden, gating):
    return fused_topk(hidden, gating, 4, True)


def _check_compiled_topk(device, backend):
    compiled = torch.compile(_topk, fullgraph=True, dynamic=True, backend=backend)
    for m in M_VALUES:
        g = seeded(m)
        gating = torch.randn(m, 16, generator=g).to(device)
        hidden = torch.randn(m, 32, generator=g).to(device)
        got = compiled(hidden, gating)
        want = _topk(hidden, gating)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_fused_topk_cpu():
    _check_compiled_topk("cpu", "aot_eager")


@gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor_static", "fp8_tensor_dynamic",
                                    "fp8_channel", "fp8_block"])
def test_compile_fused_experts_gpu(scheme):
    # Block FP8 with H != I: see test_compile_block_fp8_hidden_equal_intermediate_gpu.
    h = 256 if scheme == "fp8_block" else 128
    _check_compiled_layer(scheme, "cuda", "inductor", torch.bfloat16, e=8, num_local=6, h=h)


@gpu
@pytest.mark.xfail(strict=True, raises=torch._inductor.exc.InductorError,
                   reason="Inductor's Triton codegen prints sqrt(ps) for H when H == I (below)")
def test_compile_block_fp8_hidden_equal_intermediate_gpu():
    """Pins a PyTorch Inductor bug (seen with torch 2.11 on the H200; the same codegen in
    torch 2.14): block FP8 on the torch backend, H == I, dynamic=True. Dynamo gives H and I
    one symbol s; the weight dequantization of w2 [E, H, I] makes Inductor precompute
    ps = s**2, and the row stride of torch._grouped_mm's output (padded to 8*ceil(s/8)) is
    then printed with s rewritten as sqrt(ps), which the Triton printer rejects
    ("AssertionError: 1/2"). H != I (the test above) compiles. strict: when PyTorch fixes
    it this test fails, and this note and the H != I shape can go."""
    _check_compiled_layer("fp8_block", "cuda", "inductor", torch.bfloat16, e=8, num_local=6,
                          h=128, i=128)


@gpu
def test_compile_fused_experts_gpu_block_distinct_sizes():
    """Block FP8 with no two unrelated sizes equal (H/128 = 3, 2I/128 = 12, I/128 = 6, topk 4,
    7 local of 8 experts, M 5/17/40). With the block scales expanded by repeat_interleave and a
    slice, both this test (then with H/128 = topk = 3) and the one above (2I/128 = topk = 2)
    failed in Inductor on torch 2.11 + CUDA ("AssertionError: 1/2" from the sympy printer: a
    square root in an index expression, after Dynamo gave the equal sizes one symbol). The
    torch backend now gathers block scales by index, which ties no sizes together."""
    _check_compiled_layer("fp8_block", "cuda", "inductor", torch.bfloat16, e=8, num_local=7,
                          h=384, i=768, topk=4)


@gpu
def test_compile_fused_topk_gpu():
    _check_compiled_topk("cuda", "inductor")
