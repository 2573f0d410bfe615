"""silu_and_mul and silu_and_mul_quant: each device's op vs the reference evaluated on that
device, bit for bit (vLLM's rounding order: silu rounded to the input dtype, then the product
rounded), the CUDA op vs the CPU op within one rounding step (their exp differ by an ulp), edge
cases, bad inputs, opcheck."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICES, gpu, poison, seeded
from hopper_moe.reference import activation as ref

ops = torch.ops.hopper_moe
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (leading shape, d): tiny, odd, vector-sized, wide, 3-D
SHAPES = [((1,), 1), ((1,), 7), ((3,), 8), ((5,), 33), ((4,), 4097), ((2, 3), 64), ((17,), 128)]
# one rounding step of each output dtype, relative (fp32 gets a few ulp for the exp)
REL_STEP = {torch.float32: 2.0 ** -21, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# vLLM's kernel tests run these (num_tokens, d); the largest token count is left to the GPU.
VLLM_SHAPES = [((7,), 512), ((83,), 512), ((7,), 13824), ((83,), 13824)]


def make_input(lead, d, dtype, seed=0, device="cpu", scale=3.0):
    """Contiguous input [*lead, 2d] = gate || up, normal values times `scale`."""
    x = (torch.randn(*lead, 2 * d, generator=seeded(seed)) * scale).to(dtype)
    return x.to(device)


def strided_like(x: torch.Tensor, device: str, elem_offset: int = 0, row_pad: int = 0):
    """Copy of 2-D x on `device` as a row-padded / offset view (same values, same layout kind)."""
    rows, width = x.shape
    base = torch.empty(elem_offset + rows * (width + row_pad), dtype=x.dtype, device=device)
    view = base[elem_offset:].view(rows, width + row_pad)[:, :width]
    view.copy_(x)
    return view


def out_shape(x):
    return x.shape[:-1] + (x.shape[-1] // 2,)


def assert_bits_equal(out, expected):
    """Equal values (NaN where expected is NaN; +0 and -0 count as equal, as in vLLM's
    assert_close(atol=0, rtol=0))."""
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def assert_within_one_step(out, expected, dtype):
    """out equals expected except on a few elements (any number for fp32), which differ by at
    most one rounding step of dtype (relative); NaN where expected is NaN. For CPU vs CUDA
    results, whose exp differ by an ulp."""
    max_frac = 1.0 if dtype == torch.float32 else 0.02
    o, e = out.float(), expected.float()
    assert torch.equal(torch.isnan(o), torch.isnan(e))
    fin = ~torch.isnan(e)
    o, e = o[fin], e[fin]
    diff = (o - e).abs()
    tol = e.abs() * (2 * REL_STEP[dtype]) + 1e-30
    assert bool((diff <= tol).all()), f"max diff {diff.max().item()}"
    assert (diff > 0).float().mean().item() <= max_frac


def assert_fp8_within_one_ulp(q, expected, max_frac=0.01):
    """e4m3 bytes equal except on at most max_frac of the elements, off by one code."""
    a = q.view(torch.uint8).to(torch.int16)
    b = expected.view(torch.uint8).to(torch.int16)
    same_sign = (a & 0x80) == (b & 0x80)
    diff = (a - b).abs()
    assert bool(((diff == 0) | (same_sign & (diff == 1))).all())
    assert (diff != 0).float().mean().item() <= max_frac


def fp8_bytes_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- CPU vs reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d", SHAPES)
def test_silu_and_mul_cpu_matches_reference(lead, d, dtype):
    x = make_input(lead, d, dtype, seed=d)
    out = poison(torch.empty(out_shape(x), dtype=dtype))
    ops.silu_and_mul(out, x)
    assert_bits_equal(out, ref.silu_and_mul_ref(x))
    assert out.float().abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d", SHAPES)
def test_silu_and_mul_quant_cpu_matches_reference(lead, d, dtype):
    x = make_input(lead, d, dtype, seed=100 + d)
    scale = torch.tensor([0.05])
    out = poison(torch.empty(out_shape(x), dtype=FP8))
    ops.silu_and_mul_quant(out, x, scale)
    assert fp8_bytes_equal(out, ref.silu_and_mul_quant_ref(x, scale))
    # round trip: dequantized values within half an e4m3 step of v plus one rounding step of
    # dtype (v is rounded to dtype before it is quantized), or the saturation bound
    v = ref.silu_mul_f32_ref(x)
    deq = out.float() * scale
    bound = (torch.maximum(v.abs() * 2.0 ** -4, scale * 2.0 ** -10)
             + v.abs() * REL_STEP[dtype]) * 1.01 + 1e-6
    inside = v.abs() <= 448 * scale
    assert bool(((deq - v).abs() <= bound)[inside].all())
    assert bool((deq[~inside].abs() == 448 * scale).all())


def _silu_f32_accuracy(device):
    # every exp argument class: underflow, subnormal results, normal, overflow
    g = torch.cat([torch.linspace(-110, 110, 200001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])])
    x = torch.cat([g, torch.ones_like(g)]).reshape(1, -1).to(device)
    out = torch.empty(1, g.numel(), device=device)
    ops.silu_and_mul(out, x)
    out = out.cpu()
    exact = (g.double() / (1 + torch.exp(-g.double()))).float()
    # exp(-g) overflows fp32 below g = -88.72: silu is then g / inf = -0, as with any fp32 exp
    finite = g > -88.72
    overflow = g < -88.73
    rel = (out[0].double() - exact.double()).abs() / exact.double().abs().clamp(min=1e-38)
    assert rel[finite].max().item() <= 4 * 2.0 ** -23  # exp within 2 ulp, then add and divide
    assert torch.equal(torch.signbit(out[0]), torch.signbit(g))
    assert bool((out[0][overflow] == 0).all())


def test_silu_f32_accuracy_over_the_exp_range_cpu():
    _silu_f32_accuracy("cpu")


@gpu
def test_silu_f32_accuracy_over_the_exp_range_cuda():
    _silu_f32_accuracy("cuda")


def _nan_inf(device):
    gate = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 2.0, -1.0, 100.0, -100.0])
    up = torch.tensor([1.0, 2.0, 1.0, float("nan"), float("inf"), -float("inf"), 0.0, 3.0])
    for dtype in DTYPES:
        x = torch.cat([gate, up]).reshape(1, -1).to(device=device, dtype=dtype)
        out = poison(torch.empty(1, 8, dtype=dtype, device=device))
        ops.silu_and_mul(out, x)
        assert_bits_equal(out, ref.silu_and_mul_ref(x))
        # silu(nan) * 1, silu(inf) * 2, silu(-inf) * 1 = nan, inf, nan (-inf / inf)
        assert torch.isnan(out[0, 0]) and out[0, 1].item() == float("inf")
        assert torch.isnan(out[0, 2])
        q = poison(torch.empty(1, 8, dtype=FP8, device=device))
        one = torch.tensor([1.0], device=device)
        ops.silu_and_mul_quant(q, x, one)
        # NaN products quantize to +448 (fmax(-448, fmin(NaN, 448))), infinities saturate
        assert fp8_bytes_equal(q, ref.silu_and_mul_quant_ref(x, one))
        assert q.float()[0, 0].item() == 448.0 and q.float()[0, 1].item() == 448.0


def test_silu_and_mul_nan_inf_cpu():
    _nan_inf("cpu")


@gpu
def test_silu_and_mul_nan_inf_cuda():
    _nan_inf("cuda")


def _rounding_order(device):
    """The op rounds silu(gate) to the dtype before the product (vLLM's order), which differs
    from rounding silu(gate) * up once on a good share of fp16/bf16 elements: the test picks
    those elements, so it fails for the single-rounding order."""
    for dtype in (torch.float16, torch.bfloat16):
        x = make_input((64,), 256, dtype, seed=21, device=device)
        gate, up = x[:, :256], x[:, 256:]
        twice = F.silu(gate) * up
        once = (F.silu(gate.float()) * up.float()).to(dtype)
        differ = twice != once
        assert differ.float().mean().item() > 0.05
        out = poison(torch.empty(64, 256, dtype=dtype, device=device))
        ops.silu_and_mul(out, x)
        assert torch.equal(out[differ], twice[differ])
        assert_bits_equal(out, twice)


def test_rounding_order_is_silu_then_product_cpu():
    _rounding_order("cpu")


@gpu
def test_rounding_order_is_silu_then_product_cuda():
    _rounding_order("cuda")


def _native_on_vllm_shapes(device, shapes):
    """vLLM's test_act_and_mul: the op equals F.silu(x[..., :d]) * x[..., d:] exactly."""
    for dtype in DTYPES:
        for lead, d in shapes:
            x = make_input(lead, d, dtype, seed=d + lead[0], device=device, scale=1.0)
            out = poison(torch.empty(out_shape(x), dtype=dtype, device=device))
            ops.silu_and_mul(out, x)
            assert_bits_equal(out, F.silu(x[..., :d]) * x[..., d:])


def test_matches_torch_native_on_vllm_shapes_cpu():
    _native_on_vllm_shapes("cpu", VLLM_SHAPES)


@gpu
def test_matches_torch_native_on_vllm_shapes_cuda():
    _native_on_vllm_shapes("cuda", VLLM_SHAPES + [((2048,), 512), ((2048,), 13824)])


def test_silu_and_mul_quant_saturates():
    x = torch.tensor([[1000.0, 1000.0, 3.0, 0.0, 10.0, -10.0, 200.0, 5.0]])
    q = poison(torch.empty(1, 4, dtype=FP8))
    ops.silu_and_mul_quant(q, x, torch.tensor([0.01]))
    assert q.float().tolist() == [[448.0, -448.0, 448.0, 0.0]]
    assert fp8_bytes_equal(q, ref.silu_and_mul_quant_ref(x, torch.tensor([0.01])))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_write_nothing(device):
    for dtype in DTYPES:
        x = torch.empty(0, 16, dtype=dtype, device=device)
        out = torch.empty(0, 8, dtype=dtype, device=device)
        ops.silu_and_mul(out, x)
        q = torch.empty(0, 8, dtype=FP8, device=device)
        ops.silu_and_mul_quant(q, x, torch.tensor([1.0], device=device))
    x = torch.empty(3, 0, device=device)
    ops.silu_and_mul(torch.empty(3, 0, device=device), x)


def test_row_strided_and_offset_input_cpu():
    # row-strided (row_pad) and offset (misaligned) views give the contiguous results
    for dtype in DTYPES:
        x = make_input((9,), 24, dtype, seed=7)
        expected = torch.empty(9, 24, dtype=dtype)
        ops.silu_and_mul(expected, x)
        for off, pad in [(1, 0), (0, 5), (3, 2)]:
            xs = strided_like(x, "cpu", off, pad)
            out = poison(torch.empty(9, 24, dtype=dtype))
            ops.silu_and_mul(out, xs)
            assert torch.equal(out, expected)


# ----------------------------------------------------------------------------------- bad inputs
def _bad_calls(device):
    f32 = dict(dtype=torch.float32, device=device)
    x = torch.randn(4, 16, **f32)
    out = torch.empty(4, 8, **f32)
    q = torch.empty(4, 8, dtype=FP8, device=device)
    s = torch.ones(1, **f32)
    overlap_buf = torch.randn(64, **f32)
    return [
        ("input", lambda: ops.silu_and_mul(torch.empty(4, 8, dtype=torch.int32, device=device),
                                           torch.ones(4, 16, dtype=torch.int32, device=device))),
        ("result", lambda: ops.silu_and_mul(torch.empty(4, 8, dtype=torch.float16,
                                                        device=device), x)),
        ("input", lambda: ops.silu_and_mul(torch.empty(4, 7, **f32), torch.randn(4, 15, **f32))),
        ("result", lambda: ops.silu_and_mul(torch.empty(4, 9, **f32), x)),
        ("result", lambda: ops.silu_and_mul(torch.empty(3, 8, **f32), x)),
        ("result", lambda: ops.silu_and_mul(torch.empty(8, 4, **f32).t(), x)),
        ("input", lambda: ops.silu_and_mul(out, torch.randn(16, 4, **f32).t())),
        ("input", lambda: ops.silu_and_mul(torch.empty(2, 3, 8, **f32),
                                           torch.randn(2, 4, 16, **f32)[:, :3])),
        ("input", lambda: ops.silu_and_mul(torch.empty(0, **f32), torch.tensor(1.0, **f32))),
        ("result", lambda: ops.silu_and_mul(overlap_buf[:32].view(4, 8),
                                            overlap_buf.view(4, 16))),
        ("result", lambda: ops.silu_and_mul_quant(out, x, s)),
        ("scale", lambda: ops.silu_and_mul_quant(q, x, torch.ones(1, dtype=torch.float16,
                                                                   device=device))),
        ("scale", lambda: ops.silu_and_mul_quant(q, x, torch.ones(2, **f32))),
        ("input", lambda: ops.silu_and_mul_quant(q, x.double(), s)),
        ("input", lambda: ops.silu_and_mul_quant(q, torch.randn(4, 17, **f32), s)),
        ("result", lambda: ops.silu_and_mul_quant(torch.empty(4, 9, dtype=FP8, device=device),
                                                  x, s)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))))
def test_bad_inputs_raise_cpu(case):
    name, call = _bad_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=name):
        call()


# --------------------------------------------------------------------------------------- opcheck
def _opcheck_samples(device):
    g = seeded(3)
    samples = []
    for dtype in (torch.float32, torch.bfloat16):
        x1 = torch.randn(1, 16, generator=g).to(device=device, dtype=dtype)        # tiny M
        x2 = torch.randn(5, 40, generator=g).to(device=device, dtype=dtype)[:, :32]  # row-strided
        x3 = torch.randn(2, 3, 24, generator=g).to(device=device, dtype=dtype)       # 3-D
        samples += [x1, x2, x3]
    return samples


# opcheck's test_schema compares mutated tensors with torch.allclose, which has no float8
# kernel: ops writing e4m3 run the other three utils (fake tensor, autograd registration, AOT
# dispatch), and the test checks directly that their read-only arguments stay unchanged.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for x in _opcheck_samples(device):
        out = torch.empty(out_shape(x), dtype=x.dtype, device=device)
        torch.library.opcheck(ops.silu_and_mul.default, (out, x))
        q = torch.empty(out_shape(x), dtype=FP8, device=device)
        s = torch.tensor([0.1], device=device)
        x_before, s_before = x.clone(), s.clone()
        torch.library.opcheck(ops.silu_and_mul_quant.default, (q, x, s),
                              test_utils=FP8_OPCHECK_UTILS)
        assert torch.equal(x, x_before) and torch.equal(s, s_before)


# ------------------------------------------------------------------------------------- GPU tests
GPU_SHAPES = SHAPES + [((70000,), 8), ((3,), 14336), ((1,), 2048), ((257,), 1000)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,d", GPU_SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "offset", "row_pad"])
def test_cuda_matches_reference_bitwise(lead, d, dtype, layout):
    """Vector and scalar paths equal the reference on the GPU (torch's CUDA silu and mul) bit
    for bit, and the CPU op within one rounding step."""
    x = make_input(lead, d, dtype, seed=d + len(lead))
    x2 = x.reshape(-1, 2 * d)
    if layout == "offset":      # misaligned base: scalar path
        xg = strided_like(x2, "cuda", elem_offset=1)
    elif layout == "row_pad":   # row stride 2d + 8: vector path when d allows
        xg = strided_like(x2, "cuda", row_pad=8)
    else:
        xg = x2.cuda()
    out = poison(torch.empty(out_shape(x2), dtype=dtype, device="cuda"))
    ops.silu_and_mul(out, xg)
    assert_bits_equal(out, ref.silu_and_mul_ref(xg))
    out_cpu = torch.empty(out_shape(x2), dtype=dtype)
    ops.silu_and_mul(out_cpu, x2)
    assert_within_one_step(out.cpu(), out_cpu, dtype)
    scale = torch.tensor([0.02], device="cuda")
    q = poison(torch.empty(out_shape(x2), dtype=FP8, device="cuda"))
    ops.silu_and_mul_quant(q, xg, scale)
    assert fp8_bytes_equal(q, ref.silu_and_mul_quant_ref(xg, scale))
    # the quantized op is the static quantization of silu_and_mul's output
    q_static = torch.empty_like(q)
    ops.static_scaled_fp8_quant(q_static, out, scale, None)
    assert fp8_bytes_equal(q, q_static)


@gpu
def test_cuda_3d_and_special_values():
    x = make_input((2, 5), 40, torch.bfloat16, seed=11)
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("inf")
    x.view(-1)[5::13] = -float("inf")
    xg = x.cuda()
    out = poison(torch.empty(out_shape(x), dtype=x.dtype, device="cuda"))
    ops.silu_and_mul(out, xg)
    assert_bits_equal(out, ref.silu_and_mul_ref(xg))
    scale = torch.tensor([0.5], device="cuda")
    q = poison(torch.empty(out_shape(x), dtype=FP8, device="cuda"))
    ops.silu_and_mul_quant(q, xg, scale)
    assert fp8_bytes_equal(q, ref.silu_and_mul_quant_ref(xg, scale))


@gpu
def test_cuda_deterministic():
    x = make_input((300,), 1536, torch.bfloat16, seed=5, device="cuda")
    s = torch.tensor([0.03], device="cuda")
    first = torch.empty(out_shape(x), dtype=x.dtype, device="cuda")
    first_q = torch.empty(out_shape(x), dtype=FP8, device="cuda")
    ops.silu_and_mul(first, x)
    ops.silu_and_mul_quant(first_q, x, s)
    for _ in range(20):
        out = poison(torch.empty_like(first))
        q = poison(torch.empty_like(first_q))
        ops.silu_and_mul(out, x)
        ops.silu_and_mul_quant(q, x, s)
        assert torch.equal(out, first) and fp8_bytes_equal(q, first_q)


@gpu
def test_cuda_graph_replay():
    x = make_input((64,), 256, torch.float16, seed=1, device="cuda")
    s = torch.tensor([0.05], device="cuda")
    out = torch.empty(out_shape(x), dtype=x.dtype, device="cuda")
    q = torch.empty(out_shape(x), dtype=FP8, device="cuda")
    ops.silu_and_mul(out, x)  # warm up outside the capture
    ops.silu_and_mul_quant(q, x, s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.silu_and_mul(out, x)
        ops.silu_and_mul_quant(q, x, s)
    for seed in range(5):
        x.copy_(make_input((64,), 256, torch.float16, seed=100 + seed))
        s.fill_(0.01 * (seed + 1))
        poison(out), poison(q)
        graph.replay()
        torch.cuda.synchronize()
        eo = torch.empty_like(out)
        eq = torch.empty_like(q)
        ops.silu_and_mul(eo, x)
        ops.silu_and_mul_quant(eq, x, s)
        assert torch.equal(out, eo) and fp8_bytes_equal(q, eq)


@gpu
@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))))
def test_bad_inputs_raise_cuda(case):
    name, call = _bad_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=name):
        call()


@gpu
def test_device_mismatch_raises():
    x = torch.randn(4, 16, device="cuda")
    with pytest.raises(RuntimeError, match="result"):
        ops.silu_and_mul(torch.empty(4, 8), x)
    with pytest.raises(RuntimeError, match="scale"):
        ops.silu_and_mul_quant(torch.empty(4, 8, dtype=FP8, device="cuda"), x,
                               torch.tensor([1.0]))



# ---------------------------------------------------------------- input audit: shared rules
# csrc/checks/activation.cpp, the same for the CPU and the CUDA op (each *_cpu test has a GPU
# twin).
def _activation_audit_calls(dev):
    buf = torch.zeros(8, 16, device=dev)
    q = torch.empty(4, 8, dtype=torch.float8_e4m3fn, device=dev)
    x = torch.zeros(4, 16, device=dev)
    return [
        # input reads rows 0, 2, 4, 6 of buf; result (rows 4..5 as [4, 8]) holds its row 4,
        # past the input's first numel elements.
        ("result must not overlap input",
         lambda: torch.ops.hopper_moe.silu_and_mul(buf[4:6].view(4, 8), buf[::2])),
        # the static scale (read) inside result (written).
        ("result must not overlap scale",
         lambda: torch.ops.hopper_moe.silu_and_mul_quant(q, x,
                                                         q.view(torch.float32).view(-1)[:1])),
    ]


@pytest.mark.parametrize("case", range(len(_activation_audit_calls("cpu"))))
def test_activation_input_audit_cpu(case):
    message, call = _activation_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_activation_audit_calls("cpu"))))
def test_activation_input_audit_cuda(case):
    message, call = _activation_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def _broadcast_rows_accepted(dev):
    """A read-only input whose rows are one broadcast row (row stride 0) is read like its
    copy."""
    x = make_input((1,), 16, torch.float32, seed=4, device=dev).expand(5, 32)
    out = poison(torch.empty(5, 16, device=dev))
    torch.ops.hopper_moe.silu_and_mul(out, x)
    want = torch.empty_like(out)
    torch.ops.hopper_moe.silu_and_mul(want, x.contiguous())
    assert torch.equal(out, want)


def test_broadcast_rows_accepted_cpu():
    _broadcast_rows_accepted("cpu")


@gpu
def test_broadcast_rows_accepted_cuda():
    _broadcast_rows_accepted("cuda")
