"""fp32 reference of fused_inv_rope_fp8_quant (same semantics as vLLM's DeepSeek-V4 attention-
output kernel of that name, SM90 scale format): inverse RoPE on the attention output, then
block FP8 quantization of the heads gathered per output group.

Input ``x [T, H, 512]``: each head is 448 no-rope dims followed by 64 rope dims. The rope dims
hold GPT-J (interleaved) pairs ``(x[448 + 2i], x[448 + 2i + 1])``, i = 0..31, rotated by +theta
when the attention inputs were built; here they are rotated by -theta:

    p      = clamp(positions[t], 0, max_position - 1)        (max_position = cos_sin_cache rows)
    c, s   = cos_sin_cache[p, i], cos_sin_cache[p, 32 + i]   (cache row = 32 cos || 32 sin)
    y[448 + 2i]     = x[448 + 2i] * c + x[448 + 2i + 1] * s
    y[448 + 2i + 1] = x[448 + 2i + 1] * c - x[448 + 2i] * s
    y[d]            = x[d]                                   (d < 448)

Each rotated value is ``fp32(fp64(a * c) + fp64(b * s))``: the products of fp32 numbers are
exact in fp64, so this value does not depend on whether a kernel fuses them into an FMA.

Heads gathered per group: ``H = n_groups * heads_per_group``; output group ``g`` holds heads
``g * heads_per_group + j`` (j = 0..heads_per_group-1) side by side, so row ``(t, g)`` of the
output is ``D = heads_per_group * 512`` wide and has ``K = D / 128`` quantization blocks
(block ``k`` covers head ``j = k // 4``, dims ``(k % 4) * 128 ...``). That is the A operand of a
per-group block-FP8 output projection (one GEMM of ``[T, D] x [D, N]`` per group).

Quantization of each 128-element block with amax ``a``:

    scale = 2 ** ceil(log2(max(a, 1e-10) / 448))   (exact: the smallest power of two >= that)
    q     = e4m3(y / scale)                         (round to nearest even; |y / scale| <= 448)

Returns ``(x_fp8 [T, n_groups, D] float8_e4m3fn, scales [T, n_groups, K] float32)`` as
contiguous tensors (the kernel returns the same values in DeepGEMM's layouts; see
hopper_moe.kernels.inv_rope_quant). Positions out of range are clamped (no error), as the
kernel does. Non-finite inputs give unspecified outputs.
"""
from __future__ import annotations

import torch

__all__ = [
    "fused_inv_rope_fp8_quant_ref",
    "inv_rope_ref",
    "pow2_block_scale_ref",
]

FP8_E4M3_MAX = 448.0
SCALE_EPS = 1e-10


def inv_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 nope_dim: int = 448, rope_dim: int = 64) -> torch.Tensor:
    """``[T, H, nope_dim + rope_dim]`` float32: x with its last ``rope_dim`` dims rotated by
    -theta (GPT-J interleaved pairs), the ``nope_dim`` dims unchanged."""
    y = x.float().clone()
    half = rope_dim // 2
    max_position = cos_sin_cache.shape[0]
    p = positions.long().clamp(0, max_position - 1)
    cs = cos_sin_cache.float()[p]                    # [T, rope_dim]
    c = cs[:, None, :half].double()                  # [T, 1, half]
    s = cs[:, None, half:rope_dim].double()
    even = y[:, :, nope_dim::2].double()             # [T, H, half]
    odd = y[:, :, nope_dim + 1::2].double()
    y[:, :, nope_dim::2] = (even * c + odd * s).float()
    y[:, :, nope_dim + 1::2] = (odd * c - even * s).float()
    return y


def pow2_block_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** ceil(log2(max(amax, 1e-10) / 448))``, exactly."""
    a = torch.clamp(amax.float(), min=SCALE_EPS)
    ratio = a.double() / FP8_E4M3_MAX   # never rounds onto a power of two it is not
    mantissa, exponent = torch.frexp(ratio)   # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.exp2(exponent.double()).float()


def fused_inv_rope_fp8_quant_ref(x: torch.Tensor, positions: torch.Tensor,
                                 cos_sin_cache: torch.Tensor, n_groups: int,
                                 heads_per_group: int, nope_dim: int = 448, rope_dim: int = 64,
                                 quant_group_size: int = 128
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_fp8 [T, n_groups, heads_per_group * head_dim] e4m3fn, scales [T, n_groups,
    heads_per_group * head_dim / quant_group_size] f32)``, both contiguous."""
    num_tokens, num_heads, head_dim = x.shape
    assert num_heads == n_groups * heads_per_group and head_dim == nope_dim + rope_dim
    y = inv_rope_ref(x, positions, cos_sin_cache, nope_dim, rope_dim)
    blocks = y.reshape(num_tokens, num_heads, head_dim // quant_group_size, quant_group_size)
    scale = pow2_block_scale_ref(blocks.abs().amax(dim=-1, keepdim=True))
    q = (blocks / scale).to(torch.float8_e4m3fn)
    row = heads_per_group * head_dim
    return (q.reshape(num_tokens, n_groups, row),
            scale.reshape(num_tokens, n_groups, row // quant_group_size))
