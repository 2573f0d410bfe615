"""Routing ops: topk_softmax, topk_sigmoid, grouped_topk.

CPU op vs the fp32 reference (ids exact; weights within a few ulps, since the reference uses
torch.exp while the ops share routing::exp_f32; grouped_topk's sigmoid is torch.tanh's form on
either device, bit for bit), edge cases (T = 0 and 1, E not a power of two,
K = E, tied rows, NaN/inf rows, bias, padding, renormalize, strided and misaligned gating), the
behaviours vLLM 0.33's kernels define (non-finite logits: finite weights and distinct ids; ties:
lowest id first; grouped_topk: every scores x bias dtype pair, fp32 sigmoid), every argument
check, opcheck. On a GPU: the CUDA op vs the CPU op bit for bit (same arithmetic by
construction; grouped_topk's sigmoid scores, whose tanh is each device's own, are computed on
the GPU and handed to the CPU op) over many shapes, dtypes and index dtypes, through both
kernel paths (rows in shared memory, E <= 1024; rows in a global workspace, E > 1024) and both
load paths (16-byte vectors, scalars), plus determinism over 20 reruns and CUDA-graph replay.
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, gpu, poison, seeded
from hopper_moe.reference import routing as ref

ops = torch.ops.hopper_moe
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GATING_OPS = ["softmax", "sigmoid"]
DEVICE_PARAMS = ["cpu", pytest.param("cuda", marks=gpu)]
NAN = float("nan")
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# helpers


def make_logits(T, E, dtype=torch.float32, seed=0, scale=2.0, device="cpu"):
    x = torch.randn(T, E, generator=seeded(seed)) * scale
    return x.to(dtype).to(device)


def make_bias(E, op, dtype=torch.float32, seed=1, device="cpu"):
    """A bias on the scale of the scores it is added to, so it changes the selection."""
    spread = 4.0 / E if op == "softmax" else 0.2
    b = (torch.rand(E, generator=seeded(seed)) - 0.5) * spread
    return b.to(dtype).to(device)


def poisoned_outputs(T, K, device="cpu", index_dtype=torch.int32):
    weights = poison(torch.empty(T, K, dtype=torch.float32, device=device))
    ids = torch.empty(T, K, dtype=index_dtype, device=device)
    poison(ids.view(torch.int32) if index_dtype == torch.uint32 else ids)
    tei = poison(torch.empty(T, K, dtype=torch.int32, device=device))
    return weights, ids, tei


def run_gating(op, x, K, renormalize=False, bias=None, is_padding=None, scale=1.0,
               index_dtype=torch.int32):
    weights, ids, tei = poisoned_outputs(x.shape[0], K, x.device, index_dtype)
    if op == "softmax":
        ops.topk_softmax(weights, ids, tei, x, renormalize, bias, is_padding)
    else:
        ops.topk_sigmoid(weights, ids, tei, x, renormalize, bias, scale, is_padding)
    return weights, ids, tei


def ref_gating(op, x, K, renormalize=False, bias=None, is_padding=None, scale=1.0):
    x = x.cpu()
    bias = None if bias is None else bias.cpu()
    is_padding = None if is_padding is None else is_padding.cpu()
    if op == "softmax":
        return ref.topk_softmax(x, K, renormalize, bias, is_padding)
    return ref.topk_sigmoid(x, K, renormalize, bias, scale, is_padding)


def as_int64(ids):
    ids = ids.cpu()
    return (ids.view(torch.int32) if ids.dtype == torch.uint32 else ids).to(torch.int64)


def assert_weights_close(actual, expected, rtol=4e-6):
    actual, expected = actual.cpu(), expected.cpu()
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), "NaN positions differ"
    # atol covers subnormal weights only (the reference rounds them differently).
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-37, equal_nan=True)


def assert_bitwise_equal(actual, expected):
    """Same bits (NaN payloads aside), dtype and shape."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.is_floating_point:
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), "NaN positions differ"
        a = torch.where(nan, torch.zeros_like(actual), actual).view(torch.int32)
        e = torch.where(nan, torch.zeros_like(expected), expected).view(torch.int32)
        mismatch = (a != e).nonzero()
        assert mismatch.numel() == 0, (
            f"{mismatch.shape[0]} mismatches, first at {mismatch[0].tolist()}: "
            f"{actual[tuple(mismatch[0])]} vs {expected[tuple(mismatch[0])]}")
    else:
        assert torch.equal(as_int64(actual), as_int64(expected))


def assert_gating_matches_reference(out, expected):
    weights, ids, tei = out
    ref_weights, ref_ids, ref_tei = expected
    assert torch.equal(as_int64(ids), ref_ids.to(torch.int64)), "ids differ from the reference"
    assert_weights_close(weights, ref_weights)
    assert torch.equal(tei.cpu(), ref_tei)


def assert_valid_ids(ids, E, padded_rows=None):
    """Each real row holds distinct ids in [0, E); padded rows hold -1."""
    ids = as_int64(ids)
    real = torch.ones(ids.shape[0], dtype=torch.bool)
    if padded_rows is not None:
        real = ~padded_rows.cpu()
        assert bool((ids[~real] == -1).all())
    ids = ids[real]
    assert bool(((ids >= 0) & (ids < E)).all())
    if ids.shape[1] > 1:
        s = ids.sort(dim=1).values
        assert bool((s[:, 1:] != s[:, :-1]).all()), "duplicate ids in a row"


def run_grouped(x, n_group, topk_group, topk, renormalize, scale, bias, scoring_func):
    return ops.grouped_topk(x, n_group, topk_group, topk, renormalize, scale, bias, scoring_func)


def ref_grouped(x, n_group, topk_group, topk, renormalize, scale, bias, scoring_func):
    """The reference on x's device (its sigmoid is that device's torch.tanh, as the op's),
    returned on the CPU."""
    weights, ids = ref.grouped_topk(x, n_group, topk_group, topk, renormalize, scale,
                                    bias.to(x.device), scoring_func)
    return weights.cpu(), ids.cpu()


def device_sigmoid_scores(x):
    """grouped_topk's sigmoid scores as x's device computes them, NaN where x is not finite
    (such an expert is invalid under either scoring_func)."""
    xf = x.float()
    s = 0.5 * torch.tanh(0.5 * xf) + 0.5
    return torch.where(torch.isfinite(xf), s, torch.full_like(s, NAN))


def cpu_twin_grouped(x, n_group, topk_group, topk, renormalize, scale, bias, scoring_func):
    """The CPU op on what the op sees on x's device. Everything after the sigmoid is shared by
    the two devices bit for bit; the sigmoid's tanh is each device's own, so under
    scoring_func 1 the scores x's device computes go in with scoring_func 0."""
    if scoring_func == 1:
        x, scoring_func = device_sigmoid_scores(x), 0
    return run_grouped(x.cpu(), n_group, topk_group, topk, renormalize, scale, bias.cpu(),
                       scoring_func)


def gating_variants(op, E, dtype, device="cpu"):
    """(renormalize, bias, scale) combinations every shape is run with."""
    bias32 = make_bias(E, op, torch.float32, seed=E, device=device)
    bias_same = make_bias(E, op, dtype, seed=E + 1, device=device)
    return [(False, None, 1.0), (True, None, 2.5), (False, bias32, 0.75), (True, bias_same, 1.0)]


# ---------------------------------------------------------------------------------------------
# CPU op vs the reference

GATING_SHAPES = [(1, 1, 1), (1, 8, 2), (3, 8, 8), (33, 64, 8), (17, 60, 7), (5, 256, 8),
                 (4, 37, 37), (9, 100, 1), (2, 1500, 6)]


@pytest.mark.parametrize("T,E,K", GATING_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_cpu_matches_reference(op, dtype, T, E, K):
    x = make_logits(T, E, dtype, seed=T * 1000 + E)
    for renormalize, bias, scale in gating_variants(op, E, dtype):
        out = run_gating(op, x, K, renormalize, bias, scale=scale)
        assert_gating_matches_reference(out, ref_gating(op, x, K, renormalize, bias, scale=scale))
        assert_valid_ids(out[1], E)


GROUPED_CASES = [  # (T, E, n_group, topk_group, topk)
    (5, 256, 8, 4, 8),  # DeepSeek-V3
    (3, 64, 4, 2, 6),
    (7, 60, 5, 2, 5),  # E and the group size not powers of two
    (4, 16, 16, 4, 4),  # one expert per group: group score = its single score
    (4, 12, 1, 1, 3),  # one group
    (3, 24, 3, 3, 24),  # every group kept, topk = E
    (2, 160, 40, 10, 12),  # more groups than lanes
    (1, 2, 2, 1, 1),
    (2, 1536, 8, 4, 8),  # E > 1024: global workspace on the GPU
]


@pytest.mark.parametrize("T,E,n_group,topk_group,topk", GROUPED_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_topk_cpu_matches_reference(dtype, T, E, n_group, topk_group, topk):
    x = make_logits(T, E, dtype, seed=E + topk)
    for scoring_func in (0, 1):
        for renormalize, bias_dtype, scale in [(True, torch.float32, 2.5), (False, dtype, 1.0)]:
            bias = make_bias(E, "sigmoid", bias_dtype, seed=E)
            args = (n_group, topk_group, topk, renormalize, scale, bias, scoring_func)
            weights, ids = run_grouped(x, *args)
            ref_weights, ref_ids = ref_grouped(x, *args)
            assert weights.dtype == torch.float32 and ids.dtype == torch.int32
            assert weights.shape == (T, topk) and ids.shape == (T, topk)
            assert torch.equal(ids, ref_ids), (scoring_func, renormalize)
            assert_weights_close(weights, ref_weights)
            assert_valid_ids(ids, E)


def test_reference_rank_order():
    s = torch.tensor([[1.0, NAN, -INF, 3.0, 1.0, -0.0, 0.0, INF]])
    assert ref.routing_rank_order(s).tolist() == [[7, 3, 0, 4, 5, 6, 2, 1]]


# ---------------------------------------------------------------------------------------------
# edge cases (on the CPU, and on the GPU when there is one)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_no_tokens(op, device):
    x = torch.empty(0, 16, device=device)
    weights, ids, tei = run_gating(op, x, 4, True, make_bias(16, op, device=device),
                                   torch.empty(0, dtype=torch.bool, device=device))
    assert weights.shape == ids.shape == tei.shape == (0, 4)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_no_tokens(device):
    weights, ids = run_grouped(torch.empty(0, 64, device=device), 8, 4, 8, True, 1.0,
                               torch.zeros(64, device=device), 1)
    assert weights.shape == ids.shape == (0, 8)
    assert weights.device.type == ids.device.type == device


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_tied_rows_pick_lowest_ids(op, dtype, device):
    E, K = 10, 4
    x = torch.tensor([[0.0] * E, [-3.0] * E, [5.0] * E, [0.0, -0.0] * (E // 2)], dtype=dtype,
                     device=device)
    weights, ids, _ = run_gating(op, x, K)
    assert as_int64(ids).tolist() == [[0, 1, 2, 3]] * 4
    if op == "softmax":
        expected = torch.full((4, K), 1.0 / E)
    else:
        expected = torch.sigmoid(x[:, :K].float().cpu())
    assert_weights_close(weights, expected)
    weights, ids, _ = run_gating(op, x, K, renormalize=True, scale=2.0)
    assert as_int64(ids).tolist() == [[0, 1, 2, 3]] * 4
    full = 0.25 * (2.0 if op == "sigmoid" else 1.0)
    assert torch.equal(weights.cpu(), torch.full((4, K), full))
    # a tie across the top-K boundary: the lower id of the tied pair wins
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.0]], dtype=dtype, device=device)
    assert as_int64(run_gating(op, x, 2)[1]).tolist() == [[1, 3]]
    assert as_int64(run_gating(op, x, 4)[1]).tolist() == [[1, 3, 4, 2]]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_bias_steers_selection_but_not_weights(op, device):
    E, K = 8, 3
    x = torch.full((2, E), 0.5, device=device)
    bias = torch.tensor([0.0, 0.01, 0.0, 0.03, -1.0, 0.02, 0.0, 0.0], device=device)
    weights, ids, _ = run_gating(op, x, K, bias=bias)
    assert as_int64(ids).tolist() == [[3, 5, 1]] * 2
    p = 1.0 / E if op == "softmax" else float(torch.sigmoid(torch.tensor(0.5)))
    assert_weights_close(weights, torch.full((2, K), p))
    # the same bias in the gating dtype gives the same result
    x16 = x.to(torch.bfloat16)
    assert_bitwise_equal(run_gating(op, x16, K, bias=bias)[1],
                         run_gating(op, x16, K, bias=bias.to(torch.bfloat16))[1])


NONFINITE_ROWS = [
    [NAN, 1.0, 2.0, 3.0, 0.0, -1.0],
    [NAN] * 6,
    [INF, 0.0, 1.0, 2.0, 3.0, 4.0],
    [-INF, 0.0, 1.0, 2.0, -INF, 4.0],
    [-INF] * 6,
    [INF, -INF, NAN, 1.0, 2.0, INF],
    [2.0, NAN, -INF, 2.0, INF, -2.0],
]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("K", [1, 3, 6])
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_nan_and_inf_rows(op, K, device):
    x = torch.tensor(NONFINITE_ROWS, device=device)
    for renormalize in (False, True):
        out = run_gating(op, x, K, renormalize, scale=1.5)
        assert_valid_ids(out[1], 6)
        assert_gating_matches_reference(out, ref_gating(op, x, K, renormalize, scale=1.5))
    weights, ids, _ = run_gating(op, x, K)
    ids = as_int64(ids)
    assert bool(torch.isfinite(weights).all())
    if op == "softmax":
        # a NaN, a +inf or only -inf make the whole softmax NaN, which counts as 0: ids 0..K-1,
        # weights 0
        for row in (0, 1, 2, 4, 5, 6):
            assert ids[row].tolist() == list(range(K))
            assert weights[row].tolist() == [0.0] * K
        assert ids[3].tolist() == [5, 3, 2, 1, 0, 4][:K]  # exp(-inf) = 0: after the numbers
    else:
        assert ids[0].tolist() == [3, 2, 1, 4, 5, 0][:K]  # sigmoid(NaN) counts as 0
        assert ids[3].tolist() == [5, 3, 2, 1, 0, 4][:K]
        assert ids[5].tolist() == [0, 5, 4, 3, 1, 2][:K]  # sigmoid(+inf) = 1, sigmoid(-inf) = 0
        assert weights[5].tolist()[:2] == [1.0, 1.0][:K]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_random_nonfinite_logits(op, device):
    T, E = 64, 20
    x = make_logits(T, E, seed=5)
    pick = torch.rand(T, E, generator=seeded(6))
    x[pick < 0.05] = NAN
    x[(pick >= 0.05) & (pick < 0.08)] = INF
    x[(pick >= 0.08) & (pick < 0.12)] = -INF
    x = x.to(device)
    bias = make_bias(E, op, device=device)
    for K in (3, E):
        out = run_gating(op, x, K, True, bias)
        assert_valid_ids(out[1], E)
        assert_gating_matches_reference(out, ref_gating(op, x, K, True, bias))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_padding_rows(op, device):
    T, E, K = 9, 12, 4
    x = make_logits(T, E, device=device)
    is_padding = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.bool, device=device)
    garbage = x.clone()
    garbage[is_padding] = NAN  # padded rows may hold anything
    bias = make_bias(E, op, device=device)
    weights, ids, tei = run_gating(op, garbage, K, True, bias, is_padding, scale=2.0)
    assert_valid_ids(ids, E, is_padding)
    pad = is_padding.cpu()
    assert bool((weights.cpu()[pad] == 0).all())
    expected = torch.arange(K)[None, :] * T + torch.arange(T)[:, None]
    assert torch.equal(tei.cpu(), expected.to(torch.int32))
    full = run_gating(op, x, K, True, bias, scale=2.0)
    assert_bitwise_equal(weights[~is_padding], full[0][~is_padding])
    assert_bitwise_equal(ids[~is_padding], full[1][~is_padding])
    assert_gating_matches_reference((weights, ids, tei),
                                    ref_gating(op, garbage, K, True, bias, is_padding, 2.0))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_strided_and_misaligned_rows(op, device):
    T, E, K = 6, 64, 5
    wide = make_logits(T, E + 7, torch.bfloat16, device=device)
    x = wide[:, 3:E + 3]  # row stride E + 7, start 6 bytes off any 16-byte boundary
    assert x.stride() == (E + 7, 1)
    assert_bitwise_equal(run_gating(op, x, K)[0], run_gating(op, x.contiguous(), K)[0])
    assert_bitwise_equal(run_gating(op, x, K)[1], run_gating(op, x.contiguous(), K)[1])
    one = x[:1]  # a single row: its stride does not matter
    assert_bitwise_equal(run_gating(op, one, K)[1], run_gating(op, one.contiguous(), K)[1])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_index_dtypes(op, device):
    x = make_logits(11, 40, device=device)
    is_padding = torch.zeros(11, dtype=torch.bool, device=device)
    is_padding[3] = True
    base = run_gating(op, x, 6, True, None, is_padding)
    for index_dtype in (torch.int64, torch.uint32):
        out = run_gating(op, x, 6, True, None, is_padding, index_dtype=index_dtype)
        assert out[1].dtype == index_dtype
        assert torch.equal(as_int64(out[1]), as_int64(base[1]))
        assert_bitwise_equal(out[0], base[0])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_renormalized_weights_sum_to_scale(op, device):
    x = make_logits(50, 64, seed=3, device=device)
    scale = 1.0 if op == "softmax" else 2.5
    weights = run_gating(op, x, 8, True, make_bias(64, op, device=device), scale=scale)[0]
    torch.testing.assert_close(weights.sum(dim=1).cpu(), torch.full((50,), scale), rtol=2e-6,
                               atol=0)
    # without renormalize the softmax weights are probabilities of the whole row
    if op == "softmax":
        weights = run_gating(op, x, 64, False)[0]
        torch.testing.assert_close(weights.sum(dim=1).cpu(), torch.ones(50), rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_tied_scores_keep_lowest_groups(device):
    x = torch.full((3, 32), 0.25, device=device)
    bias = torch.zeros(32, device=device)
    for scoring_func in (0, 1):
        weights, ids = run_grouped(x, 4, 2, 5, False, 1.0, bias, scoring_func)
        assert ids.tolist() == [[0, 1, 2, 3, 4]] * 3
        s = 0.25 if scoring_func == 0 else float(torch.sigmoid(torch.tensor(0.25)))
        assert_weights_close(weights, torch.full((3, 5), s))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_group_score_is_top2_sum(device):
    # group 0 holds the best expert (10) but its top-2 sum is 0; group 1 sums to 6: with one
    # group kept, ids come from group 1.
    x = torch.tensor([[10.0, -10.0, 3.0, 3.0, 1.0, 1.0, 2.0, 2.5]], device=device)
    bias = torch.zeros(8, device=device)
    weights, ids = run_grouped(x, 4, 1, 2, False, 1.0, bias, 0)
    assert ids.tolist() == [[2, 3]]
    assert weights.tolist() == [[3.0, 3.0]]
    weights, ids = run_grouped(x, 4, 2, 3, False, 2.0, bias, 0)  # groups 1 and 3 (6 > 4.5)
    assert ids.tolist() == [[2, 3, 7]]
    assert weights.tolist() == [[6.0, 6.0, 5.0]]
    # one expert per group: the group score is that expert's score
    weights, ids = run_grouped(x, 8, 3, 3, False, 1.0, bias, 0)
    assert ids.tolist() == [[0, 2, 3]]
    # the bias steers groups and experts; the weights stay unbiased
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0], device=device)
    weights, ids = run_grouped(x, 4, 1, 2, False, 1.0, bias, 0)
    assert ids.tolist() == [[6, 7]]
    assert weights.tolist() == [[2.0, 2.5]]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_renormalize_eps(device):
    # scores used as given (scoring_func 0) can sum to zero: w / (0 + 1e-20) stays finite
    x = torch.tensor([[1.0, -1.0, 0.5, -0.5]], device=device)
    bias = torch.tensor([0.0, 3.0, 0.0, 0.0], device=device)
    weights, ids = run_grouped(x, 1, 1, 2, True, 1.0, bias, 0)
    assert ids.tolist() == [[1, 0]]
    eps = torch.tensor(1e-20, dtype=torch.float32)
    assert_weights_close(weights, torch.stack([-1 / eps, 1 / eps])[None])
    assert_weights_close(weights, ref_grouped(x, 1, 1, 2, True, 1.0, bias, 0)[0])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("scoring_func", [0, 1])
def test_grouped_topk_nonfinite_scores(scoring_func, device):
    T, E = 40, 32
    x = make_logits(T, E, seed=9)
    pick = torch.rand(T, E, generator=seeded(10))
    x[pick < 0.1] = NAN
    x[(pick >= 0.1) & (pick < 0.15)] = INF
    x[(pick >= 0.15) & (pick < 0.2)] = -INF
    x[0] = NAN
    x[1, :8] = INF
    x = x.to(device)
    bias = make_bias(E, "sigmoid", device=device)
    for n_group, topk_group, topk in [(4, 2, 6), (8, 8, 32), (1, 1, 4)]:
        args = (n_group, topk_group, topk, True, 1.0, bias, scoring_func)
        weights, ids = run_grouped(x, *args)
        assert_valid_ids(ids, E)
        ref_weights, ref_ids = ref_grouped(x, *args)
        assert torch.equal(ids.cpu(), ref_ids)
        assert_weights_close(weights, ref_weights)
        assert ids[0].tolist() == list(range(topk))  # an all-NaN row: lowest groups and ids
        assert torch.equal(weights[0].cpu(), torch.full((topk,), 1.0 / topk))  # uniform weights
        assert bool(torch.isfinite(weights).all())


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", GATING_OPS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_gating_poisoned_rows_stay_finite_and_distinct(bad, op, dtype, device):
    """vLLM 0.33 treats NaN/+-inf logits as input (degenerate hidden states of padded tokens):
    a probability that is not finite counts as 0, so the weights stay finite and the ids of a row
    distinct, lowest ids first, or the largest biases first with a bias."""
    E, K = 16, 4
    x = make_logits(4, E, dtype, seed=21)
    x[1:] = bad
    x = x.to(device)
    bias = make_bias(E, op, torch.float32, seed=22, device=device)
    by_bias = torch.sort(bias.cpu(), descending=True, stable=True).indices[:K].tolist()
    for b in (None, bias):
        for renormalize in (False, True):
            out = run_gating(op, x, K, renormalize, b, scale=2.0)
            weights, ids, _ = out
            assert bool(torch.isfinite(weights).all())
            assert_valid_ids(ids, E)
            assert_gating_matches_reference(out, ref_gating(op, x, K, renormalize, b, scale=2.0))
            # sigmoid(+inf) = 1 is a finite probability; everything else here counts as 0
            p = 1.0 if (op == "sigmoid" and bad == INF) else 0.0
            if renormalize and p > 0:
                p = 1.0 / K
            want = p * (2.0 if op == "sigmoid" else 1.0)
            for row in (1, 2, 3):
                assert as_int64(ids)[row].tolist() == (list(range(K)) if b is None else by_bias)
                assert weights[row].cpu().tolist() == [want] * K


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_exact_ties_pick_lowest_id_unlike_cpu_torch_topk(op, device):
    """A bf16 row of vLLM's test_fused_topk data (seed 0, 33 tokens, hidden 2048, 16 experts, on
    the CPU): experts 7 and 10 tie. vLLM's kernels and hopper_moe pick the lower id first
    ([9, 7, 10]); torch.topk on the CPU returns [9, 10, 7] for this row (its tie order follows
    its selection algorithm, not the index), which is where vLLM's test, run on the CPU,
    differs."""
    row = [-0.515625, -1.046875, 0.484375, -1.9140625, 0.030517578125, -0.69921875, -0.375,
           0.6953125, 0.30859375, 1.8828125, 0.6953125, -2.03125, -0.181640625,
           0.10693359375, -0.003814697265625, 0.65625]
    x = torch.tensor([row], dtype=torch.bfloat16, device=device)
    for K in (3, 4):
        ids = as_int64(run_gating(op, x, K)[1])
        assert ids.tolist() == [[9, 7, 10, 15][:K]]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("bias_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_topk_every_dtype_pair(dtype, bias_dtype, device):
    """Scores and correction bias each f32, f16 or bf16: the nine pairs vLLM 0.33 takes."""
    T, E = 9, 64
    x = make_logits(T, E, dtype, seed=31)
    x[2, 5] = NAN
    x[3, :3] = INF
    x = x.to(device)
    bias = make_bias(E, "sigmoid", bias_dtype, seed=32, device=device)
    for scoring_func in (0, 1):
        for n_group, topk_group, topk, renormalize, scale in [(8, 4, 8, True, 2.5),
                                                               (1, 1, 6, False, 1.0)]:
            args = (n_group, topk_group, topk, renormalize, scale, bias, scoring_func)
            weights, ids = run_grouped(x, *args)
            ref_weights, ref_ids = ref_grouped(x, *args)
            assert torch.equal(ids.cpu(), ref_ids)
            assert_weights_close(weights, ref_weights)
            assert_valid_ids(ids, E)
            # the bias counts as its fp32 value: the same call with it widened agrees bit for bit
            wide = run_grouped(x, n_group, topk_group, topk, renormalize, scale, bias.float(),
                               scoring_func)
            assert_bitwise_equal(weights, wide[0])
            assert_bitwise_equal(ids, wide[1])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_finite", [0, 15])
@pytest.mark.parametrize("E", [512, 896])
def test_grouped_topk_nonfinite_rank_last_with_weight_zero(E, num_finite, renormalize, device):
    """vLLM 0.33's grouped_topk: an expert whose logit is NaN or +-inf (or whose bias is not
    finite) ranks after every finite one, lower id first, with weight 0; a row without any
    finite pick gets weights 1/topk (renormalize) or 0, without the scaling factor."""
    x = torch.full((1, E), NAN, dtype=torch.bfloat16)
    x[0, :num_finite] = torch.arange(num_finite, dtype=torch.bfloat16)
    x[0, num_finite] = INF
    x[0, num_finite + 1] = -INF
    x = x.to(device)
    bias = torch.zeros(E, device=device)
    weights, ids = run_grouped(x, 1, 1, 16, renormalize, 2.5, bias, 1)
    if num_finite == 0:
        assert ids.tolist() == [list(range(16))]
        assert weights.tolist() == [[1.0 / 16 if renormalize else 0.0] * 16]
    else:
        assert ids.tolist() == [list(range(num_finite - 1, -1, -1)) + [num_finite]]
        s = torch.sigmoid(torch.arange(num_finite - 1, -1, -1, dtype=torch.float32))
        if renormalize:
            s = s / s.sum()
        want = torch.cat([s * 2.5, torch.zeros(1)])[None]
        torch.testing.assert_close(weights.cpu(), want, atol=2e-6, rtol=0)
        assert weights[0, -1].item() == 0.0
    assert_weights_close(weights, ref_grouped(x, 1, 1, 16, renormalize, 2.5, bias, 1)[0])
    # a non-finite bias makes its expert invalid the same way
    x = make_logits(1, 8, seed=33).to(device)
    bias = torch.zeros(8, device=device)
    bias[int(x.argmax())] = INF
    bias[int(x.argmin())] = NAN
    weights, ids = run_grouped(x, 2, 2, 8, renormalize, 1.0, bias, 1)
    assert ids[0, -2:].tolist() == sorted([int(x.argmax()), int(x.argmin())])
    assert weights[0, -2:].tolist() == [0.0, 0.0]
    assert torch.equal(ids.cpu(), ref_grouped(x, 2, 2, 8, renormalize, 1.0, bias, 1)[1])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_sigmoid_is_fp32_not_rounded_to_input_dtype(device):
    """bf16 logits 5.0 and 5.03125 have fp32 sigmoids 0.99331 and 0.99351, which both round to
    the bf16 value 0.9921875. vLLM 0.33's CUDA kernels compute the sigmoid in fp32 and never
    round it to the input dtype, so expert 1 wins; a bf16-rounded sigmoid would tie and pick
    expert 0. The weight is the fp32 sigmoid too."""
    x = torch.tensor([[5.0, 5.03125, -4.0, -4.0]], dtype=torch.bfloat16)
    s = torch.sigmoid(x.float())
    assert s[0, 0] != s[0, 1]
    assert x.sigmoid()[0, 0] == x.sigmoid()[0, 1]  # the rounded sigmoids tie
    bias = torch.zeros(4, device=device)
    for n_group, topk_group in [(1, 1), (2, 1)]:
        weights, ids = run_grouped(x.to(device), n_group, topk_group, 1, False, 1.0, bias, 1)
        assert ids.tolist() == [[1]]
        torch.testing.assert_close(weights.cpu(), s[:, 1:2], rtol=4e-7, atol=0)
        assert weights.item() != x.sigmoid()[0, 1].float().item()


def all_finite_values(dtype):
    """Every finite value of a 16-bit float dtype."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    return x[torch.isfinite(x.float())]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_sigmoid_is_torch_tanh_form(device):
    """The score of scoring_func 1 is 0.5 * torch.tanh(0.5 * x) + 0.5 on the op's device, bit for
    bit: every finite bf16 and fp16 logit and a million fp32 ones, as the weight of a one-expert
    row. (1 / (1 + exp(-x)) differs from it on about 4% of the bf16 values.)"""
    fp32 = torch.randn(1 << 20, generator=seeded(40)) * 8
    fp32[:1000] = torch.linspace(-1e-6, 1e-6, 1000)
    for x in (all_finite_values(torch.bfloat16), all_finite_values(torch.float16), fp32):
        x = x.to(device).view(-1, 1)
        weights, ids = run_grouped(x, 1, 1, 1, False, 1.0, torch.zeros(1, device=device), 1)
        assert_bitwise_equal(weights, device_sigmoid_scores(x))
        assert bool((ids == 0).all())


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_topk_single_group_ids_match_stable_argsort(seed, device):
    """vLLM's single-group case (1536 tokens, 896 experts, top 16, sigmoid, renormalize): ids
    equal a stable descending argsort of the tanh-form score plus bias computed on the same
    device, in order, even where two experts' scores are an ulp apart."""
    logits = torch.randn(1536, 896, generator=seeded(seed)).to(torch.bfloat16).to(device)
    bias = torch.randn(896, generator=seeded(seed + 100)).to(device)
    weights, ids = run_grouped(logits, 1, 1, 16, True, 1.0, bias, 1)
    s = 0.5 * torch.tanh(0.5 * logits.float()) + 0.5
    want = torch.argsort(s + bias, dim=-1, descending=True, stable=True)[:, :16]
    assert torch.equal(ids.long(), want)
    values = s.gather(1, want)
    values = values / (values.sum(dim=-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, values, atol=2e-5, rtol=0)
    # and bit for bit the op on those scores with scoring_func 0
    twin = run_grouped(device_sigmoid_scores(logits), 1, 1, 16, True, 1.0, bias, 0)
    assert_bitwise_equal(weights, twin[0])
    assert_bitwise_equal(ids, twin[1])


# ---------------------------------------------------------------------------------------------
# argument checks (each one hit, on the CPU and on the GPU)


def gating_args(device="cpu", T=4, E=8, K=2):
    return dict(
        topk_weights=torch.empty(T, K, device=device),
        topk_indices=torch.empty(T, K, dtype=torch.int32, device=device),
        token_expert_indices=torch.empty(T, K, dtype=torch.int32, device=device),
        gating_output=torch.randn(T, E, device=device),
        bias=None,
        is_padding=None,
    )


def call_gating(op, a):
    if op == "softmax":
        ops.topk_softmax(a["topk_weights"], a["topk_indices"], a["token_expert_indices"],
                         a["gating_output"], False, a["bias"], a["is_padding"])
    else:
        ops.topk_sigmoid(a["topk_weights"], a["topk_indices"], a["token_expert_indices"],
                         a["gating_output"], False, a["bias"], 1.0, a["is_padding"])


def _outputs(T, K, dev):
    return dict(topk_weights=torch.empty(T, K, device=dev),
                topk_indices=torch.empty(T, K, dtype=torch.int32, device=dev),
                token_expert_indices=torch.empty(T, K, dtype=torch.int32, device=dev))


BAD_GATING = [  # (name, changes(device) -> dict, message regex)
    ("gating_rank", lambda d: dict(gating_output=torch.randn(4, 8, 1, device=d)),
     r"gating_output must be 2-D"),
    ("gating_dtype", lambda d: dict(gating_output=torch.ones(4, 8, dtype=torch.int32, device=d)),
     r"gating_output must have dtype Float, Half or BFloat16"),
    ("gating_stride", lambda d: dict(gating_output=torch.randn(8, 4, device=d).t()),
     r"gating_output must have stride 1 in its last dimension"),
    ("gating_width",
     lambda d: dict(gating_output=torch.empty(1, 2 ** 31, dtype=torch.float16, device=d),
                    **_outputs(1, 1, d)),
     r"gating_output.size\(1\) \(num_experts\) must fit in int32"),
    ("weights_rank", lambda d: dict(topk_weights=torch.empty(8, device=d)),
     r"topk_weights must be 2-D"),
    ("weights_dtype", lambda d: dict(topk_weights=torch.empty(4, 2, dtype=torch.half, device=d)),
     r"topk_weights must have dtype Float"),
    ("weights_rows", lambda d: dict(topk_weights=torch.empty(5, 2, device=d)),
     r"topk_weights.size\(0\) must be 4"),
    ("topk_zero", lambda d: _outputs(4, 0, d),
     r"topk_weights.size\(1\) \(topk\) must be in \[1, num_experts = 8\]"),
    ("topk_above_experts", lambda d: _outputs(4, 9, d),
     r"topk_weights.size\(1\) \(topk\) must be in \[1, num_experts = 8\]"),
    ("weights_contiguous", lambda d: dict(topk_weights=torch.empty(2, 4, device=d).t()),
     r"topk_weights must be contiguous"),
    ("indices_rank", lambda d: dict(topk_indices=torch.empty(8, dtype=torch.int32, device=d)),
     r"topk_indices must be 2-D"),
    ("indices_dtype",
     lambda d: dict(topk_indices=torch.empty(4, 2, dtype=torch.int16, device=d)),
     r"topk_indices must have dtype Int, Long or UInt32"),
    ("indices_shape",
     lambda d: dict(topk_indices=torch.empty(4, 3, dtype=torch.int32, device=d)),
     r"topk_indices must have the same shape as topk_weights"),
    ("indices_contiguous",
     lambda d: dict(topk_indices=torch.empty(2, 4, dtype=torch.int32, device=d).t()),
     r"topk_indices must be contiguous"),
    ("tei_rank",
     lambda d: dict(token_expert_indices=torch.empty(8, dtype=torch.int32, device=d)),
     r"token_expert_indices must be 2-D"),
    ("tei_dtype",
     lambda d: dict(token_expert_indices=torch.empty(4, 2, dtype=torch.int64, device=d)),
     r"token_expert_indices must have dtype Int"),
    ("tei_shape",
     lambda d: dict(token_expert_indices=torch.empty(4, 1, dtype=torch.int32, device=d)),
     r"token_expert_indices must have the same shape as topk_weights"),
    ("tei_contiguous",
     lambda d: dict(token_expert_indices=torch.empty(2, 4, dtype=torch.int32, device=d).t()),
     r"token_expert_indices must be contiguous"),
    ("tei_overflow",  # 2^28 * 8 slots; the tensors are never touched (lazily allocated)
     lambda d: dict(gating_output=torch.empty(1, 16, device=d).expand(2 ** 28, 16),
                    **_outputs(2 ** 28, 8, d)),
     r"token_expert_indices holds k \* num_tokens \+ t in int32"),
    ("bias_rank", lambda d: dict(bias=torch.randn(1, 8, device=d)), r"bias must be 1-D"),
    ("bias_dtype", lambda d: dict(bias=torch.ones(8, dtype=torch.int32, device=d)),
     r"bias must have dtype Float or gating_output's dtype Float"),
    ("bias_half_for_float_logits", lambda d: dict(bias=torch.ones(8, dtype=torch.half, device=d)),
     r"bias must have dtype Float or gating_output's dtype Float \(got Half\)"),
    ("bias_size", lambda d: dict(bias=torch.randn(7, device=d)), r"bias.size\(0\) must be 8"),
    ("bias_contiguous", lambda d: dict(bias=torch.randn(16, device=d)[::2]),
     r"bias must be contiguous"),
    ("padding_rank", lambda d: dict(is_padding=torch.zeros(4, 1, dtype=torch.bool, device=d)),
     r"is_padding must be 1-D"),
    ("padding_dtype", lambda d: dict(is_padding=torch.zeros(4, dtype=torch.uint8, device=d)),
     r"is_padding must have dtype Bool"),
    ("padding_size", lambda d: dict(is_padding=torch.zeros(5, dtype=torch.bool, device=d)),
     r"is_padding.size\(0\) must be 4"),
    ("padding_contiguous",
     lambda d: dict(is_padding=torch.zeros(8, dtype=torch.bool, device=d)[::2]),
     r"is_padding must be contiguous"),
]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("name,change,message", BAD_GATING, ids=[b[0] for b in BAD_GATING])
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_rejects_bad_input(op, name, change, message, device):
    a = gating_args(device)
    a.update(change(device))
    with pytest.raises(RuntimeError, match=f"hopper_moe::topk_{op}: {message}"):
        call_gating(op, a)


@gpu
@pytest.mark.parametrize("arg", ["topk_weights", "topk_indices", "token_expert_indices", "bias",
                                 "is_padding"])
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_rejects_mixed_devices(op, arg):
    a = gating_args("cuda")
    a["bias"] = torch.zeros(8, device="cuda")
    a["is_padding"] = torch.zeros(4, dtype=torch.bool, device="cuda")
    a[arg] = a[arg].cpu()
    with pytest.raises(RuntimeError, match=f"{arg} must be on the same device as gating_output"):
        call_gating(op, a)
    a = gating_args("cuda")
    a["gating_output"] = a["gating_output"].cpu()  # everything else on the GPU
    with pytest.raises(RuntimeError, match="topk_weights must be on the same device"):
        call_gating(op, a)


def grouped_args(device="cpu", T=4, E=8):
    return dict(scores=torch.randn(T, E, device=device), n_group=4, topk_group=2, topk=3,
                bias=torch.zeros(E, device=device), scoring_func=1)


def call_grouped(a):
    return ops.grouped_topk(a["scores"], a["n_group"], a["topk_group"], a["topk"], True, 1.0,
                            a["bias"], a["scoring_func"])


BAD_GROUPED = [
    ("scores_rank", lambda d: dict(scores=torch.randn(4, 8, 1, device=d)), r"scores must be 2-D"),
    ("scores_dtype", lambda d: dict(scores=torch.ones(4, 8, dtype=torch.int64, device=d)),
     r"scores must have dtype Float, Half or BFloat16"),
    ("scores_stride", lambda d: dict(scores=torch.randn(8, 4, device=d).t()),
     r"scores must have stride 1 in its last dimension"),
    ("scores_width",
     lambda d: dict(scores=torch.empty(1, 2 ** 31, dtype=torch.float16, device=d)),
     r"scores.size\(1\) \(num_experts\) must fit in int32"),
    ("bias_rank", lambda d: dict(bias=torch.zeros(1, 8, device=d)), r"bias must be 1-D"),
    ("bias_dtype", lambda d: dict(bias=torch.zeros(8, dtype=torch.int32, device=d)),
     r"bias must have dtype Float, Half or BFloat16 \(got Int\)"),
    ("bias_size", lambda d: dict(bias=torch.zeros(16, device=d)), r"bias.size\(0\) must be 8"),
    ("bias_contiguous", lambda d: dict(bias=torch.zeros(16, device=d)[::2]),
     r"bias must be contiguous"),
    ("n_group_zero", lambda d: dict(n_group=0), r"n_group must be >= 1 and divide num_experts"),
    ("n_group_not_divisor", lambda d: dict(n_group=3),
     r"n_group must be >= 1 and divide num_experts = 8, got n_group = 3"),
    ("topk_group_zero", lambda d: dict(topk_group=0), r"topk_group must be in \[1, n_group = 4\]"),
    ("topk_group_above_groups", lambda d: dict(topk_group=5),
     r"topk_group must be in \[1, n_group = 4\]"),
    ("topk_zero", lambda d: dict(topk=0),
     r"topk must be in \[1, topk_group \* num_experts / n_group = 4\]"),
    ("topk_above_kept_experts", lambda d: dict(topk=5),
     r"topk must be in \[1, topk_group \* num_experts / n_group = 4\], got 5"),
    ("scoring_func_2", lambda d: dict(scoring_func=2),
     r"scoring_func must be 0 \(none\) or 1 \(sigmoid\)"),
    ("scoring_func_negative", lambda d: dict(scoring_func=-1),
     r"scoring_func must be 0 \(none\) or 1 \(sigmoid\)"),
]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("name,change,message", BAD_GROUPED, ids=[b[0] for b in BAD_GROUPED])
def test_grouped_topk_rejects_bad_input(name, change, message, device):
    a = grouped_args(device)
    a.update(change(device))
    with pytest.raises(RuntimeError, match=f"hopper_moe::grouped_topk: {message}"):
        call_grouped(a)


@gpu
def test_grouped_topk_rejects_mixed_devices():
    a = grouped_args("cuda")
    a["bias"] = a["bias"].cpu()
    with pytest.raises(RuntimeError, match="bias must be on the same device as scores"):
        call_grouped(a)


# ---------------------------------------------------------------------------------------------
# opcheck (schema, fake tensor, autograd registration, AOT dispatch)


def gating_opcheck_samples(op, device):
    samples = []
    x = make_logits(1, 8, device=device)  # tiny T
    samples.append((*poisoned_outputs(1, 2, device), x, False, None, None))
    wide = make_logits(6, 40, torch.bfloat16, device=device)  # strided rows, bias, padding
    pad = torch.tensor([0, 1, 0, 0, 0, 1], dtype=torch.bool, device=device)
    samples.append((*poisoned_outputs(6, 5, device, torch.int64), wide[:, 3:35], True,
                    make_bias(32, op, device=device), pad))
    x = make_logits(5, 60, torch.float16, device=device)  # K = E, bias in the gating dtype
    samples.append((*poisoned_outputs(5, 60, device), x, True,
                    make_bias(60, op, torch.float16, device=device), None))
    if op == "sigmoid":
        samples = [s[:6] + (2.5,) + s[6:] for s in samples]
    return samples


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_opcheck(op, device):
    fn = ops.topk_softmax.default if op == "softmax" else ops.topk_sigmoid.default
    for args in gating_opcheck_samples(op, device):
        torch.library.opcheck(fn, args)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_grouped_topk_opcheck(device):
    samples = [
        (make_logits(1, 8, device=device), 2, 1, 2, True, 1.0,
         torch.zeros(8, device=device), 1),
        (make_logits(5, 70, torch.bfloat16, device=device)[:, 2:66], 8, 4, 8, True, 2.5,
         make_bias(64, "sigmoid", device=device), 1),
        (make_logits(3, 24, torch.float16, device=device), 3, 2, 5, False, 1.0,
         make_bias(24, "sigmoid", torch.float16, device=device), 0),
    ]
    for args in samples:
        torch.library.opcheck(ops.grouped_topk.default, args)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA op vs the CPU op, bit for bit

GPU_GATING_SHAPES = [  # (T, E, K)
    (1, 1, 1), (2, 2, 2), (5, 3, 1), (7, 8, 2), (67, 31, 4), (33, 32, 32), (19, 33, 5),
    (64, 60, 7), (128, 64, 8), (40, 100, 3), (64, 128, 6), (300, 256, 8), (16, 257, 9),
    (8, 384, 8), (8, 512, 16), (4, 1000, 40), (9, 1024, 8), (3, 1025, 7), (2, 1500, 1500),
    (2, 3000, 16),
]


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("T,E,K", GPU_GATING_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_gpu_matches_cpu(op, dtype, T, E, K, layout):
    full = make_logits(T, E + 3, dtype, seed=E * 7 + K)
    # "strided": row stride E + 3 and a start 2 elements in (scalar loads); "contiguous": 16-byte
    # loads wherever E allows. Sliced on each device (.cuda() of a slice would be contiguous).
    x, xc = ((f[:, 2:E + 2] if layout == "strided" else f[:, :E].contiguous())
             for f in (full, full.cuda()))
    assert xc.is_contiguous() == (layout == "contiguous" or T == 1)
    pad = torch.rand(T, generator=seeded(T)) < 0.2
    index_dtypes = [torch.int32, torch.int64, torch.uint32, torch.int32]
    for n, (renormalize, bias, scale) in enumerate(gating_variants(op, E, dtype)):
        is_padding = pad if n == 3 else None
        args = (K, renormalize, bias, is_padding, scale, index_dtypes[n])
        cpu = run_gating(op, x, *args)
        cuda = run_gating(op, xc, K, renormalize, None if bias is None else bias.cuda(),
                          None if is_padding is None else is_padding.cuda(), scale,
                          index_dtypes[n])
        for a, b in zip(cuda, cpu):
            assert_bitwise_equal(a, b)
        assert_gating_matches_reference(cuda, ref_gating(op, x, K, renormalize, bias,
                                                         is_padding, scale))


@gpu
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_gpu_many_tokens(op):
    # T * K > 65535 and more rows than resident warps (grid-stride over rows)
    x = make_logits(70000, 64, torch.bfloat16, seed=11)
    bias = make_bias(64, op)
    cpu = run_gating(op, x, 8, True, bias, scale=1.5)
    cuda = run_gating(op, x.cuda(), 8, True, bias.cuda(), scale=1.5)
    for a, b in zip(cuda, cpu):
        assert_bitwise_equal(a, b)


@gpu
@pytest.mark.parametrize("E", [20, 256, 1300])
@pytest.mark.parametrize("op", GATING_OPS)
def test_gating_gpu_ties_and_nonfinite(op, E):
    T = 200
    # few distinct values: exact ties everywhere
    ties = torch.randint(-3, 3, (T, E), generator=seeded(E)).to(torch.bfloat16)
    noisy = make_logits(T, E, seed=E + 1)
    pick = torch.rand(T, E, generator=seeded(E + 2))
    noisy[pick < 0.03] = NAN
    noisy[(pick >= 0.03) & (pick < 0.05)] = INF
    noisy[(pick >= 0.05) & (pick < 0.08)] = -INF
    poisoned = make_logits(T, E, seed=E + 3)  # whole rows of NaN, +inf, -inf between normal ones
    poisoned[::4] = NAN
    poisoned[1::4] = INF
    poisoned[2::4] = -INF
    for x in (ties, noisy, poisoned):
        for K in (1, 8, E):
            bias = make_bias(E, op, dtype=x.dtype) if K == 8 else None
            cpu = run_gating(op, x, K, True, bias, scale=2.0)
            cuda = run_gating(op, x.cuda(), K, True, None if bias is None else bias.cuda(),
                              scale=2.0)
            for a, b in zip(cuda, cpu):
                assert_bitwise_equal(a, b)
            assert_valid_ids(cuda[1], E)


GPU_GROUPED_CASES = [  # (T, E, n_group, topk_group, topk)
    (1, 1, 1, 1, 1), (300, 256, 8, 4, 8), (64, 128, 32, 4, 8), (33, 96, 48, 8, 8),
    (17, 64, 64, 64, 64), (29, 60, 5, 2, 5), (31, 30, 3, 1, 10), (8, 160, 1, 1, 20),
    (9, 1024, 16, 5, 12), (3, 1025, 5, 2, 10), (2, 2048, 8, 4, 8), (2, 1200, 2, 2, 1200),
]


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("T,E,n_group,topk_group,topk", GPU_GROUPED_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_topk_gpu_matches_cpu(dtype, T, E, n_group, topk_group, topk, layout):
    full = make_logits(T, E + 5, dtype, seed=E + n_group).cuda()
    x = full[:, 1:E + 1] if layout == "strided" else full[:, :E].contiguous()
    assert x.is_contiguous() == (layout == "contiguous" or T == 1)
    for scoring_func in (0, 1):
        for renormalize, bias_dtype, scale in [(True, torch.float32, 2.5), (False, dtype, 1.0)]:
            bias = make_bias(E, "sigmoid", bias_dtype, seed=E)
            args = (n_group, topk_group, topk, renormalize, scale)
            cpu = cpu_twin_grouped(x, *args, bias, scoring_func)
            cuda = run_grouped(x, *args, bias.cuda(), scoring_func)
            assert cuda[0].device.type == cuda[1].device.type == "cuda"
            assert_bitwise_equal(cuda[0], cpu[0])
            assert_bitwise_equal(cuda[1], cpu[1])
            ref_weights, ref_ids = ref_grouped(x, *args, bias, scoring_func)
            assert torch.equal(cuda[1].cpu(), ref_ids)
            assert_weights_close(cuda[0], ref_weights)


@gpu
def test_grouped_topk_gpu_many_tokens_and_nonfinite():
    x = make_logits(70000, 256, torch.bfloat16, seed=12)
    x[::97, 5] = NAN
    x[::89, 100:140] = INF
    x[::83] = -INF
    bias = make_bias(256, "sigmoid")
    for scoring_func in (0, 1):
        cpu = cpu_twin_grouped(x.cuda(), 8, 4, 8, True, 2.5, bias, scoring_func)
        cuda = run_grouped(x.cuda(), 8, 4, 8, True, 2.5, bias.cuda(), scoring_func)
        assert_bitwise_equal(cuda[0], cpu[0])
        assert_bitwise_equal(cuda[1], cpu[1])
        assert_valid_ids(cuda[1], 256)


@gpu
@pytest.mark.parametrize("bias_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_topk_gpu_dtype_pairs_and_nonfinite_match_cpu(dtype, bias_dtype):
    """Every scores x bias dtype pair, with NaN/+-inf logits and biases and a row without a
    finite score, through the shared-memory (E <= 1024) and global-workspace kernels."""
    for T, E, n_group, topk_group, topk in [(300, 256, 8, 4, 8), (17, 896, 1, 1, 16),
                                            (5, 1500, 5, 2, 10)]:
        x = make_logits(T, E, dtype, seed=E)
        pick = torch.rand(T, E, generator=seeded(E + 1))
        x[pick < 0.05] = NAN
        x[(pick >= 0.05) & (pick < 0.07)] = INF
        x[(pick >= 0.07) & (pick < 0.09)] = -INF
        x[0] = NAN
        bias = make_bias(E, "sigmoid", bias_dtype, seed=E + 2)
        bias[3] = INF
        bias[4] = NAN
        for scoring_func in (0, 1):
            for renormalize, scale in [(True, 2.5), (False, 1.0)]:
                args = (n_group, topk_group, topk, renormalize, scale)
                cpu = cpu_twin_grouped(x.cuda(), *args, bias, scoring_func)
                cuda = run_grouped(x.cuda(), *args, bias.cuda(), scoring_func)
                assert_bitwise_equal(cuda[0], cpu[0])
                assert_bitwise_equal(cuda[1], cpu[1])
                assert_valid_ids(cuda[1], E)
                assert bool(torch.isfinite(cuda[0]).all())
                assert torch.equal(cuda[1][0].cpu(), torch.arange(topk, dtype=torch.int32))


@gpu
def test_routing_gpu_deterministic():
    x = make_logits(5000, 256, torch.bfloat16, seed=13).cuda()
    bias = make_bias(256, "sigmoid").cuda()
    for op in GATING_OPS:
        first = run_gating(op, x, 8, True, bias, scale=2.5)
        for _ in range(20):
            for a, b in zip(run_gating(op, x, 8, True, bias, scale=2.5), first):
                assert torch.equal(a, b)
    first = run_grouped(x, 8, 4, 8, True, 2.5, bias, 1)
    for _ in range(20):
        for a, b in zip(run_grouped(x, 8, 4, 8, True, 2.5, bias, 1), first):
            assert torch.equal(a, b)


@gpu
def test_routing_cuda_graph_replay():
    T, E, K = 300, 256, 8
    x = make_logits(T, E, torch.bfloat16, seed=14).cuda()
    bias = make_bias(E, "sigmoid").cuda()
    pad = torch.zeros(T, dtype=torch.bool, device="cuda")
    soft = poisoned_outputs(T, K, "cuda")
    sig = poisoned_outputs(T, K, "cuda", torch.int64)

    def step():
        ops.topk_softmax(*soft, x, True, None, pad)
        ops.topk_sigmoid(*sig, x, True, bias, 2.5, pad)
        return ops.grouped_topk(x, 8, 4, K, True, 2.5, bias, 1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped = step()
    for seed in range(5):
        x.copy_(make_logits(T, E, torch.bfloat16, seed=100 + seed))
        pad.copy_(torch.rand(T, generator=seeded(seed)) < 0.1)
        for t in (*soft, *sig, *grouped):
            poison(t)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(soft, run_gating("softmax", x, K, True, None, pad)):
            assert torch.equal(a, b)
        for a, b in zip(sig, run_gating("sigmoid", x, K, True, bias, pad, 2.5, torch.int64)):
            assert torch.equal(a, b)
        for a, b in zip(grouped, run_grouped(x, 8, 4, K, True, 2.5, bias, 1)):
            assert torch.equal(a, b)
