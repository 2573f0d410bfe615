"""Seeded shape fuzz of the routing -> align/permute -> unpermute/sum pipeline.

Every case draws T (0..300, sometimes up to 3000), E (1..300), topk (1..min(E, 10)), H (1..600,
odd sizes included), dtypes, block_size, an optional expert_map (random local subset, -1
elsewhere) and optionally skewed (Zipf) or degenerate routing, then runs on one device

  topk_softmax(random logits) -> moe_align_block_size -> moe_permute -> moe_unpermute, and
  moe_sum over the permuted rows gathered back to [T, K, H] (with topk_ids and expert_map)

with every output poisoned before its op runs, and compares each stage with the
hopper_moe.reference definitions (exact; routing weights at 1e-5 and routing ids exact except
between near-tied experts). The GPU fuzz also compares every CUDA output with the CPU op's, bit
for bit. A failing case prints one line with its seed and parameters; rerun exactly that case:

    HOPPER_MOE_FUZZ_SEED=<seed> python -m pytest tests/test_fuzz.py -q
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from conftest import gpu, poison, seeded

import hopper_moe
from hopper_moe import reference as ref

OPS = torch.ops.hopper_moe
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
_ONE_SEED = os.environ.get("HOPPER_MOE_FUZZ_SEED")

CPU_BLOCKS, CPU_CASES_PER_BLOCK = 4, 60  # 240 CPU cases
GPU_BLOCKS, GPU_CASES_PER_BLOCK = 5, 100  # 500 GPU cases
GPU_SEED_BASE = 100_000


@dataclass
class Case:
    seed: int
    num_tokens: int
    num_experts: int
    topk: int
    hidden: int
    dtype: torch.dtype
    logits_dtype: torch.dtype
    block_size: int
    renormalize: bool
    n_local: int  # == num_experts without an expert map
    use_map: bool
    skew: bool
    special_rows: bool

    def repro(self) -> str:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return (f"seed={self.seed} T={self.num_tokens} E={self.num_experts} topk={self.topk} "
                f"H={self.hidden} dtype={name(self.dtype)} logits={name(self.logits_dtype)} "
                f"block_size={self.block_size} renormalize={self.renormalize} "
                f"expert_map={f'{self.n_local}/{self.num_experts}' if self.use_map else None} "
                f"skew={self.skew} special_rows={self.special_rows} "
                f"(rerun: HOPPER_MOE_FUZZ_SEED={self.seed} pytest tests/test_fuzz.py)")


def draw_case(seed: int) -> Case:
    r = random.Random(seed)
    num_tokens = r.randint(301, 3000) if r.random() < 0.04 else r.randint(0, 300)
    if r.random() < 0.1:
        num_tokens = r.choice([0, 1, 2, 3])
    num_experts = r.choice([r.randint(1, 16), r.randint(1, 300), r.choice([8, 64, 128, 256])])
    topk = r.randint(1, min(num_experts, 10))
    hidden = r.choice([r.randint(1, 600), r.randrange(1, 600, 2), r.choice([1, 8, 64, 128, 512])])
    use_map = r.random() < 0.4
    n_local = r.randint(1, num_experts) if use_map else num_experts
    return Case(seed=seed, num_tokens=num_tokens, num_experts=num_experts, topk=topk,
                hidden=hidden, dtype=r.choice(FLOATS),
                logits_dtype=r.choice([torch.float32, torch.float32] + FLOATS),
                block_size=r.choice([1, 2, 16, 32, 64, 128, r.randint(1, 300)]),
                renormalize=r.random() < 0.5, n_local=n_local, use_map=use_map,
                skew=r.random() < 0.3, special_rows=r.random() < 0.1)


def make_inputs(c: Case):
    """CPU tensors: logits [T, E], hidden [T, H], expert_map [E] int32 or None."""
    g = seeded(c.seed)
    t, e = c.num_tokens, c.num_experts
    logits = torch.randn((t, e), generator=g) * (0.5 + 3 * torch.rand((), generator=g))
    if c.skew:  # Zipf popularity: expert of rank r gets log-weight -s*log(r)
        rank = torch.randperm(e, generator=g).float() + 1
        logits = logits - (1.0 + torch.rand((), generator=g)) * 2.0 * torch.log(rank)
    if c.special_rows and t > 0:
        rows = torch.randint(0, t, (min(t, 6),), generator=g)
        logits[rows[0]] = 0.25  # all experts tied
        logits[rows[-1], torch.randint(0, e, (1,), generator=g)] = float("nan")
        if len(rows) > 2:
            logits[rows[1]] = float("-inf")
            logits[rows[2], 0] = float("inf")
    logits = logits.to(c.logits_dtype)
    hidden = torch.randn((t, c.hidden), generator=g).to(c.dtype)
    expert_map = None
    if c.use_map:
        local = torch.randperm(e, generator=g)[: c.n_local]
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(c.n_local, dtype=torch.int32)
    return logits, hidden, expert_map


def run_pipeline(c: Case, logits, hidden, expert_map, device: str) -> dict:
    """Run the ops on `device` on poisoned outputs; returns every output (on the CPU)."""
    t, e, k, h = c.num_tokens, c.num_experts, c.topk, c.hidden
    dev = dict(device=device)
    logits, hidden = logits.to(device), hidden.to(device)
    emap = None if expert_map is None else expert_map.to(device)
    i32 = dict(dtype=torch.int32, **dev)
    out = {}

    w = poison(torch.empty((t, k), dtype=torch.float32, **dev))
    ids = poison(torch.empty((t, k), **i32))
    tei = poison(torch.empty((t, k), **i32))
    OPS.topk_softmax(w, ids, tei, logits, c.renormalize, None, None)
    out.update(weights=w, ids=ids, token_expert_indices=tei)

    sorted_ids, experts_ids, ntpp = hopper_moe.ops.moe_align_block_size_buffers(
        ids, e, c.block_size)
    scatter = torch.empty((t * k,), **i32)
    for buf in (sorted_ids, experts_ids, ntpp, scatter):
        poison(buf)
    OPS.moe_align_block_size(ids, e, c.block_size, sorted_ids, experts_ids, ntpp, emap, scatter)
    out.update(sorted_token_ids=sorted_ids, experts_ids=experts_ids, num_tokens_post_pad=ntpp,
               scatter_idx=scatter)

    slot_ids = torch.arange(t * k, **i32).view(t, k)
    permuted = poison(torch.empty((t * k, h), dtype=c.dtype, **dev))
    offsets = poison(torch.empty((c.n_local + 1,), dtype=torch.int64, **dev))
    inv = poison(torch.empty((t, k), **i32))
    permuted_idx = poison(torch.empty((t * k,), **i32))
    OPS.moe_permute(hidden, ids, slot_ids, emap, e, c.n_local, k, permuted, offsets, inv,
                    permuted_idx)
    out.update(permuted=permuted, expert_first_token_offset=offsets, inv_permuted_idx=inv,
               permuted_idx=permuted_idx)

    unpermuted = poison(torch.empty((t, h), dtype=c.dtype, **dev))
    OPS.moe_unpermute(permuted, w, inv, offsets, k, unpermuted)
    out["unpermuted"] = unpermuted

    # Each slot's permuted row back in [T, K, H]; rows of skipped slots hold the NaN poison,
    # which moe_sum must skip through topk_ids/expert_map.
    gathered = permuted[inv.long().clamp(0, max(t * k - 1, 0)).view(-1)].view(t, k, h)
    summed = poison(torch.empty((t, h), dtype=c.dtype, **dev))
    OPS.moe_sum(gathered, summed, ids, emap)
    weighted = w[:, :, None] * gathered.float()
    weighted_sum = poison(torch.empty((t, h), dtype=torch.float32, **dev))
    OPS.moe_sum(weighted, weighted_sum, ids, emap)
    out.update(gathered=gathered, summed=summed, weighted_sum=weighted_sum)
    return {name: v.cpu() for name, v in out.items()}


def _exact(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True,
                               msg=lambda m: f"{what}: {m.splitlines()[0]} "
                                             f"{m.splitlines()[2] if len(m.splitlines()) > 2 else ''}")


def check_routing(c: Case, logits, got: dict) -> None:
    want_w, want_ids, want_tei = ref.topk_softmax(logits, c.topk, c.renormalize)
    _exact(got["token_expert_indices"], want_tei, "token_expert_indices")
    ids = got["ids"].long()
    assert ((ids >= 0) & (ids < c.num_experts)).all(), "topk ids out of [0, E)"
    if c.topk > 1 and c.num_tokens > 0:
        s = torch.sort(ids, dim=1).values
        assert (s[:, 1:] != s[:, :-1]).all(), "duplicate topk ids in a row"
    same = (ids == want_ids.long()).all(dim=1)
    torch.testing.assert_close(got["weights"][same], want_w[same], rtol=1e-5, atol=1e-6,
                               equal_nan=True, msg=lambda m: f"routing weights: {m.splitlines()[0]}")
    if not same.all():  # only near ties may pick different experts
        probs = ref.topk_softmax(logits, c.num_experts, False)
        full = torch.empty((c.num_tokens, c.num_experts))
        full.scatter_(1, probs[1].long(), probs[0])
        rows = (~same).nonzero().flatten()
        got_p = torch.sort(full[rows].gather(1, ids[rows]), dim=1).values
        want_p = torch.sort(full[rows].gather(1, want_ids[rows].long()), dim=1).values
        torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"routing ids differ beyond near ties, rows "
                                                 f"{rows[:5].tolist()}: {m.splitlines()[0]}")
        torch.testing.assert_close(torch.sort(got["weights"][rows], dim=1).values,
                                   torch.sort(want_w[rows], dim=1).values, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"routing weights (near-tie rows): {m}")


def check_against_reference(c: Case, logits, hidden, expert_map, got: dict) -> None:
    """Each stage vs the reference, fed with the stage inputs the op saw."""
    check_routing(c, logits, got)
    ids, w = got["ids"], got["weights"]
    t, k = c.num_tokens, c.topk

    want = ref.moe_align_block_size(ids, c.num_experts, c.block_size, expert_map,
                                    got["sorted_token_ids"].numel(), got["experts_ids"].numel())
    for name, v in zip(["sorted_token_ids", "experts_ids", "num_tokens_post_pad", "scatter_idx"],
                       want):
        _exact(got[name], v, f"moe_align_block_size {name}")

    slot_ids = torch.arange(t * k, dtype=torch.int32).view(t, k)
    p_in, p_off, p_inv, p_idx = ref.moe_permute(hidden, ids, slot_ids, expert_map,
                                                c.num_experts, c.n_local, k, t * k)
    num_valid = p_in.shape[0]
    _exact(got["expert_first_token_offset"], p_off, "moe_permute expert_first_token_offset")
    _exact(got["permuted"][:num_valid], p_in, "moe_permute permuted_input")
    _exact(got["inv_permuted_idx"], p_inv, "moe_permute inv_permuted_idx")
    _exact(got["permuted_idx"], p_idx, "moe_permute permuted_idx")

    want_out = ref.moe_unpermute(got["permuted"], w, got["inv_permuted_idx"],
                                 got["expert_first_token_offset"], k)
    _exact(got["unpermuted"], want_out, "moe_unpermute")

    _exact(got["summed"], ref.moe_sum(got["gathered"], ids, expert_map), "moe_sum")
    weighted = w[:, :, None] * got["gathered"].float()
    _exact(got["weighted_sum"], ref.moe_sum(weighted, ids, expert_map), "moe_sum (weighted)")
    # Cross-op: summing the weighted rows in fp32 is what moe_unpermute does.
    _exact(got["weighted_sum"].to(c.dtype), got["unpermuted"], "moe_sum vs moe_unpermute")
    if num_valid > 0 and c.hidden > 0:
        assert not torch.isnan(got["permuted"][:num_valid].float()).any(), "permuted rows unset"


def fuzz(seeds, devices) -> list[str]:
    failures, ran = [], 0
    for seed in seeds:
        ran += 1
        c = draw_case(seed)
        logits, hidden, expert_map = make_inputs(c)
        stage = "cpu ops"
        try:
            cpu = run_pipeline(c, logits, hidden, expert_map, "cpu")
            stage = "cpu vs reference"
            check_against_reference(c, logits, hidden, expert_map, cpu)
            if "cuda" in devices:
                stage = "cuda ops"
                cuda = run_pipeline(c, logits, hidden, expert_map, "cuda")
                stage = "cuda vs cpu"
                for name in cpu:
                    _exact(cuda[name], cpu[name], f"cuda {name}")
        except Exception as err:  # noqa: BLE001  (collect, report all failing cases)
            msg = " ".join(str(err).split())[:400]
            failures.append(f"FUZZ FAIL [{stage}] {c.repro()}: {type(err).__name__}: {msg}")
            print(failures[-1])
    assert ran == len(seeds), f"ran {ran} of {len(seeds)} cases"
    return failures


def _seeds(base: int, block: int, per_block: int):
    if _ONE_SEED is not None:
        return [int(_ONE_SEED)] if block == 0 else []
    return range(base + block * per_block, base + (block + 1) * per_block)


@pytest.mark.parametrize("block", range(CPU_BLOCKS))
def test_fuzz_cpu(block):
    failures = fuzz(_seeds(0, block, CPU_CASES_PER_BLOCK), ["cpu"])
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])


@gpu
@pytest.mark.parametrize("block", range(GPU_BLOCKS))
def test_fuzz_gpu(block):
    failures = fuzz(_seeds(GPU_SEED_BASE, block, GPU_CASES_PER_BLOCK), ["cpu", "cuda"])
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])


def test_case_draws_cover_the_space():
    # The fuzz must actually reach the corners it claims to (guards against a silent narrowing).
    cases = [draw_case(s) for s in range(CPU_BLOCKS * CPU_CASES_PER_BLOCK)]
    assert any(c.num_tokens == 0 for c in cases) and any(c.num_tokens > 300 for c in cases)
    assert any(c.num_experts == 1 for c in cases) and any(c.num_experts > 200 for c in cases)
    assert any(c.topk == 10 for c in cases) and any(c.hidden % 2 == 1 for c in cases)
    assert any(c.use_map for c in cases) and any(c.skew for c in cases)
    assert any(c.special_rows for c in cases) and any(c.block_size == 1 for c in cases)
    assert {c.dtype for c in cases} == set(FLOATS)
