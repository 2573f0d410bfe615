"""The Triton MoE backend against the fp32 reference, every scheme, both tile mappings.

GEMM1 applies SiLU*mul in its epilogue; the SiLU*mul output (unless quantized there) and GEMM2's
output are kept in bf16 between kernels, so the layer is compared with the reference of that
storage precision (`triton_precision`): an FP8 requantization turns a bf16 rounding difference
into a whole fp8 step.

On a machine without a GPU these run in Triton's interpreter (TRITON_INTERPRET=1, set in
conftest.py before Triton is imported) on small shapes; on the GPU the same cases run compiled,
plus a larger fuzz and the zero-recompilation check.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import HAS_CUDA, gpu, seeded
from test_fused_moe import check_close

from hopper_moe import reference
from hopper_moe.quant import make_quant_config
from hopper_moe.backends.triton import fused_experts_triton
from hopper_moe.backends.triton import precision as triton_precision
from hopper_moe.kernels import moe_gemm_configs as triton_configs

SCHEMES = ["bf16", "fp8_tensor", "fp8_tensor_static", "fp8_channel", "fp8_block"]


def make_layer(M, E, topk, H, I, scheme, device, seed, expert_map=None, skew=False):
    g = seeded(seed)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    # Scaled so outputs are O(0.5): the OPS.md tolerances are for unit-scale data.
    w2 = (torch.randn(E, H, I, generator=g) / (2 * I ** 0.5)).to(torch.bfloat16)
    logits = torch.randn(M, E if expert_map is None else expert_map.numel(), generator=g)
    if skew:
        logits[:, 0] += 4.0
    weights, ids = torch.topk(torch.softmax(logits, -1), topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    quant = None
    if scheme != "bf16":
        base = "fp8_tensor" if scheme == "fp8_tensor_static" else scheme
        w1, w2, quant = make_quant_config(w1, w2, base, static_act=scheme == "fp8_tensor_static",
                                          a_sample=x)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    if quant is not None:
        quant = type(quant)(**{f: (to(v) if isinstance(v, torch.Tensor) else v)
                               for f, v in quant.__dict__.items()})
    return to(x), to(w1), to(w2), to(weights), to(ids), quant, to(expert_map)


def check(out, ref, scheme):
    """OPS.md tolerance (test_fused_moe.check_close). On a GPU the kernel's accumulation order
    differs from the reference's, so FP8 results may hold a few requantization steps."""
    check_close(out, ref, scheme, requant_steps=out.is_cuda)
    if ref.float().norm() > 0:
        ratio = out.float().norm() / ref.float().norm()
        assert 0.95 < ratio < 1.05, f"rms ratio {ratio:.3f}"


def run_case(M, E, topk, H, I, scheme, device, seed, expert_map=None, skew=False,
             apply_on_input=False):
    x, w1, w2, w, ids, quant, emap = make_layer(M, E, topk, H, I, scheme, device, seed,
                                                expert_map, skew)
    gne = -1 if emap is None else emap.numel()
    out = fused_experts_triton(x, w1, w2, w, ids, apply_router_weight_on_input=apply_on_input,
                               global_num_experts=gne, expert_map=emap, quant=quant)
    ref = reference.fused_experts_ref(x, w1, w2, w, ids,
                                      apply_router_weight_on_input=apply_on_input,
                                      global_num_experts=gne, expert_map=emap, quant=quant,
                                      **triton_precision(quant))
    check(out, ref, scheme)
    return out


DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 5, 33])
def test_triton_layer_matches_reference(scheme, M):
    H, I = (256, 128) if scheme == "fp8_block" else (192, 96)
    run_case(M, 4, 2, H, I, scheme, DEVICE, seed=M)


@pytest.mark.parametrize("swap_ab", [False, True])
def test_both_mappings_compute_the_same_function(swap_ab, monkeypatch):
    orig = triton_configs.default_config

    def forced(*args, **kwargs):
        return dict(orig(*args, **kwargs), SWAP_AB=swap_ab)

    monkeypatch.setattr(triton_configs, "default_config", forced)
    for scheme in ("bf16", "fp8_channel"):
        run_case(9, 4, 2, 128, 64, scheme, DEVICE, seed=3)


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_tensor_static", "fp8_channel",
                                    "fp8_block"])
def test_fp8_fast_accumulation_computes_the_same_layer(scheme, swap_ab, monkeypatch):
    """A config's FP8_FAST_ACC (the K loop accumulated in the MMA, no fp32 tile per K step) is
    the same function: H and I of three and two K tiles, so a path that kept only the last K
    tile fails. Block FP8 ignores the key (its scales apply per K group)."""
    orig = triton_configs.default_config

    def forced(*args, **kwargs):
        return dict(orig(*args, **kwargs), SWAP_AB=swap_ab, BLOCK_K=128, FP8_FAST_ACC=True)

    monkeypatch.setattr(triton_configs, "default_config", forced)
    run_case(9, 4, 2, 384, 256, scheme, DEVICE, seed=4)


@pytest.mark.parametrize("one_slot", [False, True])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_channel", "fp8_block"])
def test_one_slot_per_block_matches_aligned(one_slot, scheme, monkeypatch):
    """Tiny batches skip the alignment (one slot per program); both routings give the same
    result, also for ids that do not count and experts that are not local."""
    orig = triton_configs.default_config

    def forced(*args, **kwargs):
        cfg = dict(orig(*args, **kwargs), BLOCK_M=16, SWAP_AB=True)
        cfg["ONE_SLOT_PER_BLOCK"] = one_slot
        return cfg

    monkeypatch.setattr(triton_configs, "default_config", forced)
    H, I = (256, 128) if scheme == "fp8_block" else (128, 64)
    emap = torch.tensor([1, -1, 0, 2, -1, 3], dtype=torch.int32)
    x, w1, w2, w, ids, quant, emap = make_layer(3, 4, 2, H, I, scheme, DEVICE, seed=11,
                                                expert_map=emap)
    # local experts (0->1, 2->0, 5->3), a non-local one (1), and ids that are no expert
    ids = torch.tensor([[0, -1], [2, 5], [6, 1]], dtype=torch.int32, device=ids.device)
    out = fused_experts_triton(x, w1, w2, w, ids, global_num_experts=6, expert_map=emap,
                               quant=quant)
    ref = reference.fused_experts_ref(x, w1, w2, w, ids, global_num_experts=6,
                                      expert_map=emap, quant=quant, **triton_precision(quant))
    check(out, ref, scheme)


def test_expert_map_non_local_experts_contribute_zero():
    emap = torch.tensor([0, -1, 1, -1, 2, -1], dtype=torch.int32)
    run_case(7, 3, 2, 128, 64, "bf16", DEVICE, seed=5, expert_map=emap)


def test_ids_out_of_range_contribute_zero():
    x, w1, w2, w, ids, quant, _ = make_layer(6, 4, 2, 128, 64, "bf16", DEVICE, seed=9)
    ids[0, 0] = -1
    ids[3, 1] = 4  # == E: not an expert
    out = fused_experts_triton(x, w1, w2, w, ids)
    ref = reference.fused_experts_ref(x, w1, w2, w, ids, **triton_precision(quant))
    check(out, ref, "bf16")


def test_router_weight_on_input():
    run_case(5, 4, 1, 128, 64, "bf16", DEVICE, seed=2, apply_on_input=True)


def test_all_tokens_on_one_expert_and_empty_experts():
    run_case(20, 8, 2, 128, 64, "fp8_tensor", DEVICE, seed=4, skew=True)


def test_zero_tokens():
    x, w1, w2, w, ids, quant, _ = make_layer(0, 4, 2, 128, 64, "bf16", DEVICE, seed=1)
    assert fused_experts_triton(x, w1, w2, w, ids).shape == (0, 128)


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("out", ["bf16", "fp8_static", "amax"])
def test_gemm1_silu_epilogue(swap_ab, out):
    """GEMM1 with SiLU*mul in its epilogue, alone: act[slot] = silu(x g^T) * (x u^T) for placed
    slots, with an intermediate size that is no multiple of the tile's BLOCK_N / 2 outputs;
    rows of slots that are not placed stay as they were; the FP8 output is quantized with
    the static scale; the amax output is the dynamic per-tensor scale of what was stored."""
    from hopper_moe.quant import FP8_MAX, FP8_MIN_SCALE
    from hopper_moe.backends.triton import Routing, invoke_moe_gemm

    g = seeded(21)
    E, topk, H, I, M = 3, 2, 64, 40, 6
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 0], [2, -1], [0, 1], [5, 2], [1, 2]], dtype=torch.int32)
    x, w1, ids = x.to(DEVICE), w1.to(DEVICE), ids.to(DEVICE)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SWAP_AB=swap_ab, num_warps=4,
               num_stages=2)
    routing = Routing(ids, None, E, cfg["BLOCK_M"], aligned=True)
    slots = M * topk
    fp8 = out == "fp8_static"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    act = torch.full((slots, I), -3.0, device=DEVICE).to(dtype)  # poison
    scale = torch.tensor([0.01 if fp8 else FP8_MIN_SCALE], device=DEVICE)
    invoke_moe_gemm(x, w1, act, None, (0, 0), None, None, routing, topk, slots, None, False,
                    cfg, fuse_silu=True, out_scale=scale if out != "bf16" else None,
                    amax_out=out == "amax")

    flat = ids.reshape(-1).long().cpu()
    placed = (flat >= 0) & (flat < E)
    h = torch.zeros(slots, 2 * I)
    for s in torch.nonzero(placed).flatten().tolist():
        h[s] = x[s // topk].float().cpu() @ w1[flat[s]].float().cpu().t()
    want = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
    got = act.float().cpu()
    assert torch.equal(got[~placed], torch.full((int((~placed).sum()), I), -3.0).to(dtype).float())
    if fp8:
        q = (want[placed] * (1.0 / 0.01)).clamp(-FP8_MAX, FP8_MAX).to(dtype).float()
        # one fp8 step where GEMM1's accumulation order moves a value across a rounding edge
        step = q.abs().clamp_min(2.0 ** -6) / 8
        assert ((got[placed] - q).abs() <= step).all()
        assert ((got[placed] - q).abs() > 0).float().mean() < 0.02
    else:
        torch.testing.assert_close(got[placed], want[placed], atol=1e-2, rtol=2 ** -7)
    if out == "amax":
        stored_amax = got[placed].abs().max()
        assert scale.item() == max((stored_amax / FP8_MAX).item(), FP8_MIN_SCALE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm1_silu_epilogue_rounds_as_vllm_stores(dtype):
    """round_dtype: the epilogue rounds gate and up (GEMM1's output), silu(gate) and the
    product to the layer's 16-bit dtype, as vLLM's unfused pipeline (GEMM1 -> silu_and_mul)
    stores them, so an FP8 requantization afterwards sees vLLM's values. Against that
    rounding order: equal but for accumulation-order ties (a few elements: a gate or up value
    rounded to the neighbouring 16-bit value moves the product by up to two ulps; which ones
    depends on the CPU's fp32 matmul order in the reference); the fp32 product rounded once
    differs in many more elements."""
    from hopper_moe.backends.triton import Routing, invoke_moe_gemm

    g = seeded(23)
    E, topk, H, I, M = 2, 2, 64, 64, 16
    x = torch.randn(M, H, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    ids = (torch.arange(M * topk, dtype=torch.int32) % E).reshape(M, topk)
    x, w1, ids = x.to(DEVICE), w1.to(DEVICE), ids.to(DEVICE)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SWAP_AB=False, num_warps=4,
               num_stages=2)
    routing = Routing(ids, None, E, cfg["BLOCK_M"], aligned=True)
    act = torch.full((M * topk, I), float("nan"), dtype=dtype, device=DEVICE)
    invoke_moe_gemm(x, w1, act, None, (0, 0), None, None, routing, topk, M * topk, None, False,
                    cfg, fuse_silu=True, round_dtype=dtype)
    flat = ids.reshape(-1).long().cpu()
    h = torch.stack([x[s // topk].float().cpu() @ w1[flat[s]].float().cpu().t()
                     for s in range(M * topk)])
    gate, up = h[:, :I].to(dtype).float(), h[:, I:].to(dtype).float()
    silu = torch.nn.functional.silu(gate).to(dtype).float()
    vllm_order = (silu * up).to(dtype).float()
    fp32_once = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]).to(dtype).float()
    got = act.float().cpu()
    ulp = got.abs().clamp_min(2.0 ** -14) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    assert ((got - vllm_order).abs() <= 2.01 * ulp).all()
    differ_vllm = (got != vllm_order).float().mean().item()
    differ_fp32 = (got != fp32_once).float().mean().item()
    assert differ_vllm < 0.01 and differ_vllm < differ_fp32 / 4, (differ_vllm, differ_fp32)


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor_static", "fp8_channel"])
def test_stage_hook_reports_every_stage_in_order(scheme):
    """fused_experts_triton(stage_done=...) names each stage once, in launch order, and the
    hook changes nothing in the result."""
    x, w1, w2, w, ids, quant, _ = make_layer(6, 4, 2, 128, 64, scheme, DEVICE, seed=8)
    seen = []
    out = fused_experts_triton(x, w1, w2, w, ids, quant=quant, stage_done=seen.append)
    assert seen == ["align", "quant1", "gemm1", "quant2", "gemm2", "sum"]
    assert torch.equal(out, fused_experts_triton(x, w1, w2, w, ids, quant=quant))


FUZZ_SHARDS, FUZZ_CASES_PER_SHARD = 10, 100  # 1,000 seeded cases, in shards that run in parallel


@gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_triton_fuzz_gpu(shard):
    rng = random.Random(1234 + shard)
    failures = []
    for i in range(FUZZ_CASES_PER_SHARD):
        case = shard * FUZZ_CASES_PER_SHARD + i
        scheme = rng.choice(SCHEMES)
        E = rng.choice([1, 2, 8, 16, 64, 128])
        topk = rng.randint(1, min(E, 8))
        M = rng.choice([1, 2, 3, 7, 16, 31, 64, 65, 200, 513])
        if scheme == "fp8_block":
            H, I = rng.choice([128, 256, 384]), rng.choice([128, 256])
        else:
            H, I = rng.choice([64, 128, 200, 256, 520]), rng.choice([32, 64, 96, 200, 256])
        emap = None
        if rng.random() < 0.2 and E > 1:
            local = sorted(rng.sample(range(E), rng.randint(1, E)))
            emap = torch.full((E,), -1, dtype=torch.int32)
            emap[local] = torch.arange(len(local), dtype=torch.int32)
            e_local = len(local)
        else:
            e_local = E
        try:
            if emap is None:
                run_case(M, E, topk, H, I, scheme, "cuda", seed=case)
            else:
                run_case(M, e_local, topk, H, I, scheme, "cuda", seed=case, expert_map=emap)
        except AssertionError as err:
            failures.append(f"case={case} M={M} E={E} topk={topk} H={H} I={I} scheme={scheme} "
                            f"expert_map={emap is not None}: {' / '.join(str(err).splitlines()[:5])}")
    assert not failures, "\n".join(failures[:20])


def _compiled_variants(kernel) -> int:
    """Number of compiled specializations of a Triton kernel, over all devices."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_channel", "fp8_block"])
def test_no_recompilation_across_token_counts(scheme):
    from hopper_moe.kernels.moe_gemm import moe_gemm_kernel

    E, topk, H, I = 8, 2, 256, 128
    x, w1, w2, _, _, quant, _ = make_layer(8192, E, topk, H, I, scheme, "cuda", seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)

    def call(m):
        logits = torch.randn(m, E, device="cuda", generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), topk)
        fused_experts_triton(x[:m], w1, w2, w, ids.to(torch.int32), quant=quant)

    for m in triton_configs.M_BUCKETS:  # warm every bucket once
        call(m)
    torch.cuda.synchronize()
    before = _compiled_variants(moe_gemm_kernel)
    rng = random.Random(7)
    for _ in range(300):
        call(rng.randint(1, 8192))
    torch.cuda.synchronize()
    assert _compiled_variants(moe_gemm_kernel) == before


@gpu
def test_recompilation_counter_detects_specialization():
    """A copy of the kernel without do_not_specialize recompiles when a token-dependent
    integer changes divisibility, so the counter above can see recompilation."""
    import triton

    from hopper_moe.kernels import moe_gemm

    specialized = triton.jit(moe_gemm.moe_gemm_kernel.fn)
    orig = moe_gemm.moe_gemm_kernel
    try:
        moe_gemm.moe_gemm_kernel = specialized
        import hopper_moe.backends.triton as fm
        fm.moe_gemm_kernel = specialized
        x, w1, w2, _, _, _, _ = make_layer(64, 4, 2, 128, 64, "bf16", "cuda", seed=0)
        for m in (1, 7, 16, 33):
            w = torch.full((m, 2), 0.5, device="cuda")
            ids = torch.randint(0, 4, (m, 2), device="cuda", dtype=torch.int32)
            fused_experts_triton(x[:m], w1, w2, w, ids)
        assert _compiled_variants(specialized) > 1
    finally:
        moe_gemm.moe_gemm_kernel = orig
        fm.moe_gemm_kernel = orig
