"""fused_experts(backend="cute", the alias of "sm90"): the layer around moe_grouped_gemm against
the fp32 reference.

On the CPU the grouped GEMM is its CPU definition, so these tests pin the composition (slot
sort, quantization, scales, SiLU*mul, weighted sum, expert_map, invalid ids) in CI; the
gpu-marked tests run the same layer on the SM90 kernel, plus a fuzz (its CUDA-graph replay
is in test_fused_moe.py, with the other backends').
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import gpu

from hopper_moe import fused_experts
from hopper_moe.backends import sm90
from hopper_moe.reference import fused_experts_ref
from test_fused_moe import check_close, check_close_requant, make_problem

SCHEMES = ["bf16", "fp8_tensor_static", "fp8_tensor_dynamic", "fp8_channel"]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def cute_precision(p) -> dict:
    """GEMM outputs stored in bf16; SiLU*mul of the bf16 GEMM1 output as silu_and_mul rounds
    it (silu to bf16, then the product to bf16), also with a static per-tensor a2 scale, where
    that bf16 value is quantized straight to FP8."""
    return dict(intermediate_dtype=torch.bfloat16, act_dtype=torch.bfloat16,
                silu_dtype=torch.bfloat16)


def reference(p):
    return fused_experts_ref(*p.args(), **p.kwargs(), **cute_precision(p))


def run(p, device="cpu"):
    p = p.to(device)
    return fused_experts(*p.args(), **p.kwargs(), backend="cute")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,e,topk", [(1, 1, 1), (5, 8, 2), (33, 16, 4), (64, 8, 8)])
def test_cpu_matches_reference(scheme, m, e, topk):
    p = make_problem(m, e, topk, 128, 256, scheme=scheme, seed=m * 10 + e)
    out = run(p)
    assert out.shape == (m, 128) and out.dtype == p.x.dtype
    check_close(out, reference(p), scheme, f"{scheme} m={m} e={e} topk={topk}")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_semantics(scheme):
    """expert_map with -1 entries, out-of-range ids, router weight on the input, fp16/fp32."""
    cases = [dict(num_local=5), dict(invalid_ids=True), dict(on_input=True, topk=1),
             dict(dtype=torch.float16), dict(dtype=torch.float32)]
    for kw in cases:
        args = dict(m=17, e=8, topk=3, h=128, i=64, scheme=scheme, seed=7)
        args.update(kw)
        p = make_problem(**args)
        check_close(run(p), reference(p), scheme, f"{scheme} {kw}")


def test_cpu_all_slots_on_one_expert_and_empty_experts():
    p = make_problem(40, 16, 2, 128, 128, scheme="fp8_channel", seed=2)
    ids = p.topk_ids.clone()
    ids[:, 0], ids[:, 1] = 3, 11  # two experts hold everything, 14 are empty
    p = type(p)(p.x, p.w1, p.w2, p.topk_weights, ids, p.quant)
    check_close(run(p), reference(p), "fp8_channel")


def test_zero_tokens():
    p = make_problem(0, 8, 2, 128, 128)
    assert run(p).shape == (0, 128)


def test_unsupported_inputs_raise():
    p = make_problem(3, 4, 2, 128, 128, scheme="fp8_block")
    with pytest.raises(RuntimeError, match="block-wise FP8"):
        run(p)
    p = make_problem(3, 4, 2, 100, 128, scheme="fp8_channel")  # H = 100: not 16-byte rows
    with pytest.raises(RuntimeError, match=r"hidden size H \(w1.size\(2\)\) = 100"):
        run(p)
    p = make_problem(3, 4, 2, 128, 36)  # bf16, I = 36
    with pytest.raises(RuntimeError, match="intermediate size I"):
        run(p)


def test_available_on_cpu_and_only_on_sm90():
    assert sm90.is_available("cpu")
    assert sm90.is_available("cuda") == (SM90 and __import__("hopper_moe").built_with_cuda())


@pytest.mark.parametrize("scheme", ["bf16", "fp8_channel"])
def test_gemm_only_entry_runs_both_gemms(scheme):
    """api.make_gemm_only("cute", ...): GEMM1's output is SiLU*mul of the sorted rows
    times each expert's w1 (per the CPU definition), and replays are deterministic."""
    import importlib

    from hopper_moe.reference import moe_grouped_gemm_ref, silu_mul_f32_ref

    fm = importlib.import_module("hopper_moe.api")
    tb = importlib.import_module("hopper_moe.backends.torch")

    p = make_problem(9, 4, 2, 128, 64, scheme=scheme, seed=5)
    fn = fm.make_gemm_only("cute", p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, quant=p.quant)
    h, y = (t.clone() for t in fn())
    assert h.shape == (18, 64) and y.shape == (18, 128)
    h2, y2 = fn()
    assert torch.equal(h, h2) and torch.equal(y, y2)
    order, _, _, offs_end = tb.sort_slots_by_expert(p.topk_ids, 4, 4, None)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), offs_end.long()])
    rows = p.x[order // 2]
    if p.quant is None:
        want = silu_mul_f32_ref(moe_grouped_gemm_ref(rows.bfloat16(), p.w1, offsets))
        torch.testing.assert_close(h.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.isfinite(y.float()).all() and y.float().abs().max() > 0
    with pytest.raises(NotImplementedError, match="torch"):
        fm.make_gemm_only("torch", p.x, p.w1, p.w2, p.topk_weights, p.topk_ids)


# ------------------------------------------------------------------------------------ GPU
needs_sm90 = pytest.mark.skipif(not SM90, reason="the kernel is sm_90a code")


@gpu
@needs_sm90
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,e,topk,h,i", [(1, 8, 2, 4096, 1024), (16, 128, 8, 2048, 768),
                                          (64, 8, 2, 512, 1024), (300, 64, 6, 1024, 256)])
def test_gpu_matches_reference(scheme, m, e, topk, h, i):
    p = make_problem(m, e, topk, h, i, scheme=scheme, seed=m + e)
    out = run(p, "cuda")
    check_close_requant(out, reference(p), scheme, f"{scheme} m={m} e={e} h={h} i={i}")
    # the CPU composition gives the same layer
    check_close_requant(out, run(p), scheme, "cuda vs cpu")


@gpu
@needs_sm90
@pytest.mark.parametrize("shard", range(4))
def test_gpu_fuzz(shard):
    """200 seeded random layers, in 4 shards that run in parallel."""
    rng = random.Random(77 + shard)
    failures = []
    for case in range(shard * 50, shard * 50 + 50):
        scheme = rng.choice(SCHEMES)
        e = rng.choice([1, 2, 8, 16, 64, 128])
        topk = rng.randint(1, min(e, 8))
        m = rng.choice([1, 2, 3, 7, 16, 31, 64, 65, 200])
        h = rng.choice([64, 128, 192, 512])
        i = rng.choice([32, 64, 96, 256])
        kw = dict(num_local=rng.randint(1, e)) if e > 1 and rng.random() < 0.2 else {}
        p = make_problem(m, e, topk, h, i, scheme=scheme, seed=case,
                         invalid_ids=rng.random() < 0.2, **kw)
        try:
            check_close_requant(run(p, "cuda"), reference(p), scheme, f"case {case}")
        except AssertionError as err:
            failures.append(f"case={case} {scheme} m={m} e={e} topk={topk} h={h} i={i} {kw}: "
                            f"{' / '.join(str(err).splitlines()[:4])}")
    assert not failures, "\n".join(failures[:20])
