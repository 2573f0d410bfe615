"""How far an FP8 layer computed on another device may lie from the fp32 reference, element by
element: the reference with an error bound derived from the data.

An FP8 layer requantizes SiLU*mul of GEMM1's output before GEMM2. Two correct computations
whose GEMM1 sums differ in the last bits (another accumulation order; the FP8 tensor core keeps
about 14 mantissa bits between promotions) can round an intermediate element to neighbouring
bf16 values and then to neighbouring FP8 codes. One FP8 step is 1/16 to 1/8 of the element,
and it reaches every output of the token through a column of w2. With a per-tensor scale the
largest elements of a large batch are several times the typical one, so a flip there can move
an output well beyond OPS.md's absolute tolerance; and a dynamic scale whose amax rounds
differently rescales every element. No fixed multiple of the tolerance describes that.

`reference_with_bound(p)` follows the reference layer (hopper_moe.reference.fused_experts_ref
with the sm90 layer's precision model: GEMM outputs, silu and SiLU*mul stored in bf16) and
carries intervals instead of values through the requantization: GEMM1's fp32 sums widened by
GEMM_NOISE * sum |x * w|, every bf16 / FP8 rounding applied to both ends, the dynamic scales
from the ends of the amax. Each intermediate element then has a set of FP8 values a correct
computation may produce; their largest distance from the reference's value, pushed through
|w2| and the routed weight, is the bound. Elements not next to a rounding boundary contribute
nothing, so a wrong row, scale or expert still fails by far.

Scope: FP8 per-tensor (static and dynamic) and per-token x per-channel, the schemes of the sm90
layer; M > 0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hopper_moe.quant import FP8_MAX, FP8_MIN_SCALE
from hopper_moe.reference import dequantize_weight_ref, quant_dequant_activation_ref

# Relative noise of a GEMM's fp32 sum against the reference's, as a fraction of sum |x * w|:
# FP8 tensor-core products are accumulated with about 14 mantissa bits between promotions to
# fp32 (2^-14 per add, a few adds per promotion interval), times a margin of 4.
GEMM_NOISE = 2.0 ** -12
# Relative noise of the scalar steps (silu's exponential, a product, a scale's reciprocal):
# a few fp32 ulps.
SCALAR_NOISE = 2.0 ** -20
_BF16_STEP = 2.0 ** -7  # one bf16 ulp, relative to the value (2^-8 to 2^-7)


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).float()


def _widen(lo: torch.Tensor, hi: torch.Tensor, rel: float):
    return lo - rel * lo.abs(), hi + rel * hi.abs()


def _product_interval(a_lo, a_hi, b_lo, b_hi):
    corners = torch.stack([a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi])
    return corners.amin(0), corners.amax(0)


def _fp8(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def _abs_interval(lo, hi):
    """(min, max) of |v| over v in [lo, hi]."""
    straddles = (lo <= 0) & (hi >= 0)
    low = torch.where(straddles, torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs()))
    return low, torch.maximum(lo.abs(), hi.abs())


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax / FP8_MAX).clamp_min(FP8_MIN_SCALE)


def _local_experts(p, num_experts: int) -> torch.Tensor:
    """[M, topk] local expert of each slot, -1 where it does not count (the reference's rule)."""
    ids = p.topk_ids.long()
    if p.expert_map is None:
        return torch.where((ids >= 0) & (ids < num_experts), ids, -1)
    g = p.global_num_experts if p.global_num_experts != -1 else p.expert_map.numel()
    ok = (ids >= 0) & (ids < g)
    local = p.expert_map.long()[ids.clamp(0, p.expert_map.numel() - 1)]
    return torch.where(ok & (local >= 0) & (local < num_experts), local, -1)


def reference_with_bound(p, gemm_noise: float = GEMM_NOISE, sample: torch.Generator = None):
    """(reference [M, H] fp32, bound [M, H] fp32) for an FP8 problem on the CPU.

    sample: instead of the bound, return (reference, one perturbed layer): every GEMM sum moved
    by a random fraction of its noise, every scalar step by a random fraction of SCALAR_NOISE,
    and the result carried through the same roundings (tests hold it within the bound)."""
    q = p.quant
    assert q is not None and q.block_shape is None, "FP8 per-tensor or per-token only"
    x = p.x.float()
    w = p.topk_weights.float()
    if p.apply_router_weight_on_input:
        x = x * w
    x1 = quant_dequant_activation_ref(x, q, q.a1_scale)
    w1f = dequantize_weight_ref(p.w1, q.w1_scale, q)
    w2f = dequantize_weight_ref(p.w2, q.w2_scale, q)
    num_experts, inter = w1f.shape[0], w2f.shape[2]
    m, topk = p.topk_ids.shape
    local = _local_experts(p, num_experts)

    def jitter(v, rel, like=None):
        """v moved by a uniform fraction of rel * |like| (sample mode)."""
        scale = (like if like is not None else v).abs() * rel
        return v + (torch.rand(v.shape, generator=sample) * 2 - 1) * scale

    # SiLU*mul of every counted slot: the reference's value and the interval (or sample).
    shape = (m, topk, inter)
    a_ref, a_lo, a_hi = (torch.zeros(shape) for _ in range(3))
    for e in range(num_experts):
        tok, kk = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x1[tok] @ w1f[e].t()
        eps = gemm_noise * (x1[tok].abs() @ w1f[e].abs().t())
        g, u = h[:, :inter], h[:, inter:]
        a_ref[tok, kk] = _bf16(_bf16(F.silu(_bf16(g))) * _bf16(u))
        if sample is not None:
            hs = _bf16(h + (torch.rand(h.shape, generator=sample) * 2 - 1) * eps)
            s = _bf16(jitter(F.silu(hs[:, :inter]), SCALAR_NOISE))
            a_lo[tok, kk] = a_hi[tok, kk] = _bf16(jitter(s * hs[:, inter:], SCALAR_NOISE))
            continue
        h_lo, h_hi = _bf16(h - eps), _bf16(h + eps)
        g_lo, g_hi, u_lo, u_hi = h_lo[:, :inter], h_hi[:, :inter], h_lo[:, inter:], h_hi[:, inter:]
        ends = torch.stack([F.silu(g_lo), F.silu(g_hi)])
        s_lo, s_hi = _widen(ends.amin(0), ends.amax(0), SCALAR_NOISE)
        # silu's minimum (at g = -1.2785) inside [g_lo, g_hi]: the interval's low end.
        has_min = (g_lo <= -1.2785) & (g_hi >= -1.2785)
        s_lo = torch.where(has_min, torch.minimum(s_lo, F.silu(torch.tensor(-1.2785))), s_lo)
        p_lo, p_hi = _product_interval(_bf16(s_lo), _bf16(s_hi), u_lo, u_hi)
        p_lo, p_hi = _widen(p_lo, p_hi, SCALAR_NOISE)
        a_lo[tok, kk], a_hi[tok, kk] = _bf16(p_lo), _bf16(p_hi)

    counted = local >= 0
    if sample is None:
        inside = (a_lo <= a_ref) & (a_ref <= a_hi)
        assert bool(inside[counted].all()), "an interval misses the reference's value"

    # The requantization: scale(s) and FP8 values, reference and interval ends.
    reciprocal = not q.per_act_token_quant
    if q.per_act_token_quant:
        s_ref = _scale(a_ref.abs().amax(-1, keepdim=True))
        amin, amax = _abs_interval(a_lo, a_hi)
        sc_lo, sc_hi = _scale(amin.amax(-1, keepdim=True)), _scale(amax.amax(-1, keepdim=True))
    elif q.a2_scale is not None:
        s_ref = sc_lo = sc_hi = q.a2_scale.float().reshape(())
    else:
        s_ref = _scale(a_ref[counted].abs().amax() if counted.any() else torch.zeros(()))
        amin, amax = _abs_interval(a_lo[counted], a_hi[counted])
        zero = torch.zeros(())
        sc_lo = _scale(amin.amax() if amin.numel() else zero)
        sc_hi = _scale(amax.amax() if amax.numel() else zero)

    def quantize(a, s):
        return _fp8(a * (1.0 / s) if reciprocal else a / s) * s

    v_ref = quantize(a_ref, s_ref)
    if sample is not None:
        sc = jitter(sc_lo, SCALAR_NOISE) if q.a2_scale is None else sc_lo
        dev = quantize(a_lo, sc) - v_ref  # signed: the perturbed layer's intermediate
    else:
        sc_lo, sc_hi = _widen(sc_lo, sc_hi, SCALAR_NOISE)
        # a / s over a in [a_lo, a_hi], s in [sc_lo, sc_hi] (s > 0), widened for the rounding
        # of the reciprocal; FP8 rounding and q * s are monotone, so the ends bound every value.
        quot = torch.stack([a / s for a in (a_lo, a_hi) for s in (sc_lo, sc_hi)])
        q_lo, q_hi = _widen(quot.amin(0), quot.amax(0), SCALAR_NOISE)
        dev = torch.stack([(_fp8(qq) * s - v_ref).abs()
                           for qq in (q_lo, q_hi) for s in (sc_lo, sc_hi)]).amax(0)
    dev = torch.where(counted.unsqueeze(-1), dev, torch.zeros_like(dev))

    # GEMM2, the routed weight and the top-k sum; the bound adds GEMM2's own noise and one bf16
    # step of its stored output.
    out = torch.zeros(m, w2f.shape[1])
    other = torch.zeros_like(out)
    for e in range(num_experts):
        tok, kk = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        v = v_ref[tok, kk]
        y = _bf16(v @ w2f[e].t())
        ww = torch.ones_like(w[tok, kk]) if p.apply_router_weight_on_input else w[tok, kk]
        out.index_add_(0, tok, y * ww.unsqueeze(1))
        if sample is not None:
            ys = _bf16(jitter((v + dev[tok, kk]) @ w2f[e].t(), gemm_noise,
                              like=(v + dev[tok, kk]).abs() @ w2f[e].abs().t()))
            other.index_add_(0, tok, ys * ww.unsqueeze(1))
            continue
        spread = dev[tok, kk] @ w2f[e].abs().t()
        noise = gemm_noise * ((v.abs() + dev[tok, kk]) @ w2f[e].abs().t())
        step = _BF16_STEP * (y.abs() + spread + noise)
        other.index_add_(0, tok, (spread + noise + step) * ww.abs().unsqueeze(1))
    return out, other


def check_within_bound(got: torch.Tensor, p, atol: float, rtol: float, what: str = "") -> None:
    """got (any device) within OPS.md's tolerance of the reference plus the requantization
    bound of `reference_with_bound`, at every element."""
    ref, bound = reference_with_bound(p)
    o = got.float().cpu()
    assert o.shape == ref.shape, what
    excess = (o - ref).abs() - (atol + rtol * ref.abs())
    bad = excess > bound
    if bad.any():
        i = int((excess - bound).argmax())
        worst = excess.flatten()[i].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {o.numel()} elements beyond the tolerance plus the "
            f"requantization bound; worst: |out - ref| - tol = {worst:.4f} against a bound of "
            f"{bound.flatten()[i].item():.4f} (out {o.flatten()[i].item():.4f}, "
            f"ref {ref.flatten()[i].item():.4f})")
