"""FP8 quantization ops: CPU op vs the fp32 reference (bit-exact: same fp32 expressions), CUDA
op vs CPU op (bit-exact, scales included), round-trip error bounds, scale layouts, NaN/inf,
saturation, bad inputs, opcheck, determinism and CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, gpu, poison, seeded
from hopper_moe.reference import quant as ref

ops = torch.ops.hopper_moe
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MIN_SCALE = torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32).item()
# (shape): tiny, odd, vector-sized, wide, 3-D
SHAPES = [(1, 1), (1, 7), (3, 16), (5, 33), (4, 4097), (2, 3, 64), (17, 128)]
# opcheck's test_schema compares mutated tensors with torch.allclose, which has no float8
# kernel; these ops all write e4m3, so they run the other three utils and the tests check
# directly that read-only arguments stay unchanged.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def make_x(shape, dtype, seed=0, device="cpu"):
    """Normal values with a different magnitude per row (so per-row scales differ) and a few
    exact zeros."""
    g = seeded(seed)
    x = torch.randn(*shape, generator=g)
    rows = x.reshape(-1, shape[-1])
    rows *= torch.exp2(torch.randint(-6, 7, (rows.shape[0], 1), generator=g).float())
    x.view(-1)[5::11] = 0.0
    return x.to(dtype).to(device)


def strided_like(x: torch.Tensor, device: str, elem_offset: int = 0, row_pad: int = 0):
    """x as rows [M, K] on `device`, placed `elem_offset` elements into a buffer with rows of
    K + row_pad elements (misaligned base when the offset is odd)."""
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    base = torch.empty(elem_offset + m * (k + row_pad), dtype=x.dtype, device=device)
    view = base[elem_offset:].view(m, k + row_pad)[:, :k]
    view.copy_(rows)
    return view


def fp8_empty(shape, device="cpu"):
    return poison(torch.empty(shape, dtype=FP8, device=device))


def f32_empty(shape, device="cpu"):
    return poison(torch.empty(shape, dtype=torch.float32, device=device))


def bytes_equal(a, b):
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def assert_round_trip(q, scale_map, x):
    """Dequantized q is within half an e4m3 step of x (relative 2^-4 for normals, 2^-10 * s in
    the subnormal range) wherever x / s is inside [-448, 448]."""
    x = x.float()
    deq = q.float() * scale_map
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale_map * 2.0 ** -10) * 1.001 + 1e-30
    inside = x.abs() <= 448 * scale_map
    assert bool(((deq - x).abs() <= bound)[inside].all())
    assert bool((deq[~inside].abs() == 448 * scale_map[~inside]).all())


def rows2d(t):
    return t.reshape(-1, t.shape[-1])


# ------------------------------------------------------------------------- static, per tensor
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_static_per_tensor_cpu_matches_reference(shape, dtype):
    x = make_x(shape, dtype, seed=len(shape) + shape[-1])
    scale = torch.tensor([0.0371])
    q = fp8_empty(shape)
    ops.static_scaled_fp8_quant(q, x, scale)
    assert bytes_equal(q, ref.static_scaled_fp8_quant_ref(x, scale))
    assert_round_trip(rows2d(q), scale.expand(rows2d(x).shape), rows2d(x))
    assert q.float().abs().sum() > 0


def test_static_saturates_and_maps_nan_to_max():
    x = torch.tensor([[1e6, -1e6, float("inf"), -float("inf"), float("nan"), 447.9, -0.0, 1e-9]])
    q = fp8_empty(x.shape)
    ops.static_scaled_fp8_quant(q, x, torch.tensor([1.0]))
    assert q.float().tolist() == [[448.0, -448.0, 448.0, -448.0, 448.0, 448.0, 0.0, 0.0]]
    assert torch.signbit(q.float())[0, 6]  # -0 stays -0
    assert bytes_equal(q, ref.static_scaled_fp8_quant_ref(x, torch.tensor([1.0])))


# --------------------------------------------------------------------- static, grouped scales
def static_group_cases(m, k):
    """(scale, group_shape) pairs covering every accepted layout for rows [m, k]."""
    g = seeded(m * 1000 + k)

    def rnd(*s):
        return torch.rand(*s, generator=g) * 0.1 + 0.01

    cases = [
        (rnd(m), [1, -1]),                      # per token
        (rnd(k), [-1, 1]),                      # per channel
        (rnd(1, 1), [4, 8]),                    # single element: per tensor, group ignored
        (rnd(-(-m // 2), -(-k // 8)), [2, 8]),  # 2-D blocks, partial last groups
        (rnd(-(-m // 3), -(-k // 16)), [3, 16]),
        (rnd(m, 1), None),                      # 2-D, groups inferred: per token
        (rnd(1, k), None),                      # 2-D, groups inferred: per channel
        (rnd(-(-k // 16), -(-m // 3)).t(), [3, 16]),  # transposed (non-contiguous) scale
    ]
    if m % 2 == 0 and k % 4 == 0:
        cases.append((rnd(m // 2, k // 4), None))  # 2-D blocks inferred
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 16), (6, 64), (5, 33), (8, 4096), (7, 13)])
def test_static_grouped_cpu_matches_reference(m, k, dtype):
    x = make_x((m, k), dtype, seed=m + k)
    for scale, group_shape in static_group_cases(m, k):
        q = fp8_empty((m, k))
        ops.static_scaled_fp8_quant(q, x, scale, group_shape)
        assert bytes_equal(q, ref.static_scaled_fp8_quant_ref(x, scale, group_shape)), (
            scale.shape, group_shape)
        smap = ref.static_scale_map_ref((m, k), scale, group_shape)
        assert_round_trip(q, smap, x)


def test_static_grouped_scale_really_selects_groups():
    # scale [2, 2] over rows [4, 4] with groups (2, 2): each quadrant gets its own scale
    x = torch.full((4, 4), 1.0)
    scale = torch.tensor([[1.0, 0.5], [0.25, 0.125]])
    q = fp8_empty((4, 4))
    ops.static_scaled_fp8_quant(q, x, scale, [2, 2])
    expected = torch.tensor([[1.0, 1, 2, 2], [1, 1, 2, 2], [4, 4, 8, 8], [4, 4, 8, 8]])
    assert torch.equal(q.float(), expected)


# -------------------------------------------------------------------------- dynamic per tensor
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_per_tensor_cpu_matches_reference(shape, dtype):
    x = make_x(shape, dtype, seed=7 + shape[-1])
    q = fp8_empty(shape)
    scale = torch.full((1,), 1e30)  # the op must not rely on the caller's initial value
    ops.dynamic_scaled_fp8_quant(q, x, scale)
    q_ref, s_ref = ref.dynamic_scaled_fp8_quant_ref(x)
    assert torch.equal(scale, s_ref)
    assert bytes_equal(q, q_ref)
    assert torch.equal(scale, torch.clamp(x.float().abs().amax() / 448.0, min=MIN_SCALE)[None])
    # the largest magnitude lands on +-448 exactly
    assert q.float().abs().max().item() == 448.0
    assert_round_trip(rows2d(q), scale.expand(rows2d(x).shape), rows2d(x))


def test_dynamic_per_tensor_zero_nan_inf():
    q = fp8_empty((3, 5))
    s = f32_empty((1,))
    ops.dynamic_scaled_fp8_quant(q, torch.zeros(3, 5), s)
    assert s.item() == MIN_SCALE and bool((q.float() == 0).all())
    # NaN elements do not affect the scale and quantize to +448
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5]])
    ops.dynamic_scaled_fp8_quant(q[:1, :4], x, s)
    assert s.item() == torch.tensor(2.0 / 448.0).item()
    assert q[:1, :4].float().tolist() == [[224.0, 448.0, -448.0, 112.0]]
    # an infinite element makes the scale infinite: finite values go to 0, infinities to 448
    x = torch.tensor([[1.0, float("inf"), -2.0, -float("inf")]])
    ops.dynamic_scaled_fp8_quant(q[:1, :4], x, s)
    assert s.item() == float("inf")
    assert q[:1, :4].float().tolist() == [[0.0, 448.0, -0.0, 448.0]]
    for x in (torch.tensor([[1.0, float("nan"), -2.0, 0.5]]),
              torch.tensor([[1.0, float("inf"), -2.0, -float("inf")]])):
        ops.dynamic_scaled_fp8_quant(q[:1, :4], x, s)
        q_ref, s_ref = ref.dynamic_scaled_fp8_quant_ref(x)
        assert bytes_equal(q[:1, :4], q_ref) and torch.equal(s, s_ref)


def _dynamic_scale_any_shape(device):
    """vLLM passes dynamic_scaled_fp8_quant a [num_tokens, 1] scale buffer (its opcheck), and
    any shape with at least one element is accepted: the op writes the first element only."""
    x = make_x((6, 40), torch.bfloat16, seed=31, device=device)
    q_ref, s_ref = ref.dynamic_scaled_fp8_quant_ref(x.cpu())
    buf = torch.full((24,), -5.0, device=device)
    for scale in (buf[:6].view(6, 1), buf[:1].view(()), buf[2:14].view(3, 4).t(), buf[::4],
                  buf.view(2, 3, 4)[:, 1]):
        buf.fill_(-5.0)
        q = fp8_empty((6, 40), device)
        ops.dynamic_scaled_fp8_quant(q, x, scale)
        assert bytes_equal(q, q_ref)
        first = scale.reshape(-1)[0]
        assert torch.equal(first.reshape(1).cpu(), s_ref)
        written = (buf != -5.0).nonzero().flatten().tolist()
        assert written == [scale.storage_offset()], (scale.shape, written)


def test_dynamic_scale_any_shape_cpu():
    _dynamic_scale_any_shape("cpu")


@gpu
def test_dynamic_scale_any_shape_cuda():
    _dynamic_scale_any_shape("cuda")


# --------------------------------------------------------------------------- dynamic per token
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ub", [None, 0.7])
def test_dynamic_per_token_cpu_matches_reference(shape, dtype, ub):
    x = make_x(shape, dtype, seed=3 + shape[-1])
    rows = rows2d(x).shape[0]
    scale_ub = None if ub is None else torch.tensor([ub])
    q = fp8_empty(shape)
    s = f32_empty((rows, 1))
    ops.dynamic_per_token_scaled_fp8_quant(q, x, s, scale_ub)
    q_ref, s_ref = ref.dynamic_per_token_scaled_fp8_quant_ref(x, scale_ub)
    assert torch.equal(s, s_ref)
    assert bytes_equal(q, q_ref)
    amax = rows2d(x).float().abs().amax(dim=1, keepdim=True)
    capped = amax if ub is None else amax.clamp(max=ub)
    torch.testing.assert_close(s, torch.clamp(capped / 448.0, min=MIN_SCALE), rtol=0, atol=0)
    assert_round_trip(rows2d(q), s.expand(rows2d(x).shape), rows2d(x))
    if ub is not None:
        # rows whose amax exceeds the bound saturate at +-448
        over = (amax > ub).squeeze(1)
        if bool(over.any()):
            assert bool((rows2d(q)[over].float().abs().amax(dim=1) == 448.0).all())


def test_dynamic_per_token_zero_rows_and_nan():
    x = torch.zeros(4, 6)
    x[1] = torch.tensor([1.0, -3.0, float("nan"), 0.0, 2.0, 1.5])
    x[2, 0] = float("inf")
    q = fp8_empty((4, 6))
    s = f32_empty((4, 1))
    ops.dynamic_per_token_scaled_fp8_quant(q, x, s, None)
    assert s[0].item() == MIN_SCALE and s[3].item() == MIN_SCALE
    assert s[1].item() == torch.tensor(3.0 / 448.0).item()
    assert s[2].item() == float("inf")
    assert q[1].float().tolist() == [torch.tensor(448.0 / 3.0).to(FP8).float().item(), -448.0,
                                     448.0, 0.0, torch.tensor(2 * 448.0 / 3).to(FP8).float().item(),
                                     224.0]
    q_ref, s_ref = ref.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert bytes_equal(q, q_ref) and torch.equal(s, s_ref)


# ---------------------------------------------------------------------- per token group (fp8)
def scale_layout(lead, groups, transposed, device="cpu"):
    """output_s [*lead, groups], row-major or (2-D) column-major (transposed scales)."""
    if transposed:
        assert len(lead) == 1
        return poison(torch.empty(groups, lead[0], dtype=torch.float32, device=device)).t()
    return f32_empty((*lead, groups), device)


GROUP_CASES = [((1, 128), 128), ((3, 256), 64), ((5, 384), 128), ((4, 21), 7), ((6, 8), 1),
               ((2, 3, 256), 128), ((33, 512), 128)]
# column-major (transposed) scales exist for 2-D inputs only
GROUP_LAYOUT_CASES = [(shape, gs, transposed) for shape, gs in GROUP_CASES
                      for transposed in (False, True) if not transposed or len(shape) == 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,group_size,transposed", GROUP_LAYOUT_CASES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_group_cpu_matches_reference(shape, group_size, transposed, dtype, ue8m0):
    x = make_x(shape, dtype, seed=shape[-1] + group_size)
    groups = shape[-1] // group_size
    q = fp8_empty(shape)
    s = scale_layout(shape[:-1], groups, transposed)
    ops.per_token_group_fp8_quant(x, q, s, group_size, 1e-10, -448.0, 448.0, ue8m0, transposed,
                                  False)
    q_ref, s_ref = ref.per_token_group_fp8_quant_ref(x, group_size, 1e-10, -448.0, 448.0, ue8m0)
    assert torch.equal(s, s_ref)
    assert bytes_equal(q, q_ref)
    if ue8m0:
        mantissa, _ = torch.frexp(s)
        assert bool((mantissa == 0.5).all())  # exact powers of two
        amax = rows2d(x).float().abs().reshape(-1, groups, group_size).amax(dim=2)
        assert bool((s.reshape(-1, groups) * 448.0 >= amax).all())  # never below the exact one
    smap = s.reshape(-1, groups).repeat_interleave(group_size, dim=1)
    assert_round_trip(rows2d(q), smap, rows2d(x))


def _e4m3_boundaries() -> torch.Tensor:
    """fp32 values where rounding to e4m3 decides: every midpoint between two neighbouring
    non-negative codes (0 to 448), the 3 floats on each side of it, the codes themselves, and
    random values over every binade from 2^-12 to 2^9; both signs."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    bits = mids.view(torch.int32)
    near = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    g = seeded(7)
    rand = torch.exp2(torch.rand(100_000, generator=g) * 21 - 12).clamp(max=448.0)
    values = torch.cat([codes, near, rand])
    return torch.cat([values, -values])


@pytest.mark.parametrize("device", DEVICES)
def test_conversion_is_torchs_cast_at_every_rounding_boundary(device):
    """The quantization ops' e4m3 conversion (hopper_moe/common/fp8.cuh e4m3_bits) against
    torch's own cast, through static_scaled_fp8_quant with scale 1 (q = e4m3(clamp(x))): both
    the vectorized and the element-wise kernel on CUDA (an aligned and a misaligned input)."""
    x = _e4m3_boundaries().to(device)
    want = x.to(FP8).view(torch.uint8)
    one = torch.ones(1, device=device)
    for offset in (0, 1):
        xs = strided_like(x.view(1, -1), device, elem_offset=offset)
        q = fp8_empty(xs.shape, device)
        ops.static_scaled_fp8_quant(q, xs, one)
        got = q.view(torch.uint8).view(-1)
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item())
                                  for i in bad[:8].tolist()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,k,group_size", [(7, 13824, 64), (2050, 512, 64), (2050, 4096, 128)])
def test_per_token_group_matches_torch_on_uniform_input(device, m, k, group_size):
    """vLLM's test_per_token_group_quant_fp8 case: torch.rand bf16 input (on CUDA its values
    reach far below 2^-8, so x / s lands in e4m3's subnormal range), against torch's own
    expression on the same device: amax * (1 / 448) (what torch computes on CUDA for vLLM's
    `amax / fp8_max`), x / s, clamp, cast. Bit-exact (the ops promise the same fp32 expressions
    and round-to-nearest-even cast as torch)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand(m, k, dtype=torch.bfloat16, device=device, generator=g)
    tiny = x.view(-1)[::997]  # every binade from 2^-8 down to 2^-47
    tiny.copy_(torch.exp2(-8.0 - torch.arange(tiny.numel(), device=device) % 40))
    groups = x.reshape(-1, group_size)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10).float()
    # The fp32 reciprocal, as torch on CUDA divides by a Python scalar (on every device here)
    s_ref = amax * (torch.ones_like(amax) / torch.full_like(amax, 448.0))
    q_ref = (groups / s_ref).clamp(-448.0, 448.0).to(FP8).reshape(m, k)
    q, s = fp8_empty((m, k), device), f32_empty((m, k // group_size), device)
    ops.per_token_group_fp8_quant(x, q, s, group_size, 1e-10, -448.0, 448.0, False, False, False)
    assert torch.equal(s.reshape(-1, 1), s_ref)
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    s_rows = s_ref.view(m, -1)
    examples = [(x[r, c].item(), (x[r, c].float() / s_rows[r, c // group_size]).item(),
                 q[r, c].float().item(), q_ref[r, c].float().item()) for r, c in diff[:8].tolist()]
    assert diff.numel() == 0, f"{diff.shape[0]} codes differ; (x, x / s, got, torch): {examples}"


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_group_scale_is_amax_times_reciprocal(device):
    """The H200 case behind vLLM's 2050-token test_per_token_group_quant_fp8 failures: with
    amax = 0.99609375, amax / 448 and amax * (1 / 448) are one fp32 ulp apart, and
    x = 1.5199e-05 then lands on either side of the e4m3 tie 3.5 * 2^-9. vLLM's result
    (its test's reference on CUDA) is the reciprocal's: scale 0.0022234236..., q = 3 * 2^-9."""
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    x[0, 0], x[0, 5] = 0.99609375, 1.519918441772461e-05
    x = x.to(device)
    q, s = fp8_empty((1, 64), device), f32_empty((1, 1), device)
    ops.per_token_group_fp8_quant(x, q, s, 64, 1e-10, -448.0, 448.0, False, False, False)
    assert s.item() == 0.002223423682153225
    assert q[0, 5].float().item() == 0.005859375 and q[0, 0].float().item() == 448.0
    q_ref, s_ref = ref.per_token_group_fp8_quant_ref(x.cpu(), 64)
    assert bytes_equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)


def test_per_token_group_eps_range_nan_and_zero():
    x = torch.zeros(3, 8)
    x[1, :4] = torch.tensor([1.0, float("nan"), -0.5, 0.25])
    x[2, 4:] = torch.tensor([float("inf"), 1.0, 2.0, -1.0])
    q = fp8_empty((3, 8))
    s = f32_empty((3, 2))
    ops.per_token_group_fp8_quant(x, q, s, 4, 1e-4, -224.0, 224.0, False, False, False)
    inv = torch.tensor(1.0) / torch.tensor(224.0)  # the scale is amax times fp32(1 / fp8_max)
    eps_scale = torch.tensor(1e-4, dtype=torch.float32) * inv
    assert s[0].tolist() == [eps_scale.item()] * 2  # all-zero groups: eps / fp8_max
    assert s[1, 0].item() == inv.item()  # NaN ignored by the amax
    assert q[1, :4].float().tolist() == [224.0, -224.0, -112.0, 56.0]  # NaN -> fp8_min
    assert s[2, 1].item() == float("inf")
    assert q[2, 4:].float().tolist() == [-224.0, 0.0, 0.0, -0.0]  # inf / inf = NaN -> fp8_min
    q_ref, s_ref = ref.per_token_group_fp8_quant_ref(x, 4, 1e-4, -224.0, 224.0, False)
    assert bytes_equal(q, q_ref) and torch.equal(s, s_ref)
    # eps = 0 on an all-zero group: scale 0, 0 / 0 = NaN -> fp8_min (same as vLLM);
    # dequantized it is still 0 * -448 = -0
    ops.per_token_group_fp8_quant(torch.zeros(1, 4), q[:1, :4], s[:1, :1], 4, 0.0, -448.0,
                                  448.0, False, False, False)
    assert s[0, 0].item() == 0.0 and q[0, :4].float().tolist() == [-448.0] * 4
    # ue8m0 with eps = 0: the 1e-10 floor keeps the scale a finite power of two (2^-33)
    ops.per_token_group_fp8_quant(torch.zeros(1, 4), q[:1, :4], s[:1, :1], 4, 0.0, -448.0,
                                  448.0, True, False, False)
    assert s[0, 0].item() == 2.0 ** -33 and q[0, :4].float().tolist() == [0.0] * 4


def test_ue8m0_round_up_is_exact_near_powers_of_two():
    # amax chosen so that amax / 448 is a power of two, or one float step above / below it
    p = torch.tensor(2.0 ** -7)
    targets = [p, torch.nextafter(p, torch.tensor(1.0)), torch.nextafter(p, torch.tensor(0.0))]
    x = torch.zeros(3, 4)
    for i, t in enumerate(targets):
        x[i, 0] = (t.double() * 448.0).float()
    s = f32_empty((3, 1))
    q = fp8_empty((3, 4))
    ops.per_token_group_fp8_quant(x, q, s, 4, 1e-10, -448.0, 448.0, True, False, False)
    raw = x[:, 0] * (torch.tensor(1.0) / torch.tensor(448.0))  # the scale before rounding up
    expected = ref.ue8m0_round_up_ref(raw)
    assert torch.equal(s[:, 0], expected)
    assert bool((s[:, 0] >= raw).all())
    assert bool((q.float().abs() <= 448).all())


# ----------------------------------------------------------------------- layouts and empties
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_strided_and_offset_views_cpu(dtype):
    x = make_x((9, 40), dtype, seed=1)
    base_q = fp8_empty((9, 40))
    ops.static_scaled_fp8_quant(base_q, x, torch.tensor([0.02]))
    base_s = f32_empty((9, 5))
    base_g = fp8_empty((9, 40))
    ops.per_token_group_fp8_quant(x, base_g, base_s, 8, 1e-10, -448.0, 448.0, False, False, False)
    for off, pad in [(1, 0), (0, 3), (5, 8)]:
        xs = strided_like(x, "cpu", off, pad)
        out = strided_like(fp8_empty((9, 40)), "cpu", off, pad)  # row-strided output too
        ops.static_scaled_fp8_quant(out, xs, torch.tensor([0.02]))
        assert bytes_equal(out, base_q)
        s = f32_empty((9, 5))
        ops.per_token_group_fp8_quant(xs, out, s, 8, 1e-10, -448.0, 448.0, False, False, False)
        assert bytes_equal(out, base_g) and torch.equal(s, base_s)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs_write_nothing(device):
    for dtype in DTYPES:
        x = torch.empty(0, 64, dtype=dtype, device=device)
        q = torch.empty(0, 64, dtype=FP8, device=device)
        ops.static_scaled_fp8_quant(q, x, torch.ones(1, device=device))
        ops.static_scaled_fp8_quant(q, x, torch.ones(0, device=device), [1, -1])
        s = torch.full((1,), 7.0, device=device)
        ops.dynamic_scaled_fp8_quant(q, x, s)
        assert s.item() == 7.0  # nothing is written for an empty input, the scale included
        ops.dynamic_per_token_scaled_fp8_quant(q, x, torch.empty(0, 1, device=device), None)
        ops.per_token_group_fp8_quant(x, q, torch.empty(0, 1, device=device), 64, 1e-10,
                                      -448.0, 448.0, False, False, False)


# ----------------------------------------------------------------------------------- bad inputs
def _bad_calls(device):
    f32 = dict(dtype=torch.float32, device=device)
    x = torch.randn(4, 16, **f32)
    q = torch.empty(4, 16, dtype=FP8, device=device)
    s1 = torch.ones(1, **f32)
    st = torch.ones(4, 1, **f32)
    sg = torch.ones(4, 2, **f32)

    def group(inp=x, out=q, scales=sg, gs=8, eps=1e-10, lo=-448.0, hi=448.0):
        return lambda: ops.per_token_group_fp8_quant(inp, out, scales, gs, eps, lo, hi, False,
                                                     False, False)

    return [
        # static
        ("input", lambda: ops.static_scaled_fp8_quant(q, x.to(torch.int32), s1)),
        ("result", lambda: ops.static_scaled_fp8_quant(torch.empty(4, 16, **f32), x, s1)),
        ("result", lambda: ops.static_scaled_fp8_quant(torch.empty(4, 15, dtype=FP8,
                                                                   device=device), x, s1)),
        ("input", lambda: ops.static_scaled_fp8_quant(q, torch.randn(16, 4, **f32).t(), s1)),
        ("result", lambda: ops.static_scaled_fp8_quant(
            torch.empty(16, 4, dtype=FP8, device=device).t(), x, s1)),
        ("input", lambda: ops.static_scaled_fp8_quant(
            torch.empty(2, 3, 16, dtype=FP8, device=device), torch.randn(2, 4, 16, **f32)[:, :3],
            s1)),
        ("result", lambda: ops.static_scaled_fp8_quant(
            torch.empty(1, 16, dtype=FP8, device=device).expand(4, 16), x, s1)),
        ("scale", lambda: ops.static_scaled_fp8_quant(q, x, s1.half())),
        ("input", lambda: ops.static_scaled_fp8_quant(torch.empty((), dtype=FP8, device=device),
                                                      torch.tensor(1.0, **f32), s1)),
        ("result", lambda: ops.static_scaled_fp8_quant(x.view(FP8)[:, :16], x, s1)),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(4, **f32))),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(4, **f32), [1, 8])),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(5, **f32), [1, -1])),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, s1, [1, 2, 3])),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, s1, [0, 4])),
        ("group_shape", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(2, 2, **f32),
                                                            [2, 4])),
        ("scale", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(3, 2, **f32))),
        ("scale", lambda: ops.static_scaled_fp8_quant(q, x, torch.ones(2, 2, 2, **f32))),
        # dynamic per tensor
        ("scale", lambda: ops.dynamic_scaled_fp8_quant(q, x, torch.ones(0, **f32))),
        ("scale", lambda: ops.dynamic_scaled_fp8_quant(q, x, torch.ones(4, 0, **f32))),
        ("scale", lambda: ops.dynamic_scaled_fp8_quant(q, x, torch.ones(1, dtype=torch.float16,
                                                                        device=device))),
        ("result", lambda: ops.dynamic_scaled_fp8_quant(x.clone(), x, s1)),
        ("input", lambda: ops.dynamic_scaled_fp8_quant(q, x.double(), s1)),
        # dynamic per token
        ("scale", lambda: ops.dynamic_per_token_scaled_fp8_quant(q, x, torch.ones(3, 1, **f32),
                                                                 None)),
        ("scale", lambda: ops.dynamic_per_token_scaled_fp8_quant(q, x, torch.ones(4, **f32),
                                                                 None)),
        ("scale", lambda: ops.dynamic_per_token_scaled_fp8_quant(
            q, x, torch.ones(8, 1, **f32)[::2], None)),
        ("scale_ub", lambda: ops.dynamic_per_token_scaled_fp8_quant(q, x, st,
                                                                    torch.ones(2, **f32))),
        ("scale_ub", lambda: ops.dynamic_per_token_scaled_fp8_quant(
            q, x, st, torch.ones(1, dtype=torch.float64, device=device))),
        ("result", lambda: ops.dynamic_per_token_scaled_fp8_quant(
            torch.empty(4, 16, dtype=torch.bfloat16, device=device), x, st, None)),
        # per token group
        ("group_size", group(gs=0)),
        ("group_size", group(gs=6)),
        ("eps", group(eps=-1.0)),
        ("eps", group(eps=float("nan"))),
        ("fp8_max", group(hi=500.0)),
        ("fp8_max", group(hi=0.0)),
        ("fp8_min", group(lo=-449.0)),
        ("fp8_min", group(lo=448.0)),
        ("output_s", group(scales=torch.ones(4, 3, **f32))),
        ("output_s", group(scales=torch.ones(4, 2, dtype=torch.float16, device=device))),
        ("output_s", group(scales=torch.ones(1, 2, **f32).expand(4, 2))),
        ("output_q", group(out=torch.empty(4, 16, dtype=torch.int8, device=device))),
        ("output_q", group(out=torch.empty(4, 8, dtype=FP8, device=device))),
        ("input", group(inp=torch.randn(16, 4, **f32).t())),
        ("input", group(inp=torch.randn(4, 16, dtype=torch.float64, device=device))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))))
def test_bad_inputs_raise_cpu(case):
    name, call = _bad_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=name):
        call()


# --------------------------------------------------------------------------------------- opcheck
def _opcheck_cases(device):
    g = seeded(9)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    xs = [
        rnd(1, 16),                                # tiny M
        rnd(6, 80, dtype=torch.bfloat16)[:, :64],  # row-strided
        rnd(2, 3, 32, dtype=torch.float16),        # 3-D
    ]
    cases = []
    for x in xs:
        m = x.numel() // x.shape[-1]
        k = x.shape[-1]
        q = torch.empty(x.shape, dtype=FP8, device=device)
        s1 = torch.tensor([0.05], device=device)
        cases.append((ops.static_scaled_fp8_quant.default, (q, x, s1, None)))
        cases.append((ops.static_scaled_fp8_quant.default,
                      (q, x, torch.full((m,), 0.1, device=device), [1, -1])))
        cases.append((ops.dynamic_scaled_fp8_quant.default,
                      (q, x, torch.empty(1, device=device))))
        cases.append((ops.dynamic_scaled_fp8_quant.default,  # vLLM's opcheck scale
                      (q, x, torch.empty(m, 1, device=device))))
        cases.append((ops.dynamic_per_token_scaled_fp8_quant.default,
                      (q, x, torch.empty(m, 1, device=device), None)))
        cases.append((ops.dynamic_per_token_scaled_fp8_quant.default,
                      (q, x, torch.empty(m, 1, device=device),
                       torch.tensor([0.5], device=device))))
        cases.append((ops.per_token_group_fp8_quant.default,
                      (x, q, torch.empty(*x.shape[:-1], k // 16, device=device), 16, 1e-10,
                       -448.0, 448.0, False, False, False)))
        if x.dim() == 2:
            cases.append((ops.per_token_group_fp8_quant.default,
                          (x, q, torch.empty(k // 8, m, device=device).t(), 8, 1e-10, -448.0,
                           448.0, True, True, False)))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        read_only = [a.clone() for a in args[1:2]]  # the input (static/dynamic: arg 1)
        if op is ops.per_token_group_fp8_quant.default:
            read_only = [args[0].clone()]
        torch.library.opcheck(op, args, test_utils=FP8_OPCHECK_UTILS)
        inp = args[0] if op is ops.per_token_group_fp8_quant.default else args[1]
        assert torch.equal(inp, read_only[0])


# ------------------------------------------------------------------------------------- GPU tests
# Dynamic per tensor runs in one block up to 2^15 elements (csrc/ops/quant.cu), in three
# kernels above: both sides of the bound.
GPU_SHAPES = SHAPES + [(70000, 8), (3, 14336), (1, 2048), (257, 1000), (64, 7168),
                       (32, 768), (1, 32768), (4, 8193)]
LAYOUTS = ["contiguous", "offset", "row_pad"]


def to_cuda_layout(x, layout):
    if layout == "offset":    # misaligned base: scalar path
        return strided_like(x, "cuda", elem_offset=1)
    if layout == "row_pad":   # row stride K + 8: vector path when K allows
        return strided_like(x, "cuda", row_pad=8)
    return rows2d(x).cuda()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_per_tensor_and_per_token_match_cpu(shape, dtype, layout):
    x = rows2d(make_x(shape, dtype, seed=shape[-1] + 1))
    xg = to_cuda_layout(x, layout)
    m, k = x.shape
    # static per tensor
    q_cpu = fp8_empty((m, k))
    ops.static_scaled_fp8_quant(q_cpu, x, torch.tensor([0.013]))
    q = fp8_empty((m, k), "cuda")
    ops.static_scaled_fp8_quant(q, xg, torch.tensor([0.013], device="cuda"))
    assert bytes_equal(q, q_cpu)
    # dynamic per tensor (scale poisoned with a huge value: the op resets it itself)
    s_cpu = torch.empty(1)
    ops.dynamic_scaled_fp8_quant(q_cpu, x, s_cpu)
    s = torch.full((1,), 3e38, device="cuda")
    q = fp8_empty((m, k), "cuda")
    ops.dynamic_scaled_fp8_quant(q, xg, s)
    assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)
    # dynamic per token, with and without the bound
    for ub in (None, 0.3):
        ub_cpu = None if ub is None else torch.tensor([ub])
        s_cpu = torch.empty(m, 1)
        ops.dynamic_per_token_scaled_fp8_quant(q_cpu, x, s_cpu, ub_cpu)
        s = f32_empty((m, 1), "cuda")
        q = fp8_empty((m, k), "cuda")
        ops.dynamic_per_token_scaled_fp8_quant(q, xg, s, None if ub is None else ub_cpu.cuda())
        assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 16), (6, 64), (5, 33), (8, 4096), (7, 13), (300, 512)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_static_grouped_matches_cpu(m, k, dtype, layout):
    x = make_x((m, k), dtype, seed=m * k)
    xg = to_cuda_layout(x, layout)
    for scale, group_shape in static_group_cases(m, k):
        q_cpu = fp8_empty((m, k))
        ops.static_scaled_fp8_quant(q_cpu, x, scale, group_shape)
        q = fp8_empty((m, k), "cuda")
        ops.static_scaled_fp8_quant(q, xg, scale.cuda(), group_shape)
        assert bytes_equal(q, q_cpu), (scale.shape, group_shape)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,group_size", [(1, 128, 128), (3, 256, 64), (5, 384, 128),
                                            (4, 21, 7), (6, 8, 1), (33, 512, 128),
                                            (70000, 128, 128), (17, 7168, 128), (9, 96, 32)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_cuda_per_token_group_matches_cpu(m, k, group_size, dtype, layout, ue8m0):
    x = make_x((m, k), dtype, seed=k + group_size)
    xg = to_cuda_layout(x, layout)
    groups = k // group_size
    for transposed in (False, True):
        q_cpu = fp8_empty((m, k))
        s_cpu = scale_layout((m,), groups, transposed)
        ops.per_token_group_fp8_quant(x, q_cpu, s_cpu, group_size, 1e-10, -448.0, 448.0, ue8m0,
                                      transposed, False)
        q = fp8_empty((m, k), "cuda")
        s = scale_layout((m,), groups, transposed, "cuda")
        ops.per_token_group_fp8_quant(xg, q, s, group_size, 1e-10, -448.0, 448.0, ue8m0,
                                      transposed, False)
        assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)


@gpu
def test_cuda_3d_and_special_values_match_cpu():
    x = make_x((2, 5, 256), torch.bfloat16, seed=4)
    x.view(-1)[::17] = float("nan")
    x[1, 2, 7] = float("inf")
    x[0, 3, 9] = -float("inf")
    xg = x.cuda()
    q_cpu, q = fp8_empty(x.shape), fp8_empty(x.shape, "cuda")
    ops.static_scaled_fp8_quant(q_cpu, x, torch.tensor([0.1]))
    ops.static_scaled_fp8_quant(q, xg, torch.tensor([0.1], device="cuda"))
    assert bytes_equal(q, q_cpu)
    s_cpu, s = torch.empty(1), torch.empty(1, device="cuda")
    ops.dynamic_scaled_fp8_quant(q_cpu, x, s_cpu)
    ops.dynamic_scaled_fp8_quant(q, xg, s)
    assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)
    s_cpu, s = torch.empty(10, 1), torch.empty(10, 1, device="cuda")
    ops.dynamic_per_token_scaled_fp8_quant(q_cpu, x, s_cpu, torch.tensor([1.5]))
    ops.dynamic_per_token_scaled_fp8_quant(q, xg, s, torch.tensor([1.5], device="cuda"))
    assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)
    s_cpu, s = torch.empty(2, 5, 2), torch.empty(2, 5, 2, device="cuda")
    ops.per_token_group_fp8_quant(x, q_cpu, s_cpu, 128, 1e-10, -448.0, 448.0, True, False, False)
    ops.per_token_group_fp8_quant(xg, q, s, 128, 1e-10, -448.0, 448.0, True, False, False)
    assert torch.equal(s.cpu(), s_cpu) and bytes_equal(q, q_cpu)


@gpu
def test_cuda_deterministic():
    x = make_x((512, 4096), torch.bfloat16, seed=2, device="cuda")
    s_g = torch.empty(512, 32, device="cuda")

    def run():
        outs = []
        q = fp8_empty(x.shape, "cuda")
        s = torch.empty(1, device="cuda")
        ops.dynamic_scaled_fp8_quant(q, x, s)
        outs += [q.clone(), s.clone()]
        st = torch.empty(512, 1, device="cuda")
        ops.dynamic_per_token_scaled_fp8_quant(q, x, st, None)
        outs += [q.clone(), st.clone()]
        ops.per_token_group_fp8_quant(x, q, s_g, 128, 1e-10, -448.0, 448.0, False, False, False)
        outs += [q.clone(), s_g.clone()]
        ops.static_scaled_fp8_quant(q, x, torch.full((4, 32), 0.02, device="cuda"), [128, 128])
        outs.append(q.clone())
        return [o.view(torch.uint8) if o.dtype == FP8 else o for o in outs]

    first = run()
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(run(), first))


@gpu
def test_cuda_graph_replay_dynamic_scales():
    m, k = 96, 1024
    x = make_x((m, k), torch.float16, seed=0, device="cuda")
    q1, s1 = fp8_empty((m, k), "cuda"), torch.empty(1, device="cuda")
    q2, s2 = fp8_empty((m, k), "cuda"), torch.empty(m, 1, device="cuda")
    q3, s3 = fp8_empty((m, k), "cuda"), torch.empty(k // 128, m, device="cuda").t()

    def body():
        ops.dynamic_scaled_fp8_quant(q1, x, s1)
        ops.dynamic_per_token_scaled_fp8_quant(q2, x, s2, None)
        ops.per_token_group_fp8_quant(x, q3, s3, 128, 1e-10, -448.0, 448.0, True, True, False)

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for seed in range(5):
        xc = make_x((m, k), torch.float16, seed=50 + seed) * (seed + 1)
        x.copy_(xc)
        for t in (q1, q2, q3, s1, s2, s3):
            poison(t)
        graph.replay()
        torch.cuda.synchronize()
        eq1, es1 = fp8_empty((m, k)), torch.empty(1)
        ops.dynamic_scaled_fp8_quant(eq1, xc, es1)
        eq2, es2 = fp8_empty((m, k)), torch.empty(m, 1)
        ops.dynamic_per_token_scaled_fp8_quant(eq2, xc, es2, None)
        eq3, es3 = ref.per_token_group_fp8_quant_ref(xc, 128, 1e-10, -448.0, 448.0, True)
        assert bytes_equal(q1, eq1) and torch.equal(s1.cpu(), es1)
        assert bytes_equal(q2, eq2) and torch.equal(s2.cpu(), es2)
        assert bytes_equal(q3, eq3) and torch.equal(s3.cpu(), es3)


@gpu
@pytest.mark.parametrize("case", range(len(_bad_calls("cpu"))))
def test_bad_inputs_raise_cuda(case):
    name, call = _bad_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=name):
        call()


@gpu
def test_device_mismatch_raises():
    x = torch.randn(4, 16, device="cuda")
    q = torch.empty(4, 16, dtype=FP8, device="cuda")
    with pytest.raises(RuntimeError, match="result"):
        ops.static_scaled_fp8_quant(torch.empty(4, 16, dtype=FP8), x,
                                    torch.ones(1, device="cuda"))
    with pytest.raises(RuntimeError, match="scale"):
        ops.static_scaled_fp8_quant(q, x, torch.ones(1))
    with pytest.raises(RuntimeError, match="scale"):
        ops.dynamic_scaled_fp8_quant(q, x, torch.ones(1))
    with pytest.raises(RuntimeError, match="scale_ub"):
        ops.dynamic_per_token_scaled_fp8_quant(q, x, torch.ones(4, 1, device="cuda"),
                                               torch.ones(1))
    with pytest.raises(RuntimeError, match="output_s"):
        ops.per_token_group_fp8_quant(x, q, torch.ones(4, 2), 8, 1e-10, -448.0, 448.0, False,
                                      False, False)
    with pytest.raises(RuntimeError, match="output_q"):
        ops.per_token_group_fp8_quant(x, torch.empty(4, 16, dtype=FP8), torch.ones(4, 2),
                                      8, 1e-10, -448.0, 448.0, False, False, False)


# ---------------------------------------------------------------- input audit: shared rules
# csrc/checks/quant.cpp and quant::resolve_static_groups, the same for the CPU and the CUDA op
# (each *_cpu test has a GPU twin).
INT64_MAX = 2 ** 63 - 1


def _quant_audit_calls(device):
    f32 = dict(dtype=torch.float32, device=device)
    x = torch.randn(4, 16, **f32)
    q = torch.empty(4, 16, dtype=FP8, device=device)
    empty = torch.empty(0, **f32)
    static = ops.static_scaled_fp8_quant
    buf = torch.zeros(8, 16, **f32)
    return [
        # A group count that used to overflow to 0 and match an empty scale (the kernels then
        # read scale[0]).
        (r"scale has 0 elements but group_shape \[9223372036854775807, -1\]",
         lambda: static(q, x, empty, [INT64_MAX, -1])),
        (r"scale has 0 elements but group_shape \[-1, 9223372036854775807\]",
         lambda: static(q, x, empty, [-1, INT64_MAX])),
        (r"scale has 0 elements but group_shape \[9223372036854775806, 1\]",
         lambda: static(q, x, empty, [INT64_MAX - 1, 1])),
        (r"scale must have shape \[1, 1\] for group_shape",
         lambda: static(q, x, torch.empty(0, 1, **f32), [INT64_MAX, INT64_MAX])),
        # Non-positive entries other than -1 (whole dimension).
        (r"group_shape entries must be positive or -1",
         lambda: static(q, x, torch.ones(4, **f32), [-2, -1])),
        (r"group_shape entries must be positive or -1",
         lambda: static(q, x, torch.ones(4, **f32), [1, 0])),
        (r"group_shape entries must be positive or -1",
         lambda: static(q, x, torch.ones(4, **f32), [-INT64_MAX - 1, -1])),
        # Outputs against the other arguments, by the memory span they touch.
        ("result must not overlap scale",
         lambda: static(q, x, q.view(torch.float32).view(-1)[:1])),
        ("scale must not overlap input",
         lambda: ops.dynamic_scaled_fp8_quant(q, x, x.view(-1)[5:6])),
        ("result must not overlap scale",
         lambda: ops.dynamic_per_token_scaled_fp8_quant(
             q, x, q.view(torch.float32).view(-1)[:4].view(4, 1), None)),
        ("scale must not overlap input",
         lambda: ops.dynamic_per_token_scaled_fp8_quant(q, x, x.view(-1)[:4].view(4, 1),
                                                        None)),
        ("output_s must not overlap input",
         lambda: ops.per_token_group_fp8_quant(x, q, x[:, :2], 8, 1e-10, -448.0, 448.0, False,
                                               False, False)),
        ("output_q must not overlap output_s",
         lambda: ops.per_token_group_fp8_quant(x, q, q.view(torch.float32)[:, :2], 8, 1e-10,
                                               -448.0, 448.0, False, False, False)),
        # input reads rows 0, 2, 4, 6 of buf; result (buf's row 4 as e4m3 [4, 16]) holds its
        # row 2, past the input's first numel elements.
        ("result must not overlap input",
         lambda: static(buf[4].view(FP8).view(4, 16), buf[::2], torch.ones(1, **f32))),
        ("group_size must be > 0",
         lambda: ops.per_token_group_fp8_quant(x, q, torch.empty(4, 0, **f32), 0, 1e-10,
                                               -448.0, 448.0, False, False, False)),
    ]


@pytest.mark.parametrize("case", range(len(_quant_audit_calls("cpu"))))
def test_quant_input_audit_cpu(case):
    message, call = _quant_audit_calls("cpu")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


@gpu
@pytest.mark.parametrize("case", range(len(_quant_audit_calls("cpu"))))
def test_quant_input_audit_cuda(case):
    message, call = _quant_audit_calls("cuda")[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def _huge_group_shape_is_one_group(device):
    """A group larger than the dimension is one group: (2^62, 2) with 8 scales is the
    per-column-pair layout (-1, 2)."""
    x = make_x((4, 16), torch.float32, seed=21, device=device)
    scale = torch.linspace(0.01, 0.08, 8, device=device)
    want = fp8_empty((4, 16), device)
    ops.static_scaled_fp8_quant(want, x, scale, [-1, 2])
    got = fp8_empty((4, 16), device)
    ops.static_scaled_fp8_quant(got, x, scale, [2 ** 62, 2])
    assert bytes_equal(got, want)
    got2 = fp8_empty((4, 16), device)
    ops.static_scaled_fp8_quant(got2, x, scale.view(1, 8), [INT64_MAX, 2])
    assert bytes_equal(got2, want)


def test_huge_group_shape_is_one_group_cpu():
    _huge_group_shape_is_one_group("cpu")


@gpu
def test_huge_group_shape_is_one_group_cuda():
    _huge_group_shape_is_one_group("cuda")


def _per_token_k0_scale_is_the_floor(device):
    """K = 0: every (empty) row gets the scale of an all-zero row, the floor 1/(448*512), with
    or without scale_ub; nothing else is written."""
    for ub in (None, torch.tensor([0.25], device=device), torch.tensor([-1.0], device=device)):
        x = torch.empty(3, 0, device=device)
        q = torch.empty(3, 0, dtype=FP8, device=device)
        s = f32_empty((3, 1), device)
        ops.dynamic_per_token_scaled_fp8_quant(q, x, s, ub)
        assert torch.equal(s.cpu(), torch.full((3, 1), MIN_SCALE))
        zeros = torch.zeros(3, 4, device=device)
        s_zero = f32_empty((3, 1), device)
        ops.dynamic_per_token_scaled_fp8_quant(fp8_empty((3, 4), device), zeros, s_zero, ub)
        assert torch.equal(s.cpu(), s_zero.cpu())


def test_per_token_k0_scale_is_the_floor_cpu():
    _per_token_k0_scale_is_the_floor("cpu")


@gpu
def test_per_token_k0_scale_is_the_floor_cuda():
    _per_token_k0_scale_is_the_floor("cuda")


def _broadcast_input_rows_accepted(device):
    """A read-only input of one broadcast row (row stride 0) is quantized like its copy."""
    x = make_x((1, 32), torch.float32, seed=8, device=device).expand(6, 32)
    got, want = fp8_empty((6, 32), device), fp8_empty((6, 32), device)
    s1, s2 = f32_empty((6, 1), device), f32_empty((6, 1), device)
    ops.dynamic_per_token_scaled_fp8_quant(got, x, s1, None)
    ops.dynamic_per_token_scaled_fp8_quant(want, x.contiguous(), s2, None)
    assert bytes_equal(got, want) and torch.equal(s1, s2)


def test_broadcast_input_rows_accepted_cpu():
    _broadcast_input_rows_accepted("cpu")


@gpu
def test_broadcast_input_rows_accepted_cuda():
    _broadcast_input_rows_accepted("cuda")


@pytest.mark.parametrize("group_size", [0, -128])
def test_per_token_group_quant_wrapper_rejects_a_non_positive_group_size(group_size):
    """The allocating wrapper checks group_size before it divides by it."""
    x = torch.randn(4, 256)
    from hopper_moe import ops as wrappers

    with pytest.raises(RuntimeError, match="group_size must be > 0"):
        wrappers.per_token_group_quant_fp8(x, group_size)
