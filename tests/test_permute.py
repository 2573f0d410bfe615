"""Tests of the permutation family: moe_align_block_size, moe_permute (and its scratch forms
moe_permute_with_scratch, moe_prepare_scatter), moe_unpermute,
shuffle_rows.

The CPU ops must equal hopper_moe.reference.permute bit for bit; the CUDA ops must equal the
CPU ops bit for bit (the CUDA sort is stable and deterministic, so even the order of slots
inside an expert matches). Every output is poisoned before each call.
"""
from __future__ import annotations

import pytest
import torch

from conftest import gpu, poison, seeded
from hopper_moe.reference import permute as ref

ops = torch.ops.hopper_moe
ROW_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2]


# ----------------------------------------------------------------------------------- helpers
def random_ids(num_tokens, topk, num_experts, g, dtype=torch.int32, invalid=0.0, skew=False):
    """Random expert ids [T, topk]; a fraction `invalid` of them outside [0, num_experts)."""
    if skew:  # most slots on expert 0
        ids = torch.where(torch.rand(num_tokens, topk, generator=g) < 0.8, 0,
                          torch.randint(0, num_experts, (num_tokens, topk), generator=g))
    else:
        ids = torch.randint(0, num_experts, (num_tokens, topk), generator=g)
    if invalid > 0:
        bad = torch.tensor([-1, num_experts, num_experts + 7, -1000])
        pick = bad[torch.randint(0, 4, (num_tokens, topk), generator=g)]
        ids = torch.where(torch.rand(num_tokens, topk, generator=g) < invalid, pick, ids)
    return ids.to(dtype)


def random_expert_map(num_experts, num_local, g):
    """int32 [num_experts]: num_local random experts get local ids 0..num_local-1 in random
    order (not monotone in the global id), the others -1."""
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    chosen = torch.randperm(num_experts, generator=g)[:num_local]
    m[chosen] = torch.randperm(num_local, generator=g).to(torch.int32)
    return m


def random_rows(rows, hidden, dtype, g):
    x = torch.randn(rows, hidden, generator=g) * 3
    return x.to(dtype)


def same_bytes(a, b):
    """Bitwise equality (NaN == NaN, fp8 included)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8),
                                                                     b.view(torch.uint8))


def assert_same(a, b, what=""):
    assert same_bytes(a, b), f"{what}: mismatch\n{a}\n{b}"


# ------------------------------------------------------------------------ moe_align_block_size
def run_align(topk_ids, num_experts, block_size, expert_map=None, with_scatter=True,
              sorted_len=None, num_blocks=None):
    dev = topk_ids.device
    numel = topk_ids.numel()
    if sorted_len is None:
        sorted_len = ref.moe_align_block_size_len(numel, num_experts, block_size)
    if num_blocks is None:
        num_blocks = (sorted_len + block_size - 1) // block_size
    sorted_ids = poison(torch.empty(sorted_len, dtype=torch.int32, device=dev))
    experts_ids = poison(torch.empty(num_blocks, dtype=torch.int32, device=dev))
    post_pad = poison(torch.empty(1, dtype=torch.int32, device=dev))
    scatter = poison(torch.empty(numel, dtype=torch.int32, device=dev)) if with_scatter else None
    ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, experts_ids,
                             post_pad, expert_map, scatter)
    return sorted_ids, experts_ids, post_pad, scatter


def check_align_invariants(topk_ids, num_experts, block_size, expert_map, out):
    """Properties that hold whatever the order inside an expert: per-expert slot SETS,
    segment layout, padding values, block ids, scatter_idx as the masked identity of the
    routed slots (i where slot i is placed, -1 where it is skipped)."""
    sorted_ids, experts_ids, post_pad, scatter = (t.cpu() if t is not None else None
                                                  for t in out)
    numel = topk_ids.numel()
    local = ref._local_expert(topk_ids.cpu(), num_experts,
                              None if expert_map is None else expert_map.cpu())
    total = int(post_pad[0])
    assert total % block_size == 0 and total <= sorted_ids.numel()
    nblk = total // block_size
    assert ((experts_ids[:nblk] >= 0) & (experts_ids[:nblk] < num_experts)).all()
    assert (experts_ids[:nblk][1:] >= experts_ids[:nblk][:-1]).all()  # experts in order
    assert (experts_ids[nblk:] == -1).all()
    assert (sorted_ids[total:] == numel).all()
    block_expert = experts_ids[:nblk].long().repeat_interleave(block_size)
    slot = sorted_ids[:total].long()
    real = slot < numel
    assert (slot[~real] == numel).all()
    # (expert, slot) pairs placed == (local expert, slot) pairs of the routing, as sets.
    got = torch.sort(block_expert[real] * (numel + 1) + slot[real]).values
    idx = torch.nonzero(local >= 0).flatten()
    want = torch.sort(local[idx] * (numel + 1) + idx).values
    assert torch.equal(got, want), "per-expert slot sets differ"
    if scatter is not None:
        placed = local >= 0
        want_scatter = torch.where(placed, torch.arange(numel), -1).to(torch.int32)
        assert torch.equal(scatter, want_scatter), "scatter_idx: i where placed, else -1"
        assert torch.equal(torch.sort(slot[real]).values,
                           torch.nonzero(placed).flatten()), "each placed slot once"


def test_align_vllm_docstring_example():
    # vLLM's docstring example (with 5 experts so that id 4 is valid): expert 0 is empty.
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, experts_ids, post_pad, scatter = run_align(topk_ids, 5, 4)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert (sorted_ids[16:] == 12).all()
    assert experts_ids[:4].tolist() == [1, 2, 3, 4] and (experts_ids[4:] == -1).all()
    assert post_pad.tolist() == [16]
    assert scatter.tolist() == list(range(12))  # every slot is routed to an expert


def test_align_expert_map_and_invalid_ids_by_hand():
    # Experts 0..3, local ones: 2 -> local 0, 0 -> local 1; 1 and 3 are not local.
    topk_ids = torch.tensor([[0, 2], [3, 2], [-1, 0], [4, 1]], dtype=torch.int64)
    emap = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    sorted_ids, experts_ids, post_pad, scatter = run_align(topk_ids, 4, 2, emap)
    # local 0 (global 2): slots 1, 3 ; local 1 (global 0): slots 0, 5
    assert post_pad.tolist() == [4]
    assert sorted_ids[:4].tolist() == [1, 3, 0, 5] and (sorted_ids[4:] == 8).all()
    assert experts_ids[:2].tolist() == [0, 1] and (experts_ids[2:] == -1).all()
    # Skipped: slot 2 (global 3, not local), 4 (id -1), 6 (id 4 >= E), 7 (global 1).
    assert scatter.tolist() == [0, 1, -1, 3, -1, 5, -1, -1]


ALIGN_CASES = [
    # (num_tokens, topk, num_experts, block_size)
    (0, 2, 8, 16),
    (1, 1, 8, 16),
    (1, 8, 128, 64),
    (3, 2, 8, 1),
    (7, 3, 5, 4),
    (33, 4, 16, 16),
    (64, 8, 64, 128),
    (200, 6, 300, 16),
    (5, 2, 1, 3),
]


@pytest.mark.parametrize("num_tokens,topk,num_experts,block_size", ALIGN_CASES)
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "skew", "int64"])
def test_align_cpu_matches_reference(num_tokens, topk, num_experts, block_size, variant):
    g = seeded(num_tokens * 1000 + topk * 10 + num_experts)
    dtype = torch.int64 if variant == "int64" else torch.int32
    ids = random_ids(num_tokens, topk, num_experts, g, dtype,
                     invalid=0.2 if variant in ("invalid", "map") else 0.0,
                     skew=variant == "skew")
    emap = None
    if variant == "map":
        emap = random_expert_map(num_experts, max(1, num_experts // 2), g)
    out = run_align(ids, num_experts, block_size, emap)
    want = ref.moe_align_block_size(ids, num_experts, block_size, emap)
    for got, exp, name in zip(out, want, ["sorted_token_ids", "experts_ids",
                                          "num_tokens_post_pad", "scatter_idx"]):
        assert_same(got, exp, name)
    check_align_invariants(ids, num_experts, block_size, emap, out)


def test_align_all_on_one_expert_and_longer_buffers():
    ids = torch.full((50, 4), 3, dtype=torch.int32)
    out = run_align(ids, 8, 16, sorted_len=400, num_blocks=40, with_scatter=False)
    want = ref.moe_align_block_size(ids, 8, 16, sorted_len=400, num_blocks=40)
    for got, exp in zip(out[:3], want[:3]):
        assert_same(got, exp)
    assert out[2].item() == 208 and out[0][:200].tolist() == list(range(200))
    assert (out[1][:13] == 3).all() and (out[1][13:] == -1).all()


def test_align_all_ids_invalid():
    ids = torch.tensor([[-1, 9], [100, -5]], dtype=torch.int32)
    sorted_ids, experts_ids, post_pad, scatter = run_align(ids, 8, 4)
    assert post_pad.item() == 0 and (sorted_ids == 4).all() and (experts_ids == -1).all()
    assert (scatter == -1).all()


def test_align_small_batch_bound():
    # numel < E: vLLM allocates min(numel * bs, numel + E * (bs - 1)) slots; it must suffice.
    ids = torch.tensor([[5, 60]], dtype=torch.int32)
    out = run_align(ids, 64, 32, sorted_len=64)
    assert out[2].item() == 64 and out[0][[0, 32]].tolist() == [0, 1]
    assert out[1].tolist() == [5, 60]


def align_args(ids, E, bs, **over):
    numel = ids.numel()
    n = ref.moe_align_block_size_len(numel, E, bs)
    a = dict(topk_ids=ids, num_experts=E, block_size=bs,
             sorted_token_ids=torch.empty(n, dtype=torch.int32),
             experts_ids=torch.empty((n + bs - 1) // bs, dtype=torch.int32),
             num_tokens_post_pad=torch.empty(1, dtype=torch.int32),
             maybe_expert_map=None, scatter_idx=None)
    a.update(over)
    return a


def call_align(a):
    ops.moe_align_block_size(a["topk_ids"], a["num_experts"], a["block_size"],
                             a["sorted_token_ids"], a["experts_ids"], a["num_tokens_post_pad"],
                             a["maybe_expert_map"], a["scatter_idx"])


ALIGN_BAD = [
    ("topk_ids", dict(topk_ids=torch.zeros(4, 2, dtype=torch.float32))),
    ("topk_ids", dict(topk_ids=torch.zeros(2, 8, dtype=torch.int32)[:, ::2])),
    ("num_experts", dict(num_experts=0)),
    ("block_size", dict(block_size=0)),
    ("sorted_token_ids", dict(sorted_token_ids=torch.empty(10, dtype=torch.int32))),
    ("sorted_token_ids", dict(sorted_token_ids=torch.empty(64, dtype=torch.int64))),
    ("sorted_token_ids", dict(sorted_token_ids=torch.empty(2, 64, dtype=torch.int32))),
    ("sorted_token_ids", dict(sorted_token_ids=torch.empty(128, dtype=torch.int32)[::2])),
    ("experts_ids", dict(experts_ids=torch.empty(1, dtype=torch.int32))),
    ("experts_ids", dict(experts_ids=torch.empty(16, dtype=torch.int64))),
    ("num_tokens_post_pad", dict(num_tokens_post_pad=torch.empty(2, dtype=torch.int32))),
    ("num_tokens_post_pad", dict(num_tokens_post_pad=torch.empty(1, dtype=torch.int64))),
    ("maybe_expert_map", dict(maybe_expert_map=torch.zeros(3, dtype=torch.int32))),
    ("maybe_expert_map", dict(maybe_expert_map=torch.zeros(4, dtype=torch.int64))),
    ("scatter_idx", dict(scatter_idx=torch.empty(7, dtype=torch.int32))),
    ("scatter_idx", dict(scatter_idx=torch.empty(8, dtype=torch.int64))),
]


@pytest.mark.parametrize("name,over", ALIGN_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                     enumerate(ALIGN_BAD)])
def test_align_bad_inputs(name, over):
    a = align_args(torch.zeros(4, 2, dtype=torch.int32), 4, 8, **over)
    with pytest.raises(RuntimeError, match=name):
        call_align(a)


def align_opcheck_samples(dev):
    g = seeded(7)
    samples = []
    for (T, K, E, bs), emap in [((1, 2, 8, 16), None), ((13, 4, 16, 4), True),
                                ((40, 2, 32, 64), None)]:
        ids = random_ids(T, K, E, g).to(dev)
        m = random_expert_map(E, E // 2, g).to(dev) if emap else None
        a = align_args(ids, E, bs, maybe_expert_map=m,
                       scatter_idx=torch.empty(T * K, dtype=torch.int32, device=dev))
        for k in ("sorted_token_ids", "experts_ids", "num_tokens_post_pad"):
            a[k] = a[k].to(dev)
        samples.append(tuple(a.values()))
    return samples


@pytest.mark.parametrize("i", range(3))
def test_align_opcheck(i):
    torch.library.opcheck(ops.moe_align_block_size.default, align_opcheck_samples("cpu")[i])


# --------------------------------------------------------------------------------- moe_permute
def run_permute(x, topk_ids, tei, emap, n_expert, n_local, topk, rows=None, pidx_len=None):
    dev = x.device
    slots = topk_ids.numel()
    rows = slots if rows is None else rows
    pidx_len = slots if pidx_len is None else pidx_len
    permuted = poison(torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev))
    offsets = poison(torch.empty(n_local + 1, dtype=torch.int64, device=dev))
    inv = poison(torch.empty(topk_ids.shape, dtype=torch.int32, device=dev))
    pidx = poison(torch.empty(pidx_len, dtype=torch.int32, device=dev))
    before = permuted.clone()
    ops.moe_permute(x, topk_ids, tei, emap, n_expert, n_local, topk, permuted, offsets, inv,
                    pidx)
    return permuted, offsets, inv, pidx, before


def check_permute(out, want, x):
    permuted, offsets, inv, pidx, before = out
    w_perm, w_off, w_inv, w_pidx = want
    assert_same(offsets, w_off, "expert_first_token_offset")
    assert_same(inv, w_inv, "inv_permuted_idx")
    assert_same(pidx, w_pidx, "permuted_idx")
    nv = int(w_off[-1])
    assert_same(permuted[:nv], w_perm, "permuted_input")
    # Rows past the valid count are not written (vLLM leaves them too).
    assert_same(permuted[nv:], before[nv:], "permuted_input rows past the valid count")


PERMUTE_CASES = [
    # (num_tokens, topk, n_expert, hidden)
    (0, 2, 8, 16),
    (1, 1, 4, 8),
    (1, 8, 64, 40),
    (3, 2, 8, 33),
    (17, 4, 16, 64),
    (64, 6, 130, 24),
]


@pytest.mark.parametrize("num_tokens,topk,n_expert,hidden", PERMUTE_CASES)
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "skew", "int64", "srcperm"])
def test_permute_cpu_matches_reference(num_tokens, topk, n_expert, hidden, variant):
    g = seeded(num_tokens * 7 + topk * 3 + n_expert + hidden)
    dtype = ROW_DTYPES[(num_tokens + hidden) % len(ROW_DTYPES)]
    x = random_rows(num_tokens, hidden, dtype, g)
    ids = random_ids(num_tokens, topk, n_expert, g,
                     torch.int64 if variant == "int64" else torch.int32,
                     invalid=0.2 if variant in ("invalid", "map") else 0.0,
                     skew=variant == "skew")
    slots = num_tokens * topk
    if variant == "srcperm":  # a token_expert_indices that is not arange: honoured like vLLM
        tei = torch.randperm(slots, generator=g).to(torch.int32).view(num_tokens, topk)
    else:
        tei = torch.arange(slots, dtype=torch.int32).view(num_tokens, topk)
    emap, n_local = None, n_expert
    if variant == "map":
        n_local = max(1, n_expert // 3)
        emap = random_expert_map(n_expert, n_local, g)
    out = run_permute(x, ids, tei, emap, n_expert, n_local, topk, rows=slots + 3,
                      pidx_len=slots + 5)
    want = ref.moe_permute(x, ids, tei, emap, n_expert, n_local, topk, permuted_idx_len=slots + 5)
    check_permute(out, want, x)


def test_permute_by_hand():
    # 3 tokens, topk 2, 4 experts; expert 1 -> local 0, expert 3 -> local 1, others remote.
    x = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    ids = torch.tensor([[3, 1], [0, 3], [1, 2]], dtype=torch.int32)
    tei = torch.arange(6, dtype=torch.int32).view(3, 2)
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    permuted, offsets, inv, pidx, before = run_permute(x, ids, tei, emap, 4, 2, 2)
    # local 0: slots 1, 4 ; local 1: slots 0, 3 ; remote by global id: slot 2 (id 0), 5 (id 2)
    assert offsets.tolist() == [0, 2, 4]
    assert pidx.tolist() == [1, 4, 0, 3, 6, 6]
    assert inv.tolist() == [[2, 0], [4, 3], [1, 5]]
    assert torch.equal(permuted[:4], x[[0, 2, 0, 1]])
    assert permuted[4:].isnan().all()


def test_permute_without_map_n_local_smaller():
    # Without a map, ids in [n_local, n_expert) are not local: sorted after, not counted.
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 5], [2, 1], [7, 0], [3, 6]], dtype=torch.int32)
    tei = torch.arange(8, dtype=torch.int32).view(4, 2)
    out = run_permute(x, ids, tei, None, 8, 4, 2)
    want = ref.moe_permute(x, ids, tei, None, 8, 4, 2)
    check_permute(out, want, x)
    assert out[1].tolist() == [0, 2, 3, 4, 5]


def permute_args(T=4, K=2, E=8, H=16, **over):
    slots = T * K
    a = dict(input=torch.zeros(T, H), topk_ids=torch.zeros(T, K, dtype=torch.int32),
             token_expert_indices=torch.arange(slots, dtype=torch.int32).view(T, K),
             expert_map=None, n_expert=E, n_local_expert=E, topk=K,
             permuted_input=torch.empty(slots, H),
             expert_first_token_offset=torch.empty(E + 1, dtype=torch.int64),
             inv_permuted_idx=torch.empty(T, K, dtype=torch.int32),
             permuted_idx=torch.empty(slots, dtype=torch.int32))
    a.update(over)
    return a


def call_permute(a):
    ops.moe_permute(*a.values())


PERMUTE_BAD = [
    ("input", dict(input=torch.zeros(4, 16, dtype=torch.int32))),
    ("input", dict(input=torch.zeros(4, 16, 2))),
    ("input", dict(input=torch.zeros(16, 4).t())),
    ("topk_ids", dict(topk_ids=torch.zeros(4, 2))),
    ("topk_ids", dict(topk_ids=torch.zeros(5, 2, dtype=torch.int32))),
    ("topk_ids", dict(topk_ids=torch.zeros(4, 4, dtype=torch.int32)[:, ::2])),
    ("topk", dict(topk=3)),
    ("topk", dict(topk=0)),
    ("token_expert_indices", dict(token_expert_indices=torch.zeros(4, 2))),
    ("token_expert_indices", dict(token_expert_indices=torch.zeros(8, dtype=torch.int32))),
    ("n_expert", dict(n_expert=0, n_local_expert=0)),
    ("n_local_expert", dict(n_local_expert=9)),
    ("n_local_expert", dict(n_local_expert=0)),
    ("expert_map", dict(expert_map=torch.zeros(7, dtype=torch.int32))),
    ("expert_map", dict(expert_map=torch.zeros(8, dtype=torch.int64))),
    ("permuted_input", dict(permuted_input=torch.empty(7, 16))),
    ("permuted_input", dict(permuted_input=torch.empty(8, 15))),
    ("permuted_input", dict(permuted_input=torch.empty(8, 16, dtype=torch.bfloat16))),
    ("permuted_input", dict(permuted_input=torch.empty(16, 8).t())),
    ("expert_first_token_offset", dict(expert_first_token_offset=torch.empty(8,
                                                                             dtype=torch.int64))),
    ("expert_first_token_offset", dict(expert_first_token_offset=torch.empty(9,
                                                                             dtype=torch.int32))),
    ("inv_permuted_idx", dict(inv_permuted_idx=torch.empty(8, dtype=torch.int32))),
    ("inv_permuted_idx", dict(inv_permuted_idx=torch.empty(4, 2, dtype=torch.int64))),
    ("permuted_idx", dict(permuted_idx=torch.empty(7, dtype=torch.int32))),
    ("permuted_idx", dict(permuted_idx=torch.empty(8, dtype=torch.int64))),
    ("permuted_idx", dict(permuted_idx=torch.empty(16, dtype=torch.int32)[::2])),
]


@pytest.mark.parametrize("name,over", PERMUTE_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                       enumerate(PERMUTE_BAD)])
def test_permute_bad_inputs(name, over):
    with pytest.raises(RuntimeError, match=name):
        call_permute(permute_args(**over))


def test_permute_overlap_rejected():
    a = permute_args()
    a["permuted_input"] = torch.empty(8, 16)
    a["input"] = a["permuted_input"][:4]
    with pytest.raises(RuntimeError, match="permuted_input"):
        call_permute(a)


def permute_opcheck_samples(dev):
    g = seeded(11)
    samples = []
    for T, K, E, H, n_local in [(1, 2, 8, 16, 8), (9, 4, 16, 32, 5), (20, 2, 6, 8, 6)]:
        x = random_rows(2 * T, H, torch.bfloat16, g)[::2]  # non-contiguous rows
        ids = random_ids(T, K, E, g)
        emap = random_expert_map(E, n_local, g) if n_local < E else None
        a = permute_args(T, K, E, H, input=x, topk_ids=ids, expert_map=emap,
                         n_local_expert=n_local,
                         permuted_input=torch.empty(T * K, H, dtype=torch.bfloat16),
                         expert_first_token_offset=torch.empty(n_local + 1, dtype=torch.int64))
        samples.append(tuple(v.to(dev) if isinstance(v, torch.Tensor) else v
                             for v in a.values()))
    return samples


@pytest.mark.parametrize("i", range(3))
def test_permute_opcheck(i):
    torch.library.opcheck(ops.moe_permute.default, permute_opcheck_samples("cpu")[i])


# ---------------------------------------------- moe_permute_with_scratch, moe_prepare_scatter
def scratch_buffers(slots, n_expert, dev, extra=0):
    """vLLM's MoEPermuteScratch buffers (poisoned: their contents must not matter)."""
    ws = ops.moe_permute_sort_workspace_size(slots, n_expert)
    return (poison(torch.empty(ws + extra, dtype=torch.int8, device=dev)),
            *(poison(torch.empty(slots + extra, dtype=torch.int32, device=dev))
              for _ in range(3)))


def run_permute_with_scratch(x, topk_ids, tei, emap, n_expert, n_local, topk, rows=None,
                             pidx_len=None):
    """moe_permute_with_scratch with run_permute's outputs."""
    dev = x.device
    slots = topk_ids.numel()
    rows = slots if rows is None else rows
    pidx_len = slots if pidx_len is None else pidx_len
    permuted = poison(torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev))
    offsets = poison(torch.empty(n_local + 1, dtype=torch.int64, device=dev))
    inv = poison(torch.empty(topk_ids.shape, dtype=torch.int32, device=dev))
    pidx = poison(torch.empty(pidx_len, dtype=torch.int32, device=dev))
    before = permuted.clone()
    ops.moe_permute_with_scratch(x, topk_ids, tei, emap, n_expert, n_local, topk, permuted,
                                 offsets, inv, pidx, *scratch_buffers(slots, n_expert, dev))
    return permuted, offsets, inv, pidx, before


def run_prepare_scatter(topk_ids, tei, emap, n_expert, n_local):
    """moe_prepare_scatter: (offsets, scatter_idx, sorted_rows[:slots])."""
    dev = topk_ids.device
    slots = topk_ids.numel()
    offsets = poison(torch.empty(n_local + 1, dtype=torch.int64, device=dev))
    scatter = poison(torch.empty(topk_ids.shape, dtype=torch.int32, device=dev))
    ws, experts, rows, for_sort = scratch_buffers(slots, n_expert, dev, extra=3)
    ops.moe_prepare_scatter(topk_ids, tei, emap, n_expert, n_local, offsets, scatter, ws,
                            experts, rows, for_sort)
    return offsets, scatter, rows[:slots]


def permute_case(num_tokens, topk, n_expert, n_local, hidden, dtype, variant, g):
    x = random_rows(num_tokens, hidden, dtype, g)
    ids = random_ids(num_tokens, topk, n_expert, g,
                     torch.int64 if variant == "int64" else torch.int32,
                     invalid=0.2 if variant in ("invalid", "map") else 0.0,
                     skew=variant == "skew")
    slots = num_tokens * topk
    tei = (torch.randperm(slots, generator=g).to(torch.int32) if variant == "srcperm"
           else torch.arange(slots, dtype=torch.int32)).view(num_tokens, topk)
    emap = random_expert_map(n_expert, n_local, g) if (variant == "map" or
                                                       n_local < n_expert) else None
    return x, ids, tei, emap, n_expert, n_local, topk


SCRATCH_CASES = [
    # (num_tokens, topk, n_expert, n_local, hidden)
    (0, 2, 8, 8, 16), (1, 1, 4, 4, 8), (3, 2, 8, 3, 33), (17, 4, 16, 16, 64),
    (64, 6, 130, 40, 24),
]


@pytest.mark.parametrize("num_tokens,topk,n_expert,n_local,hidden", SCRATCH_CASES)
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "skew", "int64", "srcperm"])
def test_scratch_forms_equal_moe_permute(num_tokens, topk, n_expert, n_local, hidden, variant):
    g = seeded(num_tokens * 5 + topk + n_expert + hidden)
    dtype = ROW_DTYPES[(num_tokens + hidden) % len(ROW_DTYPES)]
    args = permute_case(num_tokens, topk, n_expert, n_local, hidden, dtype, variant, g)
    slots = num_tokens * topk
    want = run_permute(*args, rows=slots + 2, pidx_len=slots + 3)
    got = run_permute_with_scratch(*args, rows=slots + 2, pidx_len=slots + 3)
    for a, b, name in zip(got, want, ["permuted_input", "offsets", "inv", "pidx", "poison"]):
        assert_same(a, b, name)  # rows past the valid count: the poison, as moe_permute
    offsets, scatter, rows = run_prepare_scatter(*args[1:6])
    assert_same(offsets, want[1], "expert_first_token_offset")
    assert_same(scatter, want[2], "scatter_idx (moe_permute's inv_permuted_idx)")
    assert_same(rows, want[3][:slots], "sorted_rows (moe_permute's permuted_idx)")


def test_prepare_scatter_by_hand():
    # test_permute_by_hand's routing: 3 tokens, topk 2, experts 1 and 3 local.
    ids = torch.tensor([[3, 1], [0, 3], [1, 2]], dtype=torch.int32)
    tei = torch.arange(6, dtype=torch.int32).view(3, 2)
    emap = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)
    offsets, scatter, rows = run_prepare_scatter(ids, tei, emap, 4, 2)
    assert offsets.tolist() == [0, 2, 4]
    assert scatter.tolist() == [[2, 0], [4, 3], [1, 5]]
    assert rows.tolist() == [1, 4, 0, 3, 6, 6]


def test_sort_workspace_size():
    size = ops.moe_permute_sort_workspace_size
    assert ops.moe_permute_unpermute_supported() is True
    assert size(0, 1) > 0
    # Grows with the slots and the experts; bounded (32 MiB of counts + the bucket arrays).
    assert size(1000, 8) <= size(100000, 8) <= size(100000, 256)
    assert size(2**31 - 1, 65536) <= 4 * ((8 << 20) + 2 * (2 * 65536 + 1) + 1)
    for bad, name in [((-1, 8), "num_expanded_rows"), ((2**31, 8), "num_expanded_rows"),
                      ((10, 0), "n_expert"), ((10, 65537), "n_expert")]:
        with pytest.raises(RuntimeError, match=name):
            size(*bad)


def scratch_args(T=4, K=2, E=8, H=16, **over):
    a = permute_args(T, K, E, H)
    ws, experts, rows, for_sort = scratch_buffers(T * K, E, "cpu")
    a.update(sort_workspace=ws, permuted_experts_id=experts, sorted_row_idx=rows,
             topk_ids_for_sort=for_sort)
    a.update(over)
    return a


def prepare_args(T=4, K=2, E=8, **over):
    ws, experts, rows, for_sort = scratch_buffers(T * K, E, "cpu")
    a = dict(topk_ids=torch.zeros(T, K, dtype=torch.int32),
             token_expert_indices=torch.arange(T * K, dtype=torch.int32).view(T, K),
             expert_map=None, n_expert=E, n_local_expert=E,
             expert_first_token_offset=torch.empty(E + 1, dtype=torch.int64),
             scatter_idx=torch.empty(T, K, dtype=torch.int32), sort_workspace=ws,
             sorted_experts=experts, sorted_rows=rows, topk_ids_for_sort=for_sort)
    a.update(over)
    return a


_WS = ops.moe_permute_sort_workspace_size(8, 8)
SCRATCH_BAD = [
    ("sort_workspace", dict(sort_workspace=torch.empty(_WS - 1, dtype=torch.int8))),
    ("sort_workspace", dict(sort_workspace=torch.empty(_WS, dtype=torch.uint8))),
    ("sort_workspace", dict(sort_workspace=torch.empty(2 * _WS, dtype=torch.int8)[::2])),
    ("permuted_experts_id", dict(permuted_experts_id=torch.empty(7, dtype=torch.int32))),
    ("permuted_experts_id", dict(permuted_experts_id=torch.empty(8, dtype=torch.int64))),
    ("sorted_row_idx", dict(sorted_row_idx=torch.empty(16, dtype=torch.int32)[::2])),
    ("topk_ids_for_sort", dict(topk_ids_for_sort=torch.empty(8))),
    ("topk", dict(topk=3)),
    ("permuted_idx", dict(permuted_idx=torch.empty(7, dtype=torch.int32))),
]
PREPARE_BAD = [
    ("topk_ids", dict(topk_ids=torch.zeros(8, dtype=torch.int32))),
    ("topk_ids", dict(topk_ids=torch.zeros(4, 2))),
    ("token_expert_indices", dict(token_expert_indices=torch.zeros(4, 3, dtype=torch.int32))),
    ("n_local_expert", dict(n_local_expert=9)),
    ("expert_map", dict(expert_map=torch.zeros(7, dtype=torch.int32))),
    ("expert_first_token_offset", dict(expert_first_token_offset=torch.empty(8,
                                                                             dtype=torch.int64))),
    ("scatter_idx", dict(scatter_idx=torch.empty(8, dtype=torch.int32))),
    ("scatter_idx", dict(scatter_idx=torch.empty(4, 2, dtype=torch.int64))),
    ("sort_workspace", dict(sort_workspace=torch.empty(_WS - 1, dtype=torch.int8))),
    ("sorted_experts", dict(sorted_experts=torch.empty(7, dtype=torch.int32))),
    ("sorted_rows", dict(sorted_rows=torch.empty(8, dtype=torch.float32))),
    ("topk_ids_for_sort", dict(topk_ids_for_sort=torch.empty(2, dtype=torch.int32))),
]


@pytest.mark.parametrize("name,over", SCRATCH_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                       enumerate(SCRATCH_BAD)])
def test_permute_with_scratch_bad_inputs(name, over):
    with pytest.raises(RuntimeError, match=f"moe_permute_with_scratch: .*{name}"):
        ops.moe_permute_with_scratch(*scratch_args(**over).values())


@pytest.mark.parametrize("name,over", PREPARE_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                       enumerate(PREPARE_BAD)])
def test_prepare_scatter_bad_inputs(name, over):
    with pytest.raises(RuntimeError, match=f"moe_prepare_scatter: .*{name}"):
        ops.moe_prepare_scatter(*prepare_args(**over).values())


def test_scratch_overlap_rejected():
    a = scratch_args()
    a["sorted_row_idx"] = a["inv_permuted_idx"].view(-1)
    with pytest.raises(RuntimeError, match="sorted_row_idx"):
        ops.moe_permute_with_scratch(*a.values())
    a = prepare_args()
    a["sorted_rows"] = a["scatter_idx"].view(-1)
    with pytest.raises(RuntimeError, match="sorted_rows"):
        ops.moe_prepare_scatter(*a.values())
    a = prepare_args()
    a["topk_ids_for_sort"] = a["topk_ids"].view(-1)
    with pytest.raises(RuntimeError, match="topk_ids_for_sort"):
        ops.moe_prepare_scatter(*a.values())


@pytest.mark.parametrize("i", range(3))
def test_scratch_forms_opcheck(i):
    g = seeded(31 + i)
    T, K, E, H, n_local = [(1, 2, 8, 16, 8), (9, 4, 16, 32, 5), (20, 2, 6, 8, 6)][i]
    args = permute_case(T, K, E, n_local, H, torch.bfloat16, "map" if n_local < E else "plain",
                        g)
    x, ids, tei, emap = args[:4]
    ws, experts, rows, for_sort = scratch_buffers(T * K, E, "cpu")
    outs = (torch.empty(T * K, H, dtype=torch.bfloat16),
            torch.empty(n_local + 1, dtype=torch.int64),
            torch.empty(T, K, dtype=torch.int32), torch.empty(T * K, dtype=torch.int32))
    torch.library.opcheck(ops.moe_permute_with_scratch.default,
                          (x, ids, tei, emap, E, n_local, K, *outs, ws, experts, rows, for_sort))
    torch.library.opcheck(ops.moe_prepare_scatter.default,
                          (ids, tei, emap, E, n_local, outs[1], outs[2], ws, experts, rows,
                           for_sort))


# ------------------------------------------------------------------------------- moe_unpermute
def run_unpermute(perm, weights, inv, offsets, topk, out_rows_stride=None):
    T, H = weights.shape[0], perm.shape[1]
    if out_rows_stride is None:
        out = poison(torch.empty(T, H, dtype=perm.dtype, device=perm.device))
    else:
        out = poison(torch.empty(T, out_rows_stride, dtype=perm.dtype, device=perm.device))[:, :H]
    ops.moe_unpermute(perm, weights, inv, offsets, topk, out)
    return out


UNPERMUTE_CASES = [
    # (num_tokens, topk, hidden, dtype)
    (0, 2, 16, torch.bfloat16),
    (1, 1, 8, torch.float32),
    (1, 8, 64, torch.bfloat16),
    (3, 2, 33, torch.float16),
    (17, 4, 48, torch.float8_e4m3fn),
    (9, 3, 32, torch.float8_e5m2),
    (40, 6, 24, torch.float32),
]


@pytest.mark.parametrize("num_tokens,topk,hidden,dtype", UNPERMUTE_CASES)
@pytest.mark.parametrize("variant", ["plain", "offsets", "invalid", "strided"])
def test_unpermute_cpu_matches_reference(num_tokens, topk, hidden, dtype, variant):
    g = seeded(num_tokens * 13 + topk + hidden)
    slots = num_tokens * topk
    rows = slots + 2
    perm = random_rows(rows, hidden, dtype, g)
    if variant == "strided":
        perm = random_rows(rows, hidden + 5, dtype, g)[:, 2:hidden + 2]
    weights = torch.rand(num_tokens, topk, generator=g)
    inv = torch.randperm(rows, generator=g)[:slots].to(torch.int32).view(num_tokens, topk)
    offsets = None
    if variant == "offsets":
        offsets = torch.tensor([0, slots // 3, slots // 2], dtype=torch.int64)
    if variant == "invalid" and slots:
        inv.view(-1)[::3] = torch.tensor([-1, rows, 1 << 30], dtype=torch.int32).repeat(
            slots)[:len(inv.view(-1)[::3])]
    out = run_unpermute(perm, weights, inv, offsets, topk,
                        out_rows_stride=hidden + 3 if variant == "strided" else None)
    want = ref.moe_unpermute(perm, weights, inv, offsets, topk)
    assert_same(out, want, "hidden_states")


def test_unpermute_by_hand():
    perm = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [5.0, 5.0]])
    weights = torch.tensor([[0.5, 2.0], [1.0, 3.0]])
    inv = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)
    out = run_unpermute(perm, weights, inv, None, 2)
    assert out.tolist() == [[7.0, 14.0], [115.0, 215.0]]
    # With offsets [0, 3]: row 3 is past the valid count and contributes nothing.
    out = run_unpermute(perm, weights, inv, torch.tensor([0, 3]), 2)
    assert out.tolist() == [[7.0, 14.0], [100.0, 200.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_map", [False, True])
def test_permute_unpermute_round_trip(dtype, with_map):
    g = seeded(5)
    T, K, E, H = 23, 4, 12, 40
    x = random_rows(T, H, dtype, g)
    ids = random_ids(T, K, E, g, invalid=0.1)
    emap, n_local = (random_expert_map(E, 5, g), 5) if with_map else (None, E)
    tei = torch.arange(T * K, dtype=torch.int32).view(T, K)
    permuted, offsets, inv, _, _ = run_permute(x, ids, tei, emap, E, n_local, K)
    weights = torch.rand(T, K, generator=g)
    out = run_unpermute(permuted, weights, inv, offsets, K)
    # Direct weighted sum over the local slots, k ascending, fp32.
    local = ref._local_expert(ids, E, emap).view(T, K)
    local = torch.where(local < n_local, local, -1)
    acc = torch.zeros(T, H)
    xf = x.float()
    for k in range(K):
        term = weights[:, k:k + 1] * xf
        acc = torch.where((local[:, k] >= 0)[:, None], acc + term, acc)
    assert_same(out, acc.to(dtype), "round trip")


def unpermute_args(T=4, K=2, H=16, **over):
    a = dict(permuted_hidden_states=torch.zeros(T * K, H), topk_weights=torch.zeros(T, K),
             inv_permuted_idx=torch.zeros(T, K, dtype=torch.int32),
             expert_first_token_offset=None, topk=K, hidden_states=torch.empty(T, H))
    a.update(over)
    return a


UNPERMUTE_BAD = [
    ("permuted_hidden_states", dict(permuted_hidden_states=torch.zeros(8, 16,
                                                                       dtype=torch.int32))),
    ("permuted_hidden_states", dict(permuted_hidden_states=torch.zeros(8))),
    ("permuted_hidden_states", dict(permuted_hidden_states=torch.zeros(16, 8).t())),
    ("topk_weights", dict(topk_weights=torch.zeros(4, 2, dtype=torch.bfloat16))),
    ("topk_weights", dict(topk_weights=torch.zeros(5, 2))),
    ("topk_weights", dict(topk_weights=torch.zeros(8))),
    ("topk_weights", dict(topk_weights=torch.zeros(2, 4).t())),
    ("topk", dict(topk=3)),
    ("inv_permuted_idx", dict(inv_permuted_idx=torch.zeros(7, dtype=torch.int32))),
    ("inv_permuted_idx", dict(inv_permuted_idx=torch.zeros(4, 2, dtype=torch.int64))),
    ("inv_permuted_idx", dict(inv_permuted_idx=torch.zeros(2, 4, dtype=torch.int32).t())),
    ("expert_first_token_offset", dict(expert_first_token_offset=torch.zeros(3,
                                                                             dtype=torch.int32))),
    ("expert_first_token_offset", dict(expert_first_token_offset=torch.zeros(0,
                                                                             dtype=torch.int64))),
    ("hidden_states", dict(hidden_states=torch.empty(4, 15))),
    ("hidden_states", dict(hidden_states=torch.empty(4, 16, dtype=torch.bfloat16))),
    ("hidden_states", dict(hidden_states=torch.empty(16, 4).t())),
]


@pytest.mark.parametrize("name,over", UNPERMUTE_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(UNPERMUTE_BAD)])
def test_unpermute_bad_inputs(name, over):
    with pytest.raises(RuntimeError, match=name):
        ops.moe_unpermute(*unpermute_args(**over).values())


def unpermute_opcheck_samples(dev):
    g = seeded(3)
    samples = []
    for T, K, H, offs in [(1, 2, 16, False), (7, 4, 24, True), (12, 1, 8, False)]:
        perm = random_rows(T * K, 2 * H, torch.bfloat16, g)[:, :H]  # non-contiguous rows
        inv = torch.randperm(T * K, generator=g).to(torch.int32).view(T, K)
        o = torch.tensor([0, T * K // 2, T * K], dtype=torch.int64) if offs else None
        a = unpermute_args(T, K, H, permuted_hidden_states=perm,
                           topk_weights=torch.rand(T, K, generator=g), inv_permuted_idx=inv,
                           expert_first_token_offset=o,
                           hidden_states=torch.empty(T, H, dtype=torch.bfloat16))
        samples.append(tuple(v.to(dev) if isinstance(v, torch.Tensor) else v
                             for v in a.values()))
    return samples


@pytest.mark.parametrize("i", range(3))
def test_unpermute_opcheck(i):
    torch.library.opcheck(ops.moe_unpermute.default, unpermute_opcheck_samples("cpu")[i])


# -------------------------------------------------------------------------------- shuffle_rows
def run_shuffle(x, index, out_stride=None):
    rows, H = index.numel(), x.shape[1]
    if out_stride is None:
        out = poison(torch.empty(rows, H, dtype=x.dtype, device=x.device))
    else:
        out = poison(torch.empty(rows, out_stride, dtype=x.dtype, device=x.device))[:, 1:H + 1]
    ops.shuffle_rows(x, index, out)
    return out


@pytest.mark.parametrize("rows_in,rows_out,hidden", [(0, 3, 8), (5, 0, 8), (1, 1, 1),
                                                     (7, 12, 33), (64, 100, 64)])
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("variant", ["int32", "int64", "invalid", "strided"])
def test_shuffle_rows_cpu_matches_reference(rows_in, rows_out, hidden, dtype, variant):
    g = seeded(rows_in * 31 + rows_out + hidden)
    x = random_rows(rows_in, hidden, dtype, g)
    if variant == "strided":
        x = random_rows(rows_in, hidden + 4, dtype, g)[:, 3:hidden + 3]
    index = torch.randint(0, max(rows_in, 1), (rows_out,), generator=g)
    if variant == "invalid" or rows_in == 0:
        index = torch.where(torch.rand(rows_out, generator=g) < 0.3,
                            torch.tensor([-1, rows_in, 1 << 40])[torch.randint(0, 3, (rows_out,),
                                                                               generator=g)],
                            index)
    index = index.to(torch.int32 if variant in ("int32", "strided") else torch.int64)
    if variant == "invalid":
        index = index.to(torch.int64)
    out = run_shuffle(x, index, out_stride=hidden + 2 if variant == "strided" else None)
    assert_same(out, ref.shuffle_rows(x, index), "output_tensor")


def shuffle_args(**over):
    a = dict(input_tensor=torch.zeros(4, 16), dst2src_map=torch.zeros(6, dtype=torch.int32),
             output_tensor=torch.empty(6, 16))
    a.update(over)
    return a


SHUFFLE_BAD = [
    ("input_tensor", dict(input_tensor=torch.zeros(4, 16, dtype=torch.int64))),
    ("input_tensor", dict(input_tensor=torch.zeros(4))),
    ("input_tensor", dict(input_tensor=torch.zeros(16, 4).t())),
    ("dst2src_map", dict(dst2src_map=torch.zeros(6))),
    ("dst2src_map", dict(dst2src_map=torch.zeros(6, 1, dtype=torch.int32))),
    ("dst2src_map", dict(dst2src_map=torch.zeros(12, dtype=torch.int32)[::2])),
    ("output_tensor", dict(output_tensor=torch.empty(5, 16))),
    ("output_tensor", dict(output_tensor=torch.empty(6, 8))),
    ("output_tensor", dict(output_tensor=torch.empty(6, 16, dtype=torch.float16))),
    ("output_tensor", dict(output_tensor=torch.empty(16, 6).t())),
]


@pytest.mark.parametrize("name,over", SHUFFLE_BAD, ids=[f"{n}-{i}" for i, (n, _) in
                                                       enumerate(SHUFFLE_BAD)])
def test_shuffle_rows_bad_inputs(name, over):
    with pytest.raises(RuntimeError, match=name):
        ops.shuffle_rows(*shuffle_args(**over).values())


def test_shuffle_rows_overlap_rejected():
    buf = torch.zeros(10, 16)
    with pytest.raises(RuntimeError, match="output_tensor"):
        ops.shuffle_rows(buf[:6], torch.zeros(6, dtype=torch.int32), buf[4:])


def shuffle_opcheck_samples(dev):
    g = seeded(9)
    samples = []
    for rows_in, rows_out, H in [(1, 1, 8), (9, 20, 24), (30, 7, 16)]:
        x = random_rows(rows_in, 2 * H, torch.float16, g)[:, ::2].contiguous()
        if rows_in == 9:
            x = random_rows(rows_in, 2 * H, torch.float16, g)[:, :H]  # non-contiguous rows
        index = torch.randint(0, rows_in, (rows_out,), generator=g).to(torch.int32)
        samples.append((x.to(dev), index.to(dev),
                        torch.empty(rows_out, H, dtype=torch.float16, device=dev)))
    return samples


@pytest.mark.parametrize("i", range(3))
def test_shuffle_rows_opcheck(i):
    torch.library.opcheck(ops.shuffle_rows.default, shuffle_opcheck_samples("cpu")[i])


# ============================================================================== GPU (CUDA) tests
def to_dev(*ts, dev="cuda"):
    return tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in ts)


def cpu_all(ts):
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in ts)


# Shapes chosen to run both sort paths: one block (<= 8192 slots, <= 1024 buckets) and the
# multi-kernel path (more slots, or more experts), including T*topk > 65535.
GPU_ALIGN_CASES = [
    (1, 1, 8, 16), (1, 8, 256, 64), (3, 2, 8, 1), (33, 4, 16, 16), (255, 8, 64, 128),
    (1024, 8, 1024, 16),  # 8192 slots, 1024 experts: the largest one-block case
    (1025, 8, 128, 64),   # first multi-kernel case by slots
    (2, 4, 1025, 16),     # multi-kernel by experts
    (9000, 8, 256, 64),   # 72000 slots > 65535
    (3000, 6, 4096, 128),
    (40000, 4, 8, 1),
    (700, 2, 3, 7),
]


@gpu
@pytest.mark.parametrize("num_tokens,topk,num_experts,block_size", GPU_ALIGN_CASES)
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "skew", "int64"])
def test_align_gpu_matches_cpu(num_tokens, topk, num_experts, block_size, variant):
    g = seeded(num_tokens + topk + num_experts + block_size)
    ids = random_ids(num_tokens, topk, num_experts, g,
                     torch.int64 if variant == "int64" else torch.int32,
                     invalid=0.2 if variant in ("invalid", "map") else 0.0,
                     skew=variant == "skew")
    emap = random_expert_map(num_experts, max(1, num_experts // 4), g) \
        if variant == "map" else None
    want = run_align(ids, num_experts, block_size, emap)
    got = cpu_all(run_align(*to_dev(ids, num_experts, block_size, emap)))
    check_align_invariants(ids, num_experts, block_size, emap, got)
    for a, b, name in zip(got, want, ["sorted_token_ids", "experts_ids", "num_tokens_post_pad",
                                      "scatter_idx"]):
        assert_same(a, b, name)


@gpu
def test_align_gpu_edge_cases():
    for ids, E, bs in [(torch.zeros(0, 2, dtype=torch.int32), 8, 16),
                       (torch.full((3000, 8), 5, dtype=torch.int32), 8, 16),
                       (torch.full((5, 2), -3, dtype=torch.int32), 8, 16),
                       (torch.tensor([[7]], dtype=torch.int32), 8, 128)]:
        want = run_align(ids, E, bs, sorted_len=ref.moe_align_block_size_len(ids.numel(), E,
                                                                             bs) + 100)
        got = run_align(ids.cuda(), E, bs,
                        sorted_len=ref.moe_align_block_size_len(ids.numel(), E, bs) + 100)
        for a, b in zip(got, want):
            assert_same(a, b)


@gpu
@pytest.mark.parametrize("num_tokens,topk,n_expert,n_local,hidden,dtype", [
    (1, 1, 8, 8, 16, torch.bfloat16),
    (1, 8, 256, 256, 7168, torch.bfloat16),
    (5, 2, 8, 3, 33, torch.float16),
    (64, 8, 128, 128, 2048, torch.float8_e4m3fn),
    (100, 4, 16, 16, 17, torch.float8_e5m2),
    (1000, 8, 256, 64, 256, torch.float32),   # > 8192 slots: multi-kernel path
    (9000, 8, 64, 64, 64, torch.bfloat16),    # 72000 slots > 65535
    (50, 4, 1024, 100, 128, torch.bfloat16),  # > 1024 buckets: multi-kernel path
    (300, 6, 60, 60, 1, torch.float16),       # 2-byte rows
])
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "srcperm"])
def test_permute_gpu_matches_cpu(num_tokens, topk, n_expert, n_local, hidden, dtype, variant):
    g = seeded(num_tokens + n_expert + hidden)
    x = random_rows(num_tokens, hidden, dtype, g)
    ids = random_ids(num_tokens, topk, n_expert, g,
                     invalid=0.15 if variant in ("invalid", "map") else 0.0)
    slots = num_tokens * topk
    tei = (torch.randperm(slots, generator=g).to(torch.int32) if variant == "srcperm"
           else torch.arange(slots, dtype=torch.int32)).view(num_tokens, topk)
    emap = random_expert_map(n_expert, n_local, g) if (variant == "map" or
                                                       n_local < n_expert) else None
    args = (x, ids, tei, emap, n_expert, n_local, topk)
    want = run_permute(*args, rows=slots + 4, pidx_len=slots + 2)
    got = cpu_all(run_permute(*to_dev(*args), rows=slots + 4, pidx_len=slots + 2))
    for a, b, name in zip(got[:4], want[:4], ["permuted_input", "offsets", "inv", "pidx"]):
        assert_same(a, b, name)
    nv = int(want[1][-1])
    assert_same(got[0][nv:], got[4][nv:], "rows past the valid count untouched")


@gpu
@pytest.mark.parametrize("num_tokens,topk,n_expert,n_local", [
    (1, 1, 8, 8), (5, 2, 8, 3), (64, 8, 128, 128),
    (1000, 8, 256, 64),   # > 8192 slots: the multi-kernel sort, in the caller's workspace
    (9000, 8, 64, 64),    # 72000 slots
    (50, 4, 1024, 100),   # > 1024 buckets
    (40000, 8, 256, 256),  # 320000 slots, 513 buckets
])
@pytest.mark.parametrize("variant", ["plain", "map", "invalid", "int64", "srcperm"])
def test_scratch_forms_gpu_match_cpu(num_tokens, topk, n_expert, n_local, variant):
    g = seeded(num_tokens + n_expert + n_local)
    args = permute_case(num_tokens, topk, n_expert, n_local, 24, torch.bfloat16, variant, g)
    slots = num_tokens * topk
    want = run_permute(*args, rows=slots, pidx_len=slots + 2)
    got = cpu_all(run_permute_with_scratch(*to_dev(*args), rows=slots, pidx_len=slots + 2))
    for a, b, name in zip(got[:4], want[:4], ["permuted_input", "offsets", "inv", "pidx"]):
        assert_same(a, b, name)
    got = cpu_all(run_prepare_scatter(*to_dev(*args[1:6])))
    for a, b, name in zip(got, (want[1], want[2], want[3][:slots]),
                          ["offsets", "scatter_idx", "sorted_rows"]):
        assert_same(a, b, name)


@gpu
def test_scratch_forms_gpu_allocate_nothing_and_replay_in_a_graph():
    """With the caller's scratch the multi-kernel sort allocates nothing (vLLM locks its
    workspace before graph capture), and a captured graph replays with new routing."""
    g = seeded(8)
    T, K, E, H = 2000, 8, 128, 64
    dev = "cuda"
    x = random_rows(T, H, torch.bfloat16, g).to(dev)
    ids = random_ids(T, K, E, g).to(dev)
    tei = torch.arange(T * K, dtype=torch.int32, device=dev).view(T, K)
    scratch = scratch_buffers(T * K, E, dev)
    bufs = (torch.empty(T * K, H, dtype=torch.bfloat16, device=dev),
            torch.empty(E + 1, dtype=torch.int64, device=dev),
            torch.empty(T, K, dtype=torch.int32, device=dev),
            torch.empty(T * K, dtype=torch.int32, device=dev))
    prep = (torch.empty(E + 1, dtype=torch.int64, device=dev),
            torch.empty(T, K, dtype=torch.int32, device=dev))

    def body():
        ops.moe_permute_with_scratch(x, ids, tei, None, E, E, K, *bufs, *scratch)
        ops.moe_prepare_scatter(ids, tei, None, E, E, *prep, *scratch)

    body()
    torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
    body()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for rep in range(3):
        ids.copy_(random_ids(T, K, E, g, skew=rep == 1))
        graph.replay()
        got = [t.cpu() for t in (*bufs, *prep)]
        want = run_permute(*cpu_all((x, ids, tei)), None, E, E, K)
        for a, b, name in zip(got, (*want[:4], want[1], want[2]),
                              ["permuted", "offsets", "inv", "pidx", "prep offsets", "scatter"]):
            assert_same(a, b, f"replay {rep}: {name}")


@gpu
@pytest.mark.parametrize("num_tokens,topk,hidden,dtype", [
    (1, 1, 16, torch.bfloat16), (1, 8, 7168, torch.bfloat16), (7, 2, 33, torch.float16),
    (64, 8, 2048, torch.float8_e4m3fn), (100, 4, 24, torch.float8_e5m2),
    (9000, 8, 64, torch.bfloat16), (300, 6, 4096, torch.float32), (17, 3, 1, torch.float32),
])
@pytest.mark.parametrize("variant", ["plain", "offsets", "invalid", "misaligned"])
def test_unpermute_gpu_matches_cpu(num_tokens, topk, hidden, dtype, variant):
    g = seeded(num_tokens + topk + hidden)
    slots = num_tokens * topk
    rows = slots + 3
    perm = random_rows(rows, hidden, dtype, g)
    if variant == "misaligned":  # row starts off the 16-byte grid: scalar path
        perm = random_rows(rows, hidden + 1, dtype, g)[:, 1:]
    weights = torch.rand(num_tokens, topk, generator=g)
    inv = torch.randperm(rows, generator=g)[:slots].to(torch.int32).view(num_tokens, topk)
    offsets = torch.tensor([0, slots // 2, slots - 1], dtype=torch.int64) \
        if variant == "offsets" else None
    if variant == "invalid":
        inv.view(-1)[::4] = -1
        inv.view(-1)[1::5] = rows + 100
    want = run_unpermute(perm, weights, inv, offsets, topk)
    got = run_unpermute(*to_dev(perm, weights, inv, offsets), topk)
    assert_same(got, want, "hidden_states")
    if dtype in (torch.bfloat16, torch.float32) and variant == "plain":
        assert got.float().abs().sum() > 0


@gpu
@pytest.mark.parametrize("rows_in,rows_out,hidden", [(1, 1, 1), (7, 12, 33), (64, 100, 64),
                                                     (4096, 70000, 16), (100, 50, 7168),
                                                     (0, 5, 8)])
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("variant", ["int32", "int64", "invalid", "misaligned"])
def test_shuffle_rows_gpu_matches_cpu(rows_in, rows_out, hidden, dtype, variant):
    g = seeded(rows_in + rows_out + hidden)
    x = random_rows(rows_in, hidden, dtype, g)
    if variant == "misaligned":
        x = random_rows(rows_in, hidden + 1, dtype, g)[:, 1:]
    index = torch.randint(0, max(rows_in, 1), (rows_out,), generator=g)
    if variant == "invalid" or rows_in == 0:
        index = torch.where(torch.rand(rows_out, generator=g) < 0.3, -1, index)
        index[::7] = rows_in
    index = index.to(torch.int64 if variant in ("int64", "invalid") else torch.int32)
    want = run_shuffle(x, index)
    got = run_shuffle(*to_dev(x, index))
    assert_same(got, want, "output_tensor")


@gpu
def test_permute_unpermute_gpu_deterministic():
    g = seeded(21)
    T, K, E, H = 3000, 8, 64, 512
    x = random_rows(T, H, torch.bfloat16, g).cuda()
    ids = random_ids(T, K, E, g, skew=True).cuda()
    tei = torch.arange(T * K, dtype=torch.int32, device="cuda").view(T, K)
    weights = torch.rand(T, K, generator=g).cuda()
    first = None
    for _ in range(20):
        out = run_permute(x, ids, tei, None, E, E, K)[:4]
        y = run_unpermute(out[0], weights, out[2], out[1], K)
        a = run_align(ids, E, 64)
        res = [t.cpu() for t in (*out, y, *a)]
        if first is None:
            first = res
        else:
            for r0, r in zip(first, res):
                assert_same(r, r0, "rerun")


@gpu
def test_ops_gpu_cuda_graph_replay():
    """Capture align + permute + unpermute + shuffle once; replay with new routing (new
    per-expert counts) and data; every replay equals eager. Fails on any host sync."""
    g = seeded(4)
    T, K, E, H, bs = 300, 4, 32, 128, 16
    x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(T, K, dtype=torch.int32, device="cuda")
    w = torch.zeros(T, K, device="cuda")
    tei = torch.arange(T * K, dtype=torch.int32, device="cuda").view(T, K)
    n = ref.moe_align_block_size_len(T * K, E, bs)
    bufs = dict(sorted=torch.empty(n, dtype=torch.int32, device="cuda"),
                blocks=torch.empty((n + bs - 1) // bs, dtype=torch.int32, device="cuda"),
                pad=torch.empty(1, dtype=torch.int32, device="cuda"),
                scatter=torch.empty(T * K, dtype=torch.int32, device="cuda"),
                perm=torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda"),
                off=torch.empty(E + 1, dtype=torch.int64, device="cuda"),
                inv=torch.empty(T, K, dtype=torch.int32, device="cuda"),
                pidx=torch.empty(T * K, dtype=torch.int32, device="cuda"),
                y=torch.empty(T, H, dtype=torch.bfloat16, device="cuda"),
                shuf=torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda"))

    def body():
        ops.moe_align_block_size(ids, E, bs, bufs["sorted"], bufs["blocks"], bufs["pad"], None,
                                 bufs["scatter"])
        ops.moe_permute(x, ids, tei, None, E, E, K, bufs["perm"], bufs["off"], bufs["inv"],
                        bufs["pidx"])
        ops.moe_unpermute(bufs["perm"], w, bufs["inv"], bufs["off"], K, bufs["y"])
        ops.shuffle_rows(x, bufs["pidx"], bufs["shuf"])

    body()  # warm up (workspace allocations) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for rep in range(6):
        x.copy_(random_rows(T, H, torch.bfloat16, g))
        ids.copy_(random_ids(T, K, E, g, skew=rep % 2 == 1))
        w.copy_(torch.rand(T, K, generator=g))
        graph.replay()
        replay = {k: v.clone() for k, v in bufs.items()}
        body()
        for k in bufs:
            assert_same(replay[k], bufs[k], f"replay {rep}: {k}")


@gpu
def test_gather_ops_gpu_64bit_offsets():
    """Rows past 2^31 bytes: the gathers must use 64-bit row offsets."""
    H = 4096  # bf16: 8 KiB rows; 2^31 bytes = 262144 rows
    rows = 262144 + 300
    x = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
    x[-1000:].copy_(torch.randn(1000, H, device="cuda"))
    x[:10].copy_(torch.randn(10, H, device="cuda"))
    index = torch.tensor([rows - 1, 3, rows - 500, rows], dtype=torch.int64, device="cuda")
    out = run_shuffle(x, index)
    assert torch.equal(out[:3], x[index[:3]]) and (out[3] == 0).all()
    # moe_permute with topk 1 routed so that late tokens land late in permuted_input.
    ids = torch.zeros(rows, 1, dtype=torch.int32, device="cuda")
    ids[-1000:] = 1
    tei = torch.arange(rows, dtype=torch.int32, device="cuda").view(rows, 1)
    permuted = torch.empty_like(x)
    offsets = torch.empty(3, dtype=torch.int64, device="cuda")
    inv = torch.empty(rows, 1, dtype=torch.int32, device="cuda")
    pidx = torch.empty(rows, dtype=torch.int32, device="cuda")
    ops.moe_permute(x, ids, tei, None, 2, 2, 1, permuted, offsets, inv, pidx)
    assert offsets.tolist() == [0, rows - 1000, rows]
    assert torch.equal(permuted[-1000:], x[-1000:]) and torch.equal(permuted[:10], x[:10])
    y = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
    ops.moe_unpermute(permuted, torch.ones(rows, 1, device="cuda"), inv, offsets, 1, y)
    assert torch.equal(y[-1000:], x[-1000:])


@gpu
def test_ops_gpu_reject_bad_inputs():
    with pytest.raises(RuntimeError, match="sorted_token_ids"):
        a = align_args(torch.zeros(4, 2, dtype=torch.int32, device="cuda"), 4, 8)
        call_align(a)  # outputs on the CPU
    a = permute_args(**{k: v.cuda() if isinstance(v, torch.Tensor) else v
                        for k, v in permute_args().items()})
    a["permuted_idx"] = torch.empty(8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="permuted_idx"):
        call_permute(a)
    a = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in unpermute_args().items()}
    a["topk_weights"] = torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match="topk_weights"):
        ops.moe_unpermute(*a.values())
    a = {k: v.cuda() for k, v in shuffle_args().items()}
    a["dst2src_map"] = torch.zeros(6, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="dst2src_map"):
        ops.shuffle_rows(*a.values())
    # A few of the CPU cases again on the GPU (only those whose tensors stay invalid once
    # copied: .cuda() makes strided tensors contiguous), plus a strided CUDA tensor.
    for i in (0, 3, 10, 12, 15, 17, 20, 22):
        name, over = PERMUTE_BAD[i]
        a = {k: v.cuda() if isinstance(v, torch.Tensor) else v
             for k, v in permute_args(**over).items()}
        with pytest.raises(RuntimeError, match=name):
            call_permute(a)
    a = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in permute_args().items()}
    a["permuted_idx"] = torch.empty(16, dtype=torch.int32, device="cuda")[::2]
    with pytest.raises(RuntimeError, match="permuted_idx"):
        call_permute(a)


@gpu
@pytest.mark.parametrize("i", range(3))
def test_ops_gpu_opcheck(i):
    torch.library.opcheck(ops.moe_align_block_size.default, align_opcheck_samples("cuda")[i])
    torch.library.opcheck(ops.moe_permute.default, permute_opcheck_samples("cuda")[i])
    torch.library.opcheck(ops.moe_unpermute.default, unpermute_opcheck_samples("cuda")[i])
    torch.library.opcheck(ops.shuffle_rows.default, shuffle_opcheck_samples("cuda")[i])


# ---------------------------------------------------------------- input audit: shared rules
# Outputs are checked against every other argument by the memory span they can touch (not only
# their first numel elements), outputs may not be broadcast (stride 0), and read-only inputs
# may be. The rules live in csrc/checks/permute.cpp: each *_cpu test has a GPU twin.
def _dev_args(args, dev):
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _permute_audit_calls(dev):
    i32 = dict(dtype=torch.int32, device=dev)
    ids = torch.zeros(4, 2, **i32)
    cases = []

    def align(**over):
        a = _dev_args(align_args(ids, 4, 8), dev)
        a.update(over)
        return lambda: call_align(a)

    sorted_ids = torch.zeros(36, **i32)
    experts = torch.zeros(5, **i32)
    cases += [
        ("sorted_token_ids must not overlap scatter_idx",
         align(sorted_token_ids=sorted_ids, scatter_idx=sorted_ids[:8])),
        ("experts_ids must not overlap num_tokens_post_pad",
         align(experts_ids=experts, num_tokens_post_pad=experts[4:])),
        ("sorted_token_ids must not overlap topk_ids",
         align(sorted_token_ids=sorted_ids, topk_ids=sorted_ids[:8].view(4, 2))),
    ]

    def permute(**over):
        a = _dev_args(permute_args(), dev)
        a.update(over)
        return lambda: call_permute(a)

    idx = torch.zeros(16, **i32)
    rows = torch.zeros(16, 16, device=dev)
    tei = torch.arange(8, **i32).view(4, 2)
    cases += [
        ("inv_permuted_idx must not overlap permuted_idx",
         permute(inv_permuted_idx=idx[:8].view(4, 2), permuted_idx=idx[:8])),
        ("permuted_input is written by the op and must not have stride 0",
         permute(permuted_input=torch.empty(1, 16, device=dev).expand(8, 16))),
        # permuted_input rows 0, 2, .., 14 of rows; input rows 9..12 hold its rows 10 and 12,
        # past permuted_input's first numel elements.
        ("permuted_input must not overlap input",
         permute(permuted_input=rows[::2], input=rows[9:13])),
        ("permuted_idx must not overlap token_expert_indices",
         permute(token_expert_indices=tei, permuted_idx=tei.view(-1))),
    ]

    def unpermute(**over):
        a = _dev_args(unpermute_args(), dev)
        a.update(over)
        return lambda: ops.moe_unpermute(*a.values())

    hs = torch.zeros(4, 16, device=dev)
    buf = torch.zeros(24, 16, device=dev)
    cases += [
        ("hidden_states is written by the op and must not have stride 0",
         unpermute(hidden_states=torch.empty(1, 16, device=dev).expand(4, 16))),
        ("hidden_states must not overlap topk_weights",
         unpermute(hidden_states=hs, topk_weights=hs[0, :8].view(4, 2))),
        ("hidden_states must not overlap permuted_hidden_states",
         unpermute(permuted_hidden_states=buf[:16:2], hidden_states=buf[9:13])),
    ]

    def shuffle(**over):
        a = _dev_args(shuffle_args(), dev)
        a.update(over)
        return lambda: ops.shuffle_rows(*a.values())

    out = torch.zeros(6, 16, device=dev)
    sbuf = torch.zeros(12, 16, device=dev)
    cases += [
        ("output_tensor is written by the op and must not have stride 0",
         shuffle(output_tensor=torch.empty(1, 16, device=dev).expand(6, 16))),
        ("output_tensor must not overlap dst2src_map",
         shuffle(output_tensor=out, dst2src_map=out.view(torch.int32)[0, :6])),
        # input rows 0, 3, 6, 9 of sbuf; the output's rows 4..9 hold two of them.
        ("output_tensor must not overlap input_tensor",
         shuffle(input_tensor=sbuf[::3], output_tensor=sbuf[4:10])),
    ]
    return cases


def _audit_ids(calls):
    return [f"{i}-{m.split(' must')[0]}" for i, (m, _) in enumerate(calls)]


@pytest.mark.parametrize("case", range(len(_permute_audit_calls("cpu"))),
                         ids=_audit_ids(_permute_audit_calls("cpu")))
def test_permute_family_input_audit_cpu(case):
    message, call = _permute_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_permute_audit_calls("cpu"))),
                         ids=_audit_ids(_permute_audit_calls("cpu")))
def test_permute_family_input_audit_cuda(case):
    message, call = _permute_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def _align_buffers_zero_block_size(dev):
    import hopper_moe.ops as hops
    with pytest.raises(RuntimeError, match="block_size must be > 0"):
        hops.moe_align_block_size_buffers(torch.zeros(4, 2, dtype=torch.int32, device=dev), 4, 0)
    with pytest.raises(RuntimeError, match="block_size must be > 0"):
        hops.moe_align_block_size_buffers(torch.zeros(4, 2, dtype=torch.int32, device=dev), 4, -8)
    with pytest.raises(RuntimeError, match="block_size must be in"):
        a = align_args(torch.zeros(4, 2, dtype=torch.int32), 4, 8)
        call_align(_dev_args(dict(a, block_size=0), dev))


def test_align_buffers_zero_block_size_cpu():
    _align_buffers_zero_block_size("cpu")


@gpu
def test_align_buffers_zero_block_size_cuda():
    _align_buffers_zero_block_size("cuda")


def _broadcast_inputs_accepted(dev):
    """Read-only inputs with a stride-0 (broadcast) row dimension are read like their
    materialized copy."""
    g = seeded(3)
    row = torch.randn(1, 16, generator=g).to(dev)
    x = row.expand(4, 16)
    index = torch.tensor([3, 0, 1, 1, 2, 0], dtype=torch.int32, device=dev)
    out = poison(torch.empty(6, 16, device=dev))
    ops.shuffle_rows(x, index, out)
    assert torch.equal(out, row.expand(6, 16))
    perm = row.expand(8, 16)
    weights = torch.full((4, 2), 0.5, device=dev)
    inv = torch.arange(8, dtype=torch.int32, device=dev).view(4, 2)
    hs = poison(torch.empty(4, 16, device=dev))
    ops.moe_unpermute(perm, weights, inv, None, 2, hs)
    torch.testing.assert_close(hs, row.expand(4, 16))


def test_broadcast_inputs_accepted_cpu():
    _broadcast_inputs_accepted("cpu")


@gpu
def test_broadcast_inputs_accepted_cuda():
    _broadcast_inputs_accepted("cuda")
