"""hopper_moe: fused Mixture-of-Experts kernels for NVIDIA Hopper.

Ops are registered under ``torch.ops.hopper_moe`` with vLLM's schemas; ``hopper_moe.ops``
mirrors ``vllm._custom_ops``; ``fused_topk`` / ``fused_experts`` / ``fused_moe`` are the layer
API (``hopper_moe.api``, backends in ``hopper_moe.backends``); ``hopper_moe.reference`` holds
the fp32 definitions everything is tested against; ``hopper_moe.kernels`` the Triton kernels,
among them ``fused_inv_rope_fp8_quant`` (an attention-output op); ``hopper_moe.settings`` the
environment variables, read once at import; ``warmup`` (module ``hopper_moe.warm``) compiles
what a layer can reach before serving; ``explain_backend`` says what ``backend="auto"`` runs
and why (module ``hopper_moe.oracle``; ``python -m hopper_moe.oracle --measure`` times the
backends on this GPU).
"""
from __future__ import annotations

import torch

from . import settings  # noqa: F401  (first: the environment is read once, here)
from . import _C  # noqa: F401  (registers torch.ops.hopper_moe.*)
from . import _fake  # noqa: F401  (fake/meta implementations)
from . import ops, reference
from .api import (available_backends, explain_backend, fused_experts, fused_moe, fused_topk,
                  register_backend)
from .quant import QuantConfig
from .warm import warmup

__version__ = "0.1.0"


# Asked once: the answer is fixed for the process, and torch.compile cannot trace the query.
_BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("hopper_moe::moe_sum", "CUDA")


def built_with_cuda() -> bool:
    """True when this build of hopper_moe._C holds the CUDA kernels."""
    return _BUILT_WITH_CUDA


__all__ = [
    "QuantConfig",
    "available_backends",
    "built_with_cuda",
    "explain_backend",
    "fused_experts",
    "fused_moe",
    "fused_topk",
    "ops",
    "reference",
    "warmup",
]
