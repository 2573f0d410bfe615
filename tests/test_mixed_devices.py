"""A call that mixes a meta tensor with real ones is dispatched to the op's fake
implementation, where no real check runs: it must fail as a call with tensors on two devices
fails, never silently do nothing."""
import pytest
import torch

import hopper_moe  # noqa: F401  (registers the ops)

OPS = torch.ops.hopper_moe


def _cases():
    f32, bf16 = torch.float32, torch.bfloat16
    e4m3 = torch.float8_e4m3fn
    return {
        "silu_and_mul": lambda d1, d2: OPS.silu_and_mul(
            torch.empty(4, 8, device=d1), torch.randn(4, 16, device=d2)),
        "moe_sum": lambda d1, d2: OPS.moe_sum(
            torch.randn(4, 2, 8, device=d1), torch.empty(4, 8, device=d2)),
        "static_scaled_fp8_quant": lambda d1, d2: OPS.static_scaled_fp8_quant(
            torch.empty(4, 8, dtype=e4m3, device=d1), torch.randn(4, 8, device=d1),
            torch.ones(1, dtype=f32, device=d2), None),
        "moe_grouped_gemm": lambda d1, d2: OPS.moe_grouped_gemm(
            torch.empty(4, 16, dtype=bf16, device=d1), torch.randn(4, 32, device=d1).to(bf16),
            torch.randn(2, 16, 32, device=d2).to(bf16),
            torch.tensor([0, 2, 4], device=d1), None, None),
        "grouped_topk": lambda d1, d2: OPS.grouped_topk(
            torch.randn(4, 16, device=d1), 4, 2, 2, True, 1.0,
            torch.zeros(16, device=d2), 1),
    }


@pytest.mark.parametrize("op", sorted(_cases()))
@pytest.mark.parametrize("meta_first", [True, False])
def test_meta_mixed_with_cpu_is_an_error(op, meta_first):
    d1, d2 = ("meta", "cpu") if meta_first else ("cpu", "meta")
    with pytest.raises(RuntimeError, match=f"hopper_moe::{op}: .*one device"):
        _cases()[op](d1, d2)


@pytest.mark.parametrize("op", sorted(_cases()))
def test_all_meta_is_accepted(op):
    _cases()[op]("meta", "meta")
