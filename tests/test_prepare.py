"""hopper_moe.prepare, the scheme-dependent steps the fused_experts backends share: its two
implementations of the activation quantization (hopper_moe's ops, tensor ops) follow the same
rules, the GEMM2-input decision per scheme, and the weight-scale shapes."""
from __future__ import annotations

import pytest
import torch

from conftest import seeded
from hopper_moe import prepare
from hopper_moe.quant import FP8_MIN_SCALE, QuantConfig, make_quant_config

E, N, K = 3, 64, 256


def _quant(scheme: str, static: bool = False) -> QuantConfig:
    g = seeded(1)
    w1 = torch.randn(E, 2 * N, K, generator=g)
    w2 = torch.randn(E, K, N, generator=g)
    return make_quant_config(w1, w2, scheme, static_act=static)[2]


@pytest.mark.parametrize("scheme,static", [("fp8_tensor", False), ("fp8_tensor", True),
                                           ("fp8_channel", False), ("fp8_block", False)])
def test_kernel_and_native_quantization_agree(scheme, static):
    quant = _quant(scheme, static)
    x = torch.randn(7, K, generator=seeded(2)) * 3
    q_ops, s_ops = prepare.quantize_activations(x, quant, quant.a1_scale)
    q_nat, s_nat = prepare.quantize_activations(x, quant, quant.a1_scale, native=True)
    assert q_ops.dtype == q_nat.dtype == torch.float8_e4m3fn and q_ops.shape == x.shape
    torch.testing.assert_close(s_ops.reshape(s_nat.shape), s_nat, rtol=0, atol=0)
    # Dequantized values agree to one fp8 step (the ops may round x / s and x * (1 / s) apart).
    deq_ops, deq_nat = q_ops.float(), q_nat.float()
    step = deq_nat.abs().clamp_min(2.0 ** -6) / 8
    assert ((deq_ops - deq_nat).abs() <= step).all()
    assert (deq_ops != deq_nat).float().mean() < 0.01
    if scheme == "fp8_block":
        assert s_nat.shape == (7, K // 128)
    elif scheme == "fp8_channel":
        assert s_nat.shape == (7, 1)
    else:
        assert s_nat.dim() == 0 and s_ops.shape == (1,)
        if static:
            assert s_nat == quant.a1_scale.reshape(())


def test_gemm2_input_per_scheme():
    assert prepare.gemm2_input(None) == prepare.UNQUANTIZED
    assert prepare.gemm2_input(_quant("fp8_tensor", static=True)) == prepare.STATIC_TENSOR
    assert prepare.gemm2_input(_quant("fp8_tensor")) == prepare.DYNAMIC_TENSOR
    assert prepare.gemm2_input(_quant("fp8_channel")) == prepare.PER_TOKEN
    assert prepare.gemm2_input(_quant("fp8_block")) == prepare.PER_GROUP
    writes = {s: prepare.gemm1_writes_gemm2_input(q) for s, q in (
        ("bf16", None), ("static", _quant("fp8_tensor", True)), ("dynamic", _quant("fp8_tensor")),
        ("channel", _quant("fp8_channel")), ("block", _quant("fp8_block")))}
    assert writes == {"bf16": True, "static": True, "dynamic": False, "channel": False,
                      "block": False}


def test_gemm1_epilogue_scale():
    static = _quant("fp8_tensor", static=True)
    assert torch.equal(prepare.gemm1_epilogue_scale(static, "cpu"), static.a2_scale.reshape(1))
    floor = prepare.gemm1_epilogue_scale(_quant("fp8_tensor"), "cpu")
    assert floor.shape == (1,) and floor.dtype == torch.float32 and floor.item() == \
        torch.tensor(FP8_MIN_SCALE, dtype=torch.float32).item()
    assert prepare.gemm1_epilogue_scale(_quant("fp8_channel"), "cpu") is None
    assert prepare.gemm1_epilogue_scale(None, "cpu") is None


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_channel", "fp8_block"])
def test_weight_scale_shapes(scheme):
    quant = _quant(scheme)
    w = torch.empty(E, 2 * N, K)
    view = prepare.weight_scale_3d(quant.w1_scale, w, quant)
    want = {"fp8_tensor": (E, 1, 1), "fp8_channel": (E, 2 * N, 1),
            "fp8_block": (E, 2 * N // 128 or 1, K // 128)}[scheme]
    assert view.shape == want and view.data_ptr() == quant.w1_scale.data_ptr()
    if scheme != "fp8_block":
        flat = prepare.gemm_weight_scales(quant.w1_scale, w, quant)
        assert flat.is_contiguous() and flat.dtype == torch.float32
        assert flat.shape == ((E, 2 * N) if scheme == "fp8_channel" else (E,))
        assert torch.equal(flat.reshape(view.shape), view)


def test_local_expert_map_cached_refreshed_and_inference_tensors():
    """Entries outside [0, num_local) become -1; the result is cached per map, remade after an
    in-place change, and an inference-mode map (no version counter) is computed each call
    (vLLM's tests call fused_experts under torch.inference_mode with an expert_map)."""
    emap = torch.tensor([0, 5, -1, 2, 1], dtype=torch.int32)
    local = prepare.local_expert_map(emap, 3)
    assert local.tolist() == [0, -1, -1, 2, 1] and local.dtype == emap.dtype
    assert prepare.local_expert_map(emap, 3) is local  # cached
    emap[0] = 7
    assert prepare.local_expert_map(emap, 3).tolist() == [-1, -1, -1, 2, 1]
    with torch.inference_mode():
        imap = torch.tensor([1, 3, 0], dtype=torch.int64)
        assert prepare.local_expert_map(imap, 2).tolist() == [1, -1, 0]
        imap[1] = 1
        assert prepare.local_expert_map(imap, 2).tolist() == [1, 1, 0]
