"""moe_sum: CPU op vs the fp32 reference (bit-exact), CUDA op vs CPU op (bit-exact), edge cases,
input validation and opcheck."""
from __future__ import annotations

import itertools

import pytest
import torch
from conftest import gpu, poison, seeded

from hopper_moe import reference as ref

OP = torch.ops.hopper_moe.moe_sum
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality; NaN only where the expectation has NaN (any payload)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what or None)


def _make(num_tokens, top_k, hidden, dtype, gen, *, ids_mode="none", num_experts=8,
          id_dtype=torch.int32):
    """Random input [T,K,H], and (topk_ids, expert_map) per ids_mode:
    none | ids (with -1 and out-of-range ids) | map (ids plus an expert_map with -1 entries)."""
    x = torch.randn((num_tokens, top_k, hidden), generator=gen).to(dtype)
    ids = expert_map = None
    if ids_mode in ("ids", "map"):
        ids = torch.randint(-2, num_experts + 2, (num_tokens, top_k), generator=gen).to(id_dtype)
    if ids_mode == "map":
        expert_map = torch.randint(-1, 4, (num_experts,), generator=gen).to(torch.int32)
        expert_map[torch.rand(num_experts, generator=gen) < 0.4] = -1
    return x, ids, expert_map


def _run(x, ids=None, expert_map=None, device="cpu", out=None):
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    x = x.to(device)
    if out is None:
        out = torch.empty((x.shape[0], x.shape[2]), dtype=x.dtype, device=device)
    poison(out)
    OP(x, out, dev(ids), dev(expert_map))
    return out


SHAPES = [(0, 2, 16), (1, 1, 1), (1, 2, 8), (2, 3, 7), (3, 4, 64), (5, 8, 129), (17, 6, 256),
          (33, 2, 1000), (4, 1, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_mode", ["none", "ids", "map"])
def test_cpu_matches_reference(dtype, ids_mode):
    gen = seeded(1)
    for shape in SHAPES:
        x, ids, emap = _make(*shape, dtype, gen, ids_mode=ids_mode)
        out = _run(x, ids, emap)
        _assert_bits_equal(out, ref.moe_sum(x, ids, emap), f"shape={shape} {dtype} {ids_mode}")
        if shape[0] and shape[2]:
            assert out.float().abs().sum() > 0 or ids_mode != "none"


def test_reference_sums_in_fp32():
    # bf16 inputs whose exact sum is representable only because accumulation is fp32.
    x = torch.tensor([[[256.0], [1.0], [1.0]]], dtype=torch.bfloat16)
    out = _run(x)
    assert out.item() == 258.0  # bf16 pairwise adds would give 256 + 1 -> 256, + 1 -> 256
    _assert_bits_equal(out, ref.moe_sum(x))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_skipped_slots_never_read(id_dtype):
    # Slots that do not count hold NaN/Inf: the result must not see them.
    x = torch.full((3, 4, 9), float("nan"))
    x[:, 0] = 1.0
    x[:, 2] = 2.0
    x[1, 3] = float("inf")
    ids = torch.tensor([[0, -1, 1, -1], [1, -5, 0, 7], [3, 2, 1, 9]], dtype=id_dtype)
    emap = torch.tensor([0, 1, -1, 2, -1, -1, -1, 3, -1, -1], dtype=torch.int32)
    # token 0: slots 0,2 count -> 3; token 1: slots 0,2,3 count (id 7 -> local 3): inf;
    # token 2: slot 0 (id 3 -> 2) and slot 2 (id 1 -> 1) count, id 2 -> -1, id 9 -> -1: 3.
    x[2, 1] = float("nan")
    out = _run(x, ids, emap)
    expected = torch.tensor([3.0, float("inf"), 3.0])[:, None].expand(3, 9)
    _assert_bits_equal(out, expected.contiguous())
    _assert_bits_equal(out, ref.moe_sum(x, ids, emap))


def test_ids_without_map_skip_only_negative():
    x = torch.ones((2, 3, 4))
    ids = torch.tensor([[0, 1000, -1], [-7, 5, 5]], dtype=torch.int32)
    out = _run(x, ids)
    _assert_bits_equal(out, torch.tensor([[2.0] * 4, [2.0] * 4]))


def test_ids_out_of_map_range_skipped():
    x = torch.ones((1, 4, 2))
    ids = torch.tensor([[0, 2, 3, 100]], dtype=torch.int32)
    emap = torch.tensor([0, 1, 2], dtype=torch.int32)  # 3 experts: ids 3 and 100 are skipped
    out = _run(x, ids, emap)
    _assert_bits_equal(out, torch.tensor([[2.0, 2.0]]))


def test_all_slots_skipped_give_zero_and_zero_topk():
    x = torch.full((4, 3, 5), float("nan"), dtype=torch.bfloat16)
    ids = torch.full((4, 3), -1, dtype=torch.int32)
    _assert_bits_equal(_run(x, ids), torch.zeros((4, 5), dtype=torch.bfloat16))
    # K = 0: every output element is still written (0).
    x0 = torch.empty((4, 0, 5), dtype=torch.float16)
    _assert_bits_equal(_run(x0), torch.zeros((4, 5), dtype=torch.float16))
    _assert_bits_equal(_run(x0, torch.empty((4, 0), dtype=torch.int32)),
                       torch.zeros((4, 5), dtype=torch.float16))


def test_empty_problem_leaves_output_alone():
    x = torch.randn((0, 2, 8))
    out = torch.empty((0, 8))
    OP(x, out)
    x = torch.randn((3, 2, 0))
    out = torch.empty((3, 0))
    OP(x, out, None, None)


def test_strided_input_and_output():
    gen = seeded(2)
    for dtype in DTYPES:
        big = torch.randn((6, 5, 40), generator=gen).to(dtype)
        x = big[::2, 1:4, 3:36]  # every stride non-trivial, unit last stride
        ids = torch.randint(-1, 4, (3, 3), generator=gen, dtype=torch.int32)
        out_big = poison(torch.empty((3, 50), dtype=dtype))
        out = out_big[:, 5:38]
        OP(x, out, ids, None)
        _assert_bits_equal(out, ref.moe_sum(x, ids))
        # The columns around the written window stay untouched.
        assert torch.isnan(out_big[:, :5].float()).all() and torch.isnan(out_big[:, 38:].float()).all()


# vLLM's test_moe_sum layouts: contiguous, topk and hidden transposed (hidden stride topk),
# every second topk slot of a wider buffer. Each is (base tensor, view of a base).
def _vllm_layouts(m, topk, k, dtype, gen):
    return {
        "contig": (torch.randn((m, topk, k), generator=gen).to(dtype), lambda b: b),
        "transpose": (torch.randn((m, k, topk), generator=gen).to(dtype),
                      lambda b: b.transpose(1, 2)),
        "slice": (torch.randn((m, 2 * topk, k), generator=gen).to(dtype),
                  lambda b: b[:, ::2, :]),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_input_strides_cpu(dtype):
    """A strided hidden dimension (vLLM's transposed layout, stride [1022, 1, 2] and the like)
    and strided topk_ids are read through their strides."""
    gen = seeded(4)
    for m, topk, k in [(1, 2, 128), (33, 8, 511), (5, 3, 7)]:
        for layout, (base, view) in _vllm_layouts(m, topk, k, dtype, gen).items():
            x = view(base)
            for ids_mode in ("none", "ids"):
                ids = None
                if ids_mode == "ids":
                    # topk_ids read through strides: a transposed view
                    ids = torch.randint(-1, 4, (topk, m), generator=gen,
                                        dtype=torch.int32).t()
                out = _run(x, ids)
                what = f"{layout} {m}x{topk}x{k} {dtype} {ids_mode} strides={x.stride()}"
                _assert_bits_equal(out, ref.moe_sum(x, ids), what)
                _assert_bits_equal(out, _run(x.contiguous(), None if ids is None
                                             else ids.contiguous()), what)
    # the vLLM test's expectation
    base, view = _vllm_layouts(33, 8, 511, torch.float32, gen)["transpose"]
    x = view(base)
    assert x.stride() == (511 * 8, 1, 8)
    _assert_bits_equal(_run(x), x.float().sum(dim=1).to(x.dtype))


def test_special_values_propagate():
    x = torch.tensor([[[1.0, float("inf"), float("nan"), -float("inf"), 3.0e38],
                       [2.0, 1.0, 0.0, float("inf"), 3.0e38]]])
    out = _run(x)
    _assert_bits_equal(out, ref.moe_sum(x))
    assert out[0, 0] == 3.0 and out[0, 1] == float("inf") and torch.isnan(out[0, 2])
    assert torch.isnan(out[0, 3]) and out[0, 4] == float("inf")


# ---------------------------------------------------------------------- input validation
def _bad_cases(device):
    f = dict(device=device)
    x = torch.randn((4, 2, 8), **f)
    out = torch.empty((4, 8), **f)
    ids = torch.zeros((4, 2), dtype=torch.int32, **f)
    emap = torch.zeros((6,), dtype=torch.int32, **f)
    wide = torch.randn((4, 2, 16), **f)
    return [
        ("input", (torch.randn((4, 8), **f), out, None, None)),  # rank
        ("output", (x, torch.empty((4, 2, 8), **f), None, None)),  # rank
        ("input", (x.to(torch.float64), out.to(torch.float64), None, None)),  # dtype
        ("input", (x.to(torch.int32), out.to(torch.int32), None, None)),  # dtype
        ("output", (x, out.to(torch.bfloat16), None, None)),  # dtype mismatch
        ("output", (x, torch.empty((3, 8), **f), None, None)),  # num_tokens
        ("output", (x, torch.empty((4, 9), **f), None, None)),  # hidden
        ("output", (x, torch.empty((4, 16), **f)[:, ::2], None, None)),  # last-dim stride
        ("output", (wide, wide[:, 0, :], None, None)),  # output overlaps input
        ("topk_ids", (x, out, torch.zeros((8,), dtype=torch.int32, **f), None)),  # rank
        ("topk_ids", (x, out, ids.float(), None)),  # dtype
        ("topk_ids", (x, out, ids.to(torch.int16), None)),  # dtype
        ("topk_ids", (x, out, torch.zeros((3, 2), dtype=torch.int32, **f), None)),  # T
        ("topk_ids", (x, out, torch.zeros((4, 3), dtype=torch.int32, **f), None)),  # K
        ("expert_map", (x, out, None, emap)),  # without topk_ids
        ("expert_map", (x, out, ids, emap.view(2, 3))),  # rank
        ("expert_map", (x, out, ids, emap.long())),  # dtype
        ("expert_map", (x, out, ids, torch.zeros((12,), dtype=torch.int32, **f)[::2])),  # contig
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases("cpu"))))
def test_bad_inputs_cpu(case):
    name, args = _bad_cases("cpu")[case]
    with pytest.raises(RuntimeError, match=name):
        OP(*args)


# ------------------------------------------------------------------------------ opcheck
def _opcheck_samples(device):
    gen = seeded(3)
    x1, ids1, _ = _make(1, 2, 8, torch.bfloat16, gen, ids_mode="ids")
    x2 = torch.randn((5, 6, 40), generator=gen)[:, 1:5, 4:36]  # non-contiguous input
    x3, ids3, map3 = _make(7, 4, 24, torch.float16, gen, ids_mode="map", id_dtype=torch.int64)
    # strided hidden dimension and strided topk_ids
    x4 = torch.randn((3, 40, 4), generator=gen).to(torch.bfloat16).transpose(1, 2)
    ids4 = torch.randint(-1, 6, (4, 3), generator=gen, dtype=torch.int32).t()
    samples = []
    for x, ids, emap in [(x1, ids1, None), (x2, None, None), (x3, ids3, map3), (x1, None, None),
                         (x4, ids4, None)]:
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        out = torch.empty((x.shape[0], x.shape[2]), dtype=x.dtype, device=device)
        samples.append((x.to(device), out, to(ids), to(emap)))
    return samples


def test_opcheck_cpu():
    for args in _opcheck_samples("cpu"):
        torch.library.opcheck(OP.default, args)


# ------------------------------------------------------------------------------ GPU
GPU_SHAPES = SHAPES + [(1, 8, 7168), (300, 10, 33), (9000, 8, 16), (2, 2, 4096), (64, 3, 1)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ids_mode", ["none", "ids", "map"])
def test_cuda_matches_cpu(dtype, ids_mode):
    gen = seeded(10)
    for shape, id_dtype in itertools.product(GPU_SHAPES, [torch.int32, torch.int64]):
        if ids_mode == "none" and id_dtype == torch.int64:
            continue
        x, ids, emap = _make(*shape, dtype, gen, ids_mode=ids_mode, num_experts=13,
                             id_dtype=id_dtype)
        want = _run(x, ids, emap)
        got = _run(x, ids, emap, device="cuda")
        what = f"shape={shape} {dtype} {ids_mode} {id_dtype}"
        _assert_bits_equal(got.cpu(), want, what)
        _assert_bits_equal(got.cpu(), ref.moe_sum(x, ids, emap), what)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_scalar_and_vector_paths(dtype):
    # Offsets/strides that break 16-byte alignment take the scalar path; both agree with CPU.
    gen = seeded(11)
    big = torch.randn((9, 7, 300), generator=gen).to(dtype)
    ids = torch.randint(-1, 5, (9, 7), generator=gen, dtype=torch.int32)
    for sl in [slice(0, 256), slice(1, 257), slice(3, 300), slice(8, 264), slice(0, 255)]:
        x = big[:, :, sl]
        for out_off in [0, 1, 8]:
            h = x.shape[2]
            out_big = poison(torch.empty((9, h + 16), dtype=dtype, device="cuda"))
            out = out_big[:, out_off:out_off + h]
            OP(x.cuda(), out, ids.cuda(), None)
            _assert_bits_equal(out.cpu(), ref.moe_sum(x, ids), f"{sl} {out_off}")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_any_input_strides(dtype):
    """Strided hidden dimensions (scalar path) and strided topk_ids on the GPU: equal to the
    reference and to the CPU op bit for bit."""
    gen = seeded(14)
    for m, topk, k in [(1, 2, 128), (33, 8, 511), (222, 8, 1024), (5, 3, 7)]:
        for layout, (base, view) in _vllm_layouts(m, topk, k, dtype, gen).items():
            x, xg = view(base), view(base.cuda())
            assert xg.stride() == x.stride()
            ids = torch.randint(-1, 4, (topk, m), generator=gen, dtype=torch.int64).t()
            emap = torch.tensor([0, -1, 1, 2], dtype=torch.int32)
            for args in [(None, None), (ids, None), (ids, emap)]:
                want = _run(x, *args)
                got = _run(xg, *args, device="cuda")
                what = f"{layout} {m}x{topk}x{k} {dtype} ids={args[0] is not None}"
                _assert_bits_equal(got.cpu(), want, what)
                _assert_bits_equal(got.cpu(), ref.moe_sum(x, *args), what)


@gpu
def test_cuda_skipped_slots_and_special_values():
    x = torch.full((3, 4, 40), float("nan"), dtype=torch.bfloat16)
    x[:, 0] = 1.5
    x[:, 2] = -0.25
    ids = torch.tensor([[0, -1, 1, -1], [1, -5, 0, 7], [3, 2, 1, 9]], dtype=torch.int32)
    emap = torch.tensor([0, 1, -1, 2, -1, -1, -1, 3, -1, -1], dtype=torch.int32)
    for args in [(ids, emap), (ids, None)]:
        got = _run(x, *args, device="cuda").cpu()
        _assert_bits_equal(got, _run(x, *args))
    x = torch.randn((5, 3, 64))
    x[0, 1, 3] = float("inf")
    x[2, 0, 5] = float("nan")
    _assert_bits_equal(_run(x, device="cuda").cpu(), _run(x))
    # All slots skipped, and K = 0: zeros, every element written.
    _assert_bits_equal(_run(x, torch.full((5, 3), -1, dtype=torch.int32), device="cuda").cpu(),
                       torch.zeros((5, 64)))
    _assert_bits_equal(_run(torch.empty((5, 0, 64)), device="cuda").cpu(), torch.zeros((5, 64)))
    # Empty problems launch nothing and do not fail.
    OP(torch.empty((0, 3, 64), device="cuda"), torch.empty((0, 64), device="cuda"), None, None)
    OP(torch.empty((4, 3, 0), device="cuda"), torch.empty((4, 0), device="cuda"), None, None)


@gpu
def test_cuda_large_and_deterministic():
    # T*K > 65535 slots and a grid-stride loop over > 65536 blocks worth of chunks.
    gen = seeded(12)
    x, ids, emap = _make(20000, 8, 520, torch.bfloat16, gen, ids_mode="map", num_experts=64)
    want = _run(x, ids, emap)
    xc, idc, mc = x.cuda(), ids.cuda(), emap.cuda()
    first = _run(xc, idc, mc, device="cuda")
    _assert_bits_equal(first.cpu(), want)
    for _ in range(20):
        assert torch.equal(_run(xc, idc, mc, device="cuda"), first)


@gpu
def test_cuda_graph_capture():
    gen = seeded(13)
    x = torch.randn((64, 4, 256), generator=gen).cuda()
    ids = torch.zeros((64, 4), dtype=torch.int32, device="cuda")
    emap = torch.arange(16, dtype=torch.int32, device="cuda")
    out = torch.empty((64, 256), device="cuda")
    OP(x, out, ids, emap)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        OP(x, out, ids, emap)
    for i in range(5):
        x.copy_(torch.randn((64, 4, 256), generator=gen))
        ids.copy_(torch.randint(-1, 20, (64, 4), generator=gen, dtype=torch.int32))
        poison(out)
        g.replay()
        torch.cuda.synchronize()
        _assert_bits_equal(out.cpu(), ref.moe_sum(x.cpu(), ids.cpu(), emap.cpu()), f"replay {i}")


@gpu
@pytest.mark.parametrize("case", range(len(_bad_cases("cpu"))))
def test_bad_inputs_cuda(case):
    name, args = _bad_cases("cuda")[case]
    with pytest.raises(RuntimeError, match=name):
        OP(*args)


@gpu
def test_bad_devices_cuda():
    x = torch.randn((4, 2, 8), device="cuda")
    out = torch.empty((4, 8), device="cuda")
    ids = torch.zeros((4, 2), dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="output"):
        OP(x, out.cpu(), None, None)
    with pytest.raises(RuntimeError, match="topk_ids"):
        OP(x, out, ids.cpu(), None)
    with pytest.raises(RuntimeError, match="expert_map"):
        OP(x, out, ids, torch.zeros((4,), dtype=torch.int32))


@gpu
def test_opcheck_cuda():
    for args in _opcheck_samples("cuda"):
        torch.library.opcheck(OP.default, args)


# ---------------------------------------------------------------- input audit: shared rules
# csrc/checks/reduce.cpp, the same for the CPU and the CUDA op (each *_cpu test has a GPU twin).
def _moe_sum_audit_calls(dev):
    buf = torch.zeros(16, 8, device=dev)
    out = torch.zeros(2, 8, device=dev)
    x = torch.zeros(2, 2, 8, device=dev)
    return [
        # A broadcast output: both tokens' sums written to one row.
        ("output is written by the op and must not have stride 0",
         lambda: torch.ops.hopper_moe.moe_sum(x, torch.empty(1, 8, device=dev).expand(2, 8),
                                              None, None)),
        # input reads rows 0, 4, 8, 12 of buf; output (rows 4..5) holds its row 4, past the
        # input's first numel elements.
        ("output must not overlap input",
         lambda: torch.ops.hopper_moe.moe_sum(buf.view(2, 8, 8)[:, ::4], buf[4:6], None, None)),
        ("output must not overlap topk_ids",
         lambda: torch.ops.hopper_moe.moe_sum(x, out, out.view(torch.int32)[0, :4].view(2, 2),
                                              None)),
        ("output must not overlap expert_map",
         lambda: torch.ops.hopper_moe.moe_sum(x, out, torch.zeros(2, 2, dtype=torch.int32,
                                                                  device=dev),
                                              out.view(torch.int32)[1, :4])),
    ]


@pytest.mark.parametrize("case", range(len(_moe_sum_audit_calls("cpu"))))
def test_moe_sum_input_audit_cpu(case):
    message, call = _moe_sum_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_moe_sum_audit_calls("cpu"))))
def test_moe_sum_input_audit_cuda(case):
    message, call = _moe_sum_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def _moe_sum_broadcast_input(dev):
    """A read-only input broadcast over topk (stride 0) is read like its copy."""
    g = seeded(5)
    rows = torch.randn(3, 1, 16, generator=g).to(dev)
    x = rows.expand(3, 4, 16)
    out = poison(torch.empty(3, 16, device=dev))
    torch.ops.hopper_moe.moe_sum(x, out, None, None)
    want = torch.empty(3, 16, device=dev)
    torch.ops.hopper_moe.moe_sum(x.contiguous(), want, None, None)
    assert torch.equal(out, want)


def test_moe_sum_broadcast_input_accepted_cpu():
    _moe_sum_broadcast_input("cpu")


@gpu
def test_moe_sum_broadcast_input_accepted_cuda():
    _moe_sum_broadcast_input("cuda")
