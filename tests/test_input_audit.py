"""Layer-level findings of the input audit, pinned: ids an int32 cannot hold, expert_map
entries past the local experts, non-contiguous routing weights, a router whose width is not
the expert count. Each runs on the CPU (Triton under its interpreter) and on the GPU."""
from __future__ import annotations

import pytest
import torch

import hopper_moe
from hopper_moe import fused_experts, fused_moe, ops
from hopper_moe.quant import make_quant_config

from conftest import DEVICES, seeded


def _layer(dev, num_tokens=5, num_experts=6, topk=2, hidden=64, inter=64, seed=0):
    g = seeded(seed)
    x = (torch.randn(num_tokens, hidden, generator=g) / 4).to(dev, torch.bfloat16)
    w1 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 8).to(dev, torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / 8).to(dev, torch.bfloat16)
    weights = torch.rand(num_tokens, topk, generator=g).to(dev)
    return x, w1, w2, weights


@pytest.mark.parametrize("dev", DEVICES)
def test_int64_ids_past_int32_are_not_experts(dev):
    """moe_permute with int64 ids: 2^32 + e is no expert (skipped), not expert e."""
    x = torch.randn(3, 8, device=dev)
    ids = torch.tensor([[2**32, 1], [0, 3], [2**32 + 2, -(2**40)]], dtype=torch.int64,
                       device=dev)
    _, _, offsets, _, _ = ops.moe_permute(x, None, ids, 4, 4, None)
    placed = torch.tensor([[-1, 1], [0, 3], [-1, -1]], dtype=torch.int32, device=dev)
    _, _, want, _, _ = ops.moe_permute(x, None, placed, 4, 4, None)
    assert torch.equal(offsets.cpu(), want.cpu())
    assert offsets[-1].item() == 3


def _backends(dev):
    return [b for b in hopper_moe.api.available_backends(dev) if b != "reference"]


@pytest.mark.parametrize("dev", DEVICES)
def test_expert_map_entries_past_the_local_experts_are_non_local(dev):
    """expert_map maps global ids to local ones; an entry in [E_local, E_global) is no local
    expert, like -1, on every backend (the Triton kernels used to index the weights with it)."""
    x, w1, w2, weights = _layer(dev, num_experts=4)
    global_experts = 8
    g = seeded(5)
    ids = torch.randint(0, global_experts, (x.shape[0], 2), generator=g).to(dev, torch.int32)
    expert_map = torch.tensor([0, 5, 1, -1, 7, 2, 3, 4], dtype=torch.int32, device=dev)
    cleaned = torch.tensor([0, -1, 1, -1, -1, 2, 3, -1], dtype=torch.int32, device=dev)
    want = fused_experts(x, w1, w2, weights, ids, global_num_experts=global_experts,
                         expert_map=cleaned, backend="reference")
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, weights, ids, global_num_experts=global_experts,
                            expert_map=expert_map, backend=backend)
        assert torch.isfinite(got).all(), backend
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("dev", DEVICES)
def test_non_contiguous_topk_weights(dev):
    """topk_weights as a strided view give the contiguous copy's result on every backend."""
    x, w1, w2, weights = _layer(dev)
    strided = torch.stack([weights, torch.full_like(weights, 9.0)], dim=-1)[..., 0]
    assert not strided.is_contiguous()
    g = seeded(9)
    ids = torch.randint(0, w1.shape[0], (x.shape[0], 2), generator=g).to(dev, torch.int32)
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, strided, ids, backend=backend)
        want = fused_experts(x, w1, w2, strided.contiguous(), ids, backend=backend)
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("width", [5, 7])
def test_fused_moe_router_width_must_be_the_expert_count(width):
    x, w1, w2, _ = _layer("cpu")
    logits = torch.randn(x.shape[0], width)
    with pytest.raises(RuntimeError, match=r"gating_output.size\(1\) must be the number of "
                                           r"experts \(w1.size\(0\) = 6\)"):
        fused_moe(x, w1, w2, logits, 2, True, backend="torch")
    with pytest.raises(RuntimeError, match=r"\(global_num_experts = 8\)"):
        fused_moe(x, w1, w2, logits, 2, True, global_num_experts=8,
                  expert_map=torch.arange(8, dtype=torch.int32) % 6, backend="torch")


def test_fused_moe_router_width_with_expert_map_is_the_map_length():
    """Under expert parallelism (expert_map, global_num_experts = -1, as vLLM passes it) the
    router scores every global expert: [M, len(expert_map)] logits are the right width and a
    local-width router is rejected (it used to pass and route over the wrong experts)."""
    x, w1, w2, _ = _layer("cpu", num_experts=4)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    logits = torch.randn(x.shape[0], 8, generator=seeded(3))
    got = fused_moe(x, w1, w2, logits, 2, True, expert_map=expert_map, backend="torch")
    weights, ids, _ = hopper_moe.fused_topk(x, logits, 2, True)
    want = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map, backend="reference")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match=r"gating_output.size\(1\) must be the number of "
                                           r"experts \(expert_map.size\(0\) = 8\), got 4"):
        fused_moe(x, w1, w2, logits[:, :4].contiguous(), 2, True, expert_map=expert_map,
                  backend="torch")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("map_dtype", [torch.int32, torch.int64])
def test_expert_map_int32_and_int64_agree_on_every_backend(dev, map_dtype):
    """An int64 expert_map (accepted by the API) gives the int32 map's result on every backend
    (the Triton backend passed it on to ops that take int32 only) at one and several tokens."""
    for num_tokens in (1, 5):
        x, w1, w2, weights = _layer(dev, num_tokens=num_tokens, num_experts=4)
        ids = torch.randint(0, 8, (num_tokens, 2), generator=seeded(num_tokens)).to(
            dev, torch.int32)
        expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], device=dev)
        want = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map.to(torch.int32),
                             backend="reference")
        for backend in _backends(dev):
            got = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map.to(map_dtype),
                                backend=backend)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("dev", DEVICES)
def test_nan_in_a_row_skipped_by_the_dynamic_scale_on_every_backend(dev):
    """FP8 with dynamic per-tensor activation scales: a NaN element of a row routed nowhere is
    skipped by the scale's amax on every backend (the ops' fmaxf rule), so the other rows are
    finite and agree; the torch backend and the reference used to return NaN everywhere."""
    x, w1, w2, weights = _layer(dev, num_tokens=6, num_experts=4)
    ids = torch.randint(0, 4, (6, 2), generator=seeded(11)).to(dev, torch.int32)
    ids[5] = -1
    x[5] = float("nan")
    w1q, w2q, config = make_quant_config(w1, w2, "fp8_tensor")
    want = fused_experts(x, w1q, w2q, weights, ids, quant=config, backend="reference")
    assert torch.isfinite(want[:5]).all()
    clean = x.clone()
    clean[5] = 0
    assert torch.equal(want[:5], fused_experts(clean, w1q, w2q, weights, ids, quant=config,
                                               backend="reference")[:5])
    for backend in _backends(dev):
        got = fused_experts(x, w1q, w2q, weights, ids, quant=config, backend=backend)
        assert torch.isfinite(got[:5]).all(), backend
        torch.testing.assert_close(got[:5].float(), want[:5].float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m: f"{backend}: {m}")


def test_warmup_with_an_expert_map_counts_the_global_experts(monkeypatch):
    """warmup takes expert_map / global_num_experts as fused_experts does: top_k may exceed
    the local experts (it was rejected against w1.size(0)), the validation call routes over
    the global ids, and the Triton classes are those of the global expert count, the count
    the backend chooses its configs by at run time."""
    from hopper_moe import api, warm

    x, w1, w2, _ = _layer("cpu", num_experts=4)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    seen = []
    real = api.fused_experts

    def recording(x, w1, w2, weights, ids, *args, **kwargs):
        seen.append(ids.clone())
        return real(x, w1, w2, weights, ids, *args, **kwargs)

    monkeypatch.setattr(api, "fused_experts", recording)
    report = hopper_moe.warmup(w1, w2, 6, 40, expert_map=expert_map, backend="triton")
    assert len(seen) == 1 and seen[0].shape == (1, 6) and int(seen[0].max()) < 8
    assert len(set(seen[0].flatten().tolist())) == 6
    want = warm._classes(w1, w2, 6, 40, torch.bfloat16, None, 8, "triton")
    assert report.token_counts == {"triton": sorted(want.values())}
    with pytest.raises(RuntimeError, match=r"top_k = 9 must be at most the number of experts "
                                           r"\(8\)"):
        hopper_moe.warmup(w1, w2, 9, 40, expert_map=expert_map, backend="torch")


def test_sm90_is_not_chosen_past_its_expert_limit():
    """The sm90 op takes at most heuristics::kMaxExperts local experts: its support check
    says so (auto's candidates), with the op's own limit."""
    from hopper_moe.backends import sm90

    hidden, inter = 16, 16
    for experts, ok in ((sm90.MAX_EXPERTS, True), (sm90.MAX_EXPERTS + 1, False)):
        w1 = torch.zeros(experts, 2 * inter, hidden, dtype=torch.bfloat16)
        w2 = torch.zeros(experts, hidden, inter, dtype=torch.bfloat16)
        reason = sm90.unsupported_reason(torch.device("cpu"), w1, w2, None)
        assert (reason is None) == ok, reason
        x = torch.zeros(1, hidden, dtype=torch.bfloat16)
        ids = torch.zeros(1, 1, dtype=torch.int32)
        run = lambda: fused_experts(x, w1, w2, torch.ones(1, 1), ids, backend="sm90")
        if ok:
            assert torch.equal(run(), torch.zeros_like(x))
        else:
            assert f"at most {sm90.MAX_EXPERTS}" in reason
            with pytest.raises(RuntimeError, match=rf"w1.size\(0\) \(num_experts\) must be at "
                                                   rf"most {sm90.MAX_EXPERTS}"):
                run()


@pytest.mark.parametrize("dev", DEVICES)
def test_inputs_that_require_grad(dev):
    """nn.Parameter weights used outside no_grad (and inputs that require grad) compute the
    same result on every backend: the ops run with autograd off (an internal out= call used to
    fail with autograd's message); silu_and_mul alike."""
    x, w1, w2, weights = _layer(dev)
    ids = torch.randint(0, w1.shape[0], (x.shape[0], 2), generator=seeded(4)).to(
        dev, torch.int32)
    p1, p2 = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    for backend in _backends(dev):
        want = fused_experts(x, w1, w2, weights, ids, backend=backend)
        got = fused_experts(x.clone().requires_grad_(), p1, p2,
                            weights.clone().requires_grad_(), ids, backend=backend)
        torch.testing.assert_close(got.detach(), want, atol=0, rtol=0,
                                   msg=lambda m: f"{backend}: {m}")
    a = torch.randn(3, 32, device=dev, requires_grad=True)
    out = torch.full((3, 16), float("nan"), device=dev)
    torch.ops.hopper_moe.silu_and_mul(out, a)
    torch.testing.assert_close(out, (torch.nn.functional.silu(a[:, :16]) * a[:, 16:]).detach())


def test_explain_backend_checks_like_fused_experts():
    """explain_backend rejects what fused_experts would (a RuntimeError naming the argument),
    rather than an AttributeError or a choice for a call that cannot run."""
    _, w1, w2, _ = _layer("cpu")
    cases = [
        (dict(quant={}), r"quant must be None or a hopper_moe.QuantConfig, got dict"),
        (dict(dtype=torch.int32), r"dtype must be float32, float16 or bfloat16"),
        (dict(dtype=torch.float16), r"w1 must have the dtype of the hidden states"),
    ]
    for kwargs, match in cases:
        with pytest.raises(RuntimeError, match=match):
            hopper_moe.explain_backend(3, w1, w2, 2, **kwargs)
    with pytest.raises(RuntimeError, match=r"w1 \[E, 2I, H\] and w2 \[E, H, I\] must agree"):
        hopper_moe.explain_backend(3, w1, w2[:, :, :32], 2)
    assert hopper_moe.explain_backend(3, w1, w2, 2).backend in _backends("cpu")


# ------------------------------------------------------------------- op-level findings
O = torch.ops.hopper_moe
F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dev", DEVICES)
def test_moe_sum_rejects_an_empty_expert_map(dev):
    """An expert_map of 0 entries read as no map at all (every slot summed): rejected."""
    x = torch.ones(2, 2, 4, device=dev)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    out = torch.full((2, 4), float("nan"), device=dev)
    with pytest.raises(RuntimeError, match=r"moe_sum: expert_map must have one entry per "
                                           r"global expert \(at least one\), got 0"):
        O.moe_sum(x, out, ids, torch.empty(0, dtype=torch.int32, device=dev))
    O.moe_sum(x, out, ids, torch.tensor([-1], dtype=torch.int32, device=dev))
    assert torch.equal(out, torch.zeros_like(out))


def _overlapping_rows(rows, cols, dtype, dev):
    """[rows, cols] whose rows overlap (row stride cols // 2): no element is stride 0."""
    return torch.zeros(rows * cols, dtype=dtype, device=dev).as_strided((rows, cols),
                                                                         (cols // 2, 1))


@pytest.mark.parametrize("dev", DEVICES)
def test_outputs_whose_rows_overlap_are_rejected(dev):
    """An output whose rows share elements (as_strided) is a race on the GPU and an arbitrary
    result on the CPU: every op that writes rows rejects it, as it rejects stride 0."""
    f32, i32 = dict(device=dev), dict(dtype=torch.int32, device=dev)
    match = r"must not overlap \(each stride must exceed the span"
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]], **i32)
    calls = {
        "moe_sum": lambda: O.moe_sum(torch.randn(5, 3, 16, **f32),
                                     _overlapping_rows(5, 16, torch.float32, dev), None, None),
        "moe_unpermute": lambda: O.moe_unpermute(
            torch.randn(4, 8, **f32), torch.ones(2, 2, **f32),
            torch.tensor([[0, 1], [2, 3]], **i32), None, 2,
            _overlapping_rows(2, 8, torch.float32, dev)),
        "shuffle_rows": lambda: O.shuffle_rows(torch.randn(5, 8, **f32),
                                               torch.tensor([4, 0, 1], **i32),
                                               _overlapping_rows(3, 8, torch.float32, dev)),
        "moe_permute": lambda: O.moe_permute(
            torch.randn(3, 8, **f32), ids, torch.arange(6, **i32).view(3, 2), None, 4, 4, 2,
            _overlapping_rows(6, 8, torch.float32, dev),
            torch.empty(5, dtype=torch.long, device=dev), torch.empty(3, 2, **i32),
            torch.empty(6, **i32)),
        "moe_grouped_gemm": lambda: O.moe_grouped_gemm(
            _overlapping_rows(6, 8, torch.bfloat16, dev),
            torch.randn(6, 16, device=dev).bfloat16(),
            torch.randn(3, 8, 16, device=dev).bfloat16(),
            torch.tensor([0, 2, 4, 6], device=dev), None, None, False, ""),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=match):
            call()


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_gemm_silu_mul_and_chain_take_a_row_strided_output(dev):
    """The checks allow any row stride for out / h (last dim contiguous): the CPU definition
    computed into them with silu_and_mul, which needs contiguous rows, and failed there."""
    g = seeded(2)
    a = torch.randn(4, 32, generator=g).bfloat16().to(dev)
    w1 = (torch.randn(1, 16, 32, generator=g) / 4).bfloat16().to(dev)
    w2 = (torch.randn(1, 16, 8, generator=g) / 4).bfloat16().to(dev)
    off = torch.tensor([0, 4], device=dev)
    want = torch.empty(4, 8, dtype=torch.bfloat16, device=dev)
    O.moe_grouped_gemm_silu_mul(want, a, w1, off, None, None, None, False, None, "")
    big = torch.full((4, 16), float("nan"), dtype=torch.bfloat16, device=dev)
    O.moe_grouped_gemm_silu_mul(big[:, :8], a, w1, off, None, None, None, False, None, "")
    assert torch.equal(big[:, :8], want) and big[:, 8:].isnan().all()
    y_want = torch.empty(4, 16, dtype=torch.bfloat16, device=dev)
    O.moe_grouped_gemm_chain(y_want, torch.empty(4, 8, dtype=torch.bfloat16, device=dev), a,
                             w1, w2, off, None, None, None, None, False, "")
    h = torch.full((4, 16), float("nan"), dtype=torch.bfloat16, device=dev)
    y = torch.empty(4, 16, dtype=torch.bfloat16, device=dev)
    O.moe_grouped_gemm_chain(y, h[:, :8], a, w1, w2, off, None, None, None, None, False, "")
    assert torch.equal(y, y_want) and torch.equal(h[:, :8], want)


@pytest.mark.parametrize("dev", DEVICES)
def test_fp8_grouped_gemm_with_no_expert(dev):
    """E = 0 with rows present: nothing to compute, no row written, in FP8 as in bf16 (the
    CPU definition failed reshaping the empty weight scales)."""
    a = torch.randn(4, 16, device=dev).to(F8)
    b = torch.empty(0, 8, 16, dtype=F8, device=dev)
    out = torch.full((4, 8), 7.0, dtype=torch.bfloat16, device=dev)
    O.moe_grouped_gemm(out, a, b, torch.zeros(1, dtype=torch.long, device=dev),
                       torch.ones(1, device=dev), torch.empty(0, device=dev), False, "")
    assert (out == 7).all()
    empty = torch.empty(0, dtype=torch.long, device=dev)
    O.cutlass_moe_mm(out, a, b, torch.ones(1, device=dev), torch.empty(0, device=dev), empty,
                     torch.empty(0, 3, dtype=torch.int32, device=dev), empty, empty, empty,
                     False, False)
    assert (out == 7).all()


@pytest.mark.parametrize("dev", DEVICES)
def test_grouped_gemm_named_errors(dev):
    """A 0-D b_scales and a cutlass_moe_mm operand of the wrong layout get the op's own
    RuntimeError (they raised IndexError / named moe_grouped_gemm's arguments)."""
    a = torch.randn(4, 16, device=dev).to(F8)
    b = torch.randn(1, 8, 16, device=dev).to(F8)
    out = torch.empty(4, 8, dtype=torch.bfloat16, device=dev)
    with pytest.raises(RuntimeError, match=r"moe_grouped_gemm: b_scales must have shape \[E\]"):
        O.moe_grouped_gemm(out, a, b, torch.tensor([0, 4], device=dev), torch.ones(1, device=dev),
                           torch.tensor(1.0, device=dev), False, "")
    a2 = torch.randn(4, 64, device=dev).to(F8)[:, ::2]
    b2 = torch.randn(2, 8, 32, device=dev).to(F8)
    sizes = torch.tensor([[2, 8, 32], [2, 8, 32]], dtype=torch.int32, device=dev)
    strides = torch.full((2,), 32, device=dev)
    with pytest.raises(RuntimeError, match=r"cutlass_moe_mm: a_tensors must have stride 1"):
        O.cutlass_moe_mm(out, a2, b2, torch.ones(1, device=dev), torch.ones(2, device=dev),
                         torch.tensor([0, 2], device=dev), sizes, strides, strides,
                         torch.full((2,), 8, device=dev), False, False)


@pytest.mark.parametrize("dev", DEVICES)
def test_expert_map_shorter_than_the_local_experts(dev):
    """A map of fewer entries than w1's experts (global ids past it count for nothing): every
    backend computes it alike (the sm90 layer failed inside moe_permute)."""
    x, w1, w2, weights = _layer(dev, num_tokens=6, num_experts=4)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [1, 1], [0, 0], [2, 3]], dtype=torch.int32,
                       device=dev)
    expert_map = torch.tensor([3, 1], dtype=torch.int32, device=dev)
    want = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map, backend="reference")
    assert want[5].abs().max() == 0 and want[0].abs().max() > 0
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map, backend=backend)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("call, match", [
    (lambda: ops.shuffle_rows(torch.randn(5), torch.tensor([1, 0], dtype=torch.int32)),
     r"shuffle_rows: input_tensor must be a 2-D tensor, got shape \[5\]"),
    (lambda: ops.moe_permute(torch.randn(3, 8), None, torch.zeros(6, dtype=torch.int32), 4),
     r"moe_permute: topk_ids must be a 2-D tensor"),
    (lambda: ops.moe_permute(torch.randn(8), None, torch.zeros(1, 2, dtype=torch.int32), 4),
     r"moe_permute: hidden_states must be a 2-D tensor"),
    (lambda: ops.moe_permute(torch.randn(3, 8), None, torch.zeros(3, 2, dtype=torch.int32), 4,
                             -4),
     r"moe_permute: n_local_expert \(or -1\) must be an int >= 1, got -4"),
    (lambda: ops.moe_align_block_size_buffers(torch.zeros(2, 2, dtype=torch.int32), -4, 4),
     r"moe_align_block_size: num_experts must be an int >= 1, got -4"),
    (lambda: ops.moe_unpermute(torch.empty(2, 8), torch.randn(4, 8), torch.ones(2, 2),
                               torch.arange(3, dtype=torch.int32)),
     r"moe_unpermute: inv_permuted_idx must hold num_tokens \* topk = 4 entries"),
    (lambda: ops.silu_and_mul(None, torch.tensor(1.0)),
     r"silu_and_mul: input must be a >= 1-D tensor, got shape \[\]"),
    (lambda: ops.per_token_group_quant_fp8(torch.tensor(1.0), 8),
     r"per_token_group_fp8_quant: input must be a >= 1-D tensor"),
])
def test_python_op_wrappers_name_the_argument(call, match):
    """The allocating wrappers of hopper_moe.ops read shapes before the op checks them: a wrong
    rank or count is a RuntimeError naming the argument (it was IndexError / ValueError or
    torch's allocation error)."""
    with pytest.raises(RuntimeError, match=match):
        call()


def test_grouped_topk_fake_checks_what_decides_its_shapes():
    """Under fake tensors (torch.compile's tracing) grouped_topk's output shape comes from its
    arguments: the rules the real op checks for them hold there too, with its messages (a
    [T, 99] result used to propagate for a call the op rejects)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    scores, bias = torch.randn(5, 8), torch.randn(8)
    for args, match in [((3, 1, 2), r"n_group must be >= 1 and divide num_experts = 8"),
                        ((4, 5, 2), r"topk_group must be in \[1, n_group = 4\], got 5"),
                        ((4, 2, 5), r"topk must be in \[1, topk_group \* num_experts / "
                                    r"n_group = 4\], got 5")]:
        with pytest.raises(RuntimeError, match=match):
            O.grouped_topk(scores, *args, True, 1.0, bias, 1)
        with FakeTensorMode() as mode:
            s, b = mode.from_tensor(scores), mode.from_tensor(bias)
            with pytest.raises(RuntimeError, match=match):
                O.grouped_topk(s, *args, True, 1.0, b, 1)
    with FakeTensorMode() as mode:
        w, i = O.grouped_topk(mode.from_tensor(scores), 4, 2, 3, True, 1.0,
                              mode.from_tensor(bias), 1)
        assert tuple(w.shape) == tuple(i.shape) == (5, 3)


def test_uint32_ids_from_fused_topk_run_the_layer():
    """fused_topk(indices_type=torch.uint32) (accepted as in vLLM) gives ids fused_experts runs
    like their int32 values on every backend; ids from 2^31 on count for nothing."""
    x, w1, w2, _ = _layer("cpu")
    logits = torch.randn(x.shape[0], w1.shape[0], generator=seeded(6))
    weights, ids, _ = hopper_moe.fused_topk(x, logits, 2, True, indices_type=torch.uint32)
    assert ids.dtype == torch.uint32
    ids32 = ids.view(torch.int32).clone()
    ids32[0, 1] = -1
    ids = ids32.view(torch.uint32).clone()
    ids.view(torch.int32)[0, 1] = -2**31  # 2^31 as uint32
    want = fused_experts(x, w1, w2, weights, ids32, backend="reference")
    for backend in _backends("cpu"):
        got = fused_experts(x, w1, w2, weights, ids, backend=backend)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("block_shape, hidden", [((128, 64), 128), ((64, 32), 128),
                                                 ((128, 16), 128), ((128, 192), 384)])
def test_block_fp8_with_groups_other_than_the_k_tile(dev, block_shape, hidden):
    """Block-wise FP8 with block_k other than 128: the Triton kernel applies one scale per K
    tile, and its tile was 128 whatever the group (wrong results for block_k < 128); the tile
    is now fitted into the group, and every backend agrees with the reference."""
    from hopper_moe.kernels.moe_gemm_configs import block_k_for_group

    assert block_k_for_group(128, block_shape[1]) <= block_shape[1]
    assert block_shape[1] % block_k_for_group(128, block_shape[1]) == 0
    g = seeded(8)
    x = torch.randn(3, hidden, generator=g).to(dev, torch.bfloat16)
    w1 = (torch.randn(2, 2 * hidden, hidden, generator=g) / hidden ** 0.5).to(dev)
    w2 = (torch.randn(2, hidden, hidden, generator=g) / hidden ** 0.5).to(dev)
    w1q, w2q, quant = make_quant_config(w1, w2, "fp8_block", block_shape=block_shape)
    weights = torch.rand(3, 2, generator=g).to(dev)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32, device=dev)
    want = fused_experts(x, w1q, w2q, weights, ids, quant=quant, backend="reference")
    for backend in _backends(dev):
        if backend == "sm90":
            continue  # no block FP8 (a clear error; tests/test_fused_moe.py)
        got = fused_experts(x, w1q, w2q, weights, ids, quant=quant, backend=backend)
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m: f"{backend} {block_shape}: {m}")


def test_block_fp8_groups_too_narrow_for_the_triton_kernel():
    """block_k = 8 leaves no K tile tl.dot takes inside a group: the Triton backend says so
    (and auto does not choose it), where it would otherwise mix two groups' scales."""
    from hopper_moe.backends import triton as triton_backend

    x, w1, w2, weights = _layer("cpu", hidden=64, inter=64)
    w1q, w2q, quant = make_quant_config(w1.float(), w2.float(), "fp8_block", block_shape=(64, 8))
    assert triton_backend.unsupported_reason(quant).startswith("block_shape[1] (block_k) = 8")
    assert not triton_backend.supports(x.device, x.dtype, w1q, w2q, quant)
    ids = torch.randint(0, w1.shape[0], (x.shape[0], 2), generator=seeded(3)).to(torch.int32)
    with pytest.raises(RuntimeError, match=r"block_shape\[1\] \(block_k\) = 8 must be a "
                                           r"multiple of 16"):
        fused_experts(x, w1q, w2q, weights, ids, quant=quant, backend="triton")


@pytest.mark.parametrize("dev", DEVICES)
def test_int64_expert_map_entries_past_int32_are_non_local(dev):
    """An int64 expert_map entry of 2^32 (+ e) is no local expert on every backend (the sm90
    layer narrowed it to e)."""
    x, w1, w2, _ = _layer(dev, num_tokens=4, num_experts=2)
    ids = torch.tensor([[0], [1], [2], [3]], dtype=torch.int32, device=dev)
    weights = torch.ones(4, 1, device=dev)
    expert_map = torch.tensor([2**32, 1, 2**32 + 1, -(2**32) + 1], device=dev)
    want = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map.clamp(-1, 2),
                         backend="reference")
    assert want[0].abs().max() == 0 and want[1].abs().max() > 0
    for backend in _backends(dev):
        got = fused_experts(x, w1, w2, weights, ids, expert_map=expert_map, backend=backend)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m: f"{backend}: {m}")


def test_sm90_weights_off_a_16_byte_boundary():
    """bf16 / FP8 weights the sm90 layer reads as they are must start on 16 bytes (bulk tensor
    copies): the op says so naming the weight (an inner GEMM's operand `b` was named), its
    support check too (auto takes another backend), and the other backends compute them."""
    from hopper_moe.backends import sm90

    x, w1, w2, weights = _layer("cpu")
    shifted = torch.empty(w2.numel() + 1, dtype=w2.dtype)[1:].view(w2.shape)
    shifted.copy_(w2)
    assert shifted.data_ptr() % 16
    ids = torch.randint(0, w1.shape[0], (x.shape[0], 2), generator=seeded(2)).to(torch.int32)
    with pytest.raises(RuntimeError, match=r"fused_experts_sm90: w2 must start on a 16-byte "
                                           r"boundary"):
        fused_experts(x, w1, shifted, weights, ids, backend="sm90")
    assert "w2 must start on a 16-byte boundary" in sm90.unsupported_reason(
        x.device, w1, shifted, None)
    want = fused_experts(x, w1, w2, weights, ids, backend="torch")
    torch.testing.assert_close(fused_experts(x, w1, shifted, weights, ids, backend="torch"),
                               want, atol=0, rtol=0)
    # fp32 weights are converted into fresh memory: any start is fine.
    x32, w1f, w2f = x.float(), w1.float(), w2.float()
    w2f_shifted = torch.empty(w2f.numel() + 1)[1:].view(w2f.shape)
    w2f_shifted.copy_(w2f)
    torch.testing.assert_close(fused_experts(x32, w1f, w2f_shifted, weights, ids, backend="sm90"),
                               fused_experts(x32, w1f, w2f, weights, ids, backend="sm90"),
                               atol=0, rtol=0)


def test_meta_argument_named_in_the_one_device_error():
    """A meta tensor among real ones reaches the fake implementation first: its error names
    the argument (it gave a position)."""
    x, w1, w2, weights = _layer("cpu")
    ids = torch.zeros(x.shape[0], 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"fused_experts_sm90: all tensor arguments must be "
                                           r"on one device; got out on cpu, topk_ids on meta"):
        fused_experts(x, w1, w2, weights, ids.to("meta"), backend="sm90")
