"""moe_grouped_gemm_silu_mul: GEMM1 with SiLU*mul (and a static FP8 quantization) in its
epilogue. The CPU definition against the fp32 reference; on an SM90 GPU, the fused kernel
against the CPU definition and the reference (both mappings, every token tile, K splits,
tails, strided outputs, CUDA-graph replay, with and without programmatic dependent launch).
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from conftest import gpu
from test_grouped_gemm import (BAD_CONFIG_CASES, GOOD_CONFIGS, cfg, make_problem,
                               offsets_from_counts, sm90)
from test_heuristics import TILES, rule_k_splits, rule_swap_ab, rule_token_tile

from hopper_moe import ops, reference

FP8 = torch.float8_e4m3fn
NAN_E4M3 = 0x7F  # the poison byte of e4m3 outputs (a NaN)



# The swap-AB warpgroup pair: as the heuristic chooses it, and forced wherever a launch has one.
PAIRS = pytest.mark.parametrize("pair", ["", "1"], ids=["heuristic", "pair"])


def make_gated(counts, inter, k, dtype="bf16", a_mode="tensor", b_mode="tensor", seed=0,
               device="cpu", out_scale=None):
    """GEMM1's operands with b = [gate; up] per expert (N = 2 * inter), and the static output
    scale [1] when out_scale is a float."""
    a, b, offs, sa, sb = make_problem(counts, 2 * inter, k, dtype, a_mode, b_mode, seed=seed,
                                      device=device)
    scale = None if out_scale is None else torch.tensor([out_scale], device=device)
    return a, b, offs, sa, sb, scale


def poisoned_out(m, inter, fp8, device, pad=0):
    if fp8:
        buf = torch.full((m, inter + pad), NAN_E4M3, dtype=torch.uint8, device=device).view(FP8)
    else:
        buf = torch.full((m, inter + pad), float("nan"), dtype=torch.bfloat16, device=device)
    return buf, buf[:, :inter]


def untouched(t):
    """Elements still holding the poison."""
    if t.dtype == FP8:
        return t.view(torch.uint8) == NAN_E4M3
    return torch.isnan(t.float())


def run(a, b, offs, sa, sb, scale, pad=0, config=""):
    inter = b.shape[1] // 2
    buf, out = poisoned_out(a.shape[0], inter, scale is not None, a.device, pad)
    ops.moe_grouped_gemm_silu_mul(a, b, offs, sa, sb, scale, out=out, config=config)
    if pad:
        assert untouched(buf[:, inter:]).all(), "columns past I stay untouched"
    return out


def reference_silu_mul(a, b, offs, sa, sb):
    """silu(g) * u of the fp32 GEMM reference, NaN on rows outside every expert."""
    h = reference.moe_grouped_gemm_ref(a.cpu(), b.cpu(), offs.cpu(),
                                       None if sa is None else sa.cpu(),
                                       None if sb is None else sb.cpu())
    return reference.silu_mul_f32_ref(h)


def check(out, a, b, offs, sa, sb, scale, fp8_gemm_error=False):
    """Against the fp32 reference: rows of no expert untouched, the rest within bf16 rounding
    of the GEMM outputs (and one e4m3 step when quantized). fp8_gemm_error: the GPU's FP8
    tensor-core sums, whose error (the unfused GEMM's tolerance, 2e-2 + 1%) the product of
    gate and up amplifies."""
    ref = reference_silu_mul(a, b, offs, sa, sb)
    written = ~torch.isnan(ref)
    o = out.cpu()
    assert torch.equal(untouched(o), ~written), "rows outside every expert must stay untouched"
    slack = 8e-2 if fp8_gemm_error else 0.0
    if scale is None:
        torch.testing.assert_close(o.float()[written], ref[written], atol=3e-2 + slack,
                                   rtol=2e-2 + slack)
    else:
        s = float(scale)
        deq = o.float() * s
        torch.testing.assert_close(deq[written], ref[written].clamp(-448 * s, 448 * s),
                                   atol=4 * s * 2 ** -9 + 3e-2 + slack, rtol=0.14 + slack)


def same_bits(x, y):
    """Equal bit for bit (NaN poison included)."""
    view = torch.uint8 if x.dtype == FP8 else torch.int16
    return torch.equal(x.view(view), y.view(view))


def unfused_on_device(a, b, offs, sa, sb, scale, config=""):
    """moe_grouped_gemm into a bf16 temporary, then silu_and_mul(_quant) of the rows each expert
    owns (rows of no expert keep the poison): the fused kernel must equal this bit for bit,
    since both run the same wgmma sums in the same order (under the same config)."""
    inter = b.shape[1] // 2
    h = ops.moe_grouped_gemm(a, b, offs, sa, sb, config=config)
    _, out = poisoned_out(a.shape[0], inter, scale is not None, a.device)
    bounds = offs.clamp(0, a.shape[0]).tolist()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], max(bounds[e + 1], bounds[e])
        if hi > lo:
            rows = out[lo:hi]
            if scale is None:
                ops.silu_and_mul(rows, h[lo:hi])
            else:
                ops.silu_and_mul_quant(rows, h[lo:hi], scale)
    return out


def matches_unfused(out, a, b, offs, sa, sb, scale, config=""):
    assert same_bits(out, unfused_on_device(a, b, offs, sa, sb, scale, config)), \
        "fused SiLU*mul differs from moe_grouped_gemm + silu_and_mul on the same device"


# ------------------------------------------------------------------------------------ CPU
SCHEMES = [("bf16", "tensor", "tensor", None), ("fp8", "tensor", "tensor", None),
           ("fp8", "tensor", "tensor", 0.02), ("fp8", "token", "channel", None),
           ("fp8", "token", "channel", 0.05)]
CASES = [
    dict(counts=[3, 0, 5, 1], inter=32, k=128),
    dict(counts=[17], inter=36, k=80),           # I and K not tile multiples
    dict(counts=[0, 0, 9, 0], inter=64, k=64),   # one expert holds every row
    dict(counts=[0, 0, 0], inter=32, k=64),      # no rows at all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_matches_reference(case, scheme):
    dtype, a_mode, b_mode, out_scale = scheme
    if dtype == "bf16" and out_scale is not None:
        pytest.skip("bf16 operands with an e4m3 output are covered by the FP8 rows")
    a, b, offs, sa, sb, scale = make_gated(**case, dtype=dtype, a_mode=a_mode, b_mode=b_mode,
                                           out_scale=out_scale)
    check(run(a, b, offs, sa, sb, scale), a, b, offs, sa, sb, scale)


def test_cpu_is_the_unfused_composition():
    """Bit for bit: moe_grouped_gemm, then silu_and_mul / silu_and_mul_quant of its rows."""
    for out_scale in (None, 0.03):
        a, b, offs, sa, sb, scale = make_gated([2, 0, 3], 48, 64, "fp8", "token", "channel",
                                               out_scale=out_scale)
        h = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
        ops.moe_grouped_gemm(a, b, offs, sa, sb, out=h)
        want = ops.silu_and_mul(None, h) if scale is None else \
            ops.silu_and_mul_quant(None, h, scale)
        # silu_and_mul's rounding (vLLM's): silu(gate) rounded to bf16, then the product
        want_ref = reference.silu_and_mul_ref(h) if scale is None else \
            reference.silu_and_mul_quant_ref(h, scale)
        assert torch.equal(want.view(torch.uint8) if scale is not None else want,
                           want_ref.view(torch.uint8) if scale is not None else want_ref)
        got = run(a, b, offs, sa, sb, scale)
        assert torch.equal(got.view(torch.uint8) if scale is not None else got,
                           want.view(torch.uint8) if scale is not None else want)


def _bad_calls():
    a, b, offs, _, _, _ = make_gated([2, 3], 16, 64)
    out = torch.empty(5, 16, dtype=torch.bfloat16)
    aq, bq, _, sa, sb, _ = make_gated([2, 3], 16, 64, dtype="fp8")
    out8 = torch.empty(5, 16, dtype=FP8)
    one = torch.ones(1)
    call = torch.ops.hopper_moe.moe_grouped_gemm_silu_mul
    return [
        ("even", lambda: call(out, a, b[:, :31].contiguous(), offs, None, None, None)),
        ("out.size\\(1\\)", lambda: call(torch.empty(5, 32, dtype=torch.bfloat16), a, b, offs,
                                         None, None, None)),
        ("out_scale", lambda: call(out8, aq, bq, offs, sa, sb, None)),
        ("out", lambda: call(out, aq, bq, offs, sa, sb, one)),
        ("out_scale", lambda: call(out8, aq, bq, offs, sa, sb, torch.ones(2))),
        ("out_scale", lambda: call(out8, aq, bq, offs, sa, sb, one.double())),
        ("a_scales", lambda: call(out, aq, bq, offs, None, None, None)),
        ("expert_offsets", lambda: call(out, a, b, offs[:2], None, None, None)),
        ("amax_scale", lambda: call(out8, aq, bq, offs, sa, sb, one, False, torch.ones(1))),
        ("amax_scale", lambda: call(out, aq, bq, offs, sa, sb, None, False, torch.ones(2))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise(case):
    name, call = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=name):
        call()


def test_opcheck():
    for counts, inter, k, dtype, out_scale in (([1], 16, 32, "bf16", None),
                                               ([2, 0, 3], 24, 64, "bf16", None),
                                               ([3, 4], 32, 64, "fp8", 0.1)):
        a, b, offs, sa, sb, scale = make_gated(counts, inter, k, dtype=dtype,
                                               out_scale=out_scale)
        out = torch.zeros(a.shape[0], inter, dtype=FP8 if scale is not None else torch.bfloat16)
        tests = ("test_faketensor", "test_aot_dispatch_dynamic") if dtype == "fp8" else \
            ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
        amax = None if scale is not None else torch.full((1,), 1e-3)
        torch.library.opcheck(torch.ops.hopper_moe.moe_grouped_gemm_silu_mul.default,
                              (out, a, b, offs, sa, sb, scale, False, amax), test_utils=tests)


@pytest.mark.parametrize("config", GOOD_CONFIGS)
def test_cpu_accepts_every_config(config):
    """The CPU definition validates a config and otherwise ignores it: the same bits as the
    heuristic's call, bf16 and e4m3 outputs."""
    for dtype, out_scale in (("bf16", None), ("fp8", 0.03)):
        a, b, offs, sa, sb, scale = make_gated([3, 0, 5, 1], 32, 128, dtype,
                                               out_scale=out_scale)
        assert same_bits(run(a, b, offs, sa, sb, scale, config=config),
                         run(a, b, offs, sa, sb, scale))


@BAD_CONFIG_CASES
def test_cpu_rejects_a_bad_config(config, message):
    a, b, offs, _, _, _ = make_gated([2, 3], 16, 64)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run(a, b, offs, None, None, None, config=config)
    out = torch.empty(5, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.hopper_moe.moe_grouped_gemm_silu_mul(out, a, b, offs, None, None, None, False,
                                                       None, config)


def test_opcheck_with_config():
    a, b, offs, sa, sb, scale = make_gated([2, 0, 3], 24, 64)
    out = torch.zeros(a.shape[0], 24, dtype=torch.bfloat16)
    for amax, config in ((None, "pair=1,k_splits=2"), (torch.full((1,), 1e-3), "pdl=0")):
        torch.library.opcheck(torch.ops.hopper_moe.moe_grouped_gemm_silu_mul.default,
                              (out, a, b, offs, sa, sb, scale, False, amax, config),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_dynamic"))


def dynamic_scale_of(h_rows):
    """dynamic_scaled_fp8_quant's scale of these bf16 rows (the same device)."""
    _, scale = ops.scaled_fp8_quant(h_rows)
    return scale


def check_amax_scale(a, b, offs, sa, sb, config=""):
    """amax_scale, started at the floor, ends as the dynamic per-tensor scale of the rows the
    GEMM writes (rows of no expert zero-filled, as the unfused layer did), bit for bit; and
    the static quantization with it equals the dynamic one."""
    floor = torch.full((1,), 1.0 / (448 * 512), device=a.device)
    h = torch.zeros(a.shape[0], b.shape[1] // 2, dtype=torch.bfloat16, device=a.device)
    ops.moe_grouped_gemm_silu_mul(a, b, offs, sa, sb, out=h, amax_scale=floor, config=config)
    want = dynamic_scale_of(h)
    assert torch.equal(floor, want), (floor.item(), want.item())
    q_static, _ = ops.scaled_fp8_quant(h, floor)
    q_dynamic, _ = ops.scaled_fp8_quant(h)
    assert same_bits(q_static, q_dynamic)


def gated_with_unowned_rows(counts, extra, inter, k, dtype, seed, device="cpu"):
    """GEMM1's operands for these experts' rows plus `extra` rows after offsets[E] that no
    expert owns: (a, b, offsets, a_scales, b_scales)."""
    a, b, offs, sa, sb, _ = make_gated(counts + [extra], inter, k, dtype, seed=seed,
                                       device=device)
    e = len(counts)
    return (a, b[:e].contiguous(), offs[:e + 1].contiguous(), sa,
            None if sb is None else sb[:e].contiguous())


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_cpu_amax_scale_is_the_dynamic_scale(dtype):
    for counts, extra in (([3, 0, 5, 1], 2), ([0, 7], 0), ([0, 0], 3)):
        check_amax_scale(*gated_with_unowned_rows(counts, extra, 40, 64, dtype, seed=extra))


# ------------------------------------------------------------------------------------ GPU
GPU_SCHEMES = [("bf16", "tensor", "tensor", None), ("fp8", "tensor", "tensor", 0.02),
               ("fp8", "token", "channel", None)]


def _failures(cases, fn):
    failures = []
    for label, args in cases:
        try:
            fn(*args)
        except AssertionError as err:
            failures.append(f"{label}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures[:20])


@gpu
@sm90
@pytest.mark.parametrize("dtype,a_mode,b_mode,out_scale", GPU_SCHEMES)
@PAIRS
def test_cuda_grid_matches_reference(dtype, a_mode, b_mode, out_scale, pair):
    """Random decode problems: E in {1, 8, 64, 128, 256}, 1..64 rows (sometimes all in one
    expert), I with tails (not a multiple of the 64-column tile, or of 8: element stores)."""
    config = cfg(pair=pair)
    rng = random.Random(7)
    cases = []
    for case in range(60):
        e = rng.choice([1, 8, 64, 128, 256])
        m_tot = rng.choice([1, 2, 7, 16, 33, 64])
        counts = [0] * e
        if rng.random() < 0.2:
            counts[rng.randrange(e)] = m_tot
        else:
            for _ in range(m_tot):
                counts[rng.randrange(e)] += 1
        inter = rng.choice([64, 100, 128, 132, 256, 384])
        k = rng.choice([64, 136, 512]) if dtype == "bf16" else rng.choice([128, 144, 512])
        cases.append((f"case={case} E={e} M={m_tot} I={inter} K={k}",
                      make_gated(counts, inter, k, dtype, a_mode, b_mode, seed=case,
                                 device="cuda", out_scale=out_scale)))

    def one(a, b, offs, sa, sb, scale):
        out = run(a, b, offs, sa, sb, scale, config=config)
        matches_unfused(out, a, b, offs, sa, sb, scale, config)
        check(out, a, b, offs, sa, sb, scale, fp8_gemm_error=dtype == "fp8")
    _failures(cases, one)


@gpu
@sm90
@pytest.mark.parametrize("dtype,a_mode,b_mode,out_scale", GPU_SCHEMES)
@PAIRS
def test_cuda_every_tile_both_mappings_and_splits(dtype, a_mode, b_mode, out_scale, pair):
    """Every swap-AB token tile (ragged experts with 3 token tiles, the last partial), the
    standard mapping at hundreds and at 16k rows, a K split (few units, long K, the reduce
    kernel's SiLU*mul), an output whose row stride is not a multiple of 8; then both mappings
    forced through the config on one ragged problem."""
    config = cfg(pair=pair)
    kernel_dtype = "bf16" if dtype == "bf16" else "e4m3"
    k = 1032 if dtype == "bf16" else 1040
    rng = random.Random(3)
    cases = []
    e = 16
    for tile in TILES[kernel_dtype]:
        m_total = 8 * tile
        assert rule_token_tile(kernel_dtype, m_total, e) == tile
        counts = [0, 2 * tile + 5, tile, tile + 1, 1, tile - 1] + [0] * (e - 6)
        for _ in range(m_total - sum(counts)):
            counts[rng.randrange(6, e - 1)] += 1
        cases.append((f"tile={tile}", (counts, 100, k, 0)))
    for counts, inter in (([300, 0, 129, 513, 0, 7], 200), ([4100, 4000, 0, 4200, 4084], 136)):
        assert not rule_swap_ab(kernel_dtype, sum(counts), len(counts))
        cases.append((f"standard M={sum(counts)}", (counts, inter, 512, 0)))
    assert rule_k_splits(kernel_dtype, 2, 2, 2 * 1024, 8208) > 1
    cases.append(("k split", ([1, 1], 1024, 8208, 0)))
    cases.append(("strided out", ([5, 0, 9], 72, 256, 3)))

    def one(counts, inter, kk, pad):
        a, b, offs, sa, sb, scale = make_gated(counts, inter, kk, dtype, a_mode, b_mode,
                                               seed=inter + kk, device="cuda",
                                               out_scale=out_scale)
        out = run(a, b, offs, sa, sb, scale, pad=pad, config=config)
        matches_unfused(out, a, b, offs, sa, sb, scale, config)
        check(out, a, b, offs, sa, sb, scale, fp8_gemm_error=dtype == "fp8")
    _failures([(label, args) for label, args in cases], one)
    # Both mappings forced on one ragged problem.
    for mapping in ("swap_ab", "standard"):
        forced = cfg(mapping=mapping, pair=pair)
        a, b, offs, sa, sb, scale = make_gated([300, 0, 129, 3], 136, k, dtype, a_mode, b_mode,
                                               device="cuda", out_scale=out_scale)
        out = run(a, b, offs, sa, sb, scale, config=forced)
        matches_unfused(out, a, b, offs, sa, sb, scale, forced)
        check(out, a, b, offs, sa, sb, scale, fp8_gemm_error=dtype == "fp8")


@gpu
@sm90
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@PAIRS
def test_cuda_amax_scale_is_the_dynamic_scale(dtype, pair):
    """The epilogue's amax fold over swap-AB tiles, the standard mapping, a K split (the
    reduce kernel's fold) and rows that no expert owns."""
    config = cfg(pair=pair)
    assert rule_k_splits("bf16" if dtype == "bf16" else "e4m3", 2, 2, 2048, 8208) > 1
    cases = [([3, 0, 5, 1], 2, 200, 512), ([1, 1], 0, 1024, 8208),
             ([300, 0, 129, 513], 3, 136, 512), ([0] * 63 + [9], 0, 256, 256)]
    _failures([(f"counts={c}+{x} I={i} K={k}",
                gated_with_unowned_rows(c, x, i, k, dtype, seed=i, device="cuda"))
               for c, x, i, k in cases],
              lambda a, b, offs, sa, sb: check_amax_scale(a, b, offs, sa, sb, config))


@gpu
@sm90
def test_cuda_programmatic_launch_changes_nothing():
    """The GEMMs of a layer back to back, with offsets_ready and as dependent launches, equal
    the same launches with pdl=0 in their config bit for bit (eager and graph-replayed)."""
    a, b, offs, _, _, _ = make_gated([7, 0, 30, 1], 768, 2048, device="cuda")
    w2 = (torch.randn(4, 2048, 768, device="cuda") / 768 ** 0.5).bfloat16()

    def layer(config):
        h = ops.moe_grouped_gemm_silu_mul(a, b, offs, offsets_ready=True, config=config)
        return ops.moe_grouped_gemm(h, w2, offs, offsets_ready=True, config=config)

    outs = {}
    for pdl in ("1", "0"):
        eager = layer(cfg(pdl=pdl))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(cfg(pdl=pdl))
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = (eager.clone(), captured.clone())
    assert torch.equal(outs["1"][0], outs["0"][0])
    assert torch.equal(outs["1"][1], outs["0"][0])
    assert torch.equal(outs["0"][1], outs["0"][0])


@gpu
@sm90
@pytest.mark.parametrize("out_scale", [None, 0.02])
@PAIRS
def test_cuda_graph_replay_with_new_offsets(out_scale, pair):
    config = cfg(pair=pair)
    dtype = "bf16" if out_scale is None else "fp8"
    replays = ([16, 0, 0, 0], [0, 1, 15, 0], [4, 4, 4, 4], [600, 0, 0, 1])
    m = max(sum(r) for r in replays)
    a, b, offs, sa, sb, scale = make_gated([m, 0, 0, 0], 192, 256, dtype, device="cuda",
                                           out_scale=out_scale)
    buf, out = poisoned_out(m, 192, scale is not None, "cuda")
    ops.moe_grouped_gemm_silu_mul(a, b, offs, sa, sb, scale, out=out, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_grouped_gemm_silu_mul(a, b, offs, sa, sb, scale, out=out, config=config)
    for counts in replays:
        offs.copy_(offsets_from_counts(counts, "cuda"))
        fresh, _ = poisoned_out(m, 192, scale is not None, "cuda")
        buf.copy_(fresh)
        graph.replay()
        eager = run(a, b, offs, sa, sb, scale, config=config)
        assert same_bits(out, eager)
        check(out, a, b, offs, sa, sb, scale, fp8_gemm_error=dtype == "fp8")


@gpu
@sm90
@BAD_CONFIG_CASES
def test_cuda_rejects_a_bad_config(config, message):
    a, b, offs, _, _, _ = make_gated([2, 3], 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run(a, b, offs, None, None, None, config=config)
