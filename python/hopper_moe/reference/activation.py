"""fp32 references of the activation ops: silu_and_mul and silu_and_mul_quant.

``input [..., 2d]`` holds ``gate || up``; ``v = silu(gate) * up`` in fp32 with
``silu(g) = g / (1 + exp(-g))``. silu_and_mul rounds ``v`` once to the input dtype;
silu_and_mul_quant stores ``e4m3(clamp(v * (1 / scale), -448, 448))`` where the clamp is
``fmax(-448, fmin(v, 448))`` (NaN -> +448; same semantics as vLLM's silu_and_mul_quant).

The ops use their own fp32 exp (identical on CPU and GPU); torch.exp may differ from it by an
ulp, so an op may differ from these references by one rounding step of the output on a few
elements (tests bound that).
"""
from __future__ import annotations

import torch

from .quant import FP8_DTYPE, FP8_MAX

__all__ = ["silu_and_mul_ref", "silu_and_mul_quant_ref", "silu_mul_f32_ref"]


def silu_mul_f32_ref(input: torch.Tensor) -> torch.Tensor:
    """fp32 ``silu(gate) * up`` of ``input [..., 2d]``: ``[..., d]`` float32."""
    d = input.shape[-1] // 2
    gate = input[..., :d].float()
    up = input[..., d:].float()
    return gate / (1.0 + torch.exp(-gate)) * up


def silu_and_mul_ref(input: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` in input's dtype: silu(gate) * up, rounded once."""
    return silu_mul_f32_ref(input).to(input.dtype)


def silu_and_mul_quant_ref(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` float8_e4m3fn: the static per-tensor quantization of silu(gate) * up."""
    v = silu_mul_f32_ref(input)
    inv_scale = 1.0 / scale.float().reshape(())
    x = v * inv_scale
    r = torch.fmax(torch.fmin(x, x.new_tensor(FP8_MAX)), x.new_tensor(-FP8_MAX))
    return r.to(FP8_DTYPE)
