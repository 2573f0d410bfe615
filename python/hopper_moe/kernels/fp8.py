"""Triton helpers for FP8 e4m3 shared by hopper_moe's Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_to_e4m3"]


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32."""
    a = tl.abs(v)
    a_bits = a.to(tl.int32, bitcast=True)
    sign = v.to(tl.int32, bitcast=True) ^ a_bits
    # Spacing of e4m3 values around a: 2^(e - 3) for normals (e >= -6), 2^-9 below.
    step_exp = tl.maximum((a_bits >> 23) - 127, -6) - 3
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - step_exp) << 23).to(tl.float32, bitcast=True)
    q = a * inv_step  # exact, < 16
    r = tl.floor(q)
    frac = q - r      # exact
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    return ((r * step).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
