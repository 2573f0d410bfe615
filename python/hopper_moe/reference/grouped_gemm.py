"""fp32 reference of moe_grouped_gemm."""
from __future__ import annotations

import torch

__all__ = ["moe_grouped_gemm_ref"]


def moe_grouped_gemm_ref(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor,
                         a_scales: torch.Tensor | None = None,
                         b_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Returns fp32 [M, N]: row r of expert e (offsets clamped like the op: begin into [0, M],
    end into [begin, M]) is sa(r) * sb(e, n) * sum_k a[r, k] b[e, n, k]; rows of no expert are
    NaN (the op leaves them untouched)."""
    m, n = a.shape[0], b.shape[1]
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=a.device)
    offs = expert_offsets.tolist()
    af = a.float()
    for e in range(b.shape[0]):
        begin = min(max(offs[e], 0), m)
        end = min(max(offs[e + 1], begin), m)
        if end == begin:
            continue
        y = af[begin:end] @ b[e].float().t()
        if b_scales is not None:
            y = y * b_scales.float().reshape(b.shape[0], -1)[e].reshape(1, -1)
        if a_scales is not None:
            sa = a_scales.float().reshape(-1)
            y = y * (sa[0] if sa.numel() == 1 else sa[begin:end].reshape(-1, 1))
        out[begin:end] = y
    return out
