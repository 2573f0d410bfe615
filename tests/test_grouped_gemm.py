"""moe_grouped_gemm: CPU definition vs the fp32 reference; the SM90 kernel vs both on the GPU.

The CUDA kernel is sm_90a code: the GPU tests run where the device is compute capability 9.0
and, elsewhere, check that the op refuses with a clear error.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from conftest import DEVICES, gpu, seeded
from test_heuristics import TILES, rule_k_splits, rule_swap_ab, rule_token_tile

from hopper_moe import ops, reference

FP8 = torch.float8_e4m3fn



# The swap-AB warpgroup pair: as the heuristic chooses it, and forced wherever a launch has one.
PAIRS = pytest.mark.parametrize("pair", ["", "1"], ids=["heuristic", "pair"])
# The operand and scale schemes of the GPU tests: bf16, FP8 per-tensor, FP8 per-token x
# per-channel.
SCHEMES = pytest.mark.parametrize("dtype,a_mode,b_mode", [("bf16", "tensor", "tensor"),
                                                          ("fp8", "tensor", "tensor"),
                                                          ("fp8", "token", "channel")])


def cfg(**settings) -> str:
    """The launch config string of the grouped-GEMM ops: cfg(pair="1", k_splits=3) ->
    "pair=1,k_splits=3"; settings that are None or "" are left to the heuristic (cfg() == "")."""
    return ",".join(f"{key}={value}" for key, value in settings.items()
                    if value is not None and value != "")


# Configs every grouped-GEMM op accepts, on the CPU (which validates and otherwise ignores
# them) and on the GPU.
GOOD_CONFIGS = ["", "mapping=swap_ab", "mapping=standard", "pair=0", "pair=1", "pdl=0", "pdl=1",
                *[f"k_splits={s}" for s in range(1, 9)],
                "mapping=standard,pair=0,k_splits=3,pdl=0", "pair=1,k_splits=8,pdl=1"]
# Configs every grouped-GEMM op rejects, on any device, with the RuntimeError's message.
BAD_CONFIGS = [
    ("mapping=sideways", "config: mapping must be swap_ab or standard (got 'sideways')"),
    ("mapping=", "config: mapping must be swap_ab or standard (got '')"),
    ("pair=2", "config: pair must be 0 or 1 (got '2')"),
    ("pair=yes", "config: pair must be 0 or 1 (got 'yes')"),
    *[(f"k_splits={v}", f"config: k_splits must be an integer in [1, 8] (got '{v}')")
      for v in ("-1", "0", "9", "abc", "5ns")],
    ("pdl=x", "config: pdl must be 0 or 1 (got 'x')"),
    ("pdl=2", "config: pdl must be 0 or 1 (got '2')"),
    ("foo=1", "config: unknown key 'foo' (keys: mapping, pair, k_splits, pdl)"),
    ("pair=1,foo=1", "config: unknown key 'foo' (keys: mapping, pair, k_splits, pdl)"),
    ("abc", "config: 'abc' is not key=value"),
    ("pair=1,k_splits", "config: 'k_splits' is not key=value"),
]
BAD_CONFIG_CASES = pytest.mark.parametrize("config,message", BAD_CONFIGS,
                                           ids=[c for c, _ in BAD_CONFIGS])


def offsets_from_counts(counts, device="cpu"):
    return torch.tensor([0] + list(torch.tensor(counts).cumsum(0).tolist()), dtype=torch.int64,
                        device=device)


def make_problem(counts, n, k, dtype="bf16", a_mode="tensor", b_mode="tensor", seed=0,
                 device="cpu"):
    g = seeded(seed)
    m, e = sum(counts), len(counts)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(e, n, k, generator=g) / k ** 0.5
    offs = offsets_from_counts(counts)
    if dtype == "bf16":
        return a.bfloat16().to(device), b.bfloat16().to(device), offs.to(device), None, None
    a_max = a.abs().amax() if a.numel() else torch.tensor(1.0)
    sa = (a.abs().amax(1, keepdim=True) / 448).clamp_min(1e-6) if a_mode == "token" \
        else (a_max / 448).reshape(1)
    sb = (b.abs().amax(2) / 448) if b_mode == "channel" else (b.abs().amax((1, 2)) / 448)
    aq = (a / sa).clamp(-448, 448).to(FP8)
    bq = (b / sb.reshape(e, -1, 1)).clamp(-448, 448).to(FP8)
    return (aq.to(device), bq.to(device), offs.to(device), sa.float().to(device),
            sb.float().to(device))


def run(a, b, offs, sa, sb, config="", out_dtype=torch.bfloat16):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype, device=a.device)
    return ops.moe_grouped_gemm(a, b, offs, sa, sb, out=out, config=config)


def check_against_reference(out, a, b, offs, sa, sb, atol=2e-2, rtol=1e-2):
    ref = reference.moe_grouped_gemm_ref(a.cpu(), b.cpu(), offs.cpu(),
                                         None if sa is None else sa.cpu(),
                                         None if sb is None else sb.cpu())
    o = out.float().cpu()
    written = ~torch.isnan(ref)
    assert torch.equal(torch.isnan(o), ~written), "rows outside every expert must stay untouched"
    torch.testing.assert_close(o[written], ref[written], atol=atol, rtol=rtol)


CASES = [
    dict(counts=[3, 0, 5, 1], n=64, k=128),
    dict(counts=[17], n=72, k=80),              # N and K not tile multiples
    dict(counts=[0, 0, 9, 0], n=128, k=64),      # one expert holds every row
    dict(counts=[1] * 16, n=256, k=256),
    dict(counts=[0, 0, 0], n=64, k=64),          # no rows at all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme", [("bf16", "tensor", "tensor"), ("fp8", "tensor", "tensor"),
                                    ("fp8", "token", "channel"), ("fp8", "tensor", "channel")])
def test_cpu_matches_reference(case, scheme):
    dtype, a_mode, b_mode = scheme
    a, b, offs, sa, sb = make_problem(**case, dtype=dtype, a_mode=a_mode, b_mode=b_mode)
    out = run(a, b, offs, sa, sb)
    check_against_reference(out, a, b, offs, sa, sb)


# fp16 outputs: the fp32 sums rounded once to fp16 (2^-11 relative half-ulp), where bf16 rounds
# to 2^-9; fp8 operands leave headroom for the tensor cores' accumulation order.
FP16_TOL = {"bf16": dict(atol=2e-4, rtol=1.5e-3), "fp8": dict(atol=1e-3, rtol=2e-3)}


# FP8 tensor-core products accumulate with less than fp32's precision: on the H200, fp16 outputs
# of FP8 operands (K = 1040) were up to 2.2e-3 from the exact fp32 reference, past FP16_TOL["fp8"]
# (which the CPU meets). Against the reference a GPU FP8 result gets the tolerance its bf16
# output is held to; that it is the fp16 rounding of the same accumulators is checked against
# the bf16 output of the same launch instead (same_accumulators).
GPU_FP8_TOL = dict(atol=2e-2, rtol=1e-2)


def same_accumulators(out16, out_bf16):
    """An fp16 and a bf16 output of the same launch configuration round the same fp32 sums:
    the fp16 value rounded on to bf16 equals the bf16 output, or is one bf16 step from it
    (a double rounding across a bf16 midpoint)."""
    o16, ob = out16.float().cpu(), out_bf16.float().cpu()
    written = ~torch.isnan(ob)
    assert torch.equal(torch.isnan(o16), ~written)
    # Below fp16's normal range (2^-14) fp16 keeps fewer significant bits than bf16: there the
    # two roundings may differ by more than a bf16 step, so those elements are left out.
    normal = written & (o16.abs() >= 2.0 ** -14)
    twice = o16[normal].bfloat16().float()
    once = ob[normal]
    off = (twice - once).abs() > once.abs() * 2.0 ** -7
    if off.any():
        i = int(off.nonzero()[0])
        raise AssertionError(
            f"the fp16 output is not the fp16 rounding of the bf16 output's accumulators: "
            f"{int(off.sum())} of {once.numel()} elements, e.g. fp16 {o16[normal][i].item()!r} "
            f"vs bf16 {once[i].item()!r}")


def check_fp16_out(out16, a, b, offs, sa, sb, tol=None):
    """out16 (an fp16 out) against the fp32 reference at fp16's rounding (or `tol`), and with
    fp16's precision: a result rounded to bf16 on the way (8 significant bits) would be exactly
    representable in bf16, which fp16 values (11 bits) mostly are not."""
    assert out16.dtype == torch.float16
    if tol is None:
        tol = FP16_TOL["bf16" if a.dtype == torch.bfloat16 else "fp8"]
    check_against_reference(out16, a, b, offs, sa, sb, **tol)
    o = out16.float().cpu()
    o = o[~torch.isnan(o) & (o != 0)]
    if o.numel() >= 64:
        in_bf16 = (o.bfloat16().float() == o).float().mean().item()
        assert in_bf16 < 0.5, f"{in_bf16:.0%} of the fp16 outputs hold only bf16's precision"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme", [("bf16", "tensor", "tensor"), ("fp8", "tensor", "tensor"),
                                    ("fp8", "token", "channel")])
def test_cpu_fp16_out_matches_reference(case, scheme):
    dtype, a_mode, b_mode = scheme
    a, b, offs, sa, sb = make_problem(**case, dtype=dtype, a_mode=a_mode, b_mode=b_mode)
    check_fp16_out(run(a, b, offs, sa, sb, out_dtype=torch.float16), a, b, offs, sa, sb)


def test_cpu_offsets_are_clamped():
    a, b, _, _, _ = make_problem([4, 4], 32, 64)
    for offs in ([-5, 3, 100], [0, 6, 2], [2, 2, 8]):
        o = torch.tensor(offs, dtype=torch.int64)
        out = run(a, b, o, None, None)
        check_against_reference(out, a, b, o, None, None)


def _bad_calls():
    a, b, offs, _, _ = make_problem([2, 3], 32, 64)
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    aq, bq, _, sa, sb = make_problem([2, 3], 32, 64, dtype="fp8")
    call = torch.ops.hopper_moe.moe_grouped_gemm
    return [
        ("a", lambda: call(out, a.float(), b, offs, None, None)),
        ("b", lambda: call(out, a, b.half(), offs, None, None)),
        ("out must have dtype BFloat16 or Half \\(got Float\\)",
         lambda: call(out.float(), a, b, offs, None, None)),
        ("expert_offsets", lambda: call(out, a, b, offs.int(), None, None)),
        ("expert_offsets", lambda: call(out, a, b, offs[:2], None, None)),
        ("b", lambda: call(out, a, b[:, :, :32].contiguous(), offs, None, None)),
        ("out", lambda: call(out[:4], a, b, offs, None, None)),
        ("16 bytes", lambda: call(torch.empty(5, 32, dtype=torch.bfloat16),
                                  torch.randn(5, 60).bfloat16(),
                                  torch.randn(2, 32, 60).bfloat16(), offs, None, None)),
        ("a", lambda: call(out, torch.randn(64, 5).bfloat16().t(), b, offs, None, None)),
        ("a_scales", lambda: call(out, a, b, offs, sa, sb)),
        ("a_scales", lambda: call(out, aq, bq, offs, None, None)),
        ("a_scales", lambda: call(out, aq, bq, offs, torch.ones(3), sb)),
        ("b_scales", lambda: call(out, aq, bq, offs, sa, torch.ones(3))),
        ("a_scales", lambda: call(out, aq, bq, offs, sa.double(), sb)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise(case):
    name, call = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=name):
        call()


def test_opcheck():
    for counts, n, k, dtype in (([1], 16, 32, "bf16"), ([2, 0, 3], 32, 64, "bf16"),
                                ([3, 4], 48, 64, "fp8")):
        a, b, offs, sa, sb = make_problem(counts, n, k, dtype=dtype)
        out = torch.zeros(a.shape[0], n, dtype=torch.bfloat16)
        tests = ("test_faketensor", "test_aot_dispatch_dynamic") if dtype == "fp8" else \
            ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")  # torch.allclose has no fp8 kernel (test_schema)
        torch.library.opcheck(torch.ops.hopper_moe.moe_grouped_gemm.default,
                              (out, a, b, offs, sa, sb), test_utils=tests)


@pytest.mark.parametrize("config", GOOD_CONFIGS)
def test_cpu_accepts_every_config(config):
    """The CPU definition validates a config and otherwise ignores it: the same bits as the
    heuristic's call."""
    for dtype, a_mode, b_mode in (("bf16", "tensor", "tensor"), ("fp8", "token", "channel")):
        a, b, offs, sa, sb = make_problem([3, 0, 5, 1], 64, 128, dtype, a_mode, b_mode)
        assert torch.equal(run(a, b, offs, sa, sb, config=config).view(torch.int16),
                           run(a, b, offs, sa, sb).view(torch.int16))


@BAD_CONFIG_CASES
def test_cpu_rejects_a_bad_config(config, message):
    """The config rule is shared by the CPU and the CUDA paths (test_cuda_rejects_a_bad_config)."""
    a, b, offs, _, _ = make_problem([2, 3], 32, 64)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run(a, b, offs, None, None, config=config)
    out = torch.empty(5, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.hopper_moe.moe_grouped_gemm(out, a, b, offs, None, None, False, config)


def test_opcheck_with_config():
    a, b, offs, sa, sb = make_problem([2, 0, 3], 32, 64)
    out = torch.zeros(a.shape[0], 32, dtype=torch.bfloat16)
    for offsets_ready, config in ((False, "pair=1,k_splits=2"), (True, "mapping=standard,pdl=0")):
        torch.library.opcheck(torch.ops.hopper_moe.moe_grouped_gemm.default,
                              (out, a, b, offs, sa, sb, offsets_ready, config),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor", "test_aot_dispatch_dynamic"))


# --------------------------------------------------------------------------- cutlass_moe_mm
def cutlass_args(topk_ids, n, k, per_act_token, per_out_ch, seed=0, device="cpu",
                 num_experts=None):
    """vLLM's call of cutlass_moe_mm for GEMM1 of a layer: get_cutlass_moe_mm_data's offsets and
    problem sizes (swapped when M_tot <= 64), fp8 rows permuted to expert order, scales, and
    the dense strides. Returns (args of the op after out_tensors, row offsets [E + 1])."""
    e = num_experts or max(int(topk_ids.max()) + 1, 4)
    rows = topk_ids.numel()
    dev = topk_ids.device
    offsets = torch.empty(e + 1, dtype=torch.int32, device=dev)
    ps1 = torch.empty(e, 3, dtype=torch.int32, device=dev)
    ps2 = torch.empty(e, 3, dtype=torch.int32, device=dev)
    a_map = torch.empty(rows, dtype=torch.int32, device=dev)
    c_map = torch.empty(rows, dtype=torch.int32, device=dev)
    torch.ops.hopper_moe.get_cutlass_moe_mm_data(topk_ids, offsets, ps1, ps2, a_map, c_map, e,
                                                 n // 2, k, None, True)
    counts = torch.bincount(topk_ids.reshape(-1).long().cpu(), minlength=e).tolist()
    a, b, offs, sa, sb = make_problem(counts, n, k, "fp8", "token" if per_act_token else "tensor",
                                      "channel" if per_out_ch else "tensor", seed=seed)
    assert torch.equal(offs, offsets.long().cpu()), "get_cutlass_moe_mm_data's offsets"
    strides = torch.full((e,), k, dtype=torch.int64)
    c_strides = torch.full((e,), n, dtype=torch.int64)
    args = [a, b, sa, sb, offsets[:-1], ps1, strides, strides, c_strides, per_act_token,
            per_out_ch]
    args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args]
    return args, offs


@pytest.mark.parametrize("per_act_token,per_out_ch", [(False, False), (True, True),
                                                      (False, True)])
@pytest.mark.parametrize("num_tokens,topk", [(1, 2), (5, 4), (16, 4), (40, 2), (100, 3)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cutlass_moe_mm_cpu_matches_reference(num_tokens, topk, per_act_token, per_out_ch,
                                              out_dtype):
    """M_tot = num_tokens * topk on both sides of 64: swapped and plain problem sizes; bf16
    and fp16 outputs (vLLM's two), fp16 at its own rounding."""
    g = seeded(num_tokens)
    topk_ids = torch.stack([torch.randperm(8, generator=g)[:topk] for _ in range(num_tokens)])
    topk_ids = topk_ids.int()
    args, offs = cutlass_args(topk_ids, 64, 128, per_act_token, per_out_ch, seed=topk)
    a, b = args[0], args[1]
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype)
    ops.cutlass_moe_mm(out, *args)
    if out_dtype == torch.float16:
        check_fp16_out(out, a, b, offs, args[2], args[3])
    else:
        check_against_reference(out, a, b, offs, args[2], args[3])
    assert not torch.isnan(out.float()).any()  # the groups tile every row


def test_cutlass_moe_mm_reads_the_swapped_row_count():
    """Only the last group's end comes from problem_sizes: column 0, or column 1 when
    M_tot <= 64 (swapped). A wrong count there changes exactly the rows it covers."""
    topk_ids = torch.tensor([[0, 3], [3, 1], [2, 3]], dtype=torch.int32)  # expert 3 is last
    args, offs = cutlass_args(topk_ids, 32, 64, False, False)
    ps = args[5]
    assert ps[3].tolist() == [32, 3, 64]  # swapped: (N, m, K) with N = 2 * (32 // 2)
    a, b = args[0], args[1]
    short = ps.clone()
    short[3, 1] = 2  # the last expert's last row is left out
    out = torch.full((6, 32), float("nan"), dtype=torch.bfloat16)
    ops.cutlass_moe_mm(out, a, b, args[2], args[3], args[4], short, *args[6:])
    assert torch.isnan(out[5].float()).all() and not torch.isnan(out[:5].float()).any()


def _cutlass_bad_calls():
    topk_ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    args, _ = cutlass_args(topk_ids, 32, 64, False, False)
    a, b, sa, sb, offs, ps, st, _, cst, _, _ = args
    out = torch.empty(4, 32, dtype=torch.bfloat16)
    call = torch.ops.hopper_moe.cutlass_moe_mm

    def with_(**kw):
        names = ["a_tensors", "b_tensors", "a_scales", "b_scales", "expert_offsets",
                 "problem_sizes", "a_strides", "b_strides", "c_strides", "per_act_token",
                 "per_out_ch"]
        values = dict(zip(names, args))
        values.update(kw)
        return lambda: call(kw.pop("out", out), *[values[n] for n in names])

    return [
        ("a_tensors", with_(a_tensors=a.float())),
        ("b_tensors", with_(b_tensors=b.float())),
        ("out_tensors must have dtype BFloat16 or Half \\(got Float\\)",
         with_(out=out.float())),
        ("out_tensors", with_(out=out[:3])),
        ("a_tensors", with_(a_tensors=a[:, :32].contiguous())),
        ("expert_offsets", with_(expert_offsets=offs[:3])),
        ("expert_offsets", with_(expert_offsets=offs.float())),
        ("problem_sizes", with_(problem_sizes=ps[:, :2].contiguous())),
        ("problem_sizes", with_(problem_sizes=ps.long())),
        ("a_strides", with_(a_strides=st[:2])),
        ("c_strides", with_(c_strides=cst.int())),
        ("a_scales", with_(per_act_token=True)),
        ("b_scales", with_(per_out_ch=True)),
        ("a_scales", with_(a_scales=sa.double())),
    ]


@pytest.mark.parametrize("case", range(len(_cutlass_bad_calls())))
def test_cutlass_moe_mm_bad_inputs_raise(case):
    name, call = _cutlass_bad_calls()[case]
    with pytest.raises(RuntimeError, match=f"cutlass_moe_mm.*{name}"):
        call()


def test_cutlass_moe_mm_opcheck():
    for ids in ([[0, 1]], [[0, 2], [1, 2], [3, 0]]):
        args, _ = cutlass_args(torch.tensor(ids, dtype=torch.int32), 32, 64, False, True)
        out = torch.zeros(args[0].shape[0], 32, dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.hopper_moe.cutlass_moe_mm.default, (out, *args),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------------------ GPU
def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(torch.cuda.is_available() and not _is_sm90(),
                          reason="sm_90a code; other GPUs run test_cuda_refuses_off_sm90")


@gpu
@pytest.mark.skipif(_is_sm90(), reason="an SM90 GPU runs the kernel (the tests below)")
def test_cuda_refuses_off_sm90():
    a, b, offs, _, _ = make_problem([2, 3], 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match="needs an SM90 GPU"):
        run(a, b, offs, None, None)


@gpu
@sm90
@SCHEMES
@PAIRS
def test_cuda_grid_matches_reference(dtype, a_mode, b_mode, pair):
    config = cfg(pair=pair)
    rng = random.Random(5)
    failures = []
    for case in range(120):
        e = rng.choice([1, 8, 64, 128, 256])
        m_tot = rng.choice([1, 2, 7, 16, 33, 64, 200])
        counts = [0] * e
        if rng.random() < 0.2:
            counts[rng.randrange(e)] = m_tot  # one expert holds every row
        else:
            for _ in range(m_tot):
                counts[rng.randrange(e)] += 1
        n = rng.choice([64, 72, 128, 200, 256])
        k = rng.choice([64, 128, 136, 512]) if dtype == "bf16" else rng.choice([128, 144, 512])
        a, b, offs, sa, sb = make_problem(counts, n, k, dtype, a_mode, b_mode, seed=case,
                                          device="cuda")
        try:
            check_against_reference(run(a, b, offs, sa, sb, config), a, b, offs, sa, sb)
        except AssertionError as err:
            failures.append(f"case={case} E={e} M={m_tot} N={n} K={k}: "
                            f"{str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures[:20])


@gpu
@sm90
@SCHEMES
@PAIRS
def test_cuda_every_token_tile(dtype, a_mode, b_mode, pair):
    """Each token tile of heuristics/sm90.h (bf16 16..128, FP8 16..64), picked through m_total:
    8 * tile rows over 16 experts put the fullest expert's expected rows above the next smaller
    tile and within this one. Ragged counts: the first and last experts empty, experts of the
    tile's size, one over and one under it, one of 2 tiles + 5 rows (three token tiles, the
    last partial), the rest spread at random; N = 200 (a partial weight tile), more k-tiles
    than stages and a K tail."""
    config = cfg(pair=pair)
    kernel_dtype = "bf16" if dtype == "bf16" else "e4m3"
    e, n = 16, 200
    k = 1032 if dtype == "bf16" else 1040  # 17 k-tiles of 64 / 9 of 128, both with a tail
    rng = random.Random(11)
    failures = []
    for tile in TILES[kernel_dtype]:
        m_total = 8 * tile
        assert rule_token_tile(kernel_dtype, m_total, e) == tile
        counts = [0, 2 * tile + 5, tile, tile + 1, 1, tile - 1] + [0] * (e - 6)
        for _ in range(m_total - sum(counts)):
            counts[rng.randrange(6, e - 1)] += 1
        assert sum(counts) == m_total and counts[0] == counts[-1] == 0
        a, b, offs, sa, sb = make_problem(counts, n, k, dtype, a_mode, b_mode, seed=tile,
                                          device="cuda")
        try:
            check_against_reference(run(a, b, offs, sa, sb, config), a, b, offs, sa, sb)
        except AssertionError as err:
            failures.append(f"tile={tile} counts={counts}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@gpu
@sm90
@SCHEMES
@pytest.mark.parametrize("pair", ["0", "1"], ids=["unpaired", "pair"])
def test_cuda_k_split(dtype, a_mode, b_mode, pair):
    """Launches with so few units that heuristics/sm90.h splits K (2 to 4 ways): partial sums
    of every split added once, scales applied once, rows that no expert owns (here the last,
    past offsets[E]) left untouched, N and K tails. Without warpgroup pairs (mixtral's GEMM2
    at one token, the third case, is a pair by the heuristic) and with them forced, which
    keeps the 128-row units' split."""
    config = cfg(pair=pair)
    kernel_dtype = "bf16" if dtype == "bf16" else "e4m3"
    failures = []
    for counts, extra, n, k in (([1, 0, 0, 1], 1, 512, 8192), ([0, 2, 1], 0, 200, 8208),
                                ([1, 1], 0, 4096, 14336), ([3], 2, 72, 8208)):
        m = sum(counts) + extra
        splits = rule_k_splits(kernel_dtype, m, len(counts), n, k, allow_pair=False)
        assert splits > 1, (counts, n, k)
        a, b, offs, sa, sb = make_problem(counts + [extra], n, k, dtype, a_mode, b_mode,
                                          seed=n + k, device="cuda")
        b, offs = b[:len(counts)].contiguous(), offs[:len(counts) + 1].contiguous()
        if sb is not None:
            sb = sb[:len(counts)].contiguous()
        try:
            check_against_reference(run(a, b, offs, sa, sb, config), a, b, offs, sa, sb)
        except AssertionError as err:
            failures.append(f"counts={counts}+{extra} N={n} K={k} splits={splits}: "
                            f"{str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@gpu
@sm90
@SCHEMES
@PAIRS
def test_cuda_every_forced_k_split(dtype, a_mode, b_mode, pair):
    """Every K split 1..8 forced through the config (k_splits=N): many units per CTA, a K
    range per split that is empty for the last splits (K of a few k-tiles), N and K tails,
    empty experts and rows past the last expert; each against the reference, and the split
    outputs close to the unsplit one."""
    rng = random.Random(8)
    counts = [0] * 48
    for _ in range(150):
        counts[rng.randrange(40)] += 1
    failures = []
    for n, k, extra in ((520, 4112, 0), (200, 272, 2), (128, 1024, 1)):
        a, b, offs, sa, sb = make_problem(counts + [extra], n, k, dtype, a_mode, b_mode,
                                          seed=n + k, device="cuda")
        b, offs = b[:len(counts)].contiguous(), offs[:len(counts) + 1].contiguous()
        if sb is not None:
            sb = sb[:len(counts)].contiguous()
        unsplit = None
        for splits in range(1, 9):
            try:
                out = run(a, b, offs, sa, sb, cfg(pair=pair, k_splits=splits))
                check_against_reference(out, a, b, offs, sa, sb)
                if unsplit is None:
                    unsplit = out
                else:
                    torch.testing.assert_close(out.float(), unsplit.float(), atol=2e-2,
                                               rtol=1e-2, equal_nan=True)
            except (AssertionError, RuntimeError) as err:
                failures.append(f"N={n} K={k} splits={splits}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@gpu
@sm90
@pytest.mark.parametrize("dtype,a_mode,b_mode", [("bf16", "tensor", "tensor"),
                                                 ("fp8", "token", "channel")])
@PAIRS
def test_cuda_persistent_units(dtype, a_mode, b_mode, pair):
    """The persistent scheduler: launches with many units per CTA (256 experts x 8 weight
    tiles; 1024 experts, the prefix table's capacity, most of them empty; one expert with
    hundreds of rows, so dozens of token tiles, next to an empty one), a column count that is
    not a multiple of 8 (element stores) and an output row stride that is not either (a view
    into a wider buffer, whose extra columns must stay untouched)."""
    config = cfg(pair=pair)
    rng = random.Random(21)
    failures = []
    for e, m_tot, n, k, pad in ((256, 512, 1024, 256, 0), (1024, 64, 64, 128, 0),
                                (3, 2500, 100, 256, 0), (8, 300, 256, 512, 3)):
        counts = [0] * e
        if e == 3:
            counts = [1500, 0, 1000]
        else:
            for _ in range(m_tot):
                counts[rng.randrange(e)] += 1
        a, b, offs, sa, sb = make_problem(counts, n, k, dtype, a_mode, b_mode, seed=e,
                                          device="cuda")
        buf = torch.full((a.shape[0], n + pad), float("nan"), dtype=torch.bfloat16,
                         device="cuda")
        out = buf[:, :n]
        ops.moe_grouped_gemm(a, b, offs, sa, sb, out=out, config=config)
        try:
            assert torch.isnan(buf[:, n:]).all(), "columns past N stay untouched"
            check_against_reference(out, a, b, offs, sa, sb)
        except AssertionError as err:
            failures.append(f"E={e} M={m_tot} N={n} K={k} pad={pad}: "
                            f"{str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@gpu
@sm90
@SCHEMES
def test_cuda_standard_mapping(dtype, a_mode, b_mode):
    """The standard mapping (tokens on wgmma's A side), chosen where the fullest expert's rows
    outgrow the swap-AB tiles: ragged experts of hundreds of rows (several 128-row token
    tiles, the last partial, empty experts between), N not a multiple of the 256 / 128 weight
    tile, a K tail; a K split of it (one expert, few units); then both mappings forced through
    the config (mapping=swap_ab|standard) on the same small and large problems."""
    kernel_dtype = "bf16" if dtype == "bf16" else "e4m3"
    k = 1032 if dtype == "bf16" else 1040
    problems = [([300, 0, 129, 513, 0, 7], 200, k), ([1000, 24], 384, k),
                ([600], 136, 8208)]
    failures = []
    for counts, n, kk in problems:
        assert not rule_swap_ab(kernel_dtype, sum(counts), len(counts)), counts
    assert rule_k_splits(kernel_dtype, 600, 1, 136, 8208) > 1
    forced = [("standard", [3, 0, 5, 1], 64, 128), ("swap_ab", [300, 0, 129, 513], 200, k),
              ("standard", [300, 0, 129, 513], 200, k)]
    cases = [(None, c, n, kk) for c, n, kk in problems] + forced
    for mapping, counts, n, kk in cases:
        a, b, offs, sa, sb = make_problem(counts, n, kk, dtype, a_mode, b_mode, seed=n + kk,
                                          device="cuda")
        try:
            check_against_reference(run(a, b, offs, sa, sb, cfg(mapping=mapping)), a, b, offs,
                                    sa, sb)
        except AssertionError as err:
            failures.append(f"mapping={mapping} counts={counts} N={n} K={kk}: "
                            f"{str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@gpu
@sm90
@pytest.mark.parametrize("dtype,a_mode,b_mode", [("bf16", "tensor", "tensor"),
                                                 ("fp8", "token", "channel")])
@PAIRS
def test_cuda_offsets_ready_and_pdl_change_no_bit(dtype, a_mode, b_mode, pair):
    """The offsets_ready prefetch and a launch without programmatic dependent launch (pdl=0)
    give the default launch's outputs bit for bit, with and without a K split."""
    a, b, offs, sa, sb = make_problem([5, 0, 40, 1, 17], 520, 4112, dtype, a_mode, b_mode,
                                      seed=23, device="cuda")
    for splits in ("", "3"):
        want = run(a, b, offs, sa, sb, cfg(pair=pair, k_splits=splits))
        for pdl in ("", "0", "1"):
            config = cfg(pair=pair, k_splits=splits, pdl=pdl)
            for offsets_ready in (False, True):
                out = torch.full_like(want, float("nan"))
                ops.moe_grouped_gemm(a, b, offs, sa, sb, out=out, offsets_ready=offsets_ready,
                                     config=config)
                assert torch.equal(out.isnan(), want.isnan()), (config, offsets_ready)
                assert torch.equal(out.nan_to_num(), want.nan_to_num()), (config, offsets_ready)
        check_against_reference(want, a, b, offs, sa, sb)


@gpu
@sm90
@BAD_CONFIG_CASES
def test_cuda_rejects_a_bad_config(config, message):
    a, b, offs, _, _ = make_problem([2, 3], 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run(a, b, offs, None, None, config=config)


@gpu
@sm90
def test_cuda_rejects_more_experts_than_the_table():
    a, b, offs, _, _ = make_problem([1] + [0] * 1024, 64, 64, device="cuda")
    with pytest.raises(RuntimeError, match="at most 1024 experts"):
        run(a, b, offs, None, None)


@gpu
@sm90
def test_cuda_fp8_large_k_accumulation():
    """K = 14336 (mixtral's intermediate): the promoted fp32 accumulation keeps the error at
    the bf16 output's rounding."""
    a, b, offs, sa, sb = make_problem([5, 11], 256, 14336, "fp8", "token", "channel",
                                      device="cuda")
    check_against_reference(run(a, b, offs, sa, sb), a, b, offs, sa, sb, atol=2e-2, rtol=1e-2)


@gpu
@sm90
@pytest.mark.parametrize("n,k,splits,replays", [
    (128, 128, 1, ([16, 0, 0, 0], [0, 1, 15, 0], [4, 4, 4, 4])),
    (512, 8192, 4, ([4, 0, 0, 0], [0, 1, 3, 0], [2, 0, 0, 2])),  # the K split's workspace
    (256, 256, 1, ([600, 0, 0, 0], [0, 100, 499, 1], [150, 150, 150, 150])),  # standard
])
@PAIRS
def test_cuda_graph_replay_with_new_offsets(n, k, splits, replays, pair):
    config = cfg(pair=pair)
    m = sum(replays[0])
    assert rule_k_splits("bf16", m, 4, n, k) == splits
    a, b, offs, _, _ = make_problem(replays[-1], n, k, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ops.moe_grouped_gemm(a, b, offs, out=out, config=config)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.moe_grouped_gemm(a, b, offs, out=out, config=config)
    for counts in replays:
        offs.copy_(offsets_from_counts(counts, "cuda"))
        a.copy_(torch.randn_like(a, dtype=torch.float32).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, run(a, b, offs, None, None, config))
        check_against_reference(out, a, b, offs, None, None)


@gpu
@sm90
@SCHEMES
def test_cuda_fp16_out(dtype, a_mode, b_mode):
    """fp16 outputs through every store path of the one set of instantiations (the output
    dtype is a runtime flag of the epilogue): each swap-AB token tile, the warpgroup pair, the
    standard mapping, K splits (the reduce kernel's stores, unpaired, paired and standard),
    element stores (N not a multiple of 8; an output row stride that is not either, whose
    extra columns stay untouched). Each against the fp32 reference at fp16's rounding and
    precision; the bf16 output of the same launch stays bf16."""
    kernel_dtype = "bf16" if dtype == "bf16" else "e4m3"
    k = 1032 if dtype == "bf16" else 1040
    rng = random.Random(31)
    problems = []
    for tile in TILES[kernel_dtype]:
        counts = [0] * 16
        for _ in range(8 * tile):
            counts[rng.randrange(1, 15)] += 1
        problems.append((counts, 200, k, "", 0))
    problems += [
        ([3, 0, 5, 1], 64, 128, "pair=1", 0),
        ([300, 0, 129, 513, 0, 7], 200, k, "", 0),  # standard by the heuristic
        ([300, 0, 129, 513], 200, k, "mapping=standard", 0),
        ([5, 0, 40, 1, 17], 520, 4112, "pair=0,k_splits=3", 0),
        ([5, 0, 40, 1, 17], 520, 4112, "pair=1,k_splits=3", 0),
        ([300, 0, 129], 200, k, "mapping=standard,k_splits=2", 0),
        ([17, 0, 4], 100, 256, "", 0),              # element stores: N % 8 != 0
        ([17, 0, 4], 100, 256, "k_splits=2", 0),
        ([9, 30, 2], 256, 512, "", 3),              # element stores: row stride 259
        ([9, 30, 2], 256, 512, "k_splits=2", 3),
    ]
    failures = []
    for counts, n, kk, config, pad in problems:
        a, b, offs, sa, sb = make_problem(counts, n, kk, dtype, a_mode, b_mode, seed=n + kk,
                                          device="cuda")
        buf = torch.full((a.shape[0], n + pad), float("nan"), dtype=torch.float16,
                         device="cuda")
        out = buf[:, :n]
        ops.moe_grouped_gemm(a, b, offs, sa, sb, out=out, config=config)
        try:
            assert torch.isnan(buf[:, n:]).all(), "columns past N stay untouched"
            check_fp16_out(out, a, b, offs, sa, sb,
                           tol=None if dtype == "bf16" else GPU_FP8_TOL)
            out_bf16 = run(a, b, offs, sa, sb, config)
            assert out_bf16.dtype == torch.bfloat16
            check_against_reference(out_bf16, a, b, offs, sa, sb)
            same_accumulators(out, out_bf16)
        except AssertionError as err:
            failures.append(f"counts={counts} N={n} K={kk} config={config!r} pad={pad}: "
                            f"{str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_rejects_fp16_out(device):
    """fp16 is a plain-store output: the SiLU*mul epilogue writes bf16 or e4m3 only."""
    a, b, offs, _, _ = make_problem([2, 3], 64, 64, device=device)
    out = torch.empty(5, 32, dtype=torch.float16, device=device)
    with pytest.raises(RuntimeError, match="out must be BFloat16 without out_scale"):
        torch.ops.hopper_moe.moe_grouped_gemm_silu_mul(out, a, b, offs, None, None, None)


@gpu
@sm90
@pytest.mark.parametrize("per_act_token,per_out_ch", [(False, False), (True, True)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_cutlass_moe_mm_matches_cpu(per_act_token, per_out_ch, out_dtype):
    """The vLLM entry on the kernel, swapped (M_tot <= 64) and plain problem sizes, bf16 and
    fp16 outputs: equal to the CPU definition up to accumulation order (fp16 at its own
    rounding, and against the fp32 reference), and rows of every group written."""
    fp16 = out_dtype == torch.float16
    for num_tokens, topk, e, n, k in ((1, 2, 8, 256, 512), (16, 4, 8, 128, 256),
                                      (33, 2, 64, 512, 128), (300, 8, 128, 256, 384)):
        g = seeded(num_tokens)
        topk_ids = torch.stack([torch.randperm(e, generator=g)[:topk]
                                for _ in range(num_tokens)]).int()
        args, offs = cutlass_args(topk_ids, n, k, per_act_token, per_out_ch, seed=e,
                                  num_experts=e)
        out_cpu = torch.full((args[0].shape[0], n), float("nan"), dtype=out_dtype)
        ops.cutlass_moe_mm(out_cpu, *args)
        cuda_args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in args]
        cuda_args[5] = torch.empty_like(cuda_args[5])  # the device's own problem sizes
        offsets = torch.empty(e + 1, dtype=torch.int32, device="cuda")
        ps2 = torch.empty_like(cuda_args[5])
        rows = topk_ids.numel()
        a_map = torch.empty(rows, dtype=torch.int32, device="cuda")
        c_map = torch.empty(rows, dtype=torch.int32, device="cuda")
        torch.ops.hopper_moe.get_cutlass_moe_mm_data(topk_ids.cuda(), offsets, cuda_args[5],
                                                     ps2, a_map, c_map, e, n // 2, k, None,
                                                     True)
        cuda_args[4] = offsets[:-1]
        out = torch.full_like(out_cpu, float("nan"), device="cuda")
        ops.cutlass_moe_mm(out, *cuda_args)
        torch.testing.assert_close(out.float().cpu(), out_cpu.float(), **GPU_FP8_TOL)
        assert not torch.isnan(out.float()).any()
        if fp16:
            check_fp16_out(out, args[0], args[1], offs, args[2], args[3], tol=GPU_FP8_TOL)



# ------------------------------------------------------------- input audit: shared rules
# The rules below live in the shared argument checks (csrc/checks/grouped_gemm.cpp), so the CPU
# and the CUDA op reject the same calls with the same message; each *_cpu test has a GPU twin.
def _gemm_audit_calls(device):
    bf16 = dict(dtype=torch.bfloat16, device=device)
    gemm = torch.ops.hopper_moe.moe_grouped_gemm
    silu = torch.ops.hopper_moe.moe_grouped_gemm_silu_mul
    chain = torch.ops.hopper_moe.moe_grouped_gemm_chain
    a, b, offs, _, _ = make_problem([2, 3], 64, 64, device=device)
    out = torch.empty(5, 64, **bf16)
    big_b = torch.zeros(1025, 16, 64, **bf16)
    big_offs = torch.zeros(1026, dtype=torch.int64, device=device)
    big_offs[1:] = 5
    buf = torch.zeros(20, 64, **bf16)
    # w1 [E, 2I, K] = [2, 64, 64] (I = 32), w2 [E, N2, I] = [2, 64, 32].
    w2 = torch.zeros(2, 64, 32, **bf16)
    h = torch.empty(5, 32, **bf16)
    gated_out = torch.empty(5, 32, **bf16)
    amax_in_out = gated_out.view(torch.float32)[0, :1]
    offs_buf = torch.zeros(5, 64, **bf16)  # expert_offsets (all 0) in its first bytes
    return [
        # K = 0: rejected on every device (the kernel cannot describe a zero-width operand).
        (r"a\.size\(1\) \(K\) must be > 0",
         lambda: gemm(out, torch.empty(5, 0, **bf16), torch.empty(2, 64, 0, **bf16), offs,
                      None, None)),
        (r"a\.size\(1\) \(K\) must be > 0",
         lambda: silu(gated_out, torch.empty(5, 0, **bf16), torch.empty(2, 64, 0, **bf16),
                      offs, None, None, None)),
        # A broadcast a (row stride 0): rows of a overlap.
        (r"a\.stride\(0\) \(0\) must be >= a\.size\(1\)",
         lambda: gemm(out, a[:1].expand(5, 64), b, offs, None, None)),
        (r"a\.stride\(0\) \(0\) must be >= a\.size\(1\)",
         lambda: chain(torch.empty(5, 64, **bf16), h, a[:1].expand(5, 64), b, w2, offs,
                       None, None, None, None)),
        # More experts than the kernel's table: the same rule on the CPU.
        (r"b\.size\(0\) \(E\) must be at most 1024 experts",
         lambda: gemm(torch.empty(5, 16, **bf16), a, big_b, big_offs, None, None)),
        # out written while a / b / expert_offsets are read.
        ("out must not overlap a", lambda: gemm(a, a, b, offs, None, None)),
        # a strided view of one buffer: out (rows 6..10) holds row 8 of a (rows 0, 4, .., 16),
        # past a's first numel elements.
        ("out must not overlap a", lambda: gemm(buf[6:11], buf[::4], b, offs, None, None)),
        ("out must not overlap b",
         lambda: gemm(b.view(-1, 64)[:5], a, b, offs, None, None)),
        ("out must not overlap expert_offsets",
         lambda: gemm(offs_buf, a, b, offs_buf.view(torch.int64)[0, :3], None, None)),
        # A broadcast out: several rows written to one place.
        ("out is written by the op and must not have stride 0",
         lambda: gemm(torch.empty(1, 64, **bf16).expand(5, 64), a, b, offs, None, None)),
        # silu_mul: amax_scale (written) inside out (written).
        ("out must not overlap amax_scale",
         lambda: silu(gated_out, a, b, offs, None, None, None, False,
                      amax_in_out)),
        # chain: h and out written, h read back by GEMM2.
        ("h must not overlap out",
         lambda: chain(out, out[:, :32], a, b, w2, offs, None, None, None, None)),
        ("h must not overlap a",
         lambda: chain(torch.empty(5, 64, **bf16), a[:, :32], a, b, w2, offs, None, None,
                       None, None)),
        ("out must not overlap w2",
         lambda: chain(w2.view(-1, 64)[:5], h, a, b, w2, offs, None, None, None, None)),
    ]


def _cutlass_audit_calls(device):
    topk_ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    args, _ = cutlass_args(topk_ids, 32, 64, False, False, device=device)
    a, b, sa, sb, offs, ps, st, st2, cst, pa, pc = args
    out = torch.empty(4, 32, dtype=torch.bfloat16, device=device)
    call = torch.ops.hopper_moe.cutlass_moe_mm
    rest = (sa, sb, offs, ps, st, st2, cst, pa, pc)
    return [
        (r"a_tensors\.size\(1\) \(K\) must be > 0",
         lambda: call(out, a[:, :0], b[:, :, :0], *rest)),
        (r"a_tensors\.stride\(0\) \(0\) must be >= a_tensors\.size\(1\)",
         lambda: call(out, a[:1].expand(4, 64), b, *rest)),
        ("out_tensors must not overlap a_tensors",
         lambda: call(a.view(torch.bfloat16), a, b, *rest)),
        ("out_tensors is written by the op and must not have stride 0",
         lambda: call(out[:1].expand(4, 32), a, b, *rest)),
    ]


def _audit_case_ids(calls):
    return [f"{i}-{re.sub(r'[^A-Za-z0-9]+', '_', m)[:40]}" for i, (m, _) in enumerate(calls)]


@pytest.mark.parametrize("case", range(len(_gemm_audit_calls("cpu"))),
                         ids=_audit_case_ids(_gemm_audit_calls("cpu")))
def test_gemm_input_audit_rules_cpu(case):
    message, call = _gemm_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_gemm_audit_calls("cpu"))),
                         ids=_audit_case_ids(_gemm_audit_calls("cpu")))
def test_gemm_input_audit_rules_cuda(case):
    message, call = _gemm_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@pytest.mark.parametrize("case", range(len(_cutlass_audit_calls("cpu"))),
                         ids=_audit_case_ids(_cutlass_audit_calls("cpu")))
def test_cutlass_moe_mm_input_audit_rules_cpu(case):
    message, call = _cutlass_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=f"cutlass_moe_mm.*{message}"):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_cutlass_audit_calls("cpu"))),
                         ids=_audit_case_ids(_cutlass_audit_calls("cpu")))
def test_cutlass_moe_mm_input_audit_rules_cuda(case):
    message, call = _cutlass_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=f"cutlass_moe_mm.*{message}"):
        call()


def test_gemm_strided_disjoint_operands_still_accepted():
    """Disjoint row slices of one buffer are not an overlap: a in rows 0..4, out in rows 8..12
    of the same allocation give the same bits as separate tensors."""
    a, b, offs, _, _ = make_problem([2, 3], 64, 64)
    buf = torch.zeros(16, 64, dtype=torch.bfloat16)
    buf[:5] = a
    got = torch.ops.hopper_moe.moe_grouped_gemm(buf[8:13], buf[:5], b, offs, None, None)
    assert got is None
    assert torch.equal(buf[8:13].view(torch.int16), run(a, b, offs, None, None).view(torch.int16))
