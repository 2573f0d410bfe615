"""Behaviours of vLLM 0.33's fused MoE that hopper_moe follows where vLLM's own kernel tests
found them missing (pinned here so they hold where vLLM's tests cannot run)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hopper_moe
from hopper_moe import api

from conftest import DEVICES
from test_fused_moe import make_problem, run
from test_grouped_gemm import GPU_FP8_TOL, check_fp16_out, cutlass_args
from test_permute import assert_same, check_align_invariants, cpu_all, run_align
from hopper_moe.reference import permute as ref_permute


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "reference", "sm90", "triton"])
@pytest.mark.parametrize("scale_3d", [False, True])
def test_per_token_activations_infer_per_channel_weights(device, backend, scale_3d):
    """per_act_token_quant=True with weight scales of shape [E, N] (or [E, N, 1]) and
    per_out_ch_quant unset: vLLM reads per-channel weights; so does hopper_moe (the same
    output as with per_out_ch_quant=True), where it used to reject the scale's shape."""
    if backend not in api.available_backends(device):
        pytest.skip(f"backend {backend} not available on {device}")
    p = make_problem(5, 4, 2, 128, 128, scheme="fp8_channel", seed=3,
                     channel_3d=scale_3d).to(device)
    assert p.quant.per_out_ch_quant and p.quant.per_act_token_quant
    explicit = run(p, backend=backend)
    inferred = replace(p, quant=replace(p.quant, per_out_ch_quant=False))
    torch.testing.assert_close(run(inferred, backend=backend), explicit, rtol=0, atol=0)


def test_resolve_leaves_other_configs_alone():
    s = torch.ones(4)
    w1 = torch.zeros(4, 64, 32, dtype=torch.float8_e4m3fn)
    per_tensor = hopper_moe.QuantConfig(s, s, per_act_token_quant=True)
    assert per_tensor.resolve(w1) is per_tensor  # [E] scales stay per-tensor weights
    plain = hopper_moe.QuantConfig(torch.ones(4, 64), s)
    assert plain.resolve(w1) is plain  # per-tensor activations: nothing is inferred
    # An [E, N] scale with per-tensor activations is still an error, named.
    w2 = torch.zeros(4, 32, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="w1_scale must have shape \\(num_experts,\\)"):
        plain.validate(w1, w2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "reference", "sm90", "triton"])
@pytest.mark.parametrize("scheme", [None, "fp8_tensor"])
def test_fused_shared_experts(device, backend, scheme):
    """More physical experts than routed ones (global_num_experts < w1.size(0), no expert_map):
    vLLM computes every physical expert, so the shared expert (id 8 of 9 here, routed 8) counts;
    hopper_moe used to reject global_num_experts != E. A larger global_num_experts leaves ids
    past E non-local."""
    if backend not in api.available_backends(device):
        pytest.skip(f"backend {backend} not available on {device}")
    routed, physical, m, hidden, inter = 8, 9, 5, 128, 64
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(m, hidden, generator=g) / 4).to(torch.bfloat16)
    w1 = torch.randn(physical, 2 * inter, hidden, generator=g) / 8
    w2 = torch.randn(physical, hidden, inter, generator=g) / 8
    quant = None
    if scheme is not None:
        s1, s2 = w1.abs().amax((1, 2)) / 448, w2.abs().amax((1, 2)) / 448
        w1 = (w1 / s1[:, None, None]).to(torch.float8_e4m3fn)
        w2 = (w2 / s2[:, None, None]).to(torch.float8_e4m3fn)
        quant = hopper_moe.QuantConfig(s1.to(device), s2.to(device))
    else:
        w1, w2 = w1.to(torch.bfloat16), w2.to(torch.bfloat16)
    ids = torch.tensor([[t % routed, routed] for t in range(m)], dtype=torch.int32)
    weights = torch.tensor([[0.5, 1.0]] * m)
    x, w1, w2, ids, weights = (t.to(device) for t in (x, w1, w2, ids, weights))
    atol = 2e-2 if scheme is None else 5.5e-2
    # The reference with all nine experts (global_num_experts = E).
    want = hopper_moe.reference.fused_experts_ref(x, w1, w2, weights, ids, quant=quant)
    got = hopper_moe.fused_experts(x, w1, w2, weights, ids, global_num_experts=routed,
                                   quant=quant, backend=backend)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=1e-2)
    # The shared expert's contribution is there (dropping it changes the output).
    dropped = hopper_moe.reference.fused_experts_ref(
        x, w1, w2, weights, torch.where(ids == routed, -1, ids), quant=quant)
    assert not torch.allclose(got.float(), dropped.float(), atol=atol, rtol=1e-2)
    # global_num_experts larger than E: ids in [E, global) are non-local (zero).
    wide = hopper_moe.fused_experts(x, w1, w2, weights, ids.masked_fill(ids == routed, 11),
                                    global_num_experts=12, quant=quant, backend=backend)
    torch.testing.assert_close(wide.float(), dropped.float(), atol=atol, rtol=1e-2)


def _cutlass_device_ok(device: str) -> bool:
    return device == "cpu" or torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [5, 40])  # M_tot 20 (swapped sizes) and 80
@pytest.mark.parametrize("per_act_token,per_out_ch", [(False, False), (True, True)])
def test_cutlass_moe_mm_fp16_out(device, num_tokens, per_act_token, per_out_ch):
    """cutlass_moe_mm writes fp16 outputs as vLLM's does (bf16 or fp16 out_tensors), where it
    used to reject them: the fp32 sums rounded once to fp16."""
    if not _cutlass_device_ok(device):
        pytest.skip("the CUDA kernel is sm_90a code")
    g = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(num_tokens)]).int()
    args, offs = cutlass_args(topk_ids, 128, 256, per_act_token, per_out_ch, seed=num_tokens,
                              num_experts=8)
    args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args]
    out = torch.full((args[0].shape[0], 128), float("nan"), dtype=torch.float16, device=device)
    hopper_moe.ops.cutlass_moe_mm(out, *args)
    assert not torch.isnan(out).any()
    check_fp16_out(out, args[0], args[1], offs, args[2], args[3],
                   tol=GPU_FP8_TOL if device == "cuda" else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_experts,num_tokens", [(32, 8), (256, 8), (256, 1024)])
@pytest.mark.parametrize("use_expert_map", [False, True])
def test_align_scatter_idx_masks_invalid_routes(device, num_experts, num_tokens,
                                                use_expert_map):
    """moe_align_block_size's scatter_idx means what vLLM's means: the routed slot's own index,
    -1 for an id outside [0, num_experts) or a non-local expert (hopper_moe used to return the
    slot's position in sorted_token_ids). The other outputs equal a call without scatter_idx
    and the reference; every valid slot is placed once."""
    ids = (torch.arange(num_tokens * 4) % num_experts).reshape(-1, 4).to(torch.int32)
    ids[0] = torch.tensor([-1, num_experts, 0, 1])
    valid = (ids >= 0) & (ids < num_experts)
    emap = None
    if use_expert_map:
        emap = torch.full((num_experts,), -1, dtype=torch.int32)
        emap[::2] = torch.arange(num_experts // 2, dtype=torch.int32)
        valid &= ids % 2 == 0
    ids_d = ids.to(device)
    emap_d = None if emap is None else emap.to(device)
    got = cpu_all(run_align(ids_d, num_experts, 32, emap_d))
    want = torch.where(valid.flatten(), torch.arange(ids.numel()), -1).to(torch.int32)
    assert torch.equal(got[3], want)
    baseline = cpu_all(run_align(ids_d, num_experts, 32, emap_d, with_scatter=False))
    for a, b in zip(got[:3], baseline[:3]):
        assert_same(a, b)
    for a, b, name in zip(got, ref_permute.moe_align_block_size(ids, num_experts, 32, emap),
                          ["sorted_token_ids", "experts_ids", "num_tokens_post_pad",
                           "scatter_idx"]):
        assert_same(a, b, name)
    check_align_invariants(ids, num_experts, 32, emap, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_topk_poisoned_logits(device, scoring_func, bad, dtype):
    """NaN/Inf gating logits (vLLM's test_fused_topk_nan_inf_clamp): vLLM 0.33 clamps
    non-finite probabilities to 0, so every row keeps distinct ids and finite weights; hopper_moe
    used to return NaN weights. The normal row is unchanged."""
    g = torch.Generator().manual_seed(0)
    gating = torch.randn(4, 16, generator=g).to(dtype)
    gating[1:] = bad
    hidden = torch.zeros(4, 8, dtype=dtype)
    weights, ids, _ = hopper_moe.fused_topk(hidden.to(device), gating.to(device), 4, False,
                                            scoring_func=scoring_func)
    weights, ids = weights.cpu(), ids.cpu()
    assert bool(torch.isfinite(weights).all())
    for row in range(4):
        assert ids[row].unique().numel() == 4
    assert ids[1:].tolist() == [[0, 1, 2, 3]] * 3
    scores = (torch.softmax if scoring_func == "softmax" else torch.sigmoid)(
        gating[:1].float(), **({"dim": -1} if scoring_func == "softmax" else {}))
    ref_w, ref_ids = torch.topk(scores, 4)
    assert ids[:1].tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights[:1], ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grouped_topk_takes_every_bias_dtype(device, dtype, bias_dtype):
    """vLLM 0.33's grouped_topk takes scores and e_score_correction_bias in any of f32/f16/bf16
    (its test_grouped_topk_single_group_tiers uses six of the pairs); hopper_moe used to reject
    a bias that was neither f32 nor the scores' dtype."""
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 513, generator=g).to(dtype).to(device)
    bias = torch.randn(513, generator=g).to(bias_dtype).to(device)
    weights, ids = hopper_moe.ops.grouped_topk(scores, 1, 1, 9, True, 2.5, bias, 1)
    s = torch.sigmoid(scores.float().cpu())
    want = torch.sort(s + bias.float().cpu(), dim=-1, descending=True, stable=True).indices[:, :9]
    assert ids.cpu().tolist() == want.tolist()
    w = s.gather(1, want)
    torch.testing.assert_close(weights.cpu(), w / w.sum(-1, keepdim=True) * 2.5, atol=2e-6,
                               rtol=0)
