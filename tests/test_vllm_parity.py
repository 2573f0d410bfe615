"""Behaviours of vLLM 0.33's fused MoE that hopper_moe follows where vLLM's own kernel tests
found them missing (pinned here so they hold where vLLM's tests cannot run)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hopper_moe
from hopper_moe import api

from conftest import DEVICES
from test_fused_moe import make_problem, run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["torch", "reference", "sm90", "triton"])
@pytest.mark.parametrize("scale_3d", [False, True])
def test_per_token_activations_infer_per_channel_weights(device, backend, scale_3d):
    """per_act_token_quant=True with weight scales of shape [E, N] (or [E, N, 1]) and
    per_out_ch_quant unset: vLLM reads per-channel weights; so does hopper_moe (the same
    output as with per_out_ch_quant=True), where it used to reject the scale's shape."""
    if backend not in api.available_backends(device):
        pytest.skip(f"backend {backend} not available on {device}")
    p = make_problem(5, 4, 2, 128, 128, scheme="fp8_channel", seed=3,
                     channel_3d=scale_3d).to(device)
    assert p.quant.per_out_ch_quant and p.quant.per_act_token_quant
    explicit = run(p, backend=backend)
    inferred = replace(p, quant=replace(p.quant, per_out_ch_quant=False))
    torch.testing.assert_close(run(inferred, backend=backend), explicit, rtol=0, atol=0)


def test_resolve_leaves_other_configs_alone():
    s = torch.ones(4)
    w1 = torch.zeros(4, 64, 32, dtype=torch.float8_e4m3fn)
    per_tensor = hopper_moe.QuantConfig(s, s, per_act_token_quant=True)
    assert per_tensor.resolve(w1) is per_tensor  # [E] scales stay per-tensor weights
    plain = hopper_moe.QuantConfig(torch.ones(4, 64), s)
    assert plain.resolve(w1) is plain  # per-tensor activations: nothing is inferred
    # An [E, N] scale with per-tensor activations is still an error, named.
    w2 = torch.zeros(4, 32, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="w1_scale must have shape \\(num_experts,\\)"):
        plain.validate(w1, w2)
