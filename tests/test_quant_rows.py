"""fp8_quant_rows: the quantization pass between the GEMMs over the rows of a layer's
intermediate that GEMM1 wrote. The rows that count equal the bytes (and scales) of
static_scaled_fp8_quant / dynamic_per_token_scaled_fp8_quant / per_token_group_fp8_quant; the
other rows of the result and of the scale keep what they held, and those of the input are
never read (CPU: they hold NaN, which a read would turn into 448 or a NaN scale; CUDA: also
compute-sanitizer initcheck over the layer). Bad arguments give a RuntimeError naming the
argument, on every device."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, gpu, poison, seeded

ops = torch.ops.hopper_moe
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["static_tensor", "per_token", "per_group"]
GROUP = 16


def _x(rows, cols, dtype, device, seed=0):
    g = seeded(seed)
    x = torch.randn(rows, cols, generator=g) * 3
    x *= torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())
    return x.to(dtype).to(device)


def _scale_shape(kind, rows, cols):
    return {"static_tensor": (1,), "per_token": (rows, 1),
            "per_group": (rows, cols // GROUP)}[kind]


def _whole(x, kind, scale):
    """The op of the same formulas over every row: (q bytes, scale) on the CPU."""
    q = poison(torch.empty(x.shape, dtype=FP8, device=x.device))
    if kind == "static_tensor":
        ops.static_scaled_fp8_quant(q, x, scale)
        s = scale
    elif kind == "per_token":
        s = poison(torch.empty(x.shape[0], 1, device=x.device))
        ops.dynamic_per_token_scaled_fp8_quant(q, x, s, None)
    else:
        s = poison(torch.empty(x.shape[0], x.shape[1] // GROUP, device=x.device))
        ops.per_token_group_fp8_quant(x, q, s, GROUP, 1e-10, -448.0, 448.0, False, False, False)
    return q.view(torch.uint8).cpu(), s.cpu()


def _check_rows(x, kind, counts, **rows):
    """Rows where counts: the whole op's bytes and scales; elsewhere the poison stays. The
    input's rows that do not count are NaN first."""
    device = x.device
    x = x.clone()
    x[~counts.to(device)] = float("nan")
    clean = torch.nan_to_num(x, nan=0.0)
    static = torch.tensor([0.0173], device=device)
    scale = static if kind == "static_tensor" else \
        poison(torch.empty(_scale_shape(kind, *x.shape), device=device))
    out = poison(torch.empty(x.shape, dtype=FP8, device=device))
    ops.fp8_quant_rows(out, x, scale, kind, GROUP if kind == "per_group" else 0,
                       rows.get("slot_ids"), rows.get("expert_map"), rows.get("num_experts", 0),
                       rows.get("row_end"))
    want_q, want_s = _whole(clean, kind, static)
    got = out.view(torch.uint8).cpu()
    counts = counts.cpu()
    assert torch.equal(got[counts], want_q[counts])
    assert bool((got[~counts] == 0x7F).all())
    if kind != "static_tensor":
        got_s = scale.cpu()
        assert torch.equal(got_s[counts], want_s[counts])
        assert bool(got_s[~counts].isnan().all())
    else:
        assert torch.equal(scale.cpu(), static.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cols", [16, 48, 768, 4112])
def test_slot_rows(device, kind, dtype, id_dtype, cols):
    g = seeded(cols)
    rows, num_experts = 37, 8
    ids = torch.randint(-3, num_experts + 3, (rows,), generator=g).to(id_dtype)
    if id_dtype == torch.int64:  # ids that a cast to int32 would wrap into range
        ids[0], ids[1] = 2**32, 2**32 + 3
    else:
        ids[0], ids[1] = -(2**31), 2**31 - 1
    x = _x(rows, cols, dtype, device, seed=cols)
    counts = (ids >= 0) & (ids < num_experts)
    _check_rows(x, kind, counts, slot_ids=ids.to(device), num_experts=num_experts)
    # With an expert map: -1 entries do not count either.
    emap = torch.tensor([0, -1, 1, -1, 2, 3, -1, 4], dtype=torch.int32)
    mapped = counts & (emap[ids.clamp(0, num_experts - 1).long()] >= 0)
    _check_rows(x, kind, mapped, slot_ids=ids.to(device), expert_map=emap.to(device),
                num_experts=num_experts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("end", [-5, 0, 1, 19, 40, 2**40])
def test_leading_rows(device, kind, dtype, end):
    rows, cols = 40, 144
    x = _x(rows, cols, dtype, device, seed=end % 1000)
    counts = torch.arange(rows) < end
    # row_end as the last entry of an expert-offsets tensor (a view, as the layer passes it).
    offsets = torch.tensor([0, 3, end], dtype=torch.int64, device=device)
    _check_rows(x, kind, counts, row_end=offsets[-1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_row_strided_input_and_output(device, kind):
    x = _x(12, 96, torch.bfloat16, device)
    wide = torch.zeros(12, 160, dtype=torch.bfloat16, device=device)
    wide[:, :96] = x
    ids = torch.tensor([0, 9, 1, -1, 2, 3, 4, 5, 6, 7, 8, 0], dtype=torch.int32, device=device)
    static = torch.tensor([0.25], device=device)
    scale = static if kind == "static_tensor" else \
        poison(torch.empty(_scale_shape(kind, 12, 96), device=device))
    out_wide = poison(torch.empty(12, 128, dtype=FP8, device=device))
    out = out_wide[:, :96]
    ops.fp8_quant_rows(out, wide[:, :96], scale, kind, GROUP, ids, None, 9, None)
    counts = ((ids >= 0) & (ids < 9)).cpu()
    want_q, _ = _whole(x, kind, static)
    assert torch.equal(out.view(torch.uint8).cpu()[counts], want_q[counts])
    assert bool((out_wide[:, 96:].view(torch.uint8) == 0x7F).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_empty_input(device, kind):
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    out = torch.empty(0, 64, dtype=FP8, device=device)
    scale = torch.ones(1, device=device) if kind == "static_tensor" else \
        torch.empty(_scale_shape(kind, 0, 64), device=device)
    ids = torch.empty(0, dtype=torch.int32, device=device)
    ops.fp8_quant_rows(out, x, scale, kind, GROUP, ids, None, 4, None)


def _bad_cases(device):
    x = _x(6, 32, torch.bfloat16, device)
    out = torch.empty(6, 32, dtype=FP8, device=device)
    s = torch.ones(1, device=device)
    st = torch.ones(6, 1, device=device)
    sg = torch.ones(6, 2, device=device)
    ids = torch.zeros(6, dtype=torch.int32, device=device)
    end = torch.tensor([3], dtype=torch.int64, device=device)
    emap = torch.zeros(4, dtype=torch.int32, device=device)
    t = "static_tensor"
    return [
        ((out, x, s, "per_tensor", 0, ids, None, 4, None), "kind must be"),
        ((out, x, s, t, 0, None, None, 4, None), "exactly one of slot_ids and row_end"),
        ((out, x, s, t, 0, ids, None, 4, end), "exactly one of slot_ids and row_end"),
        ((out, x, s, t, 0, ids.float(), None, 4, None), "slot_ids must be int32 or int64"),
        ((out, x, s, t, 0, ids[:5], None, 4, None), "slot_ids must have 6 elements"),
        ((out, x, s, t, 0, torch.zeros(6, 2, dtype=torch.int32, device=device)[:, 0], None, 4,
          None), "slot_ids must be contiguous"),
        ((out, x, s, t, 0, ids, None, -1, None), "num_experts must be in"),
        ((out, x, s, t, 0, ids, emap[:3], 4, None), "expert_map must have 4 elements"),
        ((out, x, s, t, 0, ids, emap.long(), 4, None), "expert_map"),
        ((out, x, s, t, 0, None, emap, 4, end), "expert_map is only taken with slot_ids"),
        ((out, x, s, t, 0, None, None, 0, end.int()), "row_end"),
        ((out, x, s, t, 0, None, None, 0, torch.zeros(2, dtype=torch.int64, device=device)),
         "row_end must have 1 elements"),
        ((out, x, torch.ones(2, device=device), t, 0, ids, None, 4, None), "scale must have 1"),
        ((out, x, s.double(), t, 0, ids, None, 4, None), "scale"),
        ((out, x, st[:5], "per_token", 0, ids, None, 4, None), r"scale must have shape \[6, 1\]"),
        ((out, x, torch.ones(6, 2, device=device)[:, :1], "per_token", 0, ids, None, 4, None),
         "scale must be contiguous"),
        ((out, x, torch.ones(1, 1, device=device).expand(6, 1), "per_token", 0, ids, None, 4,
          None), "scale must be contiguous"),
        ((out, x, sg, "per_group", 0, ids, None, 4, None), "group_size must be >= 1"),
        ((out, x, sg, "per_group", 5, ids, None, 4, None), "group_size must be >= 1"),
        ((out, x, st, "per_group", 16, ids, None, 4, None), r"scale must have shape \[6, 2\]"),
        ((torch.empty(6, 32, dtype=torch.bfloat16, device=device), x, s, t, 0, ids, None, 4,
          None), "result"),
        ((out[:5], x, s, t, 0, ids, None, 4, None), "result"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    for args, words in _bad_cases(device):
        with pytest.raises(RuntimeError, match=words):
            ops.fp8_quant_rows(*args)


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_overlapping_inputs_are_rejected(device):
    x = _x(4, 16, torch.bfloat16, device)
    buf = torch.zeros(64 + 16, dtype=torch.uint8, device=device)
    out = buf[:64].view(FP8).view(4, 16)
    ids = buf[16:32].view(torch.int32)  # 4 ids inside out's bytes
    with pytest.raises(RuntimeError, match="slot_ids"):
        ops.fp8_quant_rows(out, x, torch.ones(1, device=device), "static_tensor", 0, ids, None,
                           4, None)
    ids = torch.zeros(4, dtype=torch.int32, device=device)
    raw = torch.zeros(4 * 16 + 16, dtype=torch.float32, device=device)
    x32 = raw[:64].view(4, 16)
    with pytest.raises(RuntimeError, match="scale"):  # per-token scales written into input
        ops.fp8_quant_rows(torch.empty(4, 16, dtype=FP8, device=device), x32,
                           raw[8:12].view(4, 1), "per_token", 0, ids, None, 4, None)


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_cpu(kind):
    x = _x(9, 48, torch.bfloat16, "cpu")
    ids = torch.tensor([0, 5, 1, -1, 2, 3, 4, 1, 0], dtype=torch.int32)
    out = torch.empty(9, 48, dtype=FP8)
    scale = torch.ones(1) if kind == "static_tensor" else torch.empty(_scale_shape(kind, 9, 48))
    for utils in ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"):
        torch.library.opcheck(ops.fp8_quant_rows.default,
                              (out, x, scale, kind, GROUP, ids, None, 5, None), test_utils=utils)


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_follows_new_ids(kind):
    x = _x(33, 256, torch.bfloat16, "cuda")
    ids = torch.zeros(33, dtype=torch.int32, device="cuda")
    static = torch.tensor([0.125], device="cuda")
    scale = static if kind == "static_tensor" else \
        torch.empty(_scale_shape(kind, 33, 256), device="cuda")
    out = torch.empty(33, 256, dtype=FP8, device="cuda")
    call = lambda: ops.fp8_quant_rows(out, x, scale, kind, GROUP, ids, None, 4, None)  # noqa: E731
    call()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    want_q, _ = _whole(x, kind, static)
    for seed in range(3):
        new = torch.randint(-2, 6, (33,), generator=seeded(seed)).to(torch.int32)
        ids.copy_(new.cuda())
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        counts = (new >= 0) & (new < 4)
        got = out.view(torch.uint8).cpu()
        assert torch.equal(got[counts], want_q[counts])
        assert bool((got[~counts] == 0x7F).all())
