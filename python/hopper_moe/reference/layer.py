"""fp32 reference of the whole MoE layer (routing, and experts for every quant scheme).

Readable, not fast: a loop over experts, every product in fp32. The quantization steps
(activation fp8 round trips, dynamic scales) follow the exact rules the kernels use, listed in
``hopper_moe.quant``, so that an FP8 kernel and this reference see the same rounded operands.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..quant import (FP8_MAX, FP8_MIN_SCALE, GROUP_EPS, GROUP_INV_MAX, QuantConfig,
                     abs_ignoring_nan)

__all__ = [
    "dequantize_weight_ref",
    "fused_experts_ref",
    "fused_topk_ref",
    "quant_dequant_activation_ref",
]


def fused_topk_ref(
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: scores = softmax (or sigmoid) of the fp32 logits ``[M, E]``.

    Returns ``(weights [M, topk] f32, ids [M, topk] int32, token_expert_indices [M, topk]
    int32)`` with ``token_expert_indices[t, k] = k * M + t``; experts in descending score
    order, equal scores by ascending id; weights are renormalized to sum to 1 per token when
    ``renormalize``.
    """
    logits = gating_output.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise RuntimeError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    # Equal scores: the lower expert id first (a stable descending sort; torch.topk does not
    # promise an order among ties).
    weights, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :topk], ids[:, :topk]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    m = gating_output.shape[0]
    tei = (torch.arange(topk, dtype=torch.int32).view(1, topk) * m
           + torch.arange(m, dtype=torch.int32).view(m, 1)).to(gating_output.device)
    return weights, ids.to(torch.int32), tei


# Default of fused_experts_ref's act_dtype: store SiLU*mul like the GEMM outputs.
_AS_INTERMEDIATE = object()


def _store(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x as a pipeline that keeps it in ``dtype`` sees it (rounded; None = fp32, unchanged)."""
    return x if dtype is None else x.to(dtype).float()


def dequantize_weight_ref(w: torch.Tensor, scale: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """fp32 ``w [E, N, K]`` = fp8 weight x its scale (per expert, channel or block)."""
    wf = w.float()
    e, n, k = wf.shape
    if quant.block_shape is not None:
        bn, bk = quant.block_shape
        full = scale.float().repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
        return wf * full
    if quant.per_out_ch_quant:
        return wf * scale.float().reshape(e, n, 1)
    return wf * scale.float().reshape(e, 1, 1)


def _fp8_round_trip(x: torch.Tensor, scale: torch.Tensor,
                    reciprocal: bool = False) -> torch.Tensor:
    """fp32 value the kernels see after q = fp8(clamp(x / scale, -448, 448)); q * scale.

    reciprocal: quantize as x * (1 / scale), the per-tensor ops' formula (static, dynamic and
    silu_and_mul_quant; see hopper_moe.reference.quant); per-token and group quantization
    divide. The two differ in the last bit of x / scale, which can move an fp8 rounding."""
    scaled = x * (1.0 / scale) if reciprocal else x / scale
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def quant_dequant_activation_ref(
    x: torch.Tensor,
    quant: QuantConfig,
    static_scale: Optional[torch.Tensor],
) -> torch.Tensor:
    """Quantizes fp32 activations ``x [R, C]`` as the scheme says and dequantizes them.

    per_act_token_quant: one scale per row, max(amax_row / 448, 1/(448*512));
    block_shape: one scale per row per block_k columns, max(amax_group, 1e-10) * fp32(1 / 448);
    otherwise per-tensor: static_scale when given, else max(amax_all / 448, 1/(448*512)).
    Every amax skips NaN elements, as the quantization ops' ``fmaxf`` does
    (hopper_moe.reference.quant).
    """
    x = x.float()
    if quant.per_act_token_quant:
        scale = (abs_ignoring_nan(x).amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(
            FP8_MIN_SCALE)
        return _fp8_round_trip(x, scale)
    if quant.block_shape is not None:
        group = quant.block_shape[1]
        rows, cols = x.shape
        xg = x.reshape(rows, cols // group, group)
        scale = abs_ignoring_nan(xg).amax(dim=2, keepdim=True).clamp_min(GROUP_EPS) * \
            GROUP_INV_MAX
        return _fp8_round_trip(xg, scale).reshape(rows, cols)
    if static_scale is not None:
        return _fp8_round_trip(x, static_scale.float().reshape(()), reciprocal=True)
    amax = abs_ignoring_nan(x).amax() if x.numel() > 0 else x.new_zeros(())
    return _fp8_round_trip(x, (amax / FP8_MAX).clamp_min(FP8_MIN_SCALE), reciprocal=True)


def fused_experts_ref(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: Optional[torch.Tensor] = None,
    quant: Optional[QuantConfig] = None,
    intermediate_dtype: Optional[torch.dtype] = None,
    dequant_dtype: Optional[torch.dtype] = None,
    act_dtype: object = _AS_INTERMEDIATE,
    gemm1_dtype: object = _AS_INTERMEDIATE,
    silu_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """fp32 reference of the MoE layer; returns ``[M, H]`` in hidden_states' dtype.

    hidden_states ``[M, H]``; w1 ``[E, 2I, H]`` (gate rows first, then up rows); w2
    ``[E, H, I]``; topk_weights ``[M, topk]``; topk_ids ``[M, topk]`` global expert ids.
    A slot (t, k) counts only if, with expert_map, 0 <= id < global_num_experts and
    expert_map[id] >= 0 (the local expert, < E), or, without, 0 <= id < E (vLLM's rule: every
    physical expert is computed whatever global_num_experts says, as fused shared experts
    need); other slots contribute zero.

    out[t] = sum_k w[t,k] * (Q2(silu(Q1(x_t) @ g_e^T) * (Q1(x_t) @ u_e^T)) @ w2_e^T), where Q1,
    Q2 are the activation fp8 round trips of the scheme (identity without quant) and the
    weights are dequantized. With apply_router_weight_on_input (topk must be 1) the input row
    is multiplied by w[t,0] before Q1 and the output is not weighted again. A dynamic
    per-tensor Q1 takes its amax over all M rows; a dynamic per-tensor Q2 over all counted
    slots.

    Precision model (both None by default: every value stays fp32). An FP8 requantization
    turns tiny upstream differences into whole fp8 steps, so a pipeline is compared with the
    reference of its own storage precision:
      intermediate_dtype: the GEMM1 output, the SiLU*mul output and the GEMM2 output are
        stored (rounded) in this dtype, as unfused pipelines do (vLLM's Triton path and
        PyTorch's grouped GEMMs keep them in bf16).
      act_dtype: the SiLU*mul output's storage when it differs from intermediate_dtype
        (default: intermediate_dtype). A pipeline that quantizes SiLU*mul in the same kernel
        (silu_and_mul_quant) never stores it: it passes act_dtype=None.
      gemm1_dtype: the GEMM1 output's storage when it differs from intermediate_dtype
        (default: intermediate_dtype). A GEMM1 that applies SiLU*mul in its epilogue never
        stores its own output: it passes gemm1_dtype=None.
      silu_dtype: silu(gate) is rounded to this dtype before the multiply by up, as
        silu_and_mul does (silu in fp32 rounded to the input dtype, then the product);
        None = the fp32 product of the unrounded silu.
      dequant_dtype: with quant, GEMMs run on dequantized operands (q * scale) rounded to
        this dtype (PyTorch's dequantize-then-bf16-GEMM fallback); None = exact operands,
        as an FP8 tensor-core GEMM sees them.
    """
    if activation != "silu":
        raise RuntimeError(f"activation must be 'silu', got {activation!r}")
    m, hidden_size = hidden_states.shape
    num_experts = w1.shape[0]
    intermediate_size = w2.shape[2]
    topk = topk_ids.shape[1]
    if apply_router_weight_on_input and topk != 1:
        raise RuntimeError("apply_router_weight_on_input requires topk == 1, "
                           f"got topk = {topk}")
    if global_num_experts == -1 or expert_map is None:
        global_num_experts = expert_map.numel() if expert_map is not None else num_experts
    device = hidden_states.device

    x = hidden_states.float()
    if apply_router_weight_on_input:
        x = x * topk_weights.float()
    if quant is not None:
        x = _store(quant_dequant_activation_ref(x, quant, quant.a1_scale), dequant_dtype)
        w1f = _store(dequantize_weight_ref(w1, quant.w1_scale, quant), dequant_dtype)
        w2f = _store(dequantize_weight_ref(w2, quant.w2_scale, quant), dequant_dtype)
    else:
        w1f, w2f = w1.float(), w2.float()

    # Local expert of each slot, -1 when the slot does not count.
    ids = topk_ids.long().cpu()
    local = torch.full_like(ids, -1)
    for t in range(m):
        for k in range(topk):
            gid = int(ids[t, k])
            if not 0 <= gid < global_num_experts:
                continue
            lid = int(expert_map[gid]) if expert_map is not None else gid
            if 0 <= lid < num_experts:
                local[t, k] = lid
    local = local.to(device)

    inter = torch.zeros(m, topk, intermediate_size, dtype=torch.float32, device=device)
    for e in range(num_experts):
        tok, kk = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = _store(x[tok] @ w1f[e].t(),
                   intermediate_dtype if gemm1_dtype is _AS_INTERMEDIATE else gemm1_dtype)
        inter[tok, kk] = _store(_store(F.silu(h[:, :intermediate_size]), silu_dtype)
                                * h[:, intermediate_size:],
                                intermediate_dtype if act_dtype is _AS_INTERMEDIATE else act_dtype)

    if quant is not None:
        counted = (local >= 0).reshape(-1)
        flat = inter.reshape(m * topk, intermediate_size)
        if not quant.per_act_token_quant and quant.block_shape is None and quant.a2_scale is None:
            # Dynamic per-tensor: one scale from the counted slots only.
            rows = flat[counted]
            amax = abs_ignoring_nan(rows).amax() if rows.numel() > 0 else flat.new_zeros(())
            scale = (amax / FP8_MAX).clamp_min(FP8_MIN_SCALE)
            flat = _fp8_round_trip(flat, scale, reciprocal=True)
        else:
            flat = quant_dequant_activation_ref(flat, quant, quant.a2_scale)
        inter = _store(flat, dequant_dtype).reshape(m, topk, intermediate_size)

    out = torch.zeros(m, hidden_size, dtype=torch.float32, device=device)
    w = topk_weights.float()
    for e in range(num_experts):
        tok, kk = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = _store(inter[tok, kk] @ w2f[e].t(), intermediate_dtype)
        if not apply_router_weight_on_input:
            y = y * w[tok, kk].unsqueeze(1)
        out.index_add_(0, tok, y)
    return out.to(hidden_states.dtype)
