"""fp32 reference of the reduction op (moe_sum)."""
from __future__ import annotations

import torch

__all__ = ["moe_sum", "moe_sum_slot_mask"]


def moe_sum_slot_mask(topk_ids: torch.Tensor | None, num_tokens: int, top_k: int,
                      expert_map: torch.Tensor | None = None,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """bool [T, K]: which slots moe_sum adds. Every slot without topk_ids; with topk_ids, slot
    (t, k) counts iff id >= 0 and, with expert_map, id < expert_map.numel() and
    expert_map[id] >= 0."""
    if topk_ids is None:
        return torch.ones((num_tokens, top_k), dtype=torch.bool, device=device)
    ids = topk_ids.long()
    mask = ids >= 0
    if expert_map is not None:
        in_range = mask & (ids < expert_map.numel())
        local = torch.zeros_like(mask)
        local[in_range] = expert_map.long()[ids[in_range]] >= 0
        mask = in_range & local
    return mask


def moe_sum(input: torch.Tensor, topk_ids: torch.Tensor | None = None,
            expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """input [T, K, H] -> output [T, H] in input's dtype.

    output[t] = sum over the counting slots k (moe_sum_slot_mask) of input[t, k], added in fp32
    in increasing k starting from 0, rounded once to input's dtype. A slot that does not count
    adds nothing, even when its data is NaN."""
    num_tokens, top_k, hidden = input.shape
    mask = moe_sum_slot_mask(topk_ids, num_tokens, top_k, expert_map, device=input.device)
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=input.device)
    for k in range(top_k):
        x = input[:, k, :].float()
        acc = acc + torch.where(mask[:, k, None], x, torch.zeros_like(x))
    return acc.to(input.dtype)
