"""Fused inverse RoPE + block FP8 quantization of the attention output (Triton).

Same semantics as vLLM's DeepSeek-V4 `fused_inv_rope_fp8_quant` (interleaved RoPE, SM90 float32
scales); hopper_moe.reference.rope_quant holds the definition in plain PyTorch:

    x       [T, H, 512]  bf16 / fp16 / fp32 attention output, head = 448 no-rope || 64 rope dims
    y       = x with its rope dims rotated by -theta(positions[t]) (GPT-J pairs, cos||sin cache)
    x_fp8   [T, G, D]    float8_e4m3fn, D = heads_per_group * 512: row (t, g) = heads
                         g*heads_per_group ... (g+1)*heads_per_group - 1 of token t, side by side
    scales  [T, G, D/128] float32, scales[t, g, k] = 2^ceil(log2(max(amax_k, 1e-10) / 448)) of
                         block k = x_fp8[t, g, 128k : 128k + 128];  x_fp8 * scale ~= y

Layouts (part of the op's semantics: what a per-group block-FP8 GEMM such as DeepGEMM's SM90
fp8 einsum reads without a transform):
    x_fp8   storage [G, T, D] contiguous: strides (D, T*D, 1), so x_fp8[:, g] is a dense [T, D].
    scales  storage [G, K, T4] contiguous (K = D/128, T4 = T rounded up to a multiple of 4, the
            16-byte TMA alignment of float32): strides (1, K*T4, T4), token-major ("MN-major").
            The padding entries (token T..T4-1) are written with 0.

One program handles one (token, head): 512 values = 4 quantization blocks. Positions are
clamped to [0, cos_sin_cache.shape[0] - 1] (an out-of-range position reads the nearest cache
row instead of memory out of bounds). Non-finite inputs give unspecified (but in-bounds) output.

Bit-exact with the reference by construction, on the GPU and in Triton's interpreter alike:
  * a rotated value is fp32(fp64(a*c) + fp64(b*s)); fp32 products are exact in fp64, so the
    result is the same whether or not the compiler contracts it into an FMA;
  * the power-of-two scale and its inverse are built from the exponent bits of amax
    (448 = 1.75 * 2^8, so ceil(log2(amax/448)) = e - 8 + (mantissa(amax) > 1.75));
  * y * (1/scale) is exact, then rounded to the e4m3 grid (nearest, ties to even) with fp32
    arithmetic that is exact, so the final fp32 -> e4m3 conversion only sees representable
    values (the interpreter's own fp8 conversion does not round to nearest even).

No recompilation across batch sizes: `num_tokens` is the only integer argument whose value
follows the token count (the group strides T*D and K*T4 are computed in the kernel), and it is
in do_not_specialize; the launch grid is not part of the compiled kernel's key.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import settings
from .fp8 import round_to_e4m3

__all__ = ["fused_inv_rope_fp8_quant"]

# Integer arguments whose values vary with the token count: never specialized.
TOKEN_DEPENDENT_ARGS = ["num_tokens"]

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_GROUP_SIZE = 128
TOKEN_ALIGN = 4  # scales' token dimension is padded to 16 bytes of float32
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POSITION_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _pow2_scale(amax):
    """(2^ceil(log2(amax / 448)), its inverse) for positive normal fp32 amax, exactly."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 127
    k = exponent - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv_scale = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return scale, inv_scale


@triton.jit(do_not_specialize=TOKEN_DEPENDENT_ARGS)
def fused_inv_rope_fp8_quant_kernel(
    x_ptr, positions_ptr, cos_sin_cache_ptr, x_fp8_ptr, scales_ptr,
    num_tokens, max_position,
    stride_xt, stride_xh, stride_cache,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    BLOCKS_PER_HEAD: tl.constexpr = HEAD_DIM // GROUP_SIZE
    ROW: tl.constexpr = HEADS_PER_GROUP * HEAD_DIM                 # D
    SCALES_PER_ROW: tl.constexpr = HEADS_PER_GROUP * BLOCKS_PER_HEAD  # K
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    g = head // HEADS_PER_GROUP
    j = head % HEADS_PER_GROUP
    n = tl.cast(num_tokens, tl.int64)  # a specialized copy may receive a constexpr
    n_padded = (n + 3) // 4 * 4

    blk = tl.arange(0, BLOCKS_PER_HEAD)                  # (BLOCKS_PER_HEAD,)
    col = tl.arange(0, GROUP_SIZE)                       # (GROUP_SIZE,)
    # scales storage [G, K, n_padded]
    scale_ptrs = (scales_ptr + g * (SCALES_PER_ROW * n_padded)
                  + (j * BLOCKS_PER_HEAD + blk) * n_padded + t)
    if t >= n:
        tl.store(scale_ptrs, tl.zeros((BLOCKS_PER_HEAD,), dtype=tl.float32))
        return

    d = blk[:, None] * GROUP_SIZE + col[None, :]        # (BLOCKS_PER_HEAD, GROUP_SIZE)
    x_row = x_ptr + t * stride_xt + head * stride_xh
    xv = tl.load(x_row + d).to(tl.float32)

    is_rope = d >= NOPE_DIM
    pair = tl.where(is_rope, (d - NOPE_DIM) // 2, 0)
    partner = tl.load(x_row + (d ^ 1), mask=is_rope, other=0.0).to(tl.float32)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)
    cache_row = cos_sin_cache_ptr + pos * stride_cache
    cos = tl.load(cache_row + pair, mask=is_rope, other=1.0).to(tl.float64)
    sin = tl.load(cache_row + ROPE_DIM // 2 + pair, mask=is_rope, other=0.0).to(tl.float64)
    xd = xv.to(tl.float64)
    pd = partner.to(tl.float64)
    # even lane (x_e): x_e*c + x_o*s;  odd lane (x_o): x_o*c - x_e*s   (NOPE_DIM is even)
    rotated = tl.where((d & 1) == 0, xd * cos + pd * sin, xd * cos - pd * sin).to(tl.float32)
    y = tl.where(is_rope, rotated, xv)

    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-10)  # (BLOCKS_PER_HEAD,)
    scale, inv_scale = _pow2_scale(amax)
    q = round_to_e4m3(y * inv_scale[:, None])

    # x_fp8 storage [G, n, D]
    out_ptrs = x_fp8_ptr + g * (n * ROW) + t * ROW + j * HEAD_DIM + d
    tl.store(out_ptrs, q.to(x_fp8_ptr.dtype.element_ty))
    tl.store(scale_ptrs, scale)


def _fail(argument: str, rule: str):
    raise RuntimeError(f"fused_inv_rope_fp8_quant: {argument} {rule}")


def _check(x, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim,
           quant_group_size):
    for name, t in (("x", x), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if not isinstance(t, torch.Tensor):
            _fail(name, "must be a torch.Tensor")
    if x.dim() != 3:
        _fail("x", f"must have shape (num_tokens, num_heads, head_dim), got {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        _fail("x", f"must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.device.type != "cuda" and not (
            x.device.type == "cpu" and settings.TRITON_INTERPRET):
        _fail("x", f"must be a CUDA tensor (CPU only under TRITON_INTERPRET=1), got {x.device}")
    if (nope_dim, rope_dim, quant_group_size) != (NOPE_DIM, ROPE_DIM, QUANT_GROUP_SIZE):
        bad = [n for n, v, want in (("nope_dim", nope_dim, NOPE_DIM),
                                    ("rope_dim", rope_dim, ROPE_DIM),
                                    ("quant_group_size", quant_group_size, QUANT_GROUP_SIZE))
               if v != want]
        _fail(bad[0], f"must be nope_dim={NOPE_DIM}, rope_dim={ROPE_DIM}, "
                      f"quant_group_size={QUANT_GROUP_SIZE} (the only supported head layout), "
                      f"got {nope_dim}, {rope_dim}, {quant_group_size}")
    num_tokens, num_heads, head_dim = x.shape
    if head_dim != HEAD_DIM:
        _fail("x", f"must have head_dim == nope_dim + rope_dim == {HEAD_DIM}, got {head_dim}")
    if x.stride(2) != 1:
        _fail("x", f"must have stride 1 in its last dim, got {x.stride(2)}")
    if not isinstance(n_groups, int) or n_groups < 1:
        _fail("n_groups", f"must be an int >= 1, got {n_groups!r}")
    if not isinstance(heads_per_group, int) or heads_per_group < 1:
        _fail("heads_per_group", f"must be an int >= 1, got {heads_per_group!r}")
    if n_groups * heads_per_group != num_heads:
        _fail("heads_per_group", f"times n_groups must equal num_heads: {n_groups} * "
                                 f"{heads_per_group} != {num_heads}")
    if positions.dtype not in POSITION_DTYPES:
        _fail("positions", f"must have dtype int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != num_tokens:
        _fail("positions", f"must have shape (num_tokens,) = ({num_tokens},), "
                           f"got {tuple(positions.shape)}")
    if not positions.is_contiguous():
        _fail("positions", "must be contiguous")
    if positions.device != x.device:
        _fail("positions", f"must be on the same device as x ({x.device}), got {positions.device}")
    if cos_sin_cache.dtype != torch.float32:
        _fail("cos_sin_cache", f"must have dtype float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != ROPE_DIM \
            or cos_sin_cache.shape[0] < 1:
        _fail("cos_sin_cache", f"must have shape (max_position >= 1, rope_dim = {ROPE_DIM}), "
                               f"got {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.stride(1) != 1:
        _fail("cos_sin_cache", f"must have stride 1 in its last dim, got {cos_sin_cache.stride(1)}")
    if cos_sin_cache.device != x.device:
        _fail("cos_sin_cache", f"must be on the same device as x ({x.device}), "
                               f"got {cos_sin_cache.device}")


def fused_inv_rope_fp8_quant(x: torch.Tensor, positions: torch.Tensor,
                             cos_sin_cache: torch.Tensor, n_groups: int, heads_per_group: int,
                             nope_dim: int = NOPE_DIM, rope_dim: int = ROPE_DIM,
                             quant_group_size: int = QUANT_GROUP_SIZE
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse RoPE + per-128 power-of-two-scaled FP8 quantization, heads gathered per group.

    Args:
        x: attention output [num_tokens, n_groups * heads_per_group, 512], bf16/fp16/fp32,
            last dim contiguous (token and head strides free).
        positions: [num_tokens] int32/int64, contiguous; clamped to the cache's rows.
        cos_sin_cache: [max_position, 64] float32, row = 32 cos || 32 sin.
        n_groups, heads_per_group: output groups and heads per group (consecutive heads).
        nope_dim, rope_dim, quant_group_size: must be 448, 64, 128.

    Returns:
        x_fp8: [num_tokens, n_groups, heads_per_group * 512] float8_e4m3fn,
            strides (D, num_tokens * D, 1).
        scales: [num_tokens, n_groups, heads_per_group * 4] float32,
            strides (1, K * T4, T4) with T4 = num_tokens rounded up to a multiple of 4.
    """
    _check(x, positions, cos_sin_cache, n_groups, heads_per_group, nope_dim, rope_dim,
           quant_group_size)
    num_tokens, num_heads, head_dim = x.shape
    row = heads_per_group * head_dim
    scales_per_row = row // quant_group_size
    padded = (num_tokens + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN
    fp8_storage = torch.empty((n_groups, num_tokens, row), dtype=torch.float8_e4m3fn,
                              device=x.device)
    scale_storage = torch.empty((n_groups, scales_per_row, padded), dtype=torch.float32,
                                device=x.device)
    x_fp8 = fp8_storage.transpose(0, 1)
    scales = scale_storage[:, :, :num_tokens].permute(2, 0, 1)
    if num_tokens == 0:
        return x_fp8, scales

    grid = (padded, num_heads)
    fused_inv_rope_fp8_quant_kernel[grid](
        x, positions, cos_sin_cache, fp8_storage, scale_storage,
        num_tokens, cos_sin_cache.shape[0],
        x.stride(0), x.stride(1), cos_sin_cache.stride(0),
        HEADS_PER_GROUP=heads_per_group,
        HEAD_DIM=head_dim,
        NOPE_DIM=nope_dim,
        ROPE_DIM=rope_dim,
        GROUP_SIZE=quant_group_size,
        num_warps=2,
        num_stages=1,
    )
    return x_fp8, scales
