"""hopper_moe.tune on the CPU: the pruned search space, the tuned file (name, keys, round trip
through configs.get_config, --resume), --dry-run, the no-GPU exit, the output check, and one
candidate evaluation of a tiny layer (compiled on a GPU, in Triton's interpreter without one)."""
from __future__ import annotations

import json
import math
import re
import sys
import time

import pytest
import torch

from hopper_moe import tune
from hopper_moe import settings
from hopper_moe.kernels import moe_gemm_configs as configs

SHAPES = [(8, 2), (128, 8)]  # (num_experts, top_k)
MS = [1, 2, 8, 48, 64, 4096]
CFG_A = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, SWAP_AB=True,
             ONE_SLOT_PER_BLOCK=True, num_warps=4, num_stages=5, FP8_FAST_ACC=False)
CFG_B = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, SWAP_AB=True,
             ONE_SLOT_PER_BLOCK=False, num_warps=8, num_stages=2, FP8_FAST_ACC=False)
CFG_C = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=16, SWAP_AB=False,
             ONE_SLOT_PER_BLOCK=False, num_warps=8, num_stages=3, FP8_FAST_ACC=False)


# The tiny-layer tests run the kernels compiled on a GPU, in Triton's interpreter without one
# (conftest.py sets TRITON_INTERPRET=1 there; a kernel is compiled or interpreted from import on,
# so CPU tensors cannot take the interpreter on a machine with a GPU).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def time_once(fn):
    """A timer for the tiny-layer tests: one call, its wall time."""
    t0 = time.perf_counter()
    out = fn()
    us = (time.perf_counter() - t0) * 1e6
    return tune.bench_common().Timing(us, us, us, 1, "wall"), out


@pytest.fixture
def fresh_config_cache():
    configs._load.cache_clear()
    configs._NEAREST.clear()
    yield
    configs._load.cache_clear()
    configs._NEAREST.clear()


# ------------------------------------------------------------------------ search space
@pytest.mark.parametrize("scheme", tune.SCHEMES)
def test_every_config_obeys_the_rules(scheme):
    nbytes = 2 if scheme == "bf16" else 1
    for num_experts, top_k in SHAPES:
        for m in MS:
            space = tune.search_space(m, scheme, top_k, num_experts)
            assert space, (m, num_experts)
            for c in space:
                smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * nbytes
                assert smem <= 227 * 1024, c
                assert c["BLOCK_M"] <= 64 or not c["SWAP_AB"], c
                if scheme == "fp8_block":
                    assert c["BLOCK_K"] == 128 and c["BLOCK_N"] <= 128, c
                assert c["BLOCK_M"] <= max(16, 2 ** math.ceil(math.log2(m))), c
                if c["ONE_SLOT_PER_BLOCK"]:
                    assert c["BLOCK_M"] == 16 and c["GROUP_M"] == 1, c
                    assert m * top_k <= num_experts, c
                assert c["BLOCK_N"] in tune.BLOCK_NS and c["num_stages"] in tune.NUM_STAGES
            assert len({json.dumps(c, sort_keys=True) for c in space}) == len(space)


def test_pruning_removes_what_it_should_and_keeps_the_rest():
    everything = tune.all_configs()
    assert len(everything) == (4 * 4 * 3 * 3 * 2 * 2 * 4 + 4 * 3 * 2 * 2 * 4) * 2
    big = dict(CFG_C, BLOCK_N=256, BLOCK_K=128, num_stages=3)  # 3*(128+256)*128 elements
    assert tune.why_pruned(big, "bf16") == "shared memory"  # 288 KB
    assert tune.why_pruned(big, "fp8_tensor") is None       # 144 KB
    assert tune.why_pruned(dict(CFG_C, SWAP_AB=True), "bf16") == "swap-AB needs BLOCK_M <= 64"
    # Fast accumulation exists only where the kernel has it (per-tensor / per-channel FP8).
    for scheme in tune.SCHEMES:
        why = tune.why_pruned(dict(CFG_C, FP8_FAST_ACC=True), scheme)
        assert (why is None) == (scheme in ("fp8_tensor", "fp8_channel")), (scheme, why)
    assert tune.why_pruned(dict(CFG_B, BLOCK_K=128), "fp8_block") is None
    assert tune.why_pruned(CFG_B, "fp8_block") is not None            # BLOCK_K 256
    assert tune.why_pruned(dict(CFG_B, BLOCK_K=128, BLOCK_N=256), "fp8_block") is not None
    assert tune.why_pruned(CFG_B, "bf16", m=8, top_k=2, num_experts=8) == "BLOCK_M above M"
    assert tune.why_pruned(CFG_B, "bf16", m=32, top_k=2, num_experts=8) is not None  # GROUP_M 8
    assert tune.why_pruned(dict(CFG_B, GROUP_M=1), "bf16", m=32, top_k=2, num_experts=8) is None
    assert tune.why_pruned(CFG_A, "bf16", m=4, top_k=2, num_experts=8) is None
    assert tune.why_pruned(CFG_A, "bf16", m=5, top_k=2, num_experts=8) is not None
    # mixtral-like routing (2 of 8 experts): at M = 128 the fullest expert expects ~46 rows.
    # A 16-row swap-AB block would stream it 3 times; 32 rows twice at most.
    assert tune.why_pruned(dict(CFG_B, BLOCK_M=16, GROUP_M=1), "bf16", m=128, top_k=2,
                           num_experts=8) == "swap-AB block under half the fullest expert"
    assert tune.why_pruned(dict(CFG_B, GROUP_M=1), "bf16", m=128, top_k=2, num_experts=8) is None
    assert tune.why_pruned(dict(CFG_C, GROUP_M=1), "bf16", m=128, top_k=2,
                           num_experts=8) is None
    # qwen3-like routing (8 of 128): at M = 64 the fullest expert expects ~9 rows, so a
    # 128-row block is mostly padding; 32 rows are kept.
    assert tune.why_pruned(dict(CFG_C, GROUP_M=1), "bf16", m=128, top_k=8, num_experts=128) \
        == "BLOCK_M above twice the fullest expert"
    assert tune.why_pruned(dict(CFG_B, GROUP_M=1), "bf16", m=64, top_k=8, num_experts=128) is None
    # Large M keeps the standard mapping with big tiles; small M keeps swap-AB tiles.
    large = tune.search_space(4096, "bf16", 2, 8)
    assert any(c["BLOCK_M"] == 128 and c["GROUP_M"] == 16 and not c["SWAP_AB"] for c in large)
    small = tune.search_space(1, "fp8_tensor", 8, 128)
    assert {c["BLOCK_M"] for c in small} == {16}
    assert any(c["ONE_SLOT_PER_BLOCK"] for c in small) and any(c["SWAP_AB"] for c in small)
    assert len(small) < len(tune.search_space(64, "fp8_tensor", 8, 128)) < len(everything)


@pytest.mark.parametrize("scheme", tune.SCHEMES)
def test_quick_space_is_a_pruned_subset_with_both_mappings(scheme):
    full = tune.all_configs()
    quick = tune.quick_configs()
    assert quick and all(c in full for c in quick)
    assert len({tuple(sorted(c.items())) for c in quick}) == len(quick)  # no duplicates
    for m in (1, 16, 64, 256, 4096):
        space = tune.search_space(m, scheme, 8, 128, "quick")
        assert space and all(c in tune.search_space(m, scheme, 8, 128) for c in space)
        if m <= 256:  # 26 rows in the fullest expert at most
            assert any(c["SWAP_AB"] for c in space)
        if m >= 4096:  # ~300 rows in the fullest expert
            assert any(not c["SWAP_AB"] and c["BLOCK_M"] == 128 for c in space)
    assert len(tune.search_space(4096, scheme, 2, 8, "quick")) <= 60


@pytest.mark.parametrize("scheme", tune.SCHEMES)
def test_the_default_config_fits_the_same_budget(scheme):
    for m in configs.M_BUCKETS:
        cfg = tune.baseline_config(m, 8, 128, scheme)
        assert set(cfg) == set(tune.CONFIG_KEYS)
        assert tune.why_pruned(cfg, scheme) is None, (m, cfg)


# -------------------------------------------------------------------------- the file
def test_file_name_is_the_one_get_config_reads(tmp_path):
    path = tune.output_path(tmp_path, 256, 256, "fp8_block", device_name="NVIDIA H200")
    assert path.name == ("E=256,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,"
                         "block_shape=[128,128].json")
    assert path.name == configs.config_file_name(256, 256, "fp8_block", "NVIDIA H200")
    assert tune.output_path(tmp_path, 8, 14336, "bf16", "NVIDIA H200").name == \
        "E=8,N=14336,device_name=NVIDIA_H200.json"
    assert tune.output_path(tmp_path, 8, 14336, "fp8_channel", "NVIDIA H200").name == \
        "E=8,N=14336,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"


def test_entries_are_written_sorted_and_complete(tmp_path):
    path = tune.output_path(tmp_path / "sub", 8, 14336, "bf16", "NVIDIA H200")
    tune.save_entry(path, 256, dict(CFG_C, extra=1))
    tune.save_entry(path, 1, CFG_A)
    tune.save_entry(path, 16, CFG_C)
    tune.save_entry(path, 16, CFG_B)  # replaces
    with open(path) as f:
        raw = json.load(f)
    assert list(raw) == ["1", "16", "256"]
    assert raw["1"] == CFG_A and raw["16"] == CFG_B and raw["256"] == CFG_C
    assert all(list(v) == list(tune.CONFIG_KEYS) for v in raw.values())
    assert tune.load_table(path) == {1: CFG_A, 16: CFG_B, 256: CFG_C}
    assert not list(path.parent.glob("*.tmp"))


def test_round_trip_through_get_config(tmp_path, monkeypatch, fresh_config_cache):
    E, topk, inter = 8, 2, 14336
    path = tune.output_path(tmp_path, E, inter, "fp8_channel", device_name="Test GPU")
    for m, cfg in ((1, CFG_A), (16, CFG_B), (256, CFG_C)):
        tune.save_entry(path, m, cfg)
    monkeypatch.setattr(settings, "CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_has_cuda", lambda: True)
    monkeypatch.setattr(configs, "_device_name", lambda: "Test GPU")
    for tokens, want in ((1, CFG_A), (3, CFG_A), (10, CFG_B), (16, CFG_B), (100, CFG_B),
                         (200, CFG_C), (9000, CFG_C)):
        assert configs.get_config(tokens, topk, E, inter, "fp8_channel") == want, tokens
    # The dtype is part of the name: bf16 finds no file (none is shipped for this device
    # either) and keeps the default.
    assert configs.get_config(10, topk, E, inter, "bf16") == \
        configs.default_config(10, topk, E, "bf16")


def test_resume_skips_the_m_values_in_the_file(tmp_path, capsys):
    path = tune.output_path(tmp_path, 8, 512, "bf16")
    assert tune.pending_ms([1, 2, 16], path, resume=True) == [1, 2, 16]  # no file yet
    tune.save_entry(path, 1, CFG_A)
    tune.save_entry(path, 16, CFG_B)
    assert tune.pending_ms([1, 2, 16, 64], path, resume=True) == [2, 64]
    assert tune.pending_ms([1, 2, 16, 64], path, resume=False) == [1, 2, 16, 64]
    assert tune.main(["--shape", "tiny", "--m", "1,2,16,64", "--out", str(tmp_path),
                      "--resume", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "M = 1, 16 already in the file, skipped" in out
    assert "M=2:" in out and "M=64:" in out and "M=1:" not in out and "M=16:" not in out


# --------------------------------------------------------------------------------- CLI
def test_dry_run_lists_the_space_per_m(tmp_path, capsys):
    assert tune.main(["--shape", "qwen3_30b", "--dtype", "fp8_block", "--m", "1,64,4096",
                      "--out", str(tmp_path), "--device-name", "NVIDIA H200", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "E=128,N=768,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json" in out
    for m in (1, 64, 4096):
        kept = len(tune.search_space(m, "fp8_block", 8, 128))
        assert f"M={m}: {kept} configs" in out
    total = sum(len(tune.search_space(m, "fp8_block", 8, 128)) + 1 for m in (1, 64, 4096))
    assert f"total: {total} timed runs for 3 M values" in out
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_custom_shape_and_bad_arguments(capsys):
    assert tune.main(["--E", "4", "--H", "128", "--I", "64", "--topk", "2", "--m", "5",
                      "--dry-run"]) == 0
    assert "E=4 topk=2 H=128 I=64" in capsys.readouterr().out
    for argv, msg in ((["--E", "4", "--dry-run"], "all of --E --H --I --topk"),
                      (["--shape", "mixtral", "--E", "4", "--dry-run"], "not both"),
                      (["--shape", "nope", "--dry-run"], "unknown shape"),
                      (["--shape", "gpt_oss_120b", "--dtype", "fp8_block", "--dry-run"],
                       "not multiples of 128")):
        with pytest.raises(SystemExit, match=msg):
            tune.main(argv)


def test_without_a_gpu_it_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: False)
    assert tune.main(["--shape", "tiny", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_plain_progress_line_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails
    bar = tune.Progress(3, "M=4")
    for us in (5.0, 3.0, 4.0):
        bar.update(us)
    bar.close()
    assert "M=4: 3/3 configs, best 3.0 us" in capsys.readouterr().err


# --------------------------------------------------------------------- output check
def test_judge_rejects_wrong_outputs():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1024, 64, generator=g)
    good = ref + 1e-4 * torch.randn(1024, 64, generator=g)
    err, why = tune.judge(good, ref, "bf16")
    assert why is None and err < 1e-3
    assert tune.judge(good, ref, "bf16", base_err=err)[1] is None
    one_row = good.clone()
    one_row[17] = 0.0  # one token of 1024 lost: 3% of the norm, under the fp8 norm limit
    err, why = tune.judge(one_row, ref, "fp8_tensor")
    assert err < tune.ERR_MAX["fp8_tensor"] and "row 17" in why
    noisy = ref + 3e-3 * torch.randn(1024, 64, generator=g)
    assert tune.judge(noisy, ref, "bf16")[1] is None                       # under ERR_MAX
    assert "rel err" in tune.judge(noisy, ref, "bf16", base_err=1e-4)[1]   # worse than base
    nan = good.clone()
    nan[3, 5] = float("nan")
    assert tune.judge(nan, ref, "bf16")[1] == "non-finite output"


@pytest.mark.parametrize("scheme", ["bf16", "fp8_channel"])
def test_candidates_of_a_tiny_layer(scheme):
    C = tune.bench_common()
    shape = C.MoEShape("t", 4, 2, 128, 64)
    w1, w2, quant = tune.make_weights(shape, scheme, DEVICE, seed=0)
    layer = tune.make_layer(shape, w1, w2, quant, 5, DEVICE, seed=0)
    ref = layer.reference()
    timer = time_once
    base = tune.evaluate(layer, tune.baseline_config(5, 2, 4, scheme), ref, scheme, timer)
    assert base.rejected is None and base.err < tune.ERR_MAX[scheme] and base.us > 0
    other = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SWAP_AB=False,
                 ONE_SLOT_PER_BLOCK=False, num_warps=4, num_stages=2, FP8_FAST_ACC=False)
    assert other != base.config and other in tune.search_space(5, scheme, 2, 4)
    res = tune.evaluate(layer, other, ref, scheme, timer, base.err)
    assert res.rejected is None and res.err < tune.ERR_MAX[scheme]
    broken = tune.evaluate(layer, dict(other, BLOCK_K=48), ref, scheme, timer, base.err)
    assert broken.rejected.startswith("failed") and math.isnan(broken.us)


def test_compile_plan_holds_each_config_once_at_its_smallest_m():
    C = tune.bench_common()
    shape = C.MoEShape("t", 8, 2, 128, 64)
    ms = [64, 1, 4096, 16]
    plan = tune.compile_plan(shape, "bf16", ms, "quick")
    keys = [json.dumps(cfg, sort_keys=True) for _, cfg in plan]
    assert len(keys) == len(set(keys))
    want = {}
    for m in sorted(ms):
        for cfg in [tune.baseline_config(m, 2, 8, "bf16")] + \
                tune.search_space(m, "bf16", 2, 8, "quick"):
            want.setdefault(json.dumps(cfg, sort_keys=True), m)
    assert {k: m for k, (m, _) in zip(keys, plan)} == want


def test_precompile_runs_every_config_in_worker_processes(monkeypatch):
    """Two worker processes run the planned configs (one of them broken on purpose: its
    failure comes back from the worker with the config and the reason)."""
    C = tune.bench_common()
    shape = C.MoEShape("t", 4, 2, 128, 64)
    good = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SWAP_AB=False,
                ONE_SLOT_PER_BLOCK=False, num_warps=4, num_stages=2, FP8_FAST_ACC=False)
    broken = dict(good, BLOCK_K=48)
    monkeypatch.setattr(tune, "search_space", lambda *a, **k: [good, broken])
    n, failed = tune.precompile(shape, "bf16", [5], "full", jobs=2, device=DEVICE)
    assert n == 3  # the default, good and broken
    assert len(failed) == 1 and "'BLOCK_K': 48" in failed[0] and failed[0].startswith("M=5 ")


def test_tune_loop_writes_each_m(tmp_path, monkeypatch, capsys):
    """The whole loop on a tiny layer, with two candidates per M besides the default."""
    C = tune.bench_common()
    shape = C.MoEShape("t", 4, 2, 128, 64)
    real_space = tune.search_space

    def two(m, scheme, top_k, num_experts, space_name="full"):
        space = real_space(m, scheme, top_k, num_experts, space_name)
        return [next(c for c in space if c["SWAP_AB"]), next(c for c in space if not c["SWAP_AB"])]

    monkeypatch.setattr(tune, "search_space", two)
    path = tune.output_path(tmp_path, 4, 64, "bf16")
    timer = time_once
    rows = tune.tune_shape(shape, "bf16", [1, 5], path, DEVICE, timer)
    table = tune.load_table(path)
    assert sorted(table) == [1, 5] and [r[0] for r in rows] == [1, 5]
    for m in (1, 5):
        tried = two(m, "bf16", 2, 4) + [tune.baseline_config(m, 2, 4, "bf16")]
        assert table[m] in tried
    assert all(r[5] == 0 for r in rows)  # nothing rejected
    assert "M=5:" in capsys.readouterr().out


# ------------------------------------------------------------------- the shipped tables
# The tuned tile tables (the oracle's measured tables share the folder: tests/test_oracle.py).
SHIPPED = sorted(p for p in configs._SHIPPED.glob("*.json") if not p.name.startswith("oracle,"))
_NAME = re.compile(r"E=(\d+),N=(\d+),device_name=([^,]+?)(,dtype=fp8_w8a8)?"
                   r"(,block_shape=\[128,128\])?\.json")


def test_shipped_tables_exist_for_the_benchmark_shapes():
    names = {p.name for p in SHIPPED}
    for E, inter in ((8, 14336), (128, 768)):  # mixtral, qwen3_30b: bf16 and FP8
        for scheme in ("bf16", "fp8_tensor"):
            assert configs.config_file_name(E, inter, scheme, "NVIDIA H200") in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_table_is_complete_and_valid(path):
    """Every M bucket has an entry (nearest-M lookup never hands a decode config to a
    prefill batch or the reverse), every entry holds every key, and obeys the rules that hold
    for every batch size."""
    m = _NAME.fullmatch(path.name)
    assert m, path.name
    scheme = "fp8_block" if m.group(5) else "fp8_tensor" if m.group(4) else "bf16"
    table = tune.load_table(path)
    assert sorted(table) == list(configs.M_BUCKETS)
    for key, cfg in table.items():
        assert list(cfg) == list(tune.CONFIG_KEYS), (key, cfg)
        assert tune.why_pruned(cfg, scheme) is None, (key, cfg)
