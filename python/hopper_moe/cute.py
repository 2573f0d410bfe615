"""The "cute" backend of fused_experts: the layer around hopper_moe's SM90 grouped GEMM.

    sort slots by expert -> (FP8 quant of x) -> gather rows -> GEMM1 (moe_grouped_gemm) ->
    SiLU*mul (+ FP8 quant) -> GEMM2 (moe_grouped_gemm) -> weighted sum over k

Both GEMMs are ``torch.ops.hopper_moe.moe_grouped_gemm``: on CUDA the hand-written swap-AB
wgmma kernel (csrc/include/hopper_moe/gemm), on the CPU its readable definition, so the
composition is tested in CI. Schemes: bf16 (fp16/fp32 inputs run in bf16), FP8 e4m3
per-tensor (static or dynamic activation scales) and per-token activations x per-channel
weights. Block-wise [128,128] FP8 is not in the kernel yet: ``backend="triton"`` runs it.

Precision model (what tests compare against): GEMM outputs in bf16, the SiLU*mul output in
bf16 (except a static per-tensor a2 scale, which silu_and_mul_quant applies without storing
it), the weighted sum over k in fp32. No host synchronization: the slot order and the expert
row offsets stay on the device, so a layer can be captured in a CUDA graph.

Not yet fused: the slot sort, the row gather and the final sum are PyTorch ops (a few small
launches per layer); moving them into the GEMM's prologue and epilogue is the next step.
"""
from __future__ import annotations

import torch

from . import ops
from .fused_moe import combine_sorted_slots, sort_slots_by_expert

_GEMM = torch.ops.hopper_moe.moe_grouped_gemm.default


def _fail(msg: str) -> None:
    raise RuntimeError(f"fused_experts(backend='cute'): {msg}")


def is_available(device_type: str) -> bool:
    """On CUDA: a CUDA build and an SM90 GPU (the kernel is sm_90a code). On the CPU the
    GEMM's CPU definition runs (tests, small layers)."""
    if device_type == "cpu":
        return True
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    from . import built_with_cuda

    return built_with_cuda() and torch.cuda.get_device_capability() == (9, 0)


def _check_supported(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     quant) -> None:
    if quant is not None and quant.block_shape is not None:
        _fail("block-wise FP8 (quant.block_shape) is not supported yet; use backend='triton'")
    # The bulk tensor copies read rows of 16 bytes' multiples: H (GEMM1's K) and I (GEMM2's K).
    elem = 1 if quant is not None else 2
    hidden, inter = w1.shape[2], w2.shape[2]
    for name, k in (("hidden size H (w1.size(2))", hidden),
                    ("intermediate size I (w2.size(2))", inter)):
        if (k * elem) % 16:
            _fail(f"{name} = {k} must be a multiple of {16 // elem} for "
                  f"{'FP8' if quant is not None else 'bf16'} operands")
    if hidden_states.device.type == "cuda" and not is_available("cuda"):
        _fail("needs an SM90 GPU (H100/H200) and a CUDA build of hopper_moe")


def _act_quant(x: torch.Tensor, quant, static_scale):
    """FP8 activations [R, K] and their scale: [R, 1] per token, [1] per tensor."""
    if quant.per_act_token_quant:
        return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    return ops.scaled_fp8_quant(x, static_scale)


def _weight_scales(scale: torch.Tensor, w: torch.Tensor, quant) -> torch.Tensor:
    """[E] (per expert) or [E, N] (per output channel), float32, contiguous."""
    e, n = w.shape[0], w.shape[1]
    shape = (e, n) if quant.per_out_ch_quant else (e,)
    return scale.float().reshape(shape).contiguous()


def _sorted_gemm1_operands(hidden_states, w1, topk_weights, topk_ids,
                           apply_router_weight_on_input, global_num_experts, expert_map, quant):
    """Slots sorted by expert and GEMM1's operands: (order, sorted_valid, offsets int64
    [E + 1], a1 [S, H] bf16 or fp8 in slot order, its scale, w1 in the GEMM's dtype, w1's
    scale)."""
    num_experts = w1.shape[0]
    order, _, sorted_valid, offs_end = sort_slots_by_expert(
        topk_ids, num_experts, global_num_experts, expert_map)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=hidden_states.device)
    offsets[1:] = offs_end
    token_of_slot = order // topk_ids.shape[1]
    x = hidden_states
    if apply_router_weight_on_input:
        x = x.float() * topk_weights.float()  # [M, 1]: topk == 1
    if quant is None:
        return (order, sorted_valid, offsets, x.to(torch.bfloat16)[token_of_slot], None,
                w1.to(torch.bfloat16).contiguous(), None)
    q, s = _act_quant(x.float(), quant, quant.a1_scale)
    a1_scale = s if s.numel() == 1 else s[token_of_slot].contiguous()
    return (order, sorted_valid, offsets, q[token_of_slot], a1_scale, w1.contiguous(),
            _weight_scales(quant.w1_scale, w1, quant))


def _gemm2_operands(h, w2, quant):
    """SiLU*mul of GEMM1's output h and GEMM2's operands: (a2, its scale, w2, w2's scale)."""
    if quant is None:
        return ops.silu_and_mul(None, h), None, w2.to(torch.bfloat16).contiguous(), None
    if not quant.per_act_token_quant and quant.a2_scale is not None:
        a2 = ops.silu_and_mul_quant(None, h, quant.a2_scale)
        a2_scale = quant.a2_scale.float().reshape(1)
    else:
        a2, a2_scale = _act_quant(ops.silu_and_mul(None, h), quant, None)
        if a2_scale.numel() != 1:
            a2_scale = a2_scale.contiguous()
    return a2, a2_scale, w2.contiguous(), _weight_scales(quant.w2_scale, w2, quant)


def fused_experts_cute(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool, global_num_experts: int,
                       expert_map, quant) -> torch.Tensor:
    """Arguments as ``hopper_moe.fused_experts`` after its validation (M > 0,
    global_num_experts resolved)."""
    _check_supported(hidden_states, w1, w2, quant)
    order, sorted_valid, offsets, a1, a1_scale, w1g, w1_scale = _sorted_gemm1_operands(
        hidden_states, w1, topk_weights, topk_ids, apply_router_weight_on_input,
        global_num_experts, expert_map, quant)
    # Rows of slots that do not count (sorted last, past offsets[E]) are not written by the
    # GEMM: zeros keep them finite and out of a dynamic per-tensor amax.
    h = torch.zeros((order.numel(), w1.shape[1]), dtype=torch.bfloat16, device=a1.device)
    _GEMM(h, a1, w1g, offsets, a1_scale, w1_scale)
    a2, a2_scale, w2g, w2_scale = _gemm2_operands(h, w2, quant)
    y = torch.empty((order.numel(), w2.shape[1]), dtype=torch.bfloat16, device=a1.device)
    _GEMM(y, a2, w2g, offsets, a2_scale, w2_scale)
    return combine_sorted_slots(y, order, sorted_valid, topk_weights,
                                apply_router_weight_on_input).to(hidden_states.dtype)


def run(*args, **kwargs) -> torch.Tensor:
    return fused_experts_cute(*args, **kwargs)


def make_gemm_only(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, quant=None):
    """A zero-argument callable that runs this backend's GEMM1 and GEMM2 only, on operands
    prepared here once (slots sorted, activations quantized, GEMM2's input from one real
    pass), for GEMM-only benchmarks. Returns (h, y), the two GEMM outputs."""
    _check_supported(hidden_states, w1, w2, quant)
    order, _, offsets, a1, a1_scale, w1g, w1_scale = _sorted_gemm1_operands(
        hidden_states, w1, topk_weights, topk_ids, False, w1.shape[0], None, quant)
    h = torch.zeros((order.numel(), w1.shape[1]), dtype=torch.bfloat16, device=a1.device)
    y = torch.empty((order.numel(), w2.shape[1]), dtype=torch.bfloat16, device=a1.device)
    _GEMM(h, a1, w1g, offsets, a1_scale, w1_scale)
    a2, a2_scale, w2g, w2_scale = _gemm2_operands(h, w2, quant)

    def gemms():
        _GEMM(h, a1, w1g, offsets, a1_scale, w1_scale)
        _GEMM(y, a2, w2g, offsets, a2_scale, w2_scale)
        return h, y
    return gemms
