"""Grouped-GEMM metadata: get_cutlass_moe_mm_data,
get_cutlass_moe_mm_problem_sizes_from_expert_offsets and cutlass_group_gemm_supported.
CPU op vs reference (exact), CUDA op vs CPU op (exact), structural invariants, edge cases,
input validation and opcheck."""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, gpu, poison, seeded

import hopper_moe
from hopper_moe import reference as ref

DATA = torch.ops.hopper_moe.get_cutlass_moe_mm_data
SIZES = torch.ops.hopper_moe.get_cutlass_moe_mm_problem_sizes_from_expert_offsets
SUPPORTED = torch.ops.hopper_moe.cutlass_group_gemm_supported


def _outputs(num_slots, num_experts, device="cpu", offsets_dtype=torch.int32):
    f = dict(device=device)
    return [poison(torch.empty((num_experts + 1,), dtype=offsets_dtype, **f)),
            poison(torch.empty((num_experts, 3), dtype=torch.int32, **f)),
            poison(torch.empty((num_experts, 3), dtype=torch.int32, **f)),
            poison(torch.empty((num_slots,), dtype=torch.int32, **f)),
            poison(torch.empty((num_slots,), dtype=torch.int32, **f))]


def run_data(topk_ids, num_experts, n, k, is_gated=True, device="cpu",
             offsets_dtype=torch.int32):
    """Run the op on poisoned outputs; returns (expert_offsets, ps1, ps2, in_perm, out_perm)."""
    outs = _outputs(topk_ids.numel(), num_experts, device, offsets_dtype)
    DATA(topk_ids.to(device), *outs, num_experts, n, k, None, is_gated)
    return [o.cpu() for o in outs]


def random_ids(num_tokens, top_k, num_experts, gen, *, invalid=0.1, skew=False,
               dtype=torch.int32):
    """[T, K] ids, distinct per row when possible, with a fraction of invalid ids (-1, other
    negatives, >= num_experts)."""
    if skew:
        w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    else:
        w = torch.ones(num_experts, dtype=torch.float64)
    if num_tokens == 0:
        return torch.empty((0, top_k), dtype=dtype)
    ids = torch.multinomial(w.expand(num_tokens, -1), top_k,
                            replacement=top_k > num_experts, generator=gen)
    bad = torch.rand((num_tokens, top_k), generator=gen) < invalid
    junk = torch.randint(-3, 3, (num_tokens, top_k), generator=gen)
    junk = torch.where(junk >= 0, junk + num_experts, junk)  # -3..-1 or E..E+2
    return torch.where(bad, junk, ids).to(dtype)


def check_invariants(topk_ids, num_experts, n, k, is_gated, outs):
    """What the grouped GEMMs rely on, independent of the reference implementation."""
    offsets, ps1, ps2, in_perm, out_perm = (o.long() for o in outs)
    ids = topk_ids.reshape(-1).long()
    top_k = topk_ids.shape[1]
    valid = (ids >= 0) & (ids < num_experts)
    total = int(valid.sum())
    assert offsets[0] == 0 and offsets[-1] == total
    assert (offsets[1:] >= offsets[:-1]).all()
    m = offsets[1:] - offsets[:-1]
    assert torch.equal(m, torch.bincount(ids[valid], minlength=num_experts))
    n1 = 2 * n if is_gated else n
    if topk_ids.numel() <= 64:
        assert torch.equal(ps1, torch.stack([torch.full_like(m, n1), m, torch.full_like(m, k)], 1))
        assert torch.equal(ps2, torch.stack([torch.full_like(m, k), m, torch.full_like(m, n)], 1))
    else:
        assert torch.equal(ps1, torch.stack([m, torch.full_like(m, n1), torch.full_like(m, k)], 1))
        assert torch.equal(ps2, torch.stack([m, torch.full_like(m, k), torch.full_like(m, n)], 1))
    slots = torch.nonzero(valid).flatten()
    rows = out_perm[slots]
    # Every counting slot gets a distinct row inside its expert's range, in slot order.
    assert torch.equal(torch.sort(rows).values, torch.arange(total))
    assert ((rows >= offsets[ids[slots]]) & (rows < offsets[ids[slots] + 1])).all()
    assert torch.equal(in_perm[rows], slots // max(top_k, 1))
    # Grouped by expert and, within an expert, in slot order: a stable sort by expert.
    by_expert = torch.sort(ids[slots], stable=True).indices
    assert torch.equal(rows[by_expert], torch.arange(total))
    assert (out_perm[~valid] == total).all()
    assert (in_perm[total:] == -1).all()  # no row: shuffle_rows writes zeros there


CASES = [  # (T, K, E)
    (0, 2, 4), (1, 1, 1), (1, 2, 8), (3, 2, 4), (8, 8, 8), (16, 4, 16),  # <= 64 slots: swapped
    (13, 5, 64), (33, 2, 8),  # 65, 66 slots: not swapped
    (100, 6, 128), (257, 8, 256), (64, 1, 3), (50, 10, 300), (7, 3, 1024), (2000, 8, 160),
]


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("is_gated", [True, False])
def test_cpu_matches_reference(id_dtype, is_gated):
    gen = seeded(1)
    for (t, kk, e), skew in ((c, s) for c in CASES for s in (False, True)):
        ids = random_ids(t, kk, e, gen, skew=skew, dtype=id_dtype)
        n, k = 96, 160
        for offsets_dtype in (torch.int32, torch.int64):
            got = run_data(ids, e, n, k, is_gated, offsets_dtype=offsets_dtype)
            want = ref.get_cutlass_moe_mm_data(ids, e, n, k, is_gated, offsets_dtype=offsets_dtype)
            what = f"T={t} K={kk} E={e} skew={skew} {id_dtype} gated={is_gated} {offsets_dtype}"
            for g, w, name in zip(got, want, ["offsets", "ps1", "ps2", "in_perm", "out_perm"]):
                assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {what}"
            check_invariants(ids, e, n, k, is_gated, got)


def test_swap_threshold_is_64_slots():
    ids64 = torch.arange(64, dtype=torch.int32).reshape(16, 4) % 5
    ids65 = torch.arange(65, dtype=torch.int32).reshape(13, 5) % 5
    _, ps1, ps2, _, _ = run_data(ids64, 5, 7, 11)
    assert ps1[:, 0].eq(14).all() and ps1[:, 2].eq(11).all() and ps2[:, 0].eq(11).all()
    assert ps2[:, 2].eq(7).all() and torch.equal(ps1[:, 1], torch.tensor([13, 13, 13, 13, 12],
                                                                          dtype=torch.int32))
    _, ps1, ps2, _, _ = run_data(ids65, 5, 7, 11)
    assert torch.equal(ps1[:, 0], torch.full((5,), 13, dtype=torch.int32))
    assert ps1[:, 1].eq(14).all() and ps2[:, 1].eq(11).all() and ps2[:, 2].eq(7).all()


def test_worked_example():
    ids = torch.tensor([[0, 2], [1, -1], [2, 0], [5, 2]], dtype=torch.int32)
    offsets, ps1, ps2, in_perm, out_perm = run_data(ids, 3, 8, 16)
    assert offsets.tolist() == [0, 2, 3, 6]
    # expert 0: slots 0, 5 (tokens 0, 2); expert 1: slot 2 (token 1); expert 2: slots 1, 4, 7.
    assert in_perm.tolist() == [0, 2, 1, 0, 2, 3, -1, -1]
    assert out_perm.tolist() == [0, 3, 2, 6, 4, 1, 6, 5]
    assert ps1.tolist() == [[16, 2, 16], [16, 1, 16], [16, 3, 16]]  # 8 slots: swapped
    assert ps2.tolist() == [[16, 2, 8], [16, 1, 8], [16, 3, 8]]


def test_edge_cases():
    # No tokens: offsets and problem sizes are still written.
    offsets, ps1, ps2, in_perm, out_perm = run_data(torch.empty((0, 4), dtype=torch.int32),
                                                    6, 8, 16)
    assert offsets.eq(0).all() and ps1[:, 1].eq(0).all() and ps1[:, 0].eq(16).all()
    assert in_perm.numel() == 0 and out_perm.numel() == 0
    # All slots on one expert, and all slots invalid.
    for ids in [torch.full((40, 4), 3, dtype=torch.int32), torch.full((40, 4), -1, dtype=torch.int32),
                torch.full((5, 2), 7, dtype=torch.int64)]:
        outs = run_data(ids, 7, 8, 16)
        check_invariants(ids, 7, 8, 16, True, outs)
        for g, w in zip(outs, ref.get_cutlass_moe_mm_data(ids, 7, 8, 16)):
            assert torch.equal(g, w)


def test_permutations_drive_a_grouped_matmul():
    # The use the grouped GEMM makes of the metadata: gather rows with input_permutation, run
    # one matmul per expert over rows [offset[e], offset[e+1]), scatter back with
    # output_permutation (a zero row appended at index total) and sum over top-k.
    gen = seeded(5)
    t, kk, e, h, n = 37, 3, 6, 16, 8
    ids = random_ids(t, kk, e, gen, invalid=0.2)
    x = torch.randn((t, h), generator=gen, dtype=torch.float64)
    w = torch.randn((e, n, h), generator=gen, dtype=torch.float64)
    offsets, _, _, in_perm, out_perm = run_data(ids, e, n, h, is_gated=False)
    a = x[in_perm.long()]
    c = torch.zeros((t * kk + 1, n), dtype=torch.float64)
    for j in range(e):
        lo, hi = int(offsets[j]), int(offsets[j + 1])
        c[lo:hi] = a[lo:hi] @ w[j].T
    total = int(offsets[-1])
    c[total] = 0.0
    y = c[out_perm.long()].view(t, kk, n).sum(1)
    expected = torch.zeros((t, n), dtype=torch.float64)
    for tok in range(t):
        for s in range(kk):
            eid = int(ids[tok, s])
            if 0 <= eid < e:
                expected[tok] += w[eid] @ x[tok]
    torch.testing.assert_close(y, expected)


def run_data_blockscale(topk_ids, num_experts, n, k, device="cpu"):
    outs = _outputs(topk_ids.numel(), num_experts, device)
    b = poison(torch.empty((num_experts + 1,), dtype=torch.int32, device=device))
    DATA(topk_ids.to(device), *outs, num_experts, n, k, b, True)
    return [o.cpu() for o in outs], b.cpu()


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(2, 2, 2), (5, 3, 4), (300, 4, 8),
                                                          (0, 2, 3)])
def test_blockscale_offsets(num_tokens, top_k, num_experts):
    """vLLM's FP4 layout: blockscale_offsets = prefix sums of the row counts rounded up to
    128, no swap-AB even for <= 64 slots; everything else as without it."""
    ids = random_ids(num_tokens, top_k, num_experts, seeded(num_tokens + num_experts))
    outs, b = run_data_blockscale(ids, num_experts, 8, 16)
    plain = run_data(ids, num_experts, 8, 16)
    counts = (plain[0][1:] - plain[0][:-1]).long()
    want = torch.cat([torch.zeros(1, dtype=torch.long), ((counts + 127) // 128 * 128).cumsum(0)])
    assert b.tolist() == want.tolist()
    assert torch.equal(outs[0], plain[0]) and torch.equal(outs[3], plain[3])
    assert torch.equal(outs[4], plain[4])
    assert outs[1][:, 0].tolist() == counts.tolist()  # (m, 2n, k): never swapped
    assert outs[1][:, 1].eq(16).all() and outs[2][:, 1].eq(16).all()


# ------------------------------------------------- problem sizes from expert offsets
def run_sizes(offsets, n, k, swap_ab, device="cpu"):
    e = offsets.numel() - 1
    ps1 = poison(torch.empty((e, 3), dtype=torch.int32, device=device))
    ps2 = poison(torch.empty((e, 3), dtype=torch.int32, device=device))
    SIZES(offsets.to(device), ps1, ps2, n, k, swap_ab)
    return ps1.cpu(), ps2.cpu()


def random_offsets(e, gen, garbage=False):
    counts = torch.randint(0, 50, (e,), generator=gen)
    counts[torch.rand(e, generator=gen) < 0.3] = 0
    off = torch.zeros(e + 1, dtype=torch.int64)
    off[1:] = torch.cumsum(counts, 0)
    if garbage:  # unordered offsets: negative differences clamp to 0, huge ones to 2^31 - 1
        off = torch.randint(-2**40, 2**40, (e + 1,), generator=gen)
    return off


@pytest.mark.parametrize("swap_ab", [False, True])
def test_sizes_from_offsets_cpu_matches_reference(swap_ab):
    gen = seeded(2)
    for e in [1, 2, 7, 64, 300, 1500]:
        for garbage in [False, True]:
            off = random_offsets(e, gen, garbage)
            got = run_sizes(off, 320, 4096, swap_ab)
            want = ref.get_cutlass_moe_mm_problem_sizes_from_expert_offsets(off, 320, 4096,
                                                                            swap_ab)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (e, garbage)
            m = (off[1:] - off[:-1]).clamp(0, 2**31 - 1).to(torch.int32)
            col = 1 if swap_ab else 0
            assert torch.equal(got[0][:, col], m) and torch.equal(got[1][:, col], m)
            assert got[0][:, 1 - col].eq(640).all() and got[0][:, 2].eq(4096).all()
            assert got[1][:, 1 - col].eq(4096).all() and got[1][:, 2].eq(320).all()


@pytest.mark.parametrize("device", DEVICES)
def test_mm_data_padding_rows_shuffle_to_zero(device):
    """vLLM 0.33's test_cutlass_moe_permutation_maps_padding_to_zero: rows past the counted
    slots hold -1 in input_permutation, so shuffle_rows gives zero rows there, and a skipped
    slot's output_permutation (expert_offsets[E]) reads such a zero row back."""
    ids = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)  # two counted, two skipped slots
    offsets, _, _, in_perm, out_perm = run_data(ids, 2, 128, 128, device=device)
    assert in_perm.tolist() == [0, 1, -1, -1] and out_perm.tolist() == [0, 2, 1, 2]
    x = torch.randn(2, 128, generator=seeded(5)).to(torch.bfloat16).to(device)
    permuted = poison(torch.empty(4, 128, dtype=x.dtype, device=device))
    torch.ops.hopper_moe.shuffle_rows(x, in_perm.to(device), permuted)
    restored = poison(torch.empty(4, 128, dtype=x.dtype, device=device))
    torch.ops.hopper_moe.shuffle_rows(permuted, out_perm.to(device), restored)
    zero = torch.zeros(128, dtype=x.dtype, device=device)
    assert torch.equal(permuted[:2], x) and torch.equal(permuted[2], zero)
    assert torch.equal(permuted[3], zero)
    assert [torch.equal(r, w) for r, w in zip(restored, (x[0], zero, x[1], zero))] == [True] * 4


def test_sizes_from_offsets_match_mm_data():
    # From moe_permute-style offsets (int64 [E+1]) the sizes equal those of
    # get_cutlass_moe_mm_data for the same routing.
    gen = seeded(3)
    ids = random_ids(50, 4, 12, gen)
    offsets, ps1, ps2, _, _ = run_data(ids, 12, 64, 128, offsets_dtype=torch.int64)
    got = run_sizes(offsets, 64, 128, swap_ab=False)
    assert torch.equal(got[0], ps1) and torch.equal(got[1], ps2)


def test_sizes_from_offsets_no_experts():
    ps1 = torch.empty((0, 3), dtype=torch.int32)
    SIZES(torch.zeros((1,), dtype=torch.int64), ps1, torch.empty((0, 3), dtype=torch.int32),
          8, 8, False)


# ------------------------------------------------------------- cutlass_group_gemm_supported
@pytest.mark.parametrize("cap", [-1, 0, 70, 80, 86, 89, 90, 100, 103, 110, 120, 121])
def test_cutlass_group_gemm_supported_only_for_sm90(cap):
    # cutlass_moe_mm runs sm_90a code: only SM90 (H100/H200) in a build with the CUDA kernels.
    want = cap == 90 and hopper_moe.built_with_cuda()
    assert SUPPORTED(cap) is want
    assert hopper_moe.ops.cutlass_group_gemm_supported(cap) is want


# ---------------------------------------------------------------------- input validation
def _bad_data_cases(device):
    f = dict(device=device)
    i32 = dict(dtype=torch.int32, **f)
    ids = torch.zeros((4, 2), **i32)
    off, ps1, ps2, ip, op = _outputs(8, 3, device)

    def args(**kw):
        a = dict(topk_ids=ids, expert_offsets=off, problem_sizes1=ps1, problem_sizes2=ps2,
                 input_permutation=ip, output_permutation=op, num_experts=3, n=8, k=16,
                 blockscale_offsets=None, is_gated=True)
        a.update(kw)
        return tuple(a.values())

    return [
        ("blockscale_offsets", args(blockscale_offsets=torch.zeros((3,), **i32))),
        ("blockscale_offsets", args(blockscale_offsets=torch.zeros((4,), dtype=torch.int64,
                                                                   **f))),
        ("blockscale_offsets", args(blockscale_offsets=off)),  # overlaps expert_offsets
        ("num_experts", args(num_experts=0)),
        ("num_experts", args(num_experts=-2)),
        ("n must", args(n=0)),
        ("n must", args(n=2**30)),  # 2n overflows int32 when gated
        ("k must", args(k=0)),
        ("k must", args(k=2**31)),
        ("topk_ids", args(topk_ids=torch.zeros((8,), **i32))),
        ("topk_ids", args(topk_ids=ids.float())),
        ("topk_ids", args(topk_ids=ids.to(torch.int16))),
        ("topk_ids", args(topk_ids=torch.zeros((2, 4), **i32).t())),
        ("expert_offsets", args(expert_offsets=off.view(2, 2))),
        ("expert_offsets", args(expert_offsets=off.float())),
        ("expert_offsets", args(expert_offsets=torch.zeros((3,), **i32))),
        ("expert_offsets", args(expert_offsets=torch.zeros((8,), **i32)[::2])),
        ("problem_sizes1", args(problem_sizes1=ps1.view(-1))),
        ("problem_sizes1", args(problem_sizes1=ps1.long())),
        ("problem_sizes1", args(problem_sizes1=torch.zeros((4, 3), **i32))),
        ("problem_sizes1", args(problem_sizes1=torch.zeros((3, 2), **i32))),
        ("problem_sizes1", args(problem_sizes1=torch.zeros((3, 6), **i32)[:, ::2])),
        ("problem_sizes2", args(problem_sizes2=ps2.long())),
        ("problem_sizes2", args(problem_sizes2=torch.zeros((2, 3), **i32))),
        ("input_permutation", args(input_permutation=ip.view(2, 4))),
        ("input_permutation", args(input_permutation=ip.long())),
        ("input_permutation", args(input_permutation=torch.zeros((7,), **i32))),
        ("input_permutation", args(input_permutation=torch.zeros((16,), **i32)[::2])),
        ("output_permutation", args(output_permutation=op.long())),
        ("output_permutation", args(output_permutation=torch.zeros((9,), **i32))),
    ]


def _bad_sizes_cases(device):
    f = dict(device=device)
    off = torch.zeros((4,), dtype=torch.int64, **f)
    ps = torch.zeros((3, 3), dtype=torch.int32, **f)
    return [
        ("n must", (off, ps, ps.clone(), 0, 8, False)),
        ("n must", (off, ps, ps.clone(), 2**30, 8, False)),
        ("k must", (off, ps, ps.clone(), 8, -1, False)),
        ("expert_first_token_offset", (off.view(2, 2), ps, ps.clone(), 8, 8, False)),
        ("expert_first_token_offset", (off.int(), ps, ps.clone(), 8, 8, False)),
        ("expert_first_token_offset", (torch.zeros((8,), dtype=torch.int64, **f)[::2], ps,
                                       ps.clone(), 8, 8, False)),
        ("expert_first_token_offset", (off[:3], ps, ps.clone(), 8, 8, False)),
        ("problem_sizes1", (off, ps.view(-1), ps.clone(), 8, 8, False)),
        ("problem_sizes1", (off, ps.long(), ps.clone(), 8, 8, False)),
        ("problem_sizes1", (off, torch.zeros((3, 4), dtype=torch.int32, **f), ps.clone(),
                            8, 8, False)),
        ("problem_sizes1", (off, torch.zeros((3, 6), dtype=torch.int32, **f)[:, ::2],
                            ps.clone(), 8, 8, False)),
        ("problem_sizes2", (off, ps, torch.zeros((2, 3), dtype=torch.int32, **f), 8, 8, False)),
        ("problem_sizes2", (off, ps, ps.float(), 8, 8, False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_data_cases("cpu"))))
def test_bad_inputs_mm_data_cpu(case):
    name, args = _bad_data_cases("cpu")[case]
    with pytest.raises(RuntimeError, match=name):
        DATA(*args)


@pytest.mark.parametrize("case", range(len(_bad_sizes_cases("cpu"))))
def test_bad_inputs_sizes_cpu(case):
    name, args = _bad_sizes_cases("cpu")[case]
    with pytest.raises(RuntimeError, match=name):
        SIZES(*args)


# ------------------------------------------------------------------------------ opcheck
def _opcheck_data_samples(device):
    gen = seeded(4)
    samples = []
    for (t, kk, e), id_dtype, off_dtype, gated in [((1, 1, 4), torch.int32, torch.int32, True),
                                                   ((9, 4, 16), torch.int64, torch.int64, False),
                                                   ((40, 2, 8), torch.int32, torch.int32, True),
                                                   ((0, 3, 5), torch.int32, torch.int64, True)]:
        ids = random_ids(t, kk, e, gen, dtype=id_dtype).to(device)
        samples.append((ids, *_outputs(t * kk, e, device, off_dtype), e, 32, 64, None, gated))
    return samples


def _opcheck_sizes_samples(device):
    gen = seeded(5)
    samples = []
    for e, swap in [(1, True), (8, False), (77, True)]:
        off = random_offsets(e, gen).to(device)
        ps = torch.empty((e, 3), dtype=torch.int32, device=device)
        samples.append((off, ps, ps.clone(), 16, 32, swap))
    return samples


def test_opcheck_cpu():
    for args in _opcheck_data_samples("cpu"):
        torch.library.opcheck(DATA.default, args)
    for args in _opcheck_sizes_samples("cpu"):
        torch.library.opcheck(SIZES.default, args)


# ------------------------------------------------------------------------------ GPU
GPU_CASES = CASES + [(4096, 8, 256), (300, 10, 1024), (40, 8, 2048), (25000, 6, 1500),
                     (1, 8, 5000), (12, 6, 1), (70000, 1, 64)]


@gpu
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_cuda_matches_cpu(id_dtype, offsets_dtype):
    gen = seeded(10)
    for (t, kk, e), skew in ((c, s) for c in GPU_CASES for s in (False, True)):
        ids = random_ids(t, kk, e, gen, skew=skew, dtype=id_dtype)
        for gated in (True, False):
            want = run_data(ids, e, 96, 160, gated, offsets_dtype=offsets_dtype)
            got = run_data(ids, e, 96, 160, gated, device="cuda", offsets_dtype=offsets_dtype)
            what = f"T={t} K={kk} E={e} skew={skew} {id_dtype} {offsets_dtype} gated={gated}"
            for g, w, name in zip(got, want, ["offsets", "ps1", "ps2", "in_perm", "out_perm"]):
                assert torch.equal(g, w), f"{name}: {what}"
        check_invariants(ids, e, 96, 160, False, got)


@gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(2, 2, 2), (300, 4, 8), (0, 2, 3),
                                                          (5000, 8, 256)])
def test_cuda_blockscale_offsets_match_cpu(num_tokens, top_k, num_experts):
    ids = random_ids(num_tokens, top_k, num_experts, seeded(num_experts))
    outs, b = run_data_blockscale(ids, num_experts, 8, 16)
    outs_gpu, b_gpu = run_data_blockscale(ids, num_experts, 8, 16, device="cuda")
    assert torch.equal(b_gpu, b)
    for got, want in zip(outs_gpu, outs):
        assert torch.equal(got, want)


@gpu
def test_cuda_edge_cases():
    for ids, e in [(torch.empty((0, 4), dtype=torch.int32), 6),
                   (torch.full((3000, 8), 5, dtype=torch.int32), 1024),  # all on one expert
                   (torch.full((300, 2), -1, dtype=torch.int32), 8),  # none valid
                   (torch.full((9, 2), 8, dtype=torch.int64), 8),  # all == E
                   (torch.randint(-2**31, 2**31 - 1, (500, 4), dtype=torch.int32), 64),
                   (torch.randint(-2**40, 2**40, (500, 4), dtype=torch.int64), 64)]:
        want = run_data(ids, e, 8, 16)
        got = run_data(ids, e, 8, 16, device="cuda")
        for g, w in zip(got, want):
            assert torch.equal(g, w), (ids.shape, e)


@gpu
def test_cuda_deterministic():
    gen = seeded(11)
    ids = random_ids(8192, 8, 256, gen, skew=True).cuda()
    first = run_data(ids, 256, 64, 64, device="cuda")
    for _ in range(20):
        again = run_data(ids, 256, 64, 64, device="cuda")
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
def test_cuda_graph_capture():
    gen = seeded(12)
    t, kk, e = 96, 4, 40
    ids = torch.zeros((t, kk), dtype=torch.int32, device="cuda")
    outs = _outputs(t * kk, e, "cuda")
    off64 = torch.zeros((e + 1,), dtype=torch.int64, device="cuda")
    ps = [torch.empty((e, 3), dtype=torch.int32, device="cuda") for _ in range(2)]
    DATA(ids, *outs, e, 32, 64, None, True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        DATA(ids, *outs, e, 32, 64, None, True)
        SIZES(off64, *ps, 32, 64, False)
    for i in range(6):
        new = random_ids(t, kk, e, gen, skew=i % 2 == 1)
        if i == 5:
            new = torch.full((t, kk), 7, dtype=torch.int32)  # every slot on one expert
        ids.copy_(new)
        off64.copy_(random_offsets(e, gen))
        for o in outs + ps:
            poison(o)
        g.replay()
        torch.cuda.synchronize()
        want = run_data(new, e, 32, 64)
        for got, w in zip(outs, want):
            assert torch.equal(got.cpu(), w), f"replay {i}"
        want_sizes = run_sizes(off64.cpu(), 32, 64, False)
        assert torch.equal(ps[0].cpu(), want_sizes[0]) and torch.equal(ps[1].cpu(), want_sizes[1])


@gpu
@pytest.mark.parametrize("swap_ab", [False, True])
def test_cuda_sizes_from_offsets(swap_ab):
    gen = seeded(13)
    for e in [1, 3, 64, 256, 1024, 5000]:
        for garbage in [False, True]:
            off = random_offsets(e, gen, garbage)
            want = run_sizes(off, 768, 2048, swap_ab)
            got = run_sizes(off, 768, 2048, swap_ab, device="cuda")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (e, garbage)
    SIZES(torch.zeros((1,), dtype=torch.int64, device="cuda"),
          torch.empty((0, 3), dtype=torch.int32, device="cuda"),
          torch.empty((0, 3), dtype=torch.int32, device="cuda"), 8, 8, False)


@gpu
@pytest.mark.parametrize("case", range(len(_bad_data_cases("cpu"))))
def test_bad_inputs_mm_data_cuda(case):
    name, args = _bad_data_cases("cuda")[case]
    with pytest.raises(RuntimeError, match=name):
        DATA(*args)


@gpu
@pytest.mark.parametrize("case", range(len(_bad_sizes_cases("cpu"))))
def test_bad_inputs_sizes_cuda(case):
    name, args = _bad_sizes_cases("cuda")[case]
    with pytest.raises(RuntimeError, match=name):
        SIZES(*args)


@gpu
def test_bad_devices_cuda():
    ids = torch.zeros((4, 2), dtype=torch.int32, device="cuda")
    outs = _outputs(8, 3, "cuda")
    for i, name in enumerate(["expert_offsets", "problem_sizes1", "problem_sizes2",
                              "input_permutation", "output_permutation"]):
        bad = list(outs)
        bad[i] = bad[i].cpu()
        with pytest.raises(RuntimeError, match=name):
            DATA(ids, *bad, 3, 8, 16, None, True)
    off = torch.zeros((4,), dtype=torch.int64, device="cuda")
    ps = torch.zeros((3, 3), dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="problem_sizes1"):
        SIZES(off, ps.cpu(), ps, 8, 8, False)
    with pytest.raises(RuntimeError, match="problem_sizes2"):
        SIZES(off, ps, ps.cpu(), 8, 8, False)


@gpu
def test_opcheck_cuda():
    for args in _opcheck_data_samples("cuda"):
        torch.library.opcheck(DATA.default, args)
    for args in _opcheck_sizes_samples("cuda"):
        torch.library.opcheck(SIZES.default, args)


# ------------------------------------------------------------- input audit: outputs disjoint
# Every output must be disjoint from every other output and from the inputs (the same rule in
# csrc/checks/gemm_data.cpp for the CPU and the CUDA op; *_cpu tests have a GPU twin).
def _overlap_cases(device):
    i32 = dict(dtype=torch.int32, device=device)
    ids = torch.tensor([[0, 1], [2, 3]], **i32)
    ps = torch.zeros(8, 3, **i32)  # rows 0..3: problem_sizes1, rows 2..5: problem_sizes2
    offsets = torch.zeros(5, **i32)
    perms = torch.zeros(4, **i32)
    off64 = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int64, device=device)
    both = torch.zeros(4, 3, **i32)
    shared = torch.zeros(9, **i32)
    return [
        ("problem_sizes1 must not overlap problem_sizes2",
         lambda: DATA(ids, offsets, ps[:4], ps[2:6], torch.zeros(4, **i32),
                      torch.zeros(4, **i32), 4, 8, 16, None, True)),
        ("input_permutation must not overlap output_permutation",
         lambda: DATA(ids, offsets, torch.zeros(4, 3, **i32), torch.zeros(4, 3, **i32), perms,
                      perms, 4, 8, 16, None, True)),
        ("expert_offsets must not overlap topk_ids",
         lambda: DATA(shared[:4].view(2, 2), shared[3:8], torch.zeros(4, 3, **i32),
                      torch.zeros(4, 3, **i32), torch.zeros(4, **i32), torch.zeros(4, **i32), 4,
                      8, 16, None, True)),
        ("problem_sizes1 must not overlap problem_sizes2",
         lambda: SIZES(off64, both, both, 8, 16, False)),
        ("problem_sizes1 must not overlap expert_first_token_offset",
         lambda: SIZES(both.view(-1)[:10].view(torch.int64), both, torch.zeros(4, 3, **i32), 8,
                       16, False)),
    ]


@pytest.mark.parametrize("case", range(len(_overlap_cases("cpu"))))
def test_outputs_must_not_overlap_cpu(case):
    message, call = _overlap_cases("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_overlap_cases("cpu"))))
def test_outputs_must_not_overlap_cuda(case):
    message, call = _overlap_cases("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()
