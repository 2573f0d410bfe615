"""Seeded fuzz of the sm90 layer op (torch.ops.hopper_moe.fused_experts_sm90) against the fp32
reference at OPS.md's tolerances.

Each case draws, for one scheme (bf16, FP8 per-tensor static and dynamic, per-token x
per-channel): M in 1..4096 (most under 256, where decode runs), E, topk, H and I (multiples
of 16 bytes, rarely of the 64/128 tiles), the activation dtype, an expert_map with -1 entries,
out-of-range ids, apply_router_weight_on_input and the ids' dtype. The op writes into a
poisoned output (NaN), so a row it skips fails the check. The CPU run (CI) takes 50 small
cases per scheme through the op's CPU definition; the GPU run takes 1,000 cases per scheme
through the SM90 kernels, in shards that run in parallel. A failing case prints one line with
its seed; rerun just that case with

    HOPPER_MOE_FUZZ_SEED=<seed> python -m pytest tests/test_sm90_layer_fuzz.py -q -k <scheme>
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

from conftest import gpu, poison
from hopper_moe.backends import sm90
from test_cute_backend import SCHEMES, SM90, reference
from requant_bound import check_within_bound
from test_fused_moe import TOL, base_scheme, check_close, check_close_requant, make_problem

_ONE_SEED = os.environ.get("HOPPER_MOE_FUZZ_SEED")
CPU_CASES_PER_SCHEME = 50  # 200 CPU cases (RELIABILITY: >= 200 in CI)
GPU_CASES_PER_SCHEME, GPU_SHARDS = 1000, 8
GPU_SEED_BASE = 1_000_000


@dataclass
class Case:
    seed: int
    scheme: str
    m: int
    e: int
    topk: int
    h: int
    i: int
    dtype: torch.dtype
    num_local: int | None
    invalid_ids: bool
    on_input: bool
    ids_dtype: torch.dtype

    def repro(self) -> str:
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        return (f"seed={self.seed} {self.scheme} M={self.m} E={self.e} topk={self.topk} "
                f"H={self.h} I={self.i} dtype={name(self.dtype)} num_local={self.num_local} "
                f"invalid_ids={self.invalid_ids} on_input={self.on_input} "
                f"ids={name(self.ids_dtype)}")


def _multiple(rng: random.Random, unit: int, low: int, high: int) -> int:
    """A multiple of `unit` in [low, high]; two draws in three avoid multiples of 64."""
    while True:
        v = unit * rng.randint(max(1, low // unit), high // unit)
        if v % 64 or rng.random() < 1 / 3:
            return v


def draw_case(seed: int, scheme: str, small: bool) -> Case:
    """small: the CPU's budget (M <= 70, H and I <= 256)."""
    rng = random.Random(seed)
    r = rng.random()
    if small:
        m = rng.randint(1, 9) if r < 0.6 else rng.randint(10, 70)
    elif r < 0.45:
        m = rng.randint(1, 8)
    elif r < 0.8:
        m = rng.randint(9, 256)
    else:
        m = rng.randint(257, 4096)
    e = rng.choice([1, 2, 3, 5, 8, 16, 60, 64, 128, 256])
    on_input = rng.random() < 0.15
    topk = 1 if on_input else rng.randint(1, min(e, 8))
    unit = 8 if scheme == "bf16" else 16  # 16-byte rows: 8 bf16/fp16 or 16 fp8 elements
    big = m > 256 or small
    h = _multiple(rng, unit, 16, 256 if big else 1024)
    i = _multiple(rng, unit, 16, 256 if big else 768)
    dtype = rng.choice([torch.bfloat16] * 3 + [torch.float16])
    num_local = rng.randint(1, e - 1) if e > 1 and rng.random() < 0.25 else None
    return Case(seed, scheme, m, e, topk, h, i, dtype, num_local,
                invalid_ids=rng.random() < 0.2, on_input=on_input,
                ids_dtype=rng.choice([torch.int32, torch.int64]))


def _layer_reference(p):
    """The fp32 reference with the layer's precision model (test_cute_backend.reference), plus
    what the op does to fp16 problems in the bf16 scheme: it runs the layer in bf16, so x
    (times the router weight, in fp32, when that is applied to the input) and the fp16 weights
    are rounded to bf16, and the output is the bf16 result converted to fp16. The reference
    gets the same bf16 operands."""
    if p.quant is not None or p.x.dtype not in (torch.bfloat16, torch.float16):
        return reference(p)
    dtype = p.x.dtype
    p = replace(p, w1=p.w1.to(torch.bfloat16), w2=p.w2.to(torch.bfloat16))
    if p.apply_router_weight_on_input:
        x = (p.x.float() * p.topk_weights.float()).to(torch.bfloat16)
        p = replace(p, x=x, topk_weights=torch.ones_like(p.topk_weights),
                    apply_router_weight_on_input=False)
    else:
        p = replace(p, x=p.x.to(torch.bfloat16))
    return reference(p).to(dtype)


def run_case(c: Case, device: str) -> None:
    p = make_problem(c.m, c.e, c.topk, c.h, c.i, scheme=c.scheme, dtype=c.dtype, seed=c.seed,
                     num_local=c.num_local, invalid_ids=c.invalid_ids, on_input=c.on_input,
                     ids_dtype=c.ids_dtype)
    want = _layer_reference(p)
    q = p.to(device)
    out = poison(torch.empty_like(q.x))
    got = sm90.fused_experts_sm90(*q.args(), q.apply_router_weight_on_input,
                                  q.global_num_experts, q.expert_map, q.quant, out=out)
    assert got.data_ptr() == out.data_ptr()
    if device == "cpu":
        check_close(got, want, c.scheme, c.repro())
    elif c.scheme == "bf16":
        check_close_requant(got, want, c.scheme, c.repro())
    else:
        # FP8 across devices: OPS.md's tolerance plus, element by element, what a
        # requantization step can move (requant_bound.py); check_close for the norms.
        check_close(got, want, c.scheme, c.repro(), elementwise=False)
        check_within_bound(got, p, *TOL[base_scheme(c.scheme)], c.repro())


def fuzz(seeds, scheme: str, device: str, small: bool) -> list[str]:
    failures = []
    for seed in seeds:
        c = draw_case(seed, scheme, small)
        try:
            run_case(c, device)
        except Exception as err:  # noqa: BLE001  (collect, report every failing case)
            msg = " ".join(str(err).split())[:300]
            failures.append(f"FUZZ FAIL {c.repro()}: {type(err).__name__}: {msg}")
            print(failures[-1])
    return failures


def _seeds(first: int, count: int):
    return [int(_ONE_SEED)] if _ONE_SEED is not None else range(first, first + count)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fuzz_cpu(scheme):
    failures = fuzz(_seeds(0, CPU_CASES_PER_SCHEME), scheme, "cpu", small=True)
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])


@gpu
@pytest.mark.skipif(not SM90, reason="the kernels are sm_90a code")
@pytest.mark.parametrize("shard", range(GPU_SHARDS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fuzz_gpu(scheme, shard):
    per_shard = GPU_CASES_PER_SCHEME // GPU_SHARDS
    seeds = _seeds(GPU_SEED_BASE + shard * per_shard, per_shard)
    if _ONE_SEED is not None and shard:
        seeds = []
    failures = fuzz(seeds, scheme, "cuda", small=False)
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])


def test_case_draws_cover_the_space():
    """The fuzz reaches the corners it claims (guards against a silent narrowing)."""
    for scheme in SCHEMES:
        cases = [draw_case(GPU_SEED_BASE + s, scheme, small=False)
                 for s in range(GPU_CASES_PER_SCHEME)]
        assert min(c.m for c in cases) == 1 and max(c.m for c in cases) > 3000
        assert sum(c.m <= 256 for c in cases) > 0.7 * len(cases)
        assert any(c.e == 1 for c in cases) and any(c.e == 256 for c in cases)
        assert any(c.topk == 8 for c in cases)
        assert any(c.h % 64 for c in cases) and any(c.i % 64 for c in cases)
        assert any(c.h % 64 == 0 for c in cases)
        assert sum(c.num_local is not None for c in cases) > 100
        assert sum(c.invalid_ids for c in cases) > 100
        assert sum(c.on_input for c in cases) > 100
        assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16}
        assert {c.ids_dtype for c in cases} == {torch.int32, torch.int64}
        unit = 8 if scheme == "bf16" else 16
        assert all(c.h % unit == 0 and c.i % unit == 0 for c in cases)
        if scheme == "bf16":
            assert any(c.h % 16 for c in cases) and any(c.i % 16 for c in cases)
