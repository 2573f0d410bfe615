"""The FP8 requantization bound of requant_bound.py: it contains every perturbed layer that the
noise model allows, is not so wide that a wrong result passes, and its reference is the test
reference's value."""
from __future__ import annotations

import pytest
import torch

from requant_bound import check_within_bound, reference_with_bound
from test_cute_backend import reference
from test_fused_moe import TOL, base_scheme, make_problem

FP8_SCHEMES = ["fp8_tensor_static", "fp8_tensor_dynamic", "fp8_channel"]
# (m, e, topk, h, i, extra): large batches (where one FP8 step of a large element matters),
# decode, expert_map, out-of-range ids, the router weight on the input.
CASES = [(700, 2, 1, 208, 16, {}), (8, 16, 2, 208, 48, {}), (300, 8, 2, 96, 64,
         dict(num_local=5, invalid_ids=True)), (64, 4, 1, 64, 32, dict(on_input=True)),
         (40, 3, 2, 80, 144, dict(dtype=torch.float16))]


def _problem(scheme, case, seed):
    m, e, topk, h, i, extra = case
    return make_problem(m, e, topk, h, i, scheme=scheme, seed=seed, **extra)


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_is_the_tests_reference(scheme, case):
    p = _problem(scheme, CASES[case], seed=case)
    ref, _ = reference_with_bound(p)
    want = reference(p)
    assert torch.equal(ref.to(want.dtype), want)


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_perturbed_layers_stay_inside(scheme, case):
    """Layers whose GEMM sums and scalar steps move within the noise model (then rounded as the
    kernels round) differ from the reference by at most the bound, at every element; and the
    perturbations do move outputs (the test would notice a model that never flips)."""
    p = _problem(scheme, CASES[case], seed=100 + case)
    ref, bound = reference_with_bound(p)
    moved = 0.0
    for s in range(6):
        _, other = reference_with_bound(p, sample=torch.Generator().manual_seed(s))
        diff = (other - ref).abs()
        assert bool((diff <= bound).all()), f"sample {s}: {(diff - bound).max().item():.3g}"
        moved = max(moved, diff.max().item())
    assert moved > 0


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_wrong_results_fail(scheme):
    """A dropped slot, one token's row from another token, a scale off by 10%: each fails."""
    p = _problem(scheme, CASES[0], seed=7)
    atol, rtol = TOL[base_scheme(scheme)]
    good = reference(p)
    check_within_bound(good, p, atol, rtol, "the reference itself")
    dropped = reference(type(p)(p.x, p.w1, p.w2, p.topk_weights,
                                torch.where(torch.arange(p.x.shape[0]).unsqueeze(1) == 3,
                                            torch.full_like(p.topk_ids, -1), p.topk_ids),
                                p.quant))
    swapped = good.clone()
    swapped[5] = good[6]
    scaled = good.float() * 1.1
    for bad, what in ((dropped, "dropped slot"), (swapped, "swapped row"),
                      (scaled.to(good.dtype), "scale 1.1")):
        with pytest.raises(AssertionError, match="beyond the tolerance"):
            check_within_bound(bad, p, atol, rtol, what)
