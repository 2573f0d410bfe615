"""moe_grouped_gemm_chain: GEMM1 with SiLU*mul (and a static FP8 quantization of h), then GEMM2
over h, in one call. Its CPU definition is the two ops one after the other; on an SM90 GPU its
two dependent launches must equal the two ops on the same device bit for bit, h and out, over
ragged decode and prefill problems, under forced configs (K splits, the warpgroup pair, a
mapping, no programmatic dependent launch; the same config given to the two ops), in CUDA-graph
replays with new expert counts, and call after call behind a long kernel; and out is checked
against the fp32 reference of GEMM2 over the h the kernel wrote.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from conftest import gpu
from test_grouped_gemm import (BAD_CONFIG_CASES, GOOD_CONFIGS, check_against_reference,
                               make_problem, offsets_from_counts, sm90)
from test_grouped_gemm_silu_mul import (FP8, _failures, check, make_gated, same_bits,
                                        untouched)

from hopper_moe import ops, reference

CHAIN = torch.ops.hopper_moe.moe_grouped_gemm_chain


def make_chain(counts, inter, k, n2, dtype="bf16", a_mode="tensor", b_mode="tensor",
               h_scale=None, seed=0, device="cpu"):
    """(a, w1, w2, offsets, a_scales, w1_scales, h_scale, w2_scales): GEMM1's operands
    (w1 = [gate; up] per expert, [E, 2I, K]) and GEMM2's weights [E, n2, I]."""
    a, w1, offs, sa, s1, hs = make_gated(counts, inter, k, dtype, a_mode, b_mode, seed=seed,
                                         device=device, out_scale=h_scale)
    _, w2, _, _, s2 = make_problem(counts, n2, inter, dtype, "tensor", b_mode, seed=seed + 1,
                                   device=device)
    return a, w1, w2, offs, sa, s1, hs, s2


def poisoned(m, cols, dtype, device):
    if dtype == FP8:
        return torch.full((m, cols), 0x7F, dtype=torch.uint8, device=device).view(FP8)
    return torch.full((m, cols), float("nan"), dtype=dtype, device=device)


def run_chain(a, w1, w2, offs, sa, s1, hs, s2, offsets_ready=False, config=""):
    m, inter = a.shape[0], w1.shape[1] // 2
    h = poisoned(m, inter, FP8 if hs is not None else torch.bfloat16, a.device)
    out = poisoned(m, w2.shape[1], torch.bfloat16, a.device)
    ops.moe_grouped_gemm_chain(a, w1, w2, offs, sa, s1, hs, s2, out=out, h=h,
                               offsets_ready=offsets_ready, config=config)
    return out, h


def run_two_ops(a, w1, w2, offs, sa, s1, hs, s2, config=""):
    """The two ops in turn, each with the chain's config (for the chain, k_splits applies to
    both GEMMs)."""
    m, inter = a.shape[0], w1.shape[1] // 2
    h = poisoned(m, inter, FP8 if hs is not None else torch.bfloat16, a.device)
    out = poisoned(m, w2.shape[1], torch.bfloat16, a.device)
    ops.moe_grouped_gemm_silu_mul(a, w1, offs, sa, s1, hs, out=h, config=config)
    ops.moe_grouped_gemm(h, w2, offs, hs, s2, out=out, config=config)
    return out, h


def matches_two_ops(got, problem, config=""):
    out, h = got
    want_out, want_h = run_two_ops(*problem, config=config)
    assert same_bits(h, want_h), "h differs from moe_grouped_gemm_silu_mul's"
    assert same_bits(out, want_out), "out differs from moe_grouped_gemm's over that h"


# ------------------------------------------------------------------------------------ CPU
SCHEMES = [("bf16", "tensor", "tensor", None), ("fp8", "tensor", "tensor", 0.02),
           ("fp8", "token", "channel", 0.05)]
CASES = [
    dict(counts=[3, 0, 5, 1], inter=32, k=128, n2=48),
    dict(counts=[17], inter=48, k=80, n2=40),          # I, K and N2 not tile multiples
    dict(counts=[0, 0, 9, 0], inter=64, k=64, n2=64),  # one expert holds every row
    dict(counts=[0, 0, 0], inter=32, k=64, n2=32),     # no rows at all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_is_the_two_ops(case, scheme):
    dtype, a_mode, b_mode, h_scale = scheme
    problem = make_chain(**case, dtype=dtype, a_mode=a_mode, b_mode=b_mode, h_scale=h_scale)
    got = run_chain(*problem)
    matches_two_ops(got, problem)
    out, h = got
    written = ~untouched(out)
    rows = written.any(1)
    assert torch.equal(written, rows[:, None].expand_as(written)), "whole rows are written"
    assert int(rows.sum()) == sum(case["counts"]), "exactly the experts' rows are written"


def _bad_calls():
    a, w1, w2, offs, _, _, _, _ = make_chain([2, 3], 16, 64, 32)
    aq, w1q, w2q, _, sa, s1, hs, s2 = make_chain([2, 3], 16, 64, 32, "fp8", h_scale=0.02)
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    h = torch.empty(5, 16, dtype=torch.bfloat16)
    h8 = torch.empty(5, 16, dtype=FP8)
    return [
        ("w1 and w2 must have the dtype of a",
         lambda: CHAIN(out, h, a, w1, w2q, offs, None, None, None, None)),
        ("h must be Float8_e4m3fn", lambda: CHAIN(out, h, aq, w1q, w2q, offs, sa, s1, hs, s2)),
        ("h_scale", lambda: CHAIN(out, h8, aq, w1q, w2q, offs, sa, s1, None, s2)),
        ("w2_scales are required", lambda: CHAIN(out, h8, aq, w1q, w2q, offs, sa, s1, hs, None)),
        ("h must be BFloat16", lambda: CHAIN(out, h8, a, w1, w2, offs, None, None, None, None)),
        ("GEMM2 .*out must have dtype BFloat16 \\(got Half\\)",
         lambda: CHAIN(out.half(), h, a, w1, w2, offs, None, None, None, None)),
        ("h_scale and w2_scales must be None",
         lambda: CHAIN(out, h, a, w1, w2, offs, None, None, torch.ones(1), None)),
        ("w2.size\\(0\\) must be E",
         lambda: CHAIN(out, h, a, w1, w2[:1].contiguous(), offs, None, None, None, None)),
        ("w2.size\\(2\\) must be I",
         lambda: CHAIN(out, h, a, w1, w2[:, :, :8].contiguous(), offs, None, None, None, None)),
        ("GEMM1 .*out.size\\(1\\)",
         lambda: CHAIN(out, torch.empty(5, 8, dtype=torch.bfloat16), a, w1, w2, offs, None,
                       None, None, None)),
        ("GEMM2 .*out.size\\(0\\)",
         lambda: CHAIN(out[:4], h, a, w1, w2, offs, None, None, None, None)),
        ("GEMM1 .*expert_offsets",
         lambda: CHAIN(out, h, a, w1, w2, offs[:2], None, None, None, None)),
        ("GEMM1 .*a_scales", lambda: CHAIN(out, h8, aq, w1q, w2q, offs, None, s1, hs, s2)),
        ("GEMM2 .*b_scales",
         lambda: CHAIN(out, h8, aq, w1q, w2q, offs, sa, s1, hs, torch.ones(3))),
        ("GEMM1 .*out_scale",
         lambda: CHAIN(out, h8, aq, w1q, w2q, offs, sa, s1, torch.ones(2), s2)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise(case):
    match, call = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=match):
        call()


def test_opcheck():
    for counts, dtype, h_scale in (([1], "bf16", None), ([2, 0, 3], "bf16", None),
                                   ([3, 4], "fp8", 0.1)):
        a, w1, w2, offs, sa, s1, hs, s2 = make_chain(counts, 16, 64, 32, dtype, h_scale=h_scale)
        h = torch.zeros(a.shape[0], 16, dtype=FP8 if hs is not None else torch.bfloat16)
        out = torch.zeros(a.shape[0], 32, dtype=torch.bfloat16)
        tests = ("test_faketensor", "test_aot_dispatch_dynamic") if dtype == "fp8" else \
            ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
        torch.library.opcheck(CHAIN.default, (out, h, a, w1, w2, offs, sa, s1, hs, s2, False),
                              test_utils=tests)


@pytest.mark.parametrize("config", GOOD_CONFIGS)
def test_cpu_accepts_every_config(config):
    """The CPU definition validates a config and otherwise ignores it: the same bits as the
    heuristic's call, bf16 and FP8 (e4m3 h)."""
    for dtype, h_scale in (("bf16", None), ("fp8", 0.02)):
        problem = make_chain([3, 0, 5, 1], 32, 128, 48, dtype, h_scale=h_scale)
        out, h = run_chain(*problem, config=config)
        want_out, want_h = run_chain(*problem)
        assert same_bits(h, want_h) and same_bits(out, want_out)


@BAD_CONFIG_CASES
def test_cpu_rejects_a_bad_config(config, message):
    problem = make_chain([2, 3], 16, 64, 32)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run_chain(*problem, config=config)
    a, w1, w2, offs, _, _, _, _ = problem
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    h = torch.empty(5, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        CHAIN(out, h, a, w1, w2, offs, None, None, None, None, False, config)


def test_opcheck_with_config():
    a, w1, w2, offs, sa, s1, hs, s2 = make_chain([2, 0, 3], 16, 64, 32)
    h = torch.zeros(a.shape[0], 16, dtype=torch.bfloat16)
    out = torch.zeros(a.shape[0], 32, dtype=torch.bfloat16)
    for offsets_ready, config in ((False, "k_splits=3,pair=1"), (True, "mapping=standard,pdl=0")):
        torch.library.opcheck(CHAIN.default,
                              (out, h, a, w1, w2, offs, sa, s1, hs, s2, offsets_ready, config),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------------------ GPU
def check_out_against_reference(out, h, problem, fp8):
    """out against the fp32 reference of GEMM2 over the h the kernel wrote (GEMM1's h is held
    to the reference by check())."""
    _, _, w2, offs, _, _, hs, s2 = problem
    if fp8:
        check_against_reference(out, h, w2, offs, hs, s2)
    else:
        check_against_reference(out, h, w2, offs, None, None)


def random_counts(rng, e, m_tot):
    counts = [0] * e
    if rng.random() < 0.2:
        counts[rng.randrange(e)] = m_tot  # one expert holds every row
    else:
        for _ in range(m_tot):
            counts[rng.randrange(e)] += 1
    return counts


@gpu
@sm90
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: "-".join(map(str, s)))
def test_cuda_matches_the_two_ops_and_the_reference(scheme):
    """Random problems: E in {1, 8, 64, 128, 256}, 1..64 rows (swap-AB) and 200..3000 (the
    standard mapping), I, K and N2 with tails, poisoned h and out."""
    dtype, a_mode, b_mode, h_scale = scheme
    rng = random.Random(11)
    cases = []
    for case in range(40):
        e = rng.choice([1, 8, 64, 128, 256])
        m_tot = rng.choice([1, 2, 4, 7, 16, 33, 64, 200, 3000])
        counts = random_counts(rng, e, m_tot)
        inter = rng.choice([64, 96, 128, 272, 384])
        k = rng.choice([64, 136, 512]) if dtype == "bf16" else rng.choice([128, 144, 512])
        n2 = rng.choice([64, 96, 256, 520])
        cases.append((f"case={case} E={e} M={m_tot} I={inter} K={k} N2={n2}",
                      (make_chain(counts, inter, k, n2, dtype, a_mode, b_mode, h_scale,
                                  seed=case, device="cuda"),)))

    def one(problem):
        out, h = run_chain(*problem)
        matches_two_ops((out, h), problem)
        a, w1, _, offs, sa, s1, hs, _ = problem
        check(h, a, w1, offs, sa, s1, hs, fp8_gemm_error=dtype == "fp8")
        check_out_against_reference(out, h, problem, dtype == "fp8")
    _failures(cases, one)


def make_chain_on_gpu(counts, inter, k, n2, fp8, seed):
    """make_chain's per-tensor problem generated on the GPU (mixtral's weights are too large for
    the CPU generator to be quick)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, m = len(counts), sum(counts)
    a = torch.randn(m, k, device="cuda", generator=g)
    w1 = torch.randn(e, 2 * inter, k, device="cuda", generator=g) / k ** 0.5
    w2 = torch.randn(e, n2, inter, device="cuda", generator=g) / inter ** 0.5
    offs = offsets_from_counts(counts, "cuda")
    if not fp8:
        return a.bfloat16(), w1.bfloat16(), w2.bfloat16(), offs, None, None, None, None

    def quant(x, per_expert):
        s = x.abs().amax((1, 2)) / 448 if per_expert else (x.abs().amax() / 448).reshape(1)
        return (x / s.reshape(-1, *[1] * (x.dim() - 1))).clamp(-448, 448).to(FP8), s.float()
    aq, sa = quant(a, False)
    w1q, s1 = quant(w1, True)
    w2q, s2 = quant(w2, True)
    return aq, w1q, w2q, offs, sa, s1, torch.tensor([0.02], device="cuda"), s2


@gpu
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_mixtral_decode_shapes(fp8):
    """The shapes the chain is for: mixtral's experts (H = 4096, I = 14336, 8 experts) at 1, 2,
    4 and 16 tokens routed top-2, and E = 64 with a handful of tokens; out against the fp32
    reference of GEMM2 over the kernel's h (on the GPU)."""
    rng = random.Random(2)
    cases = []
    for m in (1, 2, 4, 16):
        counts = [0] * 8
        for _ in range(m):
            for ex in rng.sample(range(8), 2):
                counts[ex] += 1
        cases.append((f"mixtral M={m}", (counts, 14336, 4096, 4096)))
    cases.append(("E=64 M=5", (random_counts(rng, 64, 5), 1536, 2048, 2048)))

    def one(counts, inter, k, n2):
        problem = make_chain_on_gpu(counts, inter, k, n2, fp8, seed=sum(counts))
        out, h = run_chain(*problem, offsets_ready=True)
        matches_two_ops((out, h), problem)
        _, _, w2, offs, _, _, hs, s2 = problem
        ref = reference.moe_grouped_gemm_ref(h, w2, offs, hs, s2)
        written = ~torch.isnan(ref)
        assert torch.equal(torch.isnan(out.float()), ~written), "rows of no expert untouched"
        torch.testing.assert_close(out.float()[written], ref[written], atol=2e-2, rtol=1e-2)
    _failures(cases, one)


@gpu
@sm90
@pytest.mark.parametrize("config", ["k_splits=2", "k_splits=3", "pair=1", "pair=0",
                                    "mapping=standard", "pdl=0", "pair=1,k_splits=2,pdl=0"])
def test_cuda_forced_configs(config):
    """Both GEMMs split over K, the warpgroup pair forced on and off, the standard mapping
    forced, and no programmatic dependent launch (GEMM2 starts after GEMM1): the same bits as
    the two ops under the same config."""
    for dtype, a_mode, b_mode, h_scale in SCHEMES[:2]:
        for counts, inter, k, n2 in (([1, 0, 1, 0], 1024, 2048, 512),
                                     ([3, 0, 5, 9, 1, 0, 0, 2], 256, 512, 264)):
            problem = make_chain(counts, inter, k, n2, dtype, a_mode, b_mode, h_scale,
                                 seed=inter, device="cuda")
            got = run_chain(*problem, config=config)
            matches_two_ops(got, problem, config)


@gpu
@sm90
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s[0])
def test_cuda_graph_replay_with_new_counts(scheme):
    """A captured chain replayed over new expert counts (same row total) equals eager calls."""
    dtype, a_mode, b_mode, h_scale = scheme
    a, w1, w2, offs, sa, s1, hs, s2 = make_chain([2, 0, 1, 1], 512, 1024, 256, dtype, a_mode,
                                                 b_mode, h_scale, device="cuda")
    h = torch.empty(a.shape[0], 512, dtype=FP8 if hs is not None else torch.bfloat16,
                    device="cuda")
    out = torch.empty(a.shape[0], 256, dtype=torch.bfloat16, device="cuda")
    static_offs = offs.clone()
    ops.moe_grouped_gemm_chain(a, w1, w2, static_offs, sa, s1, hs, s2, out=out, h=h)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_grouped_gemm_chain(a, w1, w2, static_offs, sa, s1, hs, s2, out=out, h=h)
    for counts in ([4, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 4], [0, 3, 0, 1], [2, 0, 1, 1]):
        static_offs.copy_(offsets_from_counts(counts, "cuda"))
        h.view(torch.uint8).fill_(0x7F)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        problem = (a, w1, w2, static_offs, sa, s1, hs, s2)
        matches_two_ops((out.clone(), h.clone()), problem)


@gpu
@sm90
def test_cuda_call_after_call_behind_a_long_kernel():
    """Fifty chains, each queued behind a long matmul that still holds the SMs when the chain's
    kernels are launched, alternating two problems (different experts active): every call
    equals the two ops' result."""
    problems = [make_chain(c, 2048, 1024, 1024, "fp8", h_scale=0.02, seed=i, device="cuda")
                for i, c in enumerate(([1, 0, 1, 0, 0, 0, 0, 0], [0, 2, 0, 0, 3, 0, 1, 0]))]
    wants = [run_two_ops(*p) for p in problems]
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    mismatches = []
    for i in range(50):
        p = problems[i % 2]
        _ = x @ x  # keeps the GPU busy while the chain's kernels are queued
        out, h = run_chain(*p, offsets_ready=True)
        want_out, want_h = wants[i % 2]
        if not (same_bits(h, want_h) and same_bits(out, want_out)):
            mismatches.append(i)
    assert not mismatches, f"calls {mismatches} differ from the two ops"


@gpu
@sm90
@BAD_CONFIG_CASES
def test_cuda_rejects_a_bad_config(config, message):
    problem = make_chain([2, 3], 64, 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run_chain(*problem, config=config)
