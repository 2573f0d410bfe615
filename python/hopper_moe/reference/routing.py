"""fp32 references of the routing ops: topk_softmax, topk_sigmoid, grouped_topk.

The semantics (documented in full in csrc/cpu/routing.cpp):
  * rank order: higher score first, NaN after every number (-inf included), ties to the lower
    expert (or group) index, so the ids of a row are always distinct and in [0, E);
  * topk_softmax selects on softmax(x) (+ bias) and returns the unbiased softmax of the chosen;
    topk_sigmoid the same with sigmoid(x), times routed_scaling_factor; a probability that is
    not finite counts as 0 (a softmax row holding NaN or +inf, or only -inf, is all zeros; a
    NaN logit under sigmoid is 0); renormalize divides by the weights' sum (by 1 when that sum
    is not > 0); is_padding rows get ids -1, weights 0; token_expert_indices[t, k] = k * T + t;
  * grouped_topk (DeepSeek-V3): scores s = 0.5 * tanh(x / 2) + 0.5 in fp32 (vLLM's form) or
    x; an expert whose x, bias or s + bias is not finite is invalid: biased score -inf, weight
    0. Group score = sum of the group's best two biased scores; keep the topk_group best
    groups; pick topk by biased score among their experts; weights are the unbiased scores,
    renormalized by (sum + 1e-20), times routed_scaling_factor; a row whose picks are all
    invalid gets weights 1/topk (renormalize) or 0.

Written with plain torch ops (exp, tanh, sort, gather): independent of the C++ code, which
shares its exp with the kernels. Weights agree with the ops to a few ulps; ids exactly, except
where two scores are within a few ulps of each other. grouped_topk's sigmoid is torch.tanh on
the input's device in both (the op calls torch's tanh on the CPU and CUDA's tanhf, which is
torch's, in the kernel), so its scores are equal, not just close.
"""
from __future__ import annotations

import torch

__all__ = ["routing_rank_order", "topk_softmax", "topk_sigmoid", "grouped_topk"]


def routing_rank_order(scores: torch.Tensor, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices that sort the last dim of `scores` in routing rank order: eligible before not
    eligible, numbers before NaN, higher first, lower index first among equals."""
    nan = torch.isnan(scores)
    key = torch.where(nan, torch.full_like(scores, float("-inf")), scores)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    cls = nan.to(torch.int8)
    if eligible is not None:
        cls = cls + 2 * (~eligible).to(torch.int8)
    # A stable sort by class keeps the value order inside each class.
    by_class = torch.sort(cls.gather(-1, order), dim=-1, stable=True).indices
    return order.gather(-1, by_class)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    # max ignores NaN; a row with NaN, +inf or only -inf becomes all NaN (inf - inf, NaN / NaN).
    row_max = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x).amax(
        dim=-1, keepdim=True)
    ex = torch.exp(x - row_max)
    return ex / ex.double().sum(dim=-1, keepdim=True).float()


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _grouped_sigmoid(x: torch.Tensor) -> torch.Tensor:
    # vLLM's form for grouped_topk; the op computes exactly this on either device.
    return 0.5 * torch.tanh(0.5 * x) + 0.5


def _zero_if_not_finite(p: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(p), p, torch.zeros_like(p))


def _topk_gating(probs, topk, renormalize, bias, scale, is_padding, indices_dtype):
    num_tokens = probs.shape[0]
    score = probs if bias is None else probs + bias.float()
    ids = routing_rank_order(score)[:, :topk]
    weights = probs.gather(1, ids)
    if renormalize:
        denom = weights.double().sum(dim=-1, keepdim=True).float()
        weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    if scale is not None:
        weights = weights * scale
    if is_padding is not None:
        pad = is_padding.bool()[:, None]
        ids = torch.where(pad, torch.full_like(ids, -1), ids)
        weights = torch.where(pad, torch.zeros_like(weights), weights)
    token_expert_indices = (torch.arange(topk, device=probs.device)[None, :] * num_tokens
                            + torch.arange(num_tokens, device=probs.device)[:, None])
    return (weights.float(), ids.to(indices_dtype),
            token_expert_indices.to(torch.int32))


def topk_softmax(gating_output: torch.Tensor, topk: int, renormalize: bool = False,
                 bias: torch.Tensor | None = None, is_padding: torch.Tensor | None = None,
                 indices_dtype: torch.dtype = torch.int32):
    """Returns (topk_weights f32 [T,K], topk_indices [T,K], token_expert_indices int32 [T,K])."""
    probs = _zero_if_not_finite(_softmax(gating_output.float()))
    return _topk_gating(probs, topk, renormalize, bias, None, is_padding, indices_dtype)


def topk_sigmoid(gating_output: torch.Tensor, topk: int, renormalize: bool = False,
                 bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                 is_padding: torch.Tensor | None = None,
                 indices_dtype: torch.dtype = torch.int32):
    """Returns (topk_weights f32 [T,K], topk_indices [T,K], token_expert_indices int32 [T,K])."""
    probs = _zero_if_not_finite(_sigmoid(gating_output.float()))
    scale = torch.tensor(routed_scaling_factor, dtype=torch.float32)
    return _topk_gating(probs, topk, renormalize, bias, scale, is_padding, indices_dtype)


def grouped_topk(scores: torch.Tensor, n_group: int, topk_group: int, topk: int,
                 renormalize: bool, routed_scaling_factor: float, bias: torch.Tensor,
                 scoring_func: int = 0):
    """Returns (weights f32 [T,topk], ids int32 [T,topk])."""
    num_tokens, num_experts = scores.shape
    group_size = num_experts // n_group
    x = scores.float()
    s = _grouped_sigmoid(x) if scoring_func == 1 else x
    sb = s + bias.float()
    valid = torch.isfinite(x) & torch.isfinite(bias.float())[None, :] & torch.isfinite(sb)
    s = torch.where(valid, s, torch.zeros_like(s))
    sb = torch.where(valid, sb, torch.full_like(sb, float("-inf")))
    grouped = sb.view(num_tokens, n_group, group_size)
    top2 = grouped.gather(-1, routing_rank_order(grouped)[..., : min(2, group_size)])
    group_score = top2[..., 0] if group_size == 1 else top2[..., 0] + top2[..., 1]
    kept_groups = routing_rank_order(group_score)[:, :topk_group]
    kept = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores.device)
    kept.scatter_(1, kept_groups, True)
    eligible = kept.repeat_interleave(group_size, dim=1)
    ids = routing_rank_order(sb, eligible)[:, :topk]
    weights = s.gather(1, ids)
    scale = torch.tensor(routed_scaling_factor, dtype=torch.float32)
    if renormalize:
        denom = weights.double().sum(dim=-1, keepdim=True).float() + 1e-20
        weights = weights / denom * scale
    else:
        weights = weights * scale
    none_valid = ~valid.gather(1, ids).any(dim=-1, keepdim=True)
    uniform = torch.full_like(weights, 1.0 / topk if renormalize else 0.0)
    weights = torch.where(none_valid, uniform, weights)
    return weights.float(), ids.to(torch.int32)
