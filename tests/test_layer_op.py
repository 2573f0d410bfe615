"""torch.ops.hopper_moe.fused_experts_sm90: the SM90 layer behind one op.

- The op is, bit for bit, the composition of hopper_moe's ops it stands for (quantize, permute,
  GEMM1 with SiLU*mul, the quantization between the GEMMs, GEMM2, the weighted sum), written
  out step by step with the Python wrappers (hopper_moe.backends.sm90.run_steps): on the CPU
  in CI, on an SM90 GPU too, where the op's GEMM1 gathers x's rows in its producer instead of
  reading moe_permute's copy.
- fused_experts(backend="sm90") is one call of the op, with the result of the validated path.
- Bad input: a RuntimeError naming the argument and the rule, on the CPU and CUDA alike.
- opcheck: schema, fake (meta) implementation, autograd registration, AOT dispatch.
(Accuracy against the fp32 reference is test_cute_backend.py's.)
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from conftest import DEVICES, gpu, poison

from hopper_moe import api, fused_experts
from hopper_moe.backends import sm90
from test_fused_moe import make_problem
from test_heuristics import rule_k_splits

LAYER = torch.ops.hopper_moe.fused_experts_sm90.default
SCHEMES = ["bf16", "fp8_tensor_static", "fp8_tensor_dynamic", "fp8_channel"]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
LAYER_DEVICES = ["cpu"] + (["cuda"] if SM90 else [])


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def op_args(p, out):
    q = p.quant
    scales = (None, None, None, None, False, False) if q is None else (
        q.w1_scale, q.w2_scale, q.a1_scale, q.a2_scale, q.per_act_token_quant,
        q.per_out_ch_quant)
    return (out, p.x, p.w1, p.w2, p.topk_weights, p.topk_ids, p.apply_router_weight_on_input,
            p.global_num_experts, p.expert_map) + scales


def composed(p) -> torch.Tensor:
    """The layer from hopper_moe's ops, one Python call per step (sm90.run_steps)."""
    return sm90.run_steps(*p.args(), **p.kwargs())


CASES = [
    dict(m=1, e=1, topk=1),
    dict(m=7, e=8, topk=2),
    dict(m=33, e=16, topk=4, num_local=9),
    dict(m=20, e=8, topk=3, invalid_ids=True),
    dict(m=9, e=8, topk=1, on_input=True),
    dict(m=12, e=8, topk=2, dtype=torch.float16),
    dict(m=5, e=4, topk=2, dtype=torch.float32, ids_dtype=torch.int64),
    dict(m=6, e=8, topk=2, channel_3d=False),
]


def _problem(scheme, case, h=128, i=64, seed=5):
    return make_problem(h=h, i=i, scheme=scheme, seed=seed, **case)


@pytest.mark.parametrize("device", LAYER_DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_op_equals_its_steps(device, scheme):
    for case in CASES:
        p = _problem(scheme, case).to(device)
        if p.expert_map is not None:
            p = replace(p, expert_map=p.expert_map.long())  # the op takes int64 maps too
        out = poison(torch.empty_like(p.x))
        LAYER(*op_args(p, out))
        want = composed(p)
        assert torch.equal(out, want), f"{device} {scheme} {case}"


@pytest.mark.parametrize("device", LAYER_DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_op_equals_its_steps_off_the_tiles(device, scheme):
    """Hidden sizes off the k-tile (a zero-filled K tail) and token tiles only partly filled,
    on both of GEMM1's row sources: x's rows through the sort's permutation (many experts, at
    most a quarter row each on average: heuristics::layer_gathers_gemm1_rows; on the GPU the
    producer gathers them), and moe_permute's copy (few experts; enough tokens for the
    standard mapping). Either gives the op-by-op composition's result bit for bit."""
    h = 200 if scheme == "bf16" else 208  # 16-byte rows, not multiples of the 64 / 128 k-tile
    for case in (dict(m=3, e=64, topk=4), dict(m=5, e=96, topk=3, num_local=64),
                 dict(m=4, e=128, topk=8, invalid_ids=True), dict(m=3, e=8, topk=2),
                 dict(m=16, e=128, topk=8),
                 dict(m=50, e=4, topk=3, num_local=3),
                 dict(m=700, e=4, topk=2, invalid_ids=True)):
        p = _problem(scheme, case, h=h, i=80).to(device)
        out = poison(torch.empty_like(p.x))
        LAYER(*op_args(p, out))
        assert torch.equal(out, composed(p)), f"{device} {scheme} {case}"


@pytest.mark.parametrize("device", LAYER_DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_op_is_deterministic(device, scheme):
    """Bit-equal over 20 reruns (3 on the CPU): every sum of the layer has a fixed order (the
    README's claim). Both of GEMM1's row sources, and on the GPU a decode shape whose long K
    the heuristic splits (partial sums added by the reduce kernel)."""
    cases = [(dict(m=3, e=128, topk=4), 128, 64), (dict(m=300, e=8, topk=2, invalid_ids=True),
                                                   128, 64)]
    if device == "cuda":
        # GEMM2 (N = H = 512, K = I = 8192, 4 rows on 8 experts): split 4 ways (bf16) / 2 (FP8).
        dtype = "bf16" if scheme == "bf16" else "e4m3"
        assert rule_k_splits(dtype, 4, 8, 512, 8192, sm_count=_sm_count()) > 1
        cases.append((dict(m=2, e=8, topk=2), 512, 8192))
    for case, h, i in cases:
        p = _problem(scheme, case, h=h, i=i).to(device)
        first = None
        for _ in range(20 if device == "cuda" else 3):
            out = poison(torch.empty_like(p.x))
            LAYER(*op_args(p, out))
            if first is None:
                first = out
            assert torch.equal(out, first), f"{device} {scheme} {case}"


@pytest.mark.parametrize("device", LAYER_DEVICES)
def test_fused_experts_is_the_op(device, monkeypatch):
    """backend="sm90" skips the Python validation (the op checks) and equals the validated
    path (taken with a non-bool-typed flag) bit for bit; out is written in place."""
    calls = []
    real = api._validate_experts_args
    monkeypatch.setattr(api, "_validate_experts_args",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for scheme in SCHEMES:
        p = _problem(scheme, dict(m=11, e=8, topk=2, num_local=6)).to(device)
        fast = fused_experts(*p.args(), **p.kwargs(), backend="sm90")
        assert not calls
        out = poison(torch.empty_like(p.x))
        assert fused_experts(*p.args(), **p.kwargs(), backend="cute", out=out) is out
        assert not calls
        kw = p.kwargs()
        kw["apply_router_weight_on_input"] = 0  # not a bool: the validated path
        slow = fused_experts(*p.args(), **kw, backend="sm90")
        assert calls
        calls.clear()
        assert torch.equal(fast, slow) and torch.equal(out, fast)


@pytest.mark.parametrize("device", LAYER_DEVICES)
def test_out_views_and_zero_tokens(device):
    p = _problem("bf16", dict(m=9, e=8, topk=2)).to(device)
    want = composed(p)
    wide = poison(torch.empty(9, 200, dtype=p.x.dtype, device=device))
    out = wide[:, 40:168]  # rows of stride 200
    LAYER(*op_args(p, out))
    assert torch.equal(out, want)
    assert torch.isnan(wide[:, :40].float()).all() and torch.isnan(wide[:, 168:].float()).all()
    p0 = _problem("fp8_tensor_dynamic", dict(m=0, e=8, topk=2)).to(device)
    out0 = torch.empty_like(p0.x)
    LAYER(*op_args(p0, out0))
    assert fused_experts(*p0.args(), **p0.kwargs(), backend="sm90").shape == (0, 128)


def _bad_cases(device):
    """(what, args mutator, the words the message must hold)."""
    def f(**kw):
        return kw
    fp8 = _problem("fp8_tensor_dynamic", dict(m=4, e=4, topk=2)).to(device)
    bf16 = _problem("bf16", dict(m=4, e=4, topk=2)).to(device)
    q = fp8.quant
    return [
        (bf16, f(x=bf16.x[None]), "hidden_states must be 2-D"),
        (bf16, f(x=bf16.x.to(torch.int32)), "hidden_states must have dtype"),
        (bf16, f(x=bf16.x.t().contiguous().t()), "hidden_states must have stride 1"),
        (bf16, f(w1=bf16.w1[:, :-1]), "w1 must have shape"),
        (bf16, f(w2=bf16.w2[:, :-8]), "w2 must have shape"),
        (bf16, f(w2=bf16.w2.float()), "w1 and w2 must have the same dtype"),
        (bf16, f(w1=bf16.w1.half(), w2=bf16.w2.half()), "w1 must have the dtype of hidden_states"),
        (bf16, f(w1_scale=q.w1_scale), "must be None unless the weights are Float8_e4m3fn"),
        (bf16, f(per_act_token_quant=True), "per_act_token_quant and per_out_ch_quant"),
        (fp8, f(w1_scale=None), "w1_scale and w2_scale are required"),
        (fp8, f(w1_scale=q.w1_scale[:-1]), "w1_scale must have shape (num_experts,)"),
        (fp8, f(w2_scale=q.w2_scale.double()), "w2_scale must have dtype Float"),
        (fp8, f(per_out_ch_quant=True), "w1_scale must have shape (num_experts, N)"),
        (fp8, f(a1_scale=torch.ones(2, device=device)), "a1_scale must be a per-tensor scale"),
        (fp8, f(a2_scale=torch.ones(1, device=device), per_act_token_quant=True),
         "a2_scale must be None with per_act_token_quant"),
        (bf16, f(topk_ids=bf16.topk_ids[:, :1]), "topk_ids and topk_weights must have the same"),
        (bf16, f(topk_ids=bf16.topk_ids.float()), "topk_ids must have dtype"),
        (bf16, f(topk_weights=bf16.topk_weights.double(), topk_ids=bf16.topk_ids),
         "topk_weights must have dtype"),
        (bf16, f(topk_ids=bf16.topk_ids[:3], topk_weights=bf16.topk_weights[:3]),
         "topk_ids.size(0) must be 4"),
        (bf16, f(apply_router_weight_on_input=True), "requires topk == 1"),
        (bf16, f(expert_map=torch.zeros(3, dtype=torch.int32, device=device),
                 global_num_experts=4), "expert_map must have global_num_experts = 4"),
        (bf16, f(expert_map=torch.zeros(4, device=device)), "expert_map must have dtype"),
        (bf16, f(global_num_experts=0), "global_num_experts must be -1 or >= 1"),
        (bf16, f(out=torch.empty(4, 64, dtype=torch.bfloat16, device=device)),
         "out must have the shape of hidden_states"),
        (bf16, f(out=torch.empty(4, 128, device=device)), "out must have the dtype"),
        (bf16, f(out="x"), "out must not overlap hidden_states"),
        (bf16, f(w1=torch.zeros(4, 128, 100, dtype=torch.bfloat16, device=device),
                 w2=torch.zeros(4, 100, 64, dtype=torch.bfloat16, device=device),
                 x=torch.zeros(4, 100, dtype=torch.bfloat16, device=device),
                 out=torch.zeros(4, 100, dtype=torch.bfloat16, device=device)),
         "hidden size H (w1.size(2)) = 100 must be a multiple of 8"),
        (fp8, f(w1=torch.zeros(4, 24, 128, device=device).to(torch.float8_e4m3fn),
                w2=torch.zeros(4, 128, 12, device=device).to(torch.float8_e4m3fn)),
         "intermediate size I (w2.size(2)) = 12 must be a multiple of 16"),
    ] + ([(bf16, f(w2=bf16.w2.cpu()), "w2 must be on the same device as hidden_states")]
         if device != "cpu" else [])


FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NAMES = ("out", "x", "w1", "w2", "topk_weights", "topk_ids", "apply_router_weight_on_input",
         "global_num_experts", "expert_map", "w1_scale", "w2_scale", "a1_scale", "a2_scale",
         "per_act_token_quant", "per_out_ch_quant")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_argument(device):
    if device == "cuda" and not SM90:
        pytest.skip("the layer op needs an SM90 GPU")
    for p, change, words in _bad_cases(device):
        args = dict(zip(NAMES, op_args(p, torch.empty_like(p.x))))
        args.update(change)
        if isinstance(args["out"], str):
            args["out"] = args["x"]
        with pytest.raises(RuntimeError, match=re.escape(words)):
            LAYER(*args.values())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    if device == "cuda" and not SM90:
        pytest.skip("the layer op needs an SM90 GPU")
    for scheme in ("bf16", "fp8_tensor_static", "fp8_channel"):
        p = _problem(scheme, dict(m=5, e=4, topk=2, num_local=3)).to(device)
        before = [t.clone() for t in op_args(p, None)[1:] if isinstance(t, torch.Tensor)]
        # opcheck's test_schema compares tensors with torch.allclose, which has no float8
        # kernel: FP8 layers run the other three utils (the read-only check is below).
        utils = FP8_OPCHECK_UTILS if p.quant is not None else \
            torch.library._OPCHECK_DEFAULT_UTILS
        torch.library.opcheck(LAYER, op_args(p, torch.empty_like(p.x)), test_utils=utils)
        after = [t for t in op_args(p, None)[1:] if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(before, after))


@gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    """A captured layer replayed after the routing changed equals an eager call."""
    if not SM90:
        pytest.skip("needs an SM90 GPU")
    for scheme in SCHEMES:
        p = _problem(scheme, dict(m=24, e=16, topk=4, num_local=12), h=256, i=128).to("cuda")
        out = torch.empty_like(p.x)
        args = op_args(p, out)
        LAYER(*args)  # warm: slot indices cached, nothing grows during capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            LAYER(*args)
        for seed in range(3):
            g = torch.Generator(device="cpu").manual_seed(seed)
            p.topk_ids.copy_(torch.randint(-2, 18, p.topk_ids.shape, generator=g))
            p.topk_weights.copy_(torch.rand(p.topk_weights.shape, generator=g))
            out.fill_(float("nan"))
            graph.replay()
            eager = torch.empty_like(out)
            LAYER(*op_args(p, eager))
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"{scheme} seed {seed}"
