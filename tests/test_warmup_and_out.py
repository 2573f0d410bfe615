"""hopper_moe.warmup (every kernel class a layer can reach compiled and run once, so that later
token counts compile nothing), fused_experts(out=...) (written in place, checked like every
other argument) and the Triton backend's direct launches of remembered compiled kernels."""
from __future__ import annotations

import random

import pytest
import torch

import hopper_moe
from hopper_moe import api
from hopper_moe.warm import _classes, _compiled_variants

from conftest import DEVICES, HAS_CUDA, gpu, poison, seeded
from test_fused_moe import make_problem, run

SCHEMES = ["bf16", "fp8_tensor", "fp8_channel", "fp8_block"]


# ------------------------------------------------------------------------------ out=
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "reference", "sm90", "triton"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor"])
def test_out_is_written_and_returned(device, backend, scheme):
    if backend not in api.available_backends(device):
        pytest.skip(f"backend {backend} not available on {device}")
    p = make_problem(6, 4, 2, 128, 128, scheme=scheme, seed=7).to(device)
    want = run(p, backend=backend)
    out = poison(torch.empty_like(p.x))
    got = hopper_moe.fused_experts(*p.args(), **p.kwargs(), backend=backend, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_out_row_strided_view(device):
    """A row-strided view (unit last stride) is written in place; the rest of its storage is
    untouched."""
    p = make_problem(5, 4, 2, 128, 128, seed=3).to(device)
    big = torch.full((5, 200), 3.0, dtype=p.x.dtype, device=device)
    out = big[:, 40:168]
    want = run(p, backend="triton" if "triton" in api.available_backends(device) else "torch")
    hopper_moe.fused_experts(*p.args(), **p.kwargs(), out=out)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert (big[:, :40] == 3).all() and (big[:, 168:] == 3).all()


@pytest.mark.parametrize("device", DEVICES)
def test_out_bad(device):
    p = make_problem(4, 4, 2, 128, 128, seed=1).to(device)
    args, kw = p.args(), p.kwargs()

    def call(out):
        return hopper_moe.fused_experts(*args, **kw, out=out)
    x = args[0]
    cases = [
        (torch.empty(4, 127, dtype=x.dtype, device=device), "out must have the shape"),
        (torch.empty(4, 128, dtype=torch.float32, device=device), "out must have the dtype"),
        (torch.empty(4, 128, 2, dtype=x.dtype, device=device)[..., 0],
         "last-dim stride 1"),
        (torch.empty(1, 128, dtype=x.dtype, device=device).expand(4, 128),
         "rows that do not overlap"),
        (x, "must not share memory"),
        (torch.empty(128, 4, dtype=x.dtype, device=device).t(), "last-dim stride 1"),
        ("not a tensor", "out must be a torch.Tensor"),
    ]
    if device == "cpu" and torch.cuda.is_available():
        cases.append((torch.empty(4, 128, dtype=x.dtype, device="cuda"), "same device"))
    for out, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call(out)
    # Overlap with a scale (a view of out's storage).
    q = make_problem(4, 4, 2, 128, 128, scheme="fp8_tensor", seed=2).to(device)
    with pytest.raises(RuntimeError, match="must not share memory"):
        _overlap_scale(q, device)


def _overlap_scale(q, device):
    """out overlapping a1_scale's storage."""
    store = torch.zeros(4 * 128 + 8, dtype=torch.bfloat16, device=device)
    out = store[:512].view(4, 128)
    a1 = store[510:512].view(torch.float32)  # the last 2 bf16 of out, as one f32
    quant = hopper_moe.QuantConfig(q.quant.w1_scale, q.quant.w2_scale, a1_scale=a1,
                                   a2_scale=None)
    hopper_moe.fused_experts(q.x, q.w1, q.w2, q.topk_weights, q.topk_ids, quant=quant, out=out)


@pytest.mark.parametrize("device", DEVICES)
def test_out_zero_tokens(device):
    p = make_problem(0, 4, 2, 128, 128, seed=1).to(device)
    out = torch.empty(0, 128, dtype=p.x.dtype, device=device)
    assert hopper_moe.fused_experts(*p.args(), **p.kwargs(), out=out) is out


def test_fused_moe_passes_out():
    g = seeded(0)
    x = torch.randn(3, 32, generator=g).bfloat16()
    w1 = (torch.randn(4, 64, 32, generator=g) / 6).bfloat16()
    w2 = (torch.randn(4, 32, 32, generator=g) / 6).bfloat16()
    logits = torch.randn(3, 4, generator=g)
    out = torch.empty_like(x)
    got = hopper_moe.fused_moe(x, w1, w2, logits, 2, True, out=out)
    assert got is out
    torch.testing.assert_close(out, hopper_moe.fused_moe(x, w1, w2, logits, 2, True))


# ------------------------------------------------------------------------------ warmup
def test_warmup_classes_cover_every_token_count():
    """One token count per (backend, config) class, the smallest of each; every M in range
    maps to a listed class."""
    w1 = torch.zeros(8, 256, 128, dtype=torch.bfloat16)
    w2 = torch.zeros(8, 128, 128, dtype=torch.bfloat16)
    reps = _classes(w1, w2, 2, 600, torch.bfloat16, None, -1, "triton")
    ms = sorted(reps.values())
    assert ms[0] == 1 and len(set(ms)) == len(ms) and max(ms) <= 600
    from hopper_moe.kernels.moe_gemm_configs import get_config
    keys = {tuple(sorted(get_config(m, 2, 8, 128, "bf16").items())) for m in range(1, 601)}
    assert {k[1] for k in reps} == keys
    torch_reps = _classes(w1, w2, 2, 600, torch.bfloat16, None, -1, "torch")
    assert sorted(torch_reps.values()) == [1, 3, 5, 9, 17, 33, 65, 129, 257, 513]


def test_warmup_cpu_reports_classes_and_runs_one_validation_call(monkeypatch):
    """On the CPU warmup validates with one call of one token and reports the classes, but
    runs none of them (nothing to compile or size there; vLLM's plugin warms every layer)."""
    w1 = (torch.randn(4, 64, 32, generator=seeded(1)) / 6).bfloat16()
    w2 = (torch.randn(4, 32, 32, generator=seeded(2)) / 6).bfloat16()
    calls = []
    real = api.fused_experts

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(api, "fused_experts", counting)
    report = hopper_moe.warmup(w1, w2, 2, 40, backend="torch")
    assert report.token_counts == {"torch": [1, 3, 5, 9, 17, 33]}
    assert calls == [1] and report.run_s == 0.0 and report.compile_s == 0.0


@gpu
def test_warmup_under_a_cuda_default_device():
    """vLLM's tests (and engines) set torch's default device to CUDA: warmup draws its inputs
    from a CPU generator, so it must place them on the CPU explicitly."""
    w1 = (torch.randn(4, 64, 32, generator=seeded(1)) / 6).bfloat16().cuda()
    w2 = (torch.randn(4, 32, 32, generator=seeded(2)) / 6).bfloat16().cuda()
    torch.set_default_device("cuda")
    try:
        report = hopper_moe.warmup(w1, w2, 2, 8, backend="torch")
    finally:
        torch.set_default_device(None)
    assert report.token_counts == {"torch": [1, 3, 5]}


@pytest.mark.parametrize("bad, match", [
    (dict(max_num_tokens=0), "max_num_tokens must be an int >= 1"),
    (dict(max_num_tokens=2.0), "max_num_tokens must be an int >= 1"),
    (dict(top_k=0), "top_k must be an int >= 1"),
    (dict(top_k=9), "top_k = 9 must be at most the number of experts"),
    (dict(dtype=torch.int32), "dtype must be float32"),
    (dict(threads=0), "threads must be None or an int >= 1"),
    (dict(backend="nope"), "backend must be one of"),
])
def test_warmup_bad_input(bad, match):
    args = dict(w1=torch.zeros(4, 64, 32, dtype=torch.bfloat16),
                w2=torch.zeros(4, 32, 32, dtype=torch.bfloat16), top_k=2, max_num_tokens=4)
    args.update(bad)
    w1, w2, k, m = (args.pop(n) for n in ("w1", "w2", "top_k", "max_num_tokens"))
    with pytest.raises(RuntimeError, match=match):
        hopper_moe.warmup(w1, w2, k, m, **args)


@gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_warmup_then_no_compilation(scheme):
    """After warmup(max_num_tokens=16384), 300 random token counts compile nothing."""
    p = make_problem(1, 16, 4, 256, 256, scheme=scheme, seed=11).to("cuda")
    report = hopper_moe.warmup(p.w1, p.w2, 4, 16384, quant=p.quant, backend="triton")
    assert report.token_counts["triton"]
    before = _compiled_variants()
    assert before is not None and before > 0
    rng = random.Random(0)
    x = torch.randn(16384, 256, device="cuda", dtype=torch.bfloat16)
    for m in rng.sample(range(1, 16385), 300):
        ids = torch.randint(0, 16, (m, 4), device="cuda", dtype=torch.int32)
        w = torch.rand(m, 4, device="cuda")
        hopper_moe.fused_experts(x[:m], p.w1, p.w2, w, ids, quant=p.quant, backend="triton")
    torch.cuda.synchronize()
    assert _compiled_variants() == before


@gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_direct_launch_matches_triton_launch(scheme, m):
    """The first call at a new key launches through Triton's own path (and remembers the
    compiled kernels); the next calls launch them directly, both GEMMs, with bit-identical
    results (the layer's accuracy against the reference: test_triton_moe.py)."""
    from hopper_moe.kernels import launch

    p = make_problem(m, 8, 2, 256, 384, scheme=scheme, seed=m).to("cuda")
    launch._COMPILED.clear()
    first = run(p, backend="triton")
    remembered, direct = launch.stats()
    assert remembered == 2 and not launch._hooks_set()
    for i in range(2):
        again = run(p, backend="triton")
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert launch.stats() == (2, direct + 2 * (i + 1))
