"""The Triton backend of fused_experts (grouped expert GEMM with swap-AB for small token
blocks). Triton itself is imported only when the backend first runs."""
from __future__ import annotations

import importlib.util
import os

import torch


# Looked up once: fused_experts asks on every call, also while torch.compile traces it, and
# Dynamo will not trace importlib (torch 2.11 breaks the graph there).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def is_available(device_type: str) -> bool:
    """Compiled kernels on CUDA; on the CPU only inside Triton's interpreter (tests)."""
    if not _HAS_TRITON:
        return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def run(*args, **kwargs) -> torch.Tensor:
    from .fused_moe import fused_experts_triton

    return fused_experts_triton(*args, **kwargs)
