"""No recompilation across token counts, shown with the JIT's own cache keys and no GPU.

Triton compiles a kernel once per cache key: the specialization of every argument that is not
in do_not_specialize (an integer's 1 / divisible-by-16 / other class, a pointer's alignment)
plus the constexprs and launch options. These tests replace the layer's kernel handle with a
recorder, run the layer on CPU tensors (the surrounding ops have CPU implementations; no
kernel runs), and feed every recorded launch to the binder that Triton itself builds for an
SM90 target (`create_function_from_signature`, `compute_cache_key`, as `JITFunction.run`
does). Warming every M bucket must produce every key that 300 random token counts in
1..8192 produce, for each scheme; and a copy of the kernel without do_not_specialize must
produce new keys, so the count can fail. The GPU tests in test_triton_moe.py and
test_inv_rope_quant.py count compiled variants on the device; these run wherever Triton is
installed, so on every Triton version CI and the GPU machine carry (3.8 and 3.6).
"""
from __future__ import annotations

import random

import pytest
import torch

from test_inv_rope_quant import make_inputs
from test_triton_moe import make_layer

from hopper_moe.backends import triton as triton_backend
from hopper_moe.kernels import inv_rope_quant, moe_gemm
from hopper_moe.kernels import moe_gemm_configs as triton_configs

triton = pytest.importorskip("triton")
from triton.runtime.jit import (  # noqa: E402
    JITFunction,
    compute_cache_key,
    create_function_from_signature,
)

SM90 = (90, 32)  # (compute capability, warp size) of the target the keys are computed for


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))
        return launch


def cache_keys(kernel_fn, do_not_specialize, calls) -> set[str]:
    """The JIT cache key of each recorded call, for a JITFunction of kernel_fn."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    jit = JITFunction(kernel_fn, do_not_specialize=do_not_specialize)
    binder = create_function_from_signature(jit.signature, jit.params,
                                            make_backend(GPUTarget("cuda", *SM90)))
    keys = set()
    for args, kwargs in calls:
        _, specialization, options = binder(*args, **kwargs)
        keys.add(compute_cache_key({}, specialization, options))
    return keys


def _moe_calls(monkeypatch, scheme: str, ms) -> list:
    rec = Recorder()
    monkeypatch.setattr(moe_gemm, "moe_gemm_kernel", rec)  # looked up there per launch
    E, topk, H, I = 8, 2, 256, 128
    x, w1, w2, _, _, quant, _ = make_layer(8192, E, topk, H, I, scheme, "cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    for m in ms:
        logits = torch.randn(m, E, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), topk)
        triton_backend.fused_experts_triton(x[:m], w1, w2, w, ids.to(torch.int32), quant=quant)
    return rec.calls


def _random_counts(seed: int, n: int = 300, high: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


@pytest.mark.parametrize("scheme", ["bf16", "fp8_tensor", "fp8_channel", "fp8_block"])
def test_moe_gemm_keys_fixed_after_warmup(monkeypatch, scheme):
    fn = moe_gemm.moe_gemm_kernel.fn
    warm = cache_keys(fn, moe_gemm.TOKEN_DEPENDENT_ARGS,
                      _moe_calls(monkeypatch, scheme, triton_configs.M_BUCKETS))
    assert warm
    later = cache_keys(fn, moe_gemm.TOKEN_DEPENDENT_ARGS,
                       _moe_calls(monkeypatch, scheme, _random_counts(7)))
    assert later <= warm, f"{len(later - warm)} keys compiled only after the warm-up"


def test_moe_gemm_keys_grow_without_do_not_specialize(monkeypatch):
    """The same launches bound to a copy that specializes every integer: token counts 1, 7,
    16, 33 (the 1 / other / divisible-by-16 classes) give more keys than one count does."""
    fn = moe_gemm.moe_gemm_kernel.fn
    one = cache_keys(fn, [], _moe_calls(monkeypatch, "bf16", [7]))
    many = cache_keys(fn, [], _moe_calls(monkeypatch, "bf16", [1, 7, 16, 33]))
    assert len(many) > len(one)
    guarded = cache_keys(fn, moe_gemm.TOKEN_DEPENDENT_ARGS,
                         _moe_calls(monkeypatch, "bf16", [1, 7, 16, 33]))
    assert len(guarded) < len(many)


def _rope_calls(monkeypatch, counts) -> list:
    rec = Recorder()
    monkeypatch.setattr(inv_rope_quant, "fused_inv_rope_fp8_quant_kernel", rec)
    # The op takes CPU tensors only under TRITON_INTERPRET=1 (set by conftest without a GPU).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x_all, pos_all, cache = make_inputs(8192, 2, torch.bfloat16, device=device)
    for t in counts:
        inv_rope_quant.fused_inv_rope_fp8_quant(x_all[:t], pos_all[:t], cache, 1, 2)
    return rec.calls


def test_inv_rope_keys_fixed_after_warmup(monkeypatch):
    fn = inv_rope_quant.fused_inv_rope_fp8_quant_kernel.fn
    dns = inv_rope_quant.TOKEN_DEPENDENT_ARGS
    warm = cache_keys(fn, dns, _rope_calls(monkeypatch, (1, 2, 3, 4, 16, 17, 64, 1000)))
    later = cache_keys(fn, dns, _rope_calls(monkeypatch, _random_counts(11)))
    assert warm and later <= warm
    assert len(cache_keys(fn, [], _rope_calls(monkeypatch, (1, 7, 16, 33)))) > 1
