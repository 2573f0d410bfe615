"""The "reference" backend of fused_experts: ``hopper_moe.reference.fused_experts_ref``, the
fp32 definition of the layer (a loop over experts; readable, not fast)."""
from __future__ import annotations

import torch

from ..reference.layer import fused_experts_ref

__all__ = ["is_available", "run"]


def is_available(device_type: str) -> bool:
    """Runs wherever PyTorch does."""
    return True


def run(hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
        global_num_experts, expert_map, quant) -> torch.Tensor:
    return fused_experts_ref(hidden_states, w1, w2, topk_weights, topk_ids, "silu",
                             apply_router_weight_on_input, global_num_experts, expert_map,
                             quant)
