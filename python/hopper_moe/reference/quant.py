"""fp32 references of the FP8 (float8_e4m3fn) quantization ops.

Every op views ``input [..., K]`` as rows and computes in fp32, with the same semantics as
vLLM's ops of the same names and the same fp32 expressions as the C++ ops (so the CPU op and
the reference agree bit for bit):

- static_scaled_fp8_quant: ``q = e4m3(clamp_e4m3(x * (1 / scale)))``, the scale of element
  ``(m, n)`` being ``scale[m // gm, n // gn]`` for groups ``(gm, gn)`` (per-tensor when the scale
  has one element).
- dynamic_scaled_fp8_quant: ``s = max(amax / 448, 1 / (448 * 512))`` over the whole tensor;
  ``q = e4m3(clamp_e4m3(x * (1 / s)))``.
- dynamic_per_token_scaled_fp8_quant: per row ``a = amax`` (``min(a, scale_ub)`` when given),
  ``s = max(a / 448, 1 / (448 * 512))``; ``q = e4m3(clamp_e4m3(x / s))``.
- per_token_group_fp8_quant: per group of ``group_size`` columns ``a = max(eps, amax)``,
  ``s = a / fp8_max`` (``2 ** ceil(log2(max(s, 1e-10)))`` when ``scale_ue8m0``, computed
  exactly); ``q = e4m3(clamp_range(x / s, fp8_min, fp8_max))``.

NaN and infinities: amax ignores NaN elements (C ``fmaxf``); an infinite element makes the
scale infinite. ``clamp_e4m3(v) = fmax(-448, fmin(v, 448))`` sends NaN to +448;
``clamp_range(v, lo, hi) = fmin(fmax(v, lo), hi)`` sends NaN to ``lo``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..quant import FP8_MAX, FP8_MIN_SCALE, abs_ignoring_nan, fp32_reciprocal

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_SCALING_FACTOR",
    "dynamic_per_token_scaled_fp8_quant_ref",
    "dynamic_scaled_fp8_quant_ref",
    "per_token_group_fp8_quant_ref",
    "static_scale_map_ref",
    "static_scaled_fp8_quant_ref",
    "ue8m0_round_up_ref",
]

FP8_DTYPE = torch.float8_e4m3fn
# vLLM's name for the floor of dynamic per-tensor / per-token scales (defined in hopper_moe.quant).
FP8_MIN_SCALING_FACTOR = FP8_MIN_SCALE


def _clamp_e4m3(v: torch.Tensor) -> torch.Tensor:
    return torch.fmax(torch.fmin(v, v.new_tensor(FP8_MAX)), v.new_tensor(-FP8_MAX))


def _clamp_range(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return torch.fmin(torch.fmax(v, v.new_tensor(lo)), v.new_tensor(hi))



def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def static_scale_map_ref(shape: Sequence[int], scale: torch.Tensor,
                         group_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The fp32 scale of every element of rows ``[M, K]`` (``M`` = product of the leading
    dims of ``shape``) under static_scaled_fp8_quant's scale layouts."""
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(m, k)
    if group_shape is not None:
        gm = max(m, 1) if group_shape[0] == -1 else group_shape[0]
        gn = max(k, 1) if group_shape[1] == -1 else group_shape[1]
        groups_m, groups_n = -(-m // gm), -(-k // gn)
        scale2d = scale.reshape(groups_m, groups_n)
    else:
        scale2d = scale
        gm, gn = m // scale.shape[0], k // scale.shape[1]
    full = scale2d.repeat_interleave(gm, dim=0).repeat_interleave(gn, dim=1)
    return full[:m, :k]


def static_scaled_fp8_quant_ref(input: torch.Tensor, scale: torch.Tensor,
                                group_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``[..., K]`` e4m3 of input with the given static scale(s)."""
    x = _rows(input).float()
    inv_scale = 1.0 / static_scale_map_ref(input.shape, scale.to(x.device), group_shape)
    return _clamp_e4m3(x * inv_scale).to(FP8_DTYPE).reshape(input.shape)


def dynamic_scaled_fp8_quant_ref(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., K] e4m3, scale [1] f32)`` with one scale for the whole tensor."""
    x = input.float()
    amax = abs_ignoring_nan(x).amax() if x.numel() else x.new_zeros(())
    s = torch.clamp(amax / FP8_MAX, min=FP8_MIN_SCALING_FACTOR).reshape(1)
    q = _clamp_e4m3(x * (1.0 / s)).to(FP8_DTYPE)
    return q, s


def dynamic_per_token_scaled_fp8_quant_ref(
        input: torch.Tensor,
        scale_ub: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., K] e4m3, scale [rows, 1] f32)`` with one scale per row."""
    x = _rows(input).float()
    amax = abs_ignoring_nan(x).amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(
        (x.shape[0], 1))
    if scale_ub is not None:
        amax = torch.fmin(amax, scale_ub.float().reshape(1, 1).to(x.device))
    s = torch.clamp(amax / FP8_MAX, min=FP8_MIN_SCALING_FACTOR)
    q = _clamp_e4m3(x / s).to(FP8_DTYPE).reshape(input.shape)
    return q, s


def ue8m0_round_up_ref(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= max(s, 1e-10), exactly (``2 ** ceil(log2(s))``)."""
    t = torch.clamp(s.float().abs(), min=1e-10)
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    out = torch.exp2(exponent.float())
    return torch.where(torch.isinf(t), t, out)


def per_token_group_fp8_quant_ref(input: torch.Tensor, group_size: int, eps: float = 1e-10,
                                  fp8_min: float = -FP8_MAX, fp8_max: float = FP8_MAX,
                                  scale_ue8m0: bool = False
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., K] e4m3, scales [..., K // group_size] f32)`` (row-major scales)."""
    k = input.shape[-1]
    groups = k // group_size
    x = _rows(input).float().reshape(-1, groups, group_size)
    eps_f32 = torch.tensor(eps, dtype=torch.float32).item()
    amax = torch.clamp(abs_ignoring_nan(x).amax(dim=2, keepdim=True), min=eps_f32)
    # amax times the fp32 reciprocal of fp8_max (vLLM's result on CUDA; see fp8.cuh group_scale)
    s = amax * fp32_reciprocal(fp8_max)
    if scale_ue8m0:
        s = ue8m0_round_up_ref(s)
    lo = torch.tensor(fp8_min, dtype=torch.float32).item()
    hi = torch.tensor(fp8_max, dtype=torch.float32).item()
    q = _clamp_range(x / s, lo, hi).to(FP8_DTYPE).reshape(input.shape)
    return q, s.reshape(*input.shape[:-1], groups)
