"""hopper_moe: fused Mixture-of-Experts kernels for NVIDIA Hopper.

Ops are registered under ``torch.ops.hopper_moe`` with vLLM's schemas; ``hopper_moe.ops``
mirrors ``vllm._custom_ops``; ``fused_topk`` / ``fused_experts`` / ``fused_moe`` are the layer
API; ``hopper_moe.reference`` holds the fp32 definitions everything is tested against.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.hopper_moe.*)
from . import _fake  # noqa: F401  (fake/meta implementations)
from . import ops, reference
from . import triton as _triton_backend
from .fused_moe import fused_experts, fused_moe, fused_topk, register_backend
from .quant import QuantConfig
from . import cute as _cute_backend  # noqa: E402  (needs fused_moe)

register_backend("triton", _triton_backend.run, _triton_backend.is_available)
register_backend("cute", _cute_backend.run, _cute_backend.is_available)

__version__ = "0.1.0"


# Asked once: the answer is fixed for the process, and torch.compile cannot trace the query.
_BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("hopper_moe::moe_sum", "CUDA")


def built_with_cuda() -> bool:
    """True when this build of hopper_moe._C holds the CUDA kernels."""
    return _BUILT_WITH_CUDA


__all__ = [
    "QuantConfig",
    "built_with_cuda",
    "fused_experts",
    "fused_moe",
    "fused_topk",
    "ops",
    "reference",
]
