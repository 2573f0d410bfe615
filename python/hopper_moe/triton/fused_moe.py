"""The Triton MoE layer: align -> (quant) -> GEMM1 with SiLU*mul (+ quant) -> GEMM2 (* weight) -> sum.

`fused_experts_triton` is what `hopper_moe.fused_experts(..., backend="triton")` runs. Arguments
are validated by the caller (hopper_moe.fused_moe); this module only plans and launches.
Configs come from `configs.get_config` (finite M buckets, so a new token count never means a
new compiled kernel).
"""
from __future__ import annotations

import os

import torch
import triton

from .. import ops
from ..quant import FP8_MIN_SCALE
from .configs import get_config
from .moe_gemm import moe_gemm_kernel

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_QUANT_NONE, _QUANT_TENSOR, _QUANT_CHANNEL, _QUANT_BLOCK = 0, 1, 2, 3


def _quantize_act(x: torch.Tensor, quant, static_scale: torch.Tensor | None):
    """Quantize activations [rows, K] per the scheme; returns (x_q, scale, stride_asm,
    stride_ask)."""
    if quant.block_shape is not None:
        xq, xs = ops.per_token_group_quant_fp8(x, quant.block_shape[1])
        return xq, xs, xs.stride(0), xs.stride(1)
    if quant.per_act_token_quant:
        xq, xs = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        return xq, xs, xs.stride(0), 0
    xq, xs = ops.scaled_fp8_quant(x, static_scale)
    return xq, xs, 0, 0


def _quant_mode(quant) -> int:
    if quant is None:
        return _QUANT_NONE
    if quant.block_shape is not None:
        return _QUANT_BLOCK
    if quant.per_act_token_quant or quant.per_out_ch_quant:
        return _QUANT_CHANNEL
    return _QUANT_TENSOR


def _weight_scale_strides(scale: torch.Tensor, mode: int):
    """(stride over experts, over N groups/channels, over K groups) of a weight scale."""
    if mode == _QUANT_BLOCK:
        return scale.stride(0), scale.stride(1), scale.stride(2)
    if mode == _QUANT_CHANNEL and scale.dim() >= 2 and scale.size(1) > 1:
        return scale.stride(0), scale.stride(1), 0
    return scale.stride(0), 0, 0


class Routing:
    """Which slots each GEMM program takes. Aligned: the moe_align_block_size layout (blocks of
    BLOCK_M slots of one expert). One slot per block (tiny batches, no alignment launch): block
    m is slot m, its expert read from topk_ids and expert_map inside the kernel."""

    def __init__(self, topk_ids, expert_map, num_experts: int, block_m: int, aligned: bool):
        self.topk_ids = topk_ids
        self.expert_map = expert_map
        self.num_experts = num_experts
        self.aligned = aligned
        if aligned:
            self.sorted_ids, self.expert_ids, self.ntp = ops.moe_align_block_size_buffers(
                topk_ids, num_experts, block_m)
            ops.moe_align_block_size(topk_ids, num_experts, block_m, self.sorted_ids,
                                     self.expert_ids, self.ntp, expert_map)
        else:
            self.sorted_ids = self.expert_ids = self.ntp = topk_ids

    def num_blocks(self, block_m: int) -> int:
        if self.aligned:
            return triton.cdiv(self.sorted_ids.numel(), block_m)
        return self.topk_ids.numel()


def invoke_moe_gemm(a, b, c, a_scale, stride_as, b_scale, topk_weights, routing: Routing,
                    top_k: int, num_slots: int, quant, mul_routed_weight: bool,
                    config: dict, fuse_silu: bool = False,
                    out_scale: torch.Tensor | None = None, amax_out: bool = False) -> None:
    """C[slot] = A[slot // top_k] . B[expert]^T for every slot the routing places.

    fuse_silu (GEMM1): C[slot] = silu(gate) * up of that product, [slots, N / 2]; an FP8 C is
    quantized with the static scale out_scale; amax_out: C stays bf16 and out_scale (set to
    the dynamic scale's floor by the caller) receives max(out_scale, amax(C) / 448)."""
    n, k = b.shape[1], b.shape[2]
    mode = _quant_mode(quant)
    grid = (routing.num_blocks(config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    dummy = c  # stands in for absent pointers (never read)
    if mode == _QUANT_NONE:
        bse = bsn = bsk = 0
        b_scale = dummy
        a_scale = dummy
    else:
        bse, bsn, bsk = _weight_scale_strides(b_scale, mode)
    group_n, group_k = (quant.block_shape if mode == _QUANT_BLOCK else (1, 1))
    moe_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, topk_weights if mul_routed_weight else dummy,
        out_scale if out_scale is not None else dummy,
        routing.sorted_ids, routing.expert_ids, routing.ntp,
        routing.topk_ids, routing.expert_map if routing.expert_map is not None else dummy,
        n, k, num_slots, routing.sorted_ids.numel(), routing.num_experts, b.shape[0],
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        stride_as[0], stride_as[1],
        bse, bsn, bsk,
        TOP_K=top_k,
        QUANT=mode,
        PER_ACT_TOKEN=bool(quant is not None and quant.per_act_token_quant),
        PER_OUT_CH=bool(quant is not None and quant.per_out_ch_quant),
        GROUP_N=group_n,
        GROUP_K=group_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        SWAP_AB=config["SWAP_AB"],
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"],
        BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"],
        ONE_SLOT_PER_BLOCK=not routing.aligned,
        HAS_EXPERT_MAP=routing.expert_map is not None,
        EVEN_K=k % config["BLOCK_K"] == 0,
        EVEN_N=n % config["BLOCK_N"] == 0,
        FUSE_SILU=fuse_silu,
        OUT_FP8=fuse_silu and c.dtype == ops.FP8_DTYPE,
        AMAX_OUT=amax_out,
        INTERPRETER=_INTERPRET,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def precision(quant, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Storage precision of this layer for hidden states of `dtype`, as
    `reference.fused_experts_ref` keywords: GEMM1's output is never stored (SiLU*mul in its
    epilogue); the SiLU*mul output is stored in `dtype`, except with a static a2 scale, where
    the epilogue quantizes it straight to FP8; GEMM2's output is stored in `dtype` before the
    top-k sum (fp32 storage rounds nothing)."""
    store = None if dtype == torch.float32 else dtype
    static_a2 = quant is not None and _quant_mode(quant) == _QUANT_TENSOR and \
        quant.a2_scale is not None
    return dict(intermediate_dtype=store, gemm1_dtype=None,
                act_dtype=None if static_a2 else store)


def _identity_map(num_experts: int, device: torch.device) -> torch.Tensor:
    return torch.arange(num_experts, dtype=torch.int32, device=device)


def fused_experts_triton(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         apply_router_weight_on_input: bool = False,
                         global_num_experts: int = -1,
                         expert_map: torch.Tensor | None = None,
                         quant=None, stage_done=None) -> torch.Tensor:
    """[M, H] -> [M, H] through the experts chosen by topk_ids, with Triton GEMMs.

    stage_done: called with each stage's name once its launches are enqueued ("align",
    "quant1", "gemm1", "quant2", "gemm2", "sum"; benchmarks/bench_stages.py records an event
    there)."""
    mark = stage_done if stage_done is not None else (lambda name: None)
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_experts = w1.shape[0] if global_num_experts == -1 else global_num_experts
    inter2 = w1.shape[1]
    out_dtype = hidden_states.dtype
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=hidden_states.device)
    if num_tokens == 0:
        return out
    num_slots = num_tokens * top_k
    mode = _quant_mode(quant)
    scheme = "bf16" if mode == _QUANT_NONE else quant.scheme

    cfg = get_config(num_tokens, top_k, num_experts, inter2 // 2, scheme)
    routing = Routing(topk_ids.contiguous(), expert_map, num_experts, cfg["BLOCK_M"],
                      aligned=not cfg.get("ONE_SLOT_PER_BLOCK", False))
    mark("align")

    x = hidden_states
    if apply_router_weight_on_input:
        x = (x.float() * topk_weights.view(num_tokens, 1)).to(out_dtype)

    if mode == _QUANT_NONE:
        a1, a1_s, a1_st = x, None, (0, 0)
    else:
        a1, a1_s, asm, ask = _quantize_act(x, quant, quant.a1_scale)
        a1_st = (asm, ask)
    mark("quant1")
    # GEMM1 applies SiLU*mul in its epilogue: act [slots, I] is its only output. Rows of
    # slots that are never placed (ids outside [0, num_experts)) stay unwritten; GEMM2 never
    # reads them, and a dynamic per-tensor scale is the amax of the written rows only.
    static_q2 = mode == _QUANT_TENSOR and quant.a2_scale is not None
    dynamic_q2 = mode == _QUANT_TENSOR and quant.a2_scale is None
    if static_q2:
        act_scale = quant.a2_scale  # the epilogue writes FP8 with it
    elif dynamic_q2:  # the epilogue maxes amax / 448 into the floor: the dynamic scale
        act_scale = torch.full((1,), FP8_MIN_SCALE, dtype=torch.float32, device=x.device)
    else:
        act_scale = None
    act = torch.empty((num_slots, inter2 // 2), dtype=ops.FP8_DTYPE if static_q2 else out_dtype,
                      device=x.device)
    invoke_moe_gemm(a1, w1, act, a1_s, a1_st, None if mode == _QUANT_NONE else quant.w1_scale,
                    topk_weights, routing, top_k, num_slots, quant, False, cfg, fuse_silu=True,
                    out_scale=act_scale, amax_out=dynamic_q2)
    mark("gemm1")
    if mode == _QUANT_NONE or static_q2:
        a2, a2_s, a2_st = act, act_scale, (0, 0)
    elif dynamic_q2:
        a2, a2_s = ops.scaled_fp8_quant(act, act_scale)
        a2_st = (0, 0)
    else:
        a2, a2_s, asm, ask = _quantize_act(act, quant, None)
        a2_st = (asm, ask)
    mark("quant2")
    cache2 = torch.empty((num_slots, hidden), dtype=out_dtype, device=x.device)
    invoke_moe_gemm(a2, w2, cache2, a2_s, a2_st, None if mode == _QUANT_NONE else quant.w2_scale,
                    topk_weights, routing, 1, num_slots, quant,
                    not apply_router_weight_on_input, cfg)
    mark("gemm2")
    # Slots with an id outside [0, num_experts) were never placed, so their rows of cache2 are
    # unwritten; an identity map makes moe_sum skip them as it skips non-local experts.
    sum_map = expert_map if expert_map is not None else _identity_map(num_experts, x.device)
    ops.moe_sum(cache2.view(num_tokens, top_k, hidden), out, topk_ids, sum_map)
    mark("sum")
    return out
