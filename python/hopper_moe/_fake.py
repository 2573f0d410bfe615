"""Fake (meta) implementations of the hopper_moe ops, for torch.compile and FakeTensor tracing.

Ops that only write their `Tensor!` arguments return nothing, so their fakes do nothing; the
one op that returns tensors (grouped_topk) allocates outputs of the right shape and dtype.
Shape rules shared with the eager wrappers live in hopper_moe.ops (see `_grouped_topk_shapes`).
"""
from __future__ import annotations

import torch

_IN_PLACE_OPS = (
    "topk_softmax",
    "topk_sigmoid",
    "moe_align_block_size",
    "moe_permute",
    "moe_unpermute",
    "shuffle_rows",
    "moe_sum",
    "silu_and_mul",
    "silu_and_mul_quant",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "per_token_group_fp8_quant",
    "get_cutlass_moe_mm_data",
    "get_cutlass_moe_mm_problem_sizes_from_expert_offsets",
    "moe_grouped_gemm",
    "moe_grouped_gemm_silu_mul",
    "moe_grouped_gemm_chain",
    "cutlass_moe_mm",
)


def _writes_only(*args, **kwargs) -> None:
    return None


for _name in _IN_PLACE_OPS:
    torch.library.register_fake(f"hopper_moe::{_name}")(_writes_only)


@torch.library.register_fake("hopper_moe::grouped_topk")
def _grouped_topk_fake(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor,
                       bias, scoring_func):
    num_tokens = scores.shape[0]
    weights = scores.new_empty((num_tokens, topk), dtype=torch.float32)
    ids = scores.new_empty((num_tokens, topk), dtype=torch.int32)
    return weights, ids
