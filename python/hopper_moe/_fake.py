"""Fake (meta) implementations of the hopper_moe ops, for torch.compile and FakeTensor tracing.

Ops that only write their `Tensor!` arguments return nothing, so their fakes only check that
the tensors share one device; the one op that returns tensors (grouped_topk) allocates outputs
of the right shape and dtype.
Shape rules shared with the eager wrappers live in hopper_moe.ops (see `_grouped_topk_shapes`).
"""
from __future__ import annotations

import torch

_IN_PLACE_OPS = (
    "topk_softmax",
    "topk_sigmoid",
    "moe_align_block_size",
    "moe_permute",
    "moe_permute_with_scratch",
    "moe_prepare_scatter",
    "moe_unpermute",
    "shuffle_rows",
    "moe_sum",
    "silu_and_mul",
    "silu_and_mul_quant",
    "static_scaled_fp8_quant",
    "fp8_quant_rows",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "per_token_group_fp8_quant",
    "get_cutlass_moe_mm_data",
    "get_cutlass_moe_mm_problem_sizes_from_expert_offsets",
    "moe_grouped_gemm",
    "moe_grouped_gemm_silu_mul",
    "moe_grouped_gemm_chain",
    "cutlass_moe_mm",
    "fused_experts_sm90",
)


def _check_one_device(op: str, args, kwargs) -> None:
    """A call whose tensors mix a meta tensor with real ones also lands here (the dispatcher
    picks the meta key), where the real implementation's device checks never run: reject it
    as the real checks reject tensors on two devices, instead of silently doing nothing."""
    devices = {}
    for i, a in enumerate(list(args) + list(kwargs.values())):
        if isinstance(a, torch.Tensor):
            devices.setdefault(a.device, i)
    if len(devices) > 1:
        names = _argument_names(op)[:len(args)] + list(kwargs)
        devices = {d: names[i] for d, i in devices.items()}
        raise RuntimeError(
            f"hopper_moe::{op}: all tensor arguments must be on one device; got "
            + ", ".join(f"{name} on {d}" for d, name in devices.items()))


def _argument_names(op: str) -> list[str]:
    """The op's argument names in schema order (for messages)."""
    return [a.name for a in getattr(torch.ops.hopper_moe, op).default._schema.arguments]


def _writes_only_fake(op: str):
    def fake(*args, **kwargs) -> None:
        _check_one_device(op, args, kwargs)

    return fake


for _name in _IN_PLACE_OPS:
    torch.library.register_fake(f"hopper_moe::{_name}")(_writes_only_fake(_name))


@torch.library.register_fake("hopper_moe::grouped_topk")
def _grouped_topk_fake(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor,
                       bias, scoring_func):
    _check_one_device("grouped_topk", (scores, bias), {})
    # The rules that decide the outputs' shape (csrc/checks/routing.cpp's, same messages): a
    # traced call with other arguments must not propagate a shape the op would never return.
    def fail(msg):
        raise RuntimeError(f"hopper_moe::grouped_topk: {msg}")

    if scores.dim() != 2:
        fail(f"scores must be 2-D, got {scores.dim()}-D")
    num_experts = scores.shape[1]
    if not (n_group >= 1 and num_experts % n_group == 0):
        fail(f"n_group must be >= 1 and divide num_experts = {num_experts}, got n_group = "
             f"{n_group}")
    if not 1 <= topk_group <= n_group:
        fail(f"topk_group must be in [1, n_group = {n_group}], got {topk_group}")
    kept = topk_group * (num_experts // n_group)
    if not 1 <= topk <= kept:
        fail(f"topk must be in [1, topk_group * num_experts / n_group = {kept}], got {topk}")
    num_tokens = scores.shape[0]
    weights = scores.new_empty((num_tokens, topk), dtype=torch.float32)
    ids = scores.new_empty((num_tokens, topk), dtype=torch.int32)
    return weights, ids
