"""Layer-level findings of the input audit, pinned: ids an int32 cannot hold, expert_map
entries past the local experts, non-contiguous routing weights, a router whose width is not
the expert count. Each runs on the CPU (Triton under its interpreter) and on the GPU."""
from __future__ import annotations

import pytest
import torch

import hopper_moe
from hopper_moe import fused_experts, fused_moe, ops

from conftest import DEVICES, seeded


def _layer(dev, num_tokens=5, num_experts=6, topk=2, hidden=64, inter=64, seed=0):
    g = seeded(seed)
    x = (torch.randn(num_tokens, hidden, generator=g) / 4).to(dev, torch.bfloat16)
    w1 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 8).to(dev, torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / 8).to(dev, torch.bfloat16)
    weights = torch.rand(num_tokens, topk, generator=g).to(dev)
    return x, w1, w2, weights


@pytest.mark.parametrize("dev", DEVICES)
def test_int64_ids_past_int32_are_not_experts(dev):
    """moe_permute with int64 ids: 2^32 + e is no expert (skipped), not expert e."""
    x = torch.randn(3, 8, device=dev)
    ids = torch.tensor([[2**32, 1], [0, 3], [2**32 + 2, -(2**40)]], dtype=torch.int64,
                       device=dev)
    _, _, offsets, _, _ = ops.moe_permute(x, None, ids, 4, 4, None)
    placed = torch.tensor([[-1, 1], [0, 3], [-1, -1]], dtype=torch.int32, device=dev)
    _, _, want, _, _ = ops.moe_permute(x, None, placed, 4, 4, None)
    assert torch.equal(offsets.cpu(), want.cpu())
    assert offsets[-1].item() == 3


def _backends(dev):
    return [b for b in hopper_moe.api.available_backends(dev) if b != "reference"]


@pytest.mark.parametrize("dev", DEVICES)
def test_expert_map_entries_past_the_local_experts_are_non_local(dev):
    """expert_map maps global ids to local ones; an entry in [E_local, E_global) is no local
    expert, like -1, on every backend (the Triton kernels used to index the weights with it)."""
    x, w1, w2, weights = _layer(dev, num_experts=4)
    global_experts = 8
    g = seeded(5)
    ids = torch.randint(0, global_experts, (x.shape[0], 2), generator=g).to(dev, torch.int32)
    expert_map = torch.tensor([0, 5, 1, -1, 7, 2, 3, 4], dtype=torch.int32, device=dev)
    cleaned = torch.tensor([0, -1, 1, -1, -1, 2, 3, -1], dtype=torch.int32, device=dev)
    want = fused_experts(x, w1, w2, weights, ids, global_num_experts=global_experts,
                         expert_map=cleaned, backend="reference")
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, weights, ids, global_num_experts=global_experts,
                            expert_map=expert_map, backend=backend)
        assert torch.isfinite(got).all(), backend
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("dev", DEVICES)
def test_non_contiguous_topk_weights(dev):
    """topk_weights as a strided view give the contiguous copy's result on every backend."""
    x, w1, w2, weights = _layer(dev)
    strided = torch.stack([weights, torch.full_like(weights, 9.0)], dim=-1)[..., 0]
    assert not strided.is_contiguous()
    g = seeded(9)
    ids = torch.randint(0, w1.shape[0], (x.shape[0], 2), generator=g).to(dev, torch.int32)
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, strided, ids, backend=backend)
        want = fused_experts(x, w1, w2, strided.contiguous(), ids, backend=backend)
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("width", [5, 7])
def test_fused_moe_router_width_must_be_the_expert_count(width):
    x, w1, w2, _ = _layer("cpu")
    logits = torch.randn(x.shape[0], width)
    with pytest.raises(RuntimeError, match=r"gating_output.size\(1\) must be the number of "
                                           r"experts \(w1.size\(0\) = 6\)"):
        fused_moe(x, w1, w2, logits, 2, True, backend="torch")
    with pytest.raises(RuntimeError, match=r"\(global_num_experts = 8\)"):
        fused_moe(x, w1, w2, logits, 2, True, global_num_experts=8,
                  expert_map=torch.arange(8, dtype=torch.int32) % 6, backend="torch")
