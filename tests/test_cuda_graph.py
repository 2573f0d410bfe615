"""CUDA graph capture of a whole MoE layer's worth of hopper_moe ops.

topk_softmax -> moe_align_block_size -> moe_permute -> silu_and_mul ->
dynamic_per_token_scaled_fp8_quant -> (dequantize) -> moe_unpermute -> moe_sum are captured
once into one torch.cuda.CUDAGraph on static buffers, then replayed with new router logits
(different per-expert counts each time, one replay with every token's first choice on a single
expert, one with all-equal logits) and new hidden data. After every replay each output equals
an eager run of the same ops on fresh poisoned buffers, bit for bit. A host sync inside any op
would make the capture itself fail.
"""
from __future__ import annotations

import pytest
import torch
from conftest import gpu, poison, seeded

OPS = torch.ops.hopper_moe
FP8 = torch.float8_e4m3fn

T, E, H = 96, 32, 256  # H = 2 * intermediate (gate || up)
BLOCK_SIZE = 16


def _buffers(topk, n_local, dtype):
    """Every op output, allocated once (graph-static) and poisoned."""
    dev = dict(device="cuda")
    i32 = dict(dtype=torch.int32, **dev)
    slots = T * topk
    sorted_len = slots + min(slots, E) * (BLOCK_SIZE - 1)
    b = dict(
        weights=torch.empty((T, topk), dtype=torch.float32, **dev),
        ids=torch.empty((T, topk), **i32),
        token_expert_indices=torch.empty((T, topk), **i32),
        sorted_token_ids=torch.empty((sorted_len,), **i32),
        experts_ids=torch.empty(((sorted_len + BLOCK_SIZE - 1) // BLOCK_SIZE,), **i32),
        num_tokens_post_pad=torch.empty((1,), **i32),
        permuted=torch.empty((slots, H), dtype=dtype, **dev),
        expert_first_token_offset=torch.empty((n_local + 1,), dtype=torch.int64, **dev),
        inv_permuted_idx=torch.empty((T, topk), **i32),
        permuted_idx=torch.empty((slots,), **i32),
        act=torch.empty((slots, H // 2), dtype=dtype, **dev),
        act_q=torch.empty((slots, H // 2), dtype=FP8, **dev),
        act_scale=torch.empty((slots, 1), dtype=torch.float32, **dev),
        unpermuted=torch.empty((T, H // 2), dtype=dtype, **dev),
        summed=torch.empty((T, H // 2), dtype=dtype, **dev),
    )
    for v in b.values():
        poison(v)
    b["permuted"].zero_()  # rows past the local slots are never written: keep them finite
    return b


def _layer(logits, hidden, expert_map, topk, n_local, b):
    """The op sequence under test, writing into the buffers b (plus two glue tensors it
    returns: the dequantized activations and their [T, K, d] gather)."""
    OPS.topk_softmax(b["weights"], b["ids"], b["token_expert_indices"], logits, True, None, None)
    OPS.moe_align_block_size(b["ids"], E, BLOCK_SIZE, b["sorted_token_ids"], b["experts_ids"],
                             b["num_tokens_post_pad"], expert_map, None)
    slot_ids = torch.arange(T * topk, dtype=torch.int32, device="cuda").view(T, topk)
    OPS.moe_permute(hidden, b["ids"], slot_ids, expert_map, E, n_local, topk, b["permuted"],
                    b["expert_first_token_offset"], b["inv_permuted_idx"], b["permuted_idx"])
    OPS.silu_and_mul(b["act"], b["permuted"])
    OPS.dynamic_per_token_scaled_fp8_quant(b["act_q"], b["act"], b["act_scale"], None)
    deq = (b["act_q"].float() * b["act_scale"]).to(hidden.dtype)
    OPS.moe_unpermute(deq, b["weights"], b["inv_permuted_idx"], b["expert_first_token_offset"],
                      topk, b["unpermuted"])
    gathered = deq[b["inv_permuted_idx"].long().view(-1)].view(T, topk, H // 2)
    OPS.moe_sum(gathered, b["summed"], b["ids"], expert_map)
    return deq, gathered


def _new_logits(i, gen, hot):
    logits = torch.randn((T, E), generator=gen) * (1 + i)
    if i == 2:  # every token's first choice is expert `hot`
        logits[:, hot] = 50.0
    elif i == 3:  # all logits equal: ties go to the lowest experts
        logits.fill_(0.5)
    elif i == 4:  # skewed: a Zipf popularity
        logits -= 2.0 * torch.log(torch.randperm(E, generator=gen).float() + 1)
    return logits


def _compare(graph_b, eager_b, num_valid, what):
    # Rows past the local slots (and the gathered rows of non-local slots) are never written by
    # moe_permute: stale data in the graph's buffers, zeros in the eager ones, by design.
    local_slot = (eager_b["inv_permuted_idx"] < num_valid).view(-1)
    for name, v in eager_b.items():
        g = graph_b[name]
        if name in ("permuted", "act", "act_q", "act_scale", "deq"):
            g, v = g[:num_valid], v[:num_valid]
        elif name == "gathered":
            g, v = g.flatten(0, 1)[local_slot], v.flatten(0, 1)[local_slot]
        if g.dtype == FP8:
            g, v = g.view(torch.uint8), v.view(torch.uint8)
        torch.testing.assert_close(g, v, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what} {name}: {m}")


@gpu
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("use_map", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_capture_and_replay_moe_ops(topk, use_map, dtype):
    gen = seeded(topk * 10 + use_map)
    n_local = E // 2 if use_map else E
    expert_map, hot, hot_local = None, 5, 5
    if use_map:
        local = torch.randperm(E, generator=gen)[:n_local]
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[local] = torch.arange(n_local, dtype=torch.int32)
        expert_map = emap.cuda()
        hot, hot_local = int(local[3]), 3

    logits = _new_logits(0, gen, hot).cuda()  # static inputs
    hidden = torch.randn((T, H), generator=gen).to(dtype).cuda()
    b = _buffers(topk, n_local, dtype)

    side = torch.cuda.Stream()  # warm up outside the capture, as torch.cuda.graphs advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer(logits, hidden, expert_map, topk, n_local, b)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deq, gathered = _layer(logits, hidden, expert_map, topk, n_local, b)

    counts_seen = set()
    for i in range(6):
        logits.copy_(_new_logits(i, gen, hot))
        hidden.copy_(torch.randn((T, H), generator=gen).to(dtype))
        for name, v in b.items():
            if name != "permuted":
                poison(v)
        graph.replay()
        torch.cuda.synchronize()
        graph_out = {k: v.clone() for k, v in b.items()}
        graph_out.update(deq=deq.clone(), gathered=gathered.clone())

        eager = _buffers(topk, n_local, dtype)
        e_deq, e_gathered = _layer(logits, hidden, expert_map, topk, n_local, eager)
        torch.cuda.synchronize()
        eager.update(deq=e_deq, gathered=e_gathered)

        offsets = eager["expert_first_token_offset"].cpu()
        num_valid = int(offsets[-1])
        counts = tuple((offsets[1:] - offsets[:-1]).tolist())
        counts_seen.add(counts)
        what = f"replay {i} (topk={topk}, expert_map={use_map}, {dtype}, counts={counts})"
        _compare(graph_out, eager, num_valid, what)
        if i == 2:
            assert counts[hot_local] == T, what  # every token on one expert
        # The layer did real work whenever some slot is local (with an expert map, the
        # all-equal replay can route every slot to non-local experts: then all zeros).
        assert (graph_out["unpermuted"].float().abs().sum() > 0) == (num_valid > 0), what
        if num_valid == 0:
            assert not graph_out["unpermuted"].float().any(), what
        assert not torch.isnan(graph_out["summed"].float()).any(), what
    assert len(counts_seen) >= 5, "replays must change the per-expert counts"
