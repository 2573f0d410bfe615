"""References of the activation ops: silu_and_mul and silu_and_mul_quant.

``input [..., 2d]`` holds ``gate || up``. silu_and_mul is ``F.silu(gate) * up`` in the input
dtype, i.e. (vLLM's rounding order)

    s = silu(gate) = gate / (1 + exp(-gate))   in fp32, rounded to the input dtype
    v = s * up                                 in fp32, rounded to the input dtype

(for float32 inputs neither rounding changes anything). silu_and_mul_quant is the static
per-tensor quantization of that output: ``e4m3(clamp(v * (1 / scale), -448, 448))`` with the
clamp ``fmax(-448, fmin(x, 448))`` (NaN -> +448).

Evaluated on the input's device, these references equal the ops bit for bit: torch's CUDA silu
uses CUDA's expf, as the CUDA kernels do, and the CPU ops call torch's CPU silu on the same
views. The two devices' exp differ by up to an ulp, so CPU and CUDA results may differ by one
rounding step of the output dtype on a few elements.

``silu_mul_f32_ref`` is the unrounded fp32 ``silu(gate) * up``, the value the rounded results
approximate (and the one the grouped GEMM tests compare their SiLU*mul epilogue against).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import FP8_DTYPE, FP8_MAX

__all__ = ["silu_and_mul_ref", "silu_and_mul_quant_ref", "silu_mul_f32_ref"]


def silu_mul_f32_ref(input: torch.Tensor) -> torch.Tensor:
    """fp32 ``silu(gate) * up`` of ``input [..., 2d]``, not rounded: ``[..., d]`` float32."""
    d = input.shape[-1] // 2
    gate = input[..., :d].float()
    up = input[..., d:].float()
    return gate / (1.0 + torch.exp(-gate)) * up


def silu_and_mul_ref(input: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` in input's dtype: silu(gate) rounded to the dtype, times up, rounded."""
    d = input.shape[-1] // 2
    return F.silu(input[..., :d]) * input[..., d:]


def silu_and_mul_quant_ref(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` float8_e4m3fn: the static per-tensor quantization of silu_and_mul_ref."""
    v = silu_and_mul_ref(input).float()
    inv_scale = 1.0 / scale.to(device=v.device, dtype=torch.float32).reshape(())
    x = v * inv_scale
    r = torch.fmax(torch.fmin(x, x.new_tensor(FP8_MAX)), x.new_tensor(-FP8_MAX))
    return r.to(FP8_DTYPE)
