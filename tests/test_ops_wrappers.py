"""hopper_moe.ops: the vllm._custom_ops-style wrappers allocate what vLLM's do and return
the op's results (checked against hopper_moe.reference on every device)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, seeded

import hopper_moe
from hopper_moe import ops, reference

FP8 = torch.float8_e4m3fn


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_fp8_quant_modes(device):
    x = torch.randn(37, 96, generator=seeded(0)).to(torch.bfloat16).to(device)
    q, s = ops.scaled_fp8_quant(x)
    rq, rs = reference.dynamic_scaled_fp8_quant_ref(x.cpu())
    assert s.shape == (1,) and torch.equal(s.cpu(), rs.reshape(1))
    assert torch.equal(_bits(q.cpu()), _bits(rq))

    q, s = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    rq, rs = reference.dynamic_per_token_scaled_fp8_quant_ref(x.cpu())
    assert s.shape == (37, 1) and torch.equal(s.cpu(), rs)
    assert torch.equal(_bits(q.cpu()), _bits(rq))

    scale = torch.tensor([0.01], device=device)
    q, s = ops.scaled_fp8_quant(x, scale)
    assert s is scale
    assert torch.equal(_bits(q.cpu()), _bits(reference.static_scaled_fp8_quant_ref(x.cpu(),
                                                                                   scale.cpu())))


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_fp8_quant_token_padding(device):
    x = torch.randn(5, 64, generator=seeded(1)).to(device)
    q, s = ops.scaled_fp8_quant(x, num_token_padding=8, use_per_token_if_dynamic=True)
    assert q.shape == (8, 64) and s.shape == (8, 1)
    assert torch.equal(q[5:].view(torch.uint8).cpu(), torch.zeros(3, 64, dtype=torch.uint8))
    assert torch.equal(s[5:].cpu(), torch.ones(3, 1))
    rq, rs = reference.dynamic_per_token_scaled_fp8_quant_ref(x.cpu())
    assert torch.equal(_bits(q[:5].cpu()), _bits(rq)) and torch.equal(s[:5].cpu(), rs)


def test_scaled_fp8_quant_rejects_non_2d():
    with pytest.raises(RuntimeError, match="input must be 2-D"):
        ops.scaled_fp8_quant(torch.randn(2, 3, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("shape", [(7, 256), (2, 3, 384)])
def test_per_token_group_quant_fp8(device, column_major, shape):
    x = torch.randn(*shape, generator=seeded(2)).to(device)
    q, s = ops.per_token_group_quant_fp8(x, 128, column_major_scales=column_major)
    rq, rs = reference.per_token_group_fp8_quant_ref(x.cpu(), 128)
    assert s.shape == shape[:-1] + (shape[-1] // 128,)
    if column_major:
        assert s.stride(-1) == s[..., 0].numel()  # the group index is outermost in memory
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(_bits(q.cpu()), _bits(rq))


@pytest.mark.parametrize("device", DEVICES)
def test_moe_permute_unpermute_round_trip(device):
    T, K, E, H = 11, 3, 6, 40
    x = torch.randn(T, H, generator=seeded(3)).to(device)
    ids = torch.randint(0, E, (T, K), generator=seeded(4), dtype=torch.int32).to(device)
    w = torch.rand(T, K, generator=seeded(5)).to(device)
    perm, _, offs, inv, pidx = ops.moe_permute(x, None, ids, E)
    assert perm.shape == (T * K, H) and offs.shape == (E + 1,) and offs.dtype == torch.int64
    assert int(offs[-1]) == T * K
    # every row of the permuted input is the input row of its slot
    assert torch.equal(perm.cpu(), x.cpu()[pidx.long().cpu() // K])
    out = torch.empty(T, H, device=device)
    ops.moe_unpermute(out, perm, w, inv, offs)
    expected = (x.cpu().unsqueeze(1) * w.cpu().unsqueeze(2)).sum(1)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def _assert_permute_matches_reference(x, ids, E, perm, offs, inv, pidx):
    """ops.moe_permute's outputs equal hopper_moe.reference's (every slot of a local expert)."""
    T, K = ids.shape
    slots = torch.arange(T * K, dtype=torch.int32).view(T, K)
    e_perm, e_offs, e_inv, e_pidx = reference.moe_permute(x.cpu(), ids.cpu(), slots, None, E, E, K)
    assert torch.equal(offs.cpu(), e_offs) and torch.equal(pidx.cpu(), e_pidx)
    assert torch.equal(inv.cpu(), e_inv.flatten()) and torch.equal(perm.cpu(), e_perm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_moe_permute_slot_indices_cache_and_graph_capture():
    # The wrapper's slot indices are a cached arange on CUDA: row counts past its capacity make
    # it grow eagerly, and inside a graph capture (no growth there) a plain arange is captured.
    # Every call must equal the reference, with poisoned outputs, eager and replayed.
    E, H, dev = 7, 24, torch.device("cuda")
    for T, K in ((3, 2), (700, 8), (5000, 2)):  # 6 slots, then 5600 and 10000 (growth)
        x = torch.randn(T, H, generator=seeded(T)).to(dev)
        ids = torch.randint(0, E, (T, K), generator=seeded(T + 1), dtype=torch.int32).to(dev)
        perm_x = torch.full((T * K, H), float("nan"), device=dev)
        perm, _, offs, inv, pidx = ops.moe_permute(x, None, ids, E, permuted_hidden_states=perm_x)
        _assert_permute_matches_reference(x, ids, E, perm, offs, inv, pidx)
    T, K = 9000, 4  # more slots than the cache holds: captured as an arange of its own
    x = torch.randn(T, H, generator=seeded(9)).to(dev)
    ids = torch.randint(0, E, (T, K), generator=seeded(10), dtype=torch.int32).to(dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin()
        perm, _, offs, inv, pidx = ops.moe_permute(x, None, ids, E)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    for t in (perm, offs, inv, pidx):
        t.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    _assert_permute_matches_reference(x, ids, E, perm, offs, inv, pidx)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_permute_permutes_per_token_scales(device):
    T, K, E = 4, 2, 3
    x = torch.randn(T, 16, device=device)
    scales = torch.arange(T, dtype=torch.float32, device=device).view(T, 1)
    ids = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]], dtype=torch.int32, device=device)
    _, s, _, _, pidx = ops.moe_permute(x, scales, ids, E)
    assert torch.equal(s.view(-1).cpu(), (pidx.long() // K).float().cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_shuffle_rows_and_align_buffers(device):
    x = torch.randn(6, 24, device=device)
    m = torch.tensor([5, 0, 0, 3], dtype=torch.int32, device=device)
    assert torch.equal(ops.shuffle_rows(x, m).cpu(), x.cpu()[m.long().cpu()])

    ids = torch.randint(0, 8, (5, 2), generator=seeded(6), dtype=torch.int32).to(device)
    sorted_ids, expert_ids, ntp = ops.moe_align_block_size_buffers(ids, 8, 16)
    assert sorted_ids.numel() == reference.moe_align_block_size_len(10, 8, 16)
    assert expert_ids.numel() == -(-sorted_ids.numel() // 16) and ntp.shape == (1,)
    ops.moe_align_block_size(ids, 8, 16, sorted_ids, expert_ids, ntp)
    r_sorted, r_experts, r_ntp = reference.moe_align_block_size(ids.cpu(), 8, 16)[:3]
    assert int(ntp) == int(r_ntp)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_wrappers_allocate(device):
    x = torch.randn(3, 2, 64, generator=seeded(7)).to(torch.bfloat16).to(device)
    out = ops.silu_and_mul(None, x)
    assert out.shape == (3, 2, 32) and out.dtype == torch.bfloat16
    # The reference on the op's device: CPU and CUDA exp may differ by an ulp.
    assert torch.equal(out, reference.silu_and_mul_ref(x))
    scale = torch.tensor([0.02], device=device)
    q = ops.silu_and_mul_quant(None, x, scale)
    assert q.dtype == FP8 and q.shape == (3, 2, 32)
    assert torch.equal(_bits(q), _bits(reference.silu_and_mul_quant_ref(x, scale)))


def test_cutlass_group_gemm_supported_wrapper():
    assert ops.cutlass_group_gemm_supported(90) is hopper_moe.built_with_cuda()
    assert ops.cutlass_group_gemm_supported(89) is False
