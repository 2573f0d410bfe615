"""fused_inv_rope_fp8_quant: inverse RoPE (GPT-J pairs, last 64 of 512 dims per head) + FP8
e4m3 quantization per 128-element block with power-of-two scales, heads gathered per group.

The reference's semantics are pinned first (round trip against a forward rope, sign
convention, scale rule, rounding); then the Triton kernel is held to the reference bit for bit
(fp8 codes and scales): the kernel is built so that no step depends on FMA contraction or on the
backend's fp8 conversion, see hopper_moe/kernels/inv_rope_quant.py. Without a GPU the kernel
runs in Triton's interpreter (slow: ~10 ms per (token, head) program), so the CPU cases are few
and small; the gpu-marked tests cover many shapes, CUDA-graph capture and recompilation.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import gpu, poison, seeded
from hopper_moe.reference.rope_quant import (
    fused_inv_rope_fp8_quant_ref,
    inv_rope_ref,
    pow2_block_scale_ref,
)
from hopper_moe import settings
from hopper_moe.kernels import fused_inv_rope_fp8_quant, inv_rope_quant

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
HEAD, NOPE, ROPE, BLOCK = 512, 448, 64, 128
_REAL_EMPTY = torch.empty


# ----------------------------------------------------------------------------- helpers

def rope_cache(max_position: int, base: float = 10000.0) -> torch.Tensor:
    """[max_position, 64] float32 = cos || sin of p * base^(-2i/64)."""
    inv_freq = base ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def forward_rope(y: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate the GPT-J pairs of the last 64 dims by +theta, as complex numbers (fp64)."""
    out = y.double().clone()
    pairs = torch.view_as_complex(out[:, :, NOPE:].reshape(*y.shape[:2], ROPE // 2, 2).contiguous())
    cs = cache.double()[positions.long()]
    rot = torch.complex(cs[:, : ROPE // 2], cs[:, ROPE // 2:])[:, None, :]
    out[:, :, NOPE:] = torch.view_as_real(pairs * rot).reshape(*y.shape[:2], ROPE)
    return out.float()


def make_inputs(num_tokens, num_heads, dtype, max_position=4096, seed=0, device="cpu"):
    """x with block magnitudes spread over 2^-12..2^12 (so scales differ), positions, cache."""
    g = seeded(seed)
    x = torch.randn(num_tokens, num_heads, HEAD // BLOCK, BLOCK, generator=g)
    x = x * torch.exp2(torch.randint(-12, 13, (num_tokens, num_heads, HEAD // BLOCK, 1),
                                     generator=g).float())
    x = x.reshape(num_tokens, num_heads, HEAD).to(dtype)
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    return x.to(device), positions.to(device), rope_cache(max_position).to(device)


def assert_same(got, want):
    q, s = got
    q_ref, s_ref = want
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    q, s, q_ref, s_ref = q.cpu(), s.cpu(), q_ref.cpu(), s_ref.cpu()
    codes, codes_ref = q.view(torch.uint8), q_ref.view(torch.uint8)
    bad = (codes != codes_ref).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} fp8 codes differ, first at {bad[0].tolist()}: "
                              f"{q[tuple(bad[0])].item()} vs {q_ref[tuple(bad[0])].item()}")
    assert torch.equal(s, s_ref), f"scales differ at {(s != s_ref).nonzero()[:5].tolist()}"


def run_kernel(x, positions, cache, n_groups, heads_per_group, monkeypatch=None):
    """The kernel on KERNEL_DEVICE with poisoned output allocations (every element the op
    returns, and the scales' padding, must be written)."""
    if monkeypatch is not None:
        monkeypatch.setattr(inv_rope_quant.torch, "empty",
                            lambda *a, **k: poison(_REAL_EMPTY(*a, **k)))
    return fused_inv_rope_fp8_quant(x.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE),
                                    cache.to(KERNEL_DEVICE), n_groups, heads_per_group)


def scale_storage(scales: torch.Tensor) -> torch.Tensor:
    """The [G, K, T4] storage behind the kernel's scales view (padding tokens included)."""
    t, g, k = scales.shape
    t4 = (t + 3) // 4 * 4
    return scales.as_strided((g, k, t4), (k * t4, t4, 1))


# ----------------------------------------------------------------------------- reference

@pytest.mark.parametrize("num_heads", [1, 3])
def test_ref_inverse_rope_undoes_forward_rope(num_heads):
    g = seeded(1)
    y = torch.randn(9, num_heads, HEAD, generator=g)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 4095, 31, 2048])
    cache = rope_cache(4096)
    x = forward_rope(y, positions, cache)
    assert not torch.allclose(x[1:, :, NOPE:], y[1:, :, NOPE:], atol=1e-2)  # it did rotate
    back = inv_rope_ref(x, positions, cache)
    assert torch.equal(back[:, :, :NOPE], y[:, :, :NOPE])  # no-rope dims untouched
    torch.testing.assert_close(back[:, :, NOPE:], y[:, :, NOPE:], atol=2e-6, rtol=2e-6)
    # position 0 is cos 1, sin 0: the identity, bit for bit
    assert torch.equal(inv_rope_ref(x[:1], positions[:1], cache), x[:1])


def test_ref_rotation_sign_and_pair_layout():
    """(x[448 + 2i], x[448 + 2i + 1]) = (1, 0) comes back as (cos, -sin): rotation by -theta of
    interleaved pairs, cos of pair i at cache[p, i], sin at cache[p, 32 + i]."""
    cache = torch.zeros(3, ROPE)
    cache[2, :32] = torch.linspace(0.1, 0.9, 32)
    cache[2, 32:] = torch.linspace(-0.5, 0.7, 32)
    x = torch.zeros(1, 1, HEAD)
    x[0, 0, NOPE::2] = 1.0
    y = inv_rope_ref(x, torch.tensor([2]), cache)
    assert torch.equal(y[0, 0, NOPE::2], cache[2, :32])
    assert torch.equal(y[0, 0, NOPE + 1::2], -cache[2, 32:])
    x = torch.zeros(1, 1, HEAD)
    x[0, 0, NOPE + 1::2] = 1.0
    y = inv_rope_ref(x, torch.tensor([2]), cache)
    assert torch.equal(y[0, 0, NOPE::2], cache[2, 32:])
    assert torch.equal(y[0, 0, NOPE + 1::2], cache[2, :32])


def test_ref_scales_are_smallest_powers_of_two():
    g = seeded(2)
    amax = torch.rand(4000, generator=g) * torch.exp2(torch.randint(-60, 60, (4000,),
                                                                  generator=g).float())
    edges = torch.tensor([448.0 * 2.0 ** k for k in range(-40, 40)])
    amax = torch.cat([amax, edges, torch.nextafter(edges, edges * 2),
                      torch.nextafter(edges, edges * 0), torch.tensor([0.0, 1e-45, 1e-10, 3e38])])
    s = pow2_block_scale_ref(amax)
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5)  # exact powers of two
    a = amax.clamp(min=1e-10).double()
    assert torch.all(s.double() * 448 >= a)
    assert torch.all(s.double() * 224 < a)  # and the smallest such
    assert pow2_block_scale_ref(torch.tensor([0.0])).item() == 2.0 ** -42
    assert pow2_block_scale_ref(torch.tensor([448.0])).item() == 1.0
    assert pow2_block_scale_ref(torch.tensor([448.0 * (1 + 2 ** -23)])).item() == 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ref_dequantized_within_half_an_fp8_step(dtype):
    x, positions, cache = make_inputs(5, 4, dtype, seed=3)
    q, s = fused_inv_rope_fp8_quant_ref(x, positions, cache, 2, 2)
    y = inv_rope_ref(x, positions, cache).reshape(5, 2, 2 * HEAD)
    scale = s.repeat_interleave(BLOCK, dim=2)
    v = (y / scale).abs()
    amax = v.reshape(5, 2, -1, BLOCK).amax(dim=-1)
    assert torch.all(amax <= 448) and torch.all(amax > 224)  # scale rule, seen from y
    step = torch.exp2(torch.clamp(torch.floor(torch.log2(v)), min=-6) - 3)
    err = (q.float() * scale - y).abs()
    assert torch.all(err <= 0.5 * step * scale)
    assert not torch.all(err == 0)


def test_ref_heads_gathered_per_group():
    """Group g holds heads g*hpg .. g*hpg + hpg - 1, side by side; each head's blocks are
    quantized on their own."""
    x, positions, cache = make_inputs(3, 6, torch.bfloat16, seed=4)
    q1, s1 = fused_inv_rope_fp8_quant_ref(x, positions, cache, 6, 1)  # one head per group
    for n_groups, hpg in ((2, 3), (3, 2), (1, 6)):
        q, s = fused_inv_rope_fp8_quant_ref(x, positions, cache, n_groups, hpg)
        assert q.shape == (3, n_groups, hpg * HEAD) and s.shape == (3, n_groups, hpg * 4)
        for h in range(6):
            g, j = divmod(h, hpg)
            assert torch.equal(q[:, g, j * HEAD:(j + 1) * HEAD].view(torch.uint8),
                               q1[:, h].view(torch.uint8))
            assert torch.equal(s[:, g, j * 4:(j + 1) * 4], s1[:, h])


# ----------------------------------------------------------------------------- kernel

CASES = (
    [(t, 1, 1, dt) for t in (0, 1, 3, 17) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    + [(t, 2, 1, dt) for t in (1, 3, 17) for dt in (torch.bfloat16, torch.float32)]
    + [(t, 1, 2, dt) for t in (0, 3, 17) for dt in (torch.float16,)]
    + [(t, 2, 8, dt) for t in (1, 3) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    + [(6, 4, 4, torch.bfloat16), (2, 16, 1, torch.float32)]
)


@pytest.mark.parametrize("num_tokens,n_groups,heads_per_group,dtype", CASES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_kernel_matches_reference(num_tokens, n_groups, heads_per_group, dtype, monkeypatch):
    x, positions, cache = make_inputs(num_tokens, n_groups * heads_per_group, dtype,
                                      seed=num_tokens * 31 + n_groups)
    got = run_kernel(x, positions, cache, n_groups, heads_per_group, monkeypatch)
    assert_same(got, fused_inv_rope_fp8_quant_ref(x, positions, cache, n_groups, heads_per_group))
    q, s = got
    row, k = heads_per_group * HEAD, heads_per_group * 4
    t4 = (num_tokens + 3) // 4 * 4
    assert q.dtype == FP8 and s.dtype == torch.float32
    if num_tokens:  # (strides of empty tensors are not meaningful)
        assert q.stride() == (row, num_tokens * row, 1)
        assert s.stride() == (1, k * t4, t4)
        assert torch.all(scale_storage(s)[:, :, num_tokens:].cpu() == 0)


def test_kernel_positions(monkeypatch):
    max_position = 64
    x, _, cache = make_inputs(8, 2, torch.bfloat16, max_position, seed=5)
    ref = fused_inv_rope_fp8_quant_ref
    at_max = torch.full((8,), max_position - 1)
    assert_same(run_kernel(x, at_max, cache, 1, 2, monkeypatch), ref(x, at_max, cache, 1, 2))
    # out of range: clamped to the cache's rows (no out-of-bounds read), int32 positions
    wild = torch.tensor([max_position, -1, 10 ** 6, -(10 ** 6), 0, 5, max_position - 1,
                         2 ** 31 - 1], dtype=torch.int32)
    clamped = wild.long().clamp(0, max_position - 1)
    got = run_kernel(x, wild, cache, 1, 2)
    assert_same(got, ref(x, clamped, cache, 1, 2))
    assert_same(got, ref(x, wild, cache, 1, 2))
    at_zero = ref(x, torch.zeros(8, dtype=torch.long), cache, 1, 2)[0]
    assert not torch.equal(got[0].view(torch.uint8).cpu(), at_zero.view(torch.uint8))


def test_kernel_rounding_ties_and_scale_edges(monkeypatch):
    """Exact ties between e4m3 values (nearest even), amax exactly 448 * 2^k and one float
    either side, all-zero, subnormal and huge blocks; position 0 keeps the rope dims as they are."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()   # 0, 2^-9, ..., 448
    ties = (codes[:-1] + codes[1:]) / 2                                   # 126, exact in fp32
    x = torch.zeros(3, 1, HEAD)
    x[0, 0, :BLOCK] = torch.cat([ties, torch.tensor([448.0, -ties[5]])])  # scale 1
    x[0, 0, BLOCK:2 * BLOCK] = torch.linspace(-1, 1, BLOCK) * 448 * 8
    x[0, 0, BLOCK] = torch.nextafter(torch.tensor(448.0 * 8), torch.tensor(1e9))  # 1 ulp over
    x[0, 0, 2 * BLOCK:3 * BLOCK] = torch.linspace(-1, 1, BLOCK) * (448 * 2.0 ** -5)
    x[0, 0, 2 * BLOCK + 3] = torch.nextafter(torch.tensor(448 * 2.0 ** -5), torch.tensor(0.0))
    x[0, 0, 3 * BLOCK:] = 0.0                                             # zero block
    x[1, 0, :BLOCK] = torch.linspace(-1, 1, BLOCK) * 1e-40               # fp32 subnormals
    x[1, 0, BLOCK:2 * BLOCK] = torch.linspace(-1, 1, BLOCK) * 3e38       # huge
    x[1, 0, 2 * BLOCK:] = torch.cat([ties, ties, torch.tensor([448.0, 1, 2, 3])]) * 2.0 ** -20
    x[2, 0] = -x[0, 0]
    positions = torch.zeros(3, dtype=torch.long)
    cache = rope_cache(4)
    got = run_kernel(x, positions, cache, 1, 1, monkeypatch)
    assert_same(got, fused_inv_rope_fp8_quant_ref(x, positions, cache, 1, 1))
    q, s = got[0].cpu(), got[1].cpu()
    assert s[0, 0].tolist() == [1.0, 16.0, 2.0 ** -5, 2.0 ** -42]
    assert s[2, 0].tolist() == [1.0, 16.0, 2.0 ** -5, 2.0 ** -42]
    assert s[1, 0].tolist() == [2.0 ** -42, 2.0 ** 120, 2.0 ** -20, 2.0 ** -20]
    i = torch.arange(126, dtype=torch.uint8)
    even = i + i % 2  # a tie goes to the neighbour whose code (last mantissa bit) is even
    assert torch.equal(q[0, 0, :126].view(torch.uint8), even)
    assert torch.equal(q[2, 0, :126].view(torch.uint8), even | 0x80)
    assert torch.equal(q[1, 0, 2 * BLOCK:2 * BLOCK + 126].view(torch.uint8), even)
    assert torch.all(q[1, 0, :BLOCK].float() == 0)


def test_kernel_noncontiguous_x(monkeypatch):
    base, positions, cache = make_inputs(5, 8, torch.bfloat16, seed=6)
    big = torch.zeros(5, 8, 640, dtype=torch.bfloat16)
    big[:, :, 64:64 + HEAD] = base
    x = big[:, ::2, 64:64 + HEAD]  # head stride 1280, token stride 5120, offset 64
    assert not x.is_contiguous()
    got = run_kernel(x, positions, cache, 2, 2, monkeypatch)
    assert_same(got, fused_inv_rope_fp8_quant_ref(x, positions, cache, 2, 2))


def test_kernel_zero_tokens_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched a kernel for zero tokens")

    monkeypatch.setattr(inv_rope_quant, "fused_inv_rope_fp8_quant_kernel", NoLaunch())
    x, positions, cache = make_inputs(0, 6, torch.bfloat16)
    q, s = run_kernel(x, positions, cache, 3, 2)
    assert q.shape == (0, 3, 2 * HEAD) and s.shape == (0, 3, 8)
    assert q.dtype == FP8 and s.dtype == torch.float32


def _bad_inputs(device="cpu"):
    """(the good arguments, [(argument named in the error, the changed arguments)]), built on
    `device`: strided tensors are sliced there, since copying a tensor with gaps to another
    device makes it contiguous (and so a valid input)."""
    x, positions, cache = make_inputs(3, 4, torch.bfloat16, max_position=16, device=device)
    ok = dict(x=x, positions=positions, cos_sin_cache=cache, n_groups=2, heads_per_group=2)
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype,  # noqa: E731
                                                             device=device)
    cases = [
        ("x", dict(x=x.to(torch.float64))),
        ("x", dict(x=x.to(torch.int32))),
        ("x", dict(x=x.reshape(3, 4 * HEAD))),
        ("x", dict(x=x[:, :, :256], cos_sin_cache=cache)),
        ("x", dict(x=zeros(3, 4, 2 * HEAD, dtype=torch.bfloat16)[:, :, ::2])),
        ("n_groups", dict(n_groups=0, heads_per_group=4)),
        ("heads_per_group", dict(heads_per_group=0)),
        ("heads_per_group", dict(n_groups=2, heads_per_group=3)),
        ("nope_dim", dict(nope_dim=384)),
        ("rope_dim", dict(rope_dim=128)),
        ("quant_group_size", dict(quant_group_size=64)),
        ("positions", dict(positions=positions.float())),
        ("positions", dict(positions=positions[:2])),
        ("positions", dict(positions=positions.reshape(3, 1))),
        ("positions", dict(positions=torch.arange(6, device=device)[::2])),
        ("cos_sin_cache", dict(cos_sin_cache=cache.to(torch.bfloat16))),
        ("cos_sin_cache", dict(cos_sin_cache=zeros(16, 128))),
        ("cos_sin_cache", dict(cos_sin_cache=zeros(0, ROPE))),
        ("cos_sin_cache", dict(cos_sin_cache=zeros(16 * ROPE))),
        ("cos_sin_cache", dict(cos_sin_cache=zeros(16, 2 * ROPE)[:, ::2])),
    ]
    return ok, cases


@pytest.mark.parametrize("index", range(len(_bad_inputs()[1])))
def test_bad_inputs_raise(index):
    ok, cases = _bad_inputs(KERNEL_DEVICE)
    name, change = cases[index]
    for t in change.values():
        assert not isinstance(t, torch.Tensor) or t.device.type == KERNEL_DEVICE
    with pytest.raises(RuntimeError, match=f": {name} "):
        fused_inv_rope_fp8_quant(**dict(ok, **change))
    fused_inv_rope_fp8_quant(**ok)  # the unchanged inputs are accepted


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    x, positions, cache = make_inputs(1, 1, torch.bfloat16)
    monkeypatch.setattr(settings, "TRITON_INTERPRET", False)  # read once at import: patched
    with pytest.raises(RuntimeError, match=": x "):
        fused_inv_rope_fp8_quant(x, positions, cache, 1, 1)


# ----------------------------------------------------------------------------- GPU

@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernel_matches_reference_many_shapes(dtype, monkeypatch):
    shapes = [(1, 1, 1), (2, 8, 8), (5, 16, 4), (64, 1, 16), (127, 4, 2), (1000, 8, 8),
              (4099, 2, 16), (33, 64, 1)]
    for i, (t, n_groups, hpg) in enumerate(shapes):
        x, positions, cache = make_inputs(t, n_groups * hpg, dtype, seed=100 + i)
        positions[::7] += 5000  # some out of range: clamped
        got = run_kernel(x, positions, cache, n_groups, hpg, monkeypatch)
        assert got[0].is_cuda
        assert_same(got, fused_inv_rope_fp8_quant_ref(x, positions, cache, n_groups, hpg))
        assert torch.all(scale_storage(got[1])[:, :, t:] == 0)


@gpu
def test_gpu_bad_device():
    x, positions, cache = make_inputs(3, 2, torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=": positions "):
        fused_inv_rope_fp8_quant(x, positions.cpu(), cache, 1, 2)
    with pytest.raises(RuntimeError, match=": cos_sin_cache "):
        fused_inv_rope_fp8_quant(x, positions, cache.cpu(), 1, 2)


@gpu
def test_gpu_cuda_graph_capture():
    x, positions, cache = make_inputs(37, 8, torch.bfloat16, device="cuda")
    want = fused_inv_rope_fp8_quant(x, positions, cache, 2, 4)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_inv_rope_fp8_quant(x, positions, cache, 2, 4)  # warm up on the side stream
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fused_inv_rope_fp8_quant(x, positions, cache, 2, 4)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (got[0].clone(), got[1].clone())
    assert not torch.equal(replayed[0].view(torch.uint8), want[0].view(torch.uint8)), \
        "the replay did not read the new x"
    # The replay equals an eager call on the same inputs, and both equal the reference
    # (computed from CPU copies, as in the other kernel tests).
    assert_same(replayed, fused_inv_rope_fp8_quant(x, positions, cache, 2, 4))
    assert_same(replayed, fused_inv_rope_fp8_quant_ref(x.cpu(), positions.cpu(), cache.cpu(),
                                                       2, 4))


def _compiled_variants(kernel) -> int:
    """Number of compiled specializations of a Triton kernel, over all devices."""
    return sum(len(c[0]) for c in kernel.device_caches.values())


@gpu
def test_gpu_no_recompilation_across_token_counts():
    kernel = inv_rope_quant.fused_inv_rope_fp8_quant_kernel
    max_tokens = 8192
    x_all, pos_all, cache = make_inputs(max_tokens, 16, torch.bfloat16, device="cuda")
    for t in (1, 2, 3, 4, 16, 17, 64, 1000):  # warm-up
        fused_inv_rope_fp8_quant(x_all[:t], pos_all[:t], cache, 2, 8)
    torch.cuda.synchronize()
    before = _compiled_variants(kernel)
    assert before >= 1
    rng = random.Random(11)
    for _ in range(300):
        t = rng.randint(1, max_tokens)
        fused_inv_rope_fp8_quant(x_all[:t], pos_all[:t], cache, 2, 8)
    torch.cuda.synchronize()
    assert _compiled_variants(kernel) == before


@gpu
def test_gpu_recompilation_counter_detects_specialization(monkeypatch):
    """A copy of the kernel without do_not_specialize recompiles when num_tokens changes its
    divisibility (1, 16k, other), so the counter above can see recompilation."""
    import triton

    specialized = triton.jit(inv_rope_quant.fused_inv_rope_fp8_quant_kernel.fn)
    monkeypatch.setattr(inv_rope_quant, "fused_inv_rope_fp8_quant_kernel", specialized)
    x_all, pos_all, cache = make_inputs(64, 2, torch.bfloat16, device="cuda")
    for t in (1, 7, 16, 33):
        fused_inv_rope_fp8_quant(x_all[:t], pos_all[:t], cache, 1, 2)
    torch.cuda.synchronize()
    keys = [k for c in specialized.device_caches.values() for k in c[0]]
    assert _compiled_variants(specialized) > 1, f"compiled variants: {keys}"
