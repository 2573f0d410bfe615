"""References of the grouped-GEMM metadata ops (get_cutlass_moe_mm_data and
get_cutlass_moe_mm_problem_sizes_from_expert_offsets). Integer outputs, compared exactly."""
from __future__ import annotations

import torch

__all__ = [
    "SWAP_AB_MAX_SLOTS",
    "get_cutlass_moe_mm_data",
    "get_cutlass_moe_mm_problem_sizes_from_expert_offsets",
    "moe_mm_problem_sizes",
]

# At or below this many slots (topk_ids.numel()) the problem sizes are written in (N, M, K) order.
SWAP_AB_MAX_SLOTS = 64


def moe_mm_problem_sizes(m: torch.Tensor, n: int, k: int, swap_ab: bool,
                         is_gated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [E, 3] problem sizes of both grouped GEMMs from the per-expert row counts m [E]:
    (m, N1, k) and (m, k, n) with N1 = 2n if is_gated else n; (N1, m, k) and (k, m, n) when
    swap_ab."""
    m = m.to(torch.int32)
    n1 = torch.full_like(m, 2 * n if is_gated else n)
    nn = torch.full_like(m, n)
    kk = torch.full_like(m, k)
    if swap_ab:
        return torch.stack([n1, m, kk], dim=1), torch.stack([kk, m, nn], dim=1)
    return torch.stack([m, n1, kk], dim=1), torch.stack([m, kk, nn], dim=1)


def get_cutlass_moe_mm_data(topk_ids: torch.Tensor, num_experts: int, n: int, k: int,
                            is_gated: bool = True, offsets_dtype: torch.dtype = torch.int32):
    """topk_ids [T, K] -> (expert_offsets [E+1], problem_sizes1 [E, 3], problem_sizes2 [E, 3],
    input_permutation [T*K], output_permutation [T*K]) (int32; offsets in offsets_dtype).

    A slot i (row-major index into topk_ids) counts iff 0 <= id < num_experts. Counting slots are
    grouped by expert (ascending) and, within an expert, kept in slot order. expert_offsets[e]
    is where expert e's rows start; input_permutation[p] is the token of the slot at row p (-1
    for rows past the counting slots: shuffle_rows writes zero rows there);
    output_permutation[i] is the row of slot i, or expert_offsets[E] for a slot that does not
    count. Problem sizes are swapped (N, M, K) when
    topk_ids.numel() <= SWAP_AB_MAX_SLOTS."""
    device = topk_ids.device
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    num_slots = ids.numel()
    counts = (ids >= 0) & (ids < num_experts)

    m = torch.bincount(ids[counts], minlength=num_experts)
    expert_offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    expert_offsets[1:] = torch.cumsum(m, 0)
    total = int(expert_offsets[-1])

    # A stable sort by expert (skipped slots last) gives every slot its row.
    key = torch.where(counts, ids, torch.full_like(ids, num_experts))
    order = torch.sort(key, stable=True).indices  # order[p] = slot placed at row p
    input_permutation = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    input_permutation[:total] = (order[:total] // max(top_k, 1)).to(torch.int32)
    output_permutation = torch.full((num_slots,), total, dtype=torch.int32, device=device)
    output_permutation[order[:total]] = torch.arange(total, dtype=torch.int32, device=device)

    ps1, ps2 = moe_mm_problem_sizes(m, n, k, num_slots <= SWAP_AB_MAX_SLOTS, is_gated)
    return (expert_offsets.to(offsets_dtype), ps1, ps2, input_permutation, output_permutation)


def get_cutlass_moe_mm_problem_sizes_from_expert_offsets(expert_first_token_offset: torch.Tensor,
                                                         n: int, k: int, swap_ab: bool):
    """expert_first_token_offset int64 [E+1] -> (problem_sizes1, problem_sizes2) int32 [E, 3]
    with m_e = offset[e+1] - offset[e] clamped to [0, 2^31 - 1]; first GEMM N = 2n."""
    off = expert_first_token_offset.long()
    m = (off[1:] - off[:-1]).clamp(0, 2**31 - 1)
    return moe_mm_problem_sizes(m, n, k, swap_ab, is_gated=True)
