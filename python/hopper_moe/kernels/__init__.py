"""hopper_moe's Triton kernels. Nothing is imported with the package: Triton loads only when a
kernel module is imported.

- ``moe_gemm`` / ``moe_gemm_configs``: the grouped expert GEMM of the Triton fused_experts
  backend (``hopper_moe.backends.triton``) and its tile configs.
- ``inv_rope_quant``: ``fused_inv_rope_fp8_quant``, inverse RoPE + block FP8 quantization of
  an attention output (not an MoE op: it stands on its own). Import it as
  ``from hopper_moe.kernels import fused_inv_rope_fp8_quant`` (or from
  ``hopper_moe.kernels.inv_rope_quant``).
- ``fp8``: Triton helpers for e4m3 that the kernels share.
"""
from __future__ import annotations

__all__ = ["fused_inv_rope_fp8_quant"]


def __getattr__(name: str):
    # The entry is loaded on first use so that importing the package does not import Triton.
    if name == "fused_inv_rope_fp8_quant":
        from .inv_rope_quant import fused_inv_rope_fp8_quant

        return fused_inv_rope_fp8_quant
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
