"""fp32 references of the permutation family: moe_align_block_size, moe_permute, moe_unpermute,
shuffle_rows (same semantics as vLLM's ops; the CPU and CUDA ops equal these bit for bit).

Common rule: the flat slot i = t * topk + k of topk_ids counts only when its id is in
[0, num_experts) and, with an expert map, maps to a local expert (expert_map[id] >= 0);
other slots are skipped. Inside one expert, slots keep ascending slot order.
"""
from __future__ import annotations

import torch

__all__ = [
    "moe_align_block_size",
    "moe_align_block_size_len",
    "moe_permute",
    "moe_unpermute",
    "shuffle_rows",
]


def moe_align_block_size_len(numel: int, num_experts: int, block_size: int) -> int:
    """Smallest sorted_token_ids length the op accepts (vLLM's bound, small-batch cap included):
    numel + min(numel, num_experts) * (block_size - 1)."""
    return numel + min(numel, num_experts) * (block_size - 1)


def _local_expert(topk_ids: torch.Tensor, num_experts: int,
                  expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert of every flat slot (int64), -1 where the slot is skipped."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    in_range = (ids >= 0) & (ids < num_experts)
    local = torch.where(in_range, ids, torch.full_like(ids, -1))
    if expert_map is not None:
        mapped = expert_map.to(torch.int64)[local.clamp(min=0)]
        local = torch.where(in_range, mapped, local)
    return torch.where((local >= 0) & (local < num_experts), local, torch.full_like(local, -1))


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                         expert_map: torch.Tensor | None = None,
                         sorted_len: int | None = None, num_blocks: int | None = None):
    """Sort the flat slots by (local) expert into segments padded to block_size.

    Returns (sorted_token_ids int32 [sorted_len], experts_ids int32 [num_blocks],
    num_tokens_post_pad int32 [1], scatter_idx int32 [numel]):
    - expert e (in increasing order) owns positions [seg[e], seg[e+1]) of sorted_token_ids,
      its slot count rounded up to block_size; its slots fill the segment in ascending order,
      padding positions and the tail after the last segment hold numel;
    - experts_ids[b] = the local expert of block b, -1 for blocks at or past the padded total;
    - num_tokens_post_pad = the padded total;
    - scatter_idx[i] = i for a placed slot, -1 for a skipped one (vLLM's masked identity of
      the routed rows; a placed slot's position is where sorted_token_ids holds i).
    Skipped slots: id outside [0, num_experts), or expert_map[id] outside [0, num_experts)
    (-1 marks a non-local expert; vLLM filters them the same way).
    """
    numel = topk_ids.numel()
    if sorted_len is None:
        sorted_len = moe_align_block_size_len(numel, num_experts, block_size)
    if num_blocks is None:
        num_blocks = (sorted_len + block_size - 1) // block_size
    local = _local_expert(topk_ids, num_experts, expert_map)

    sorted_token_ids = torch.full((sorted_len,), numel, dtype=torch.int32)
    experts_ids = torch.full((num_blocks,), -1, dtype=torch.int32)
    scatter_idx = torch.full((numel,), -1, dtype=torch.int32)
    start = 0
    for e in range(num_experts):
        slots = torch.nonzero(local == e).flatten()  # ascending slot order
        n = slots.numel()
        if n == 0:
            continue
        positions = torch.arange(start, start + n)
        sorted_token_ids[positions] = slots.to(torch.int32)
        scatter_idx[slots] = slots.to(torch.int32)
        padded = (n + block_size - 1) // block_size * block_size
        experts_ids[start // block_size:(start + padded) // block_size] = e
        start += padded
    num_tokens_post_pad = torch.tensor([start], dtype=torch.int32)
    return sorted_token_ids, experts_ids, num_tokens_post_pad, scatter_idx


def moe_permute(input: torch.Tensor, topk_ids: torch.Tensor, token_expert_indices: torch.Tensor,
                expert_map: torch.Tensor | None, n_expert: int, n_local_expert: int, topk: int,
                permuted_idx_len: int | None = None):
    """Group the rows of input [T, H] by local expert (stable: ascending slot order).

    Every slot gets a destination row r: first the slots of local experts (expert 0, 1, ...),
    then the slots whose id is in [0, n_expert) but not local, ordered by global id (as vLLM
    sorts them by id + n_expert), then the slots with ids outside [0, n_expert). Slot i
    carries v = token_expert_indices[i] (callers pass arange(T*topk), so v == i).

    Returns (permuted_input [num_valid, H], expert_first_token_offset int64 [n_local+1],
    inv_permuted_idx int32 [T, topk], permuted_idx int32 [permuted_idx_len]):
    - num_valid = expert_first_token_offset[n_local] = the number of local slots;
      permuted_input row r < num_valid = input[v / topk] (zeros if v is outside [0, T*topk));
      the op leaves its rows >= num_valid untouched, so they are not returned here;
    - inv_permuted_idx.flatten()[v] = r for every slot (also the skipped ones: r >= num_valid);
    - permuted_idx[r] = v for r < num_valid, T*topk (a sentinel) for every later entry.
    """
    num_tokens = input.shape[0]
    slots = num_tokens * topk
    if permuted_idx_len is None:
        permuted_idx_len = slots
    ids = topk_ids.reshape(-1).to(torch.int64)
    in_range = (ids >= 0) & (ids < n_expert)
    local = ids.clone()
    if expert_map is not None:
        local = torch.where(in_range, expert_map.to(torch.int64)[ids.clamp(0, n_expert - 1)],
                            ids)
    is_local = in_range & (local >= 0) & (local < n_local_expert)
    key = torch.where(is_local, local,
                      torch.where(in_range, n_local_expert + ids,
                                  torch.full_like(ids, n_local_expert + n_expert)))
    order = torch.sort(key, stable=True).indices  # destination row -> slot
    num_valid = int(is_local.sum())

    v = token_expert_indices.reshape(-1).to(torch.int64)[order]  # source of each row
    permuted_idx = torch.full((permuted_idx_len,), slots, dtype=torch.int32)
    permuted_idx[:num_valid] = v[:num_valid].to(torch.int32)
    inv = torch.empty(slots, dtype=torch.int32)
    ok = (v >= 0) & (v < slots)
    inv[v[ok]] = torch.arange(slots, dtype=torch.int32)[ok]

    offsets = torch.zeros(n_local_expert + 1, dtype=torch.int64)
    for e in range(n_local_expert):
        offsets[e + 1] = offsets[e] + int((key == e).sum())

    rows = v[:num_valid]
    permuted_input = _gather_rows(input, torch.where((rows >= 0) & (rows < slots),
                                                     rows // topk, torch.full_like(rows, -1)))
    return permuted_input, offsets, inv.view(num_tokens, topk), permuted_idx


def moe_unpermute(permuted_hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  inv_permuted_idx: torch.Tensor,
                  expert_first_token_offset: torch.Tensor | None, topk: int) -> torch.Tensor:
    """hidden_states[t] = sum over k = 0..topk-1 of topk_weights[t,k] *
    permuted_hidden_states[inv_permuted_idx[t,k]], in fp32 (each product and each sum rounded
    to fp32 in that order), returned in permuted_hidden_states' dtype. A slot whose row is
    outside [0, rows) contributes nothing; rows = the number of permuted rows, capped by
    expert_first_token_offset[-1] (the valid count) when the offsets are given."""
    num_tokens = topk_weights.shape[0]
    rows = permuted_hidden_states.shape[0]
    if expert_first_token_offset is not None:
        rows = min(rows, int(expert_first_token_offset[-1]))
    x = permuted_hidden_states.float()
    w = topk_weights.float()
    inv = inv_permuted_idx.reshape(num_tokens, topk).to(torch.int64)
    acc = torch.zeros((num_tokens, permuted_hidden_states.shape[1]), dtype=torch.float32)
    for k in range(topk):
        r = inv[:, k]
        ok = (r >= 0) & (r < rows)
        term = torch.zeros_like(acc)
        term[ok] = w[ok, k:k + 1] * x[r[ok]]
        acc = torch.where(ok[:, None], acc + term, acc)
    return acc.to(permuted_hidden_states.dtype)


def shuffle_rows(input_tensor: torch.Tensor, dst2src_map: torch.Tensor) -> torch.Tensor:
    """output[i] = input_tensor[dst2src_map[i]]; an index outside [0, rows) gives zeros."""
    return _gather_rows(input_tensor, dst2src_map.to(torch.int64))


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[j] = x[index[j]], zeros where index[j] is outside [0, rows). Works on the bytes of
    the rows, so every dtype (FP8 included) is copied exactly."""
    raw = x.contiguous().view(torch.uint8)  # [rows, H * element_size]
    ok = (index >= 0) & (index < x.shape[0])
    out = torch.zeros((index.numel(), raw.shape[1]), dtype=torch.uint8)
    out[ok] = raw[index[ok]]
    return out.view(x.dtype)
