"""The benchmarks' L2 eviction methods (benchmarks/common.py, --evict write / clean / rotate /
none): the flags and their older aliases on bench_moe.py and bench_trace.py, the rule that
picks R, the number of weight copies rotate cycles through, the copies themselves, and the
order in which the timed replays cycle through the copies' graphs (fake graphs on the CPU)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_moe  # noqa: E402
import bench_trace  # noqa: E402
import common  # noqa: E402
from hopper_moe.quant import QuantConfig  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SCRIPTS = [bench_moe, bench_trace]


# ---------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("argv, method", [
    ([], "write"),
    (["--evict", "write"], "write"),
    (["--evict", "clean"], "clean"),
    (["--evict", "rotate"], "rotate"),
    (["--evict", "none"], "none"),
    (["--clean-l2"], "clean"),
    (["--no-evict"], "none"),
    (["--clean-l2", "--evict", "clean"], "clean"),  # redundant, not contradictory
    (["--evict", "none", "--no-evict"], "none"),
])
def test_evict_flag_and_aliases(script, argv, method):
    args = script.parse_args(argv)
    assert args.evict == method
    assert args.clean_l2 == (method == "clean")
    assert args.no_evict == (method == "none")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
@pytest.mark.parametrize("argv, says", [
    (["--clean-l2", "--no-evict"], "--clean-l2 and --no-evict contradict"),
    (["--evict", "rotate", "--clean-l2"], "--evict rotate contradicts --clean-l2"),
    (["--evict", "write", "--no-evict"], "--evict write contradicts --no-evict"),
    (["--evict", "clean", "--no-evict"], "--evict clean contradicts --no-evict"),
    (["--evict", "flush"], "invalid choice: 'flush'"),
])
def test_contradictory_evict_flags_are_argparse_errors(script, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        script.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_evictor_per_method():
    cpu = torch.device("cpu")
    assert all(common.make_evictor(m, cpu) is None for m in common.EVICT_METHODS)
    with pytest.raises(ValueError):
        common.make_evictor("flush", cpu)
    for m in common.EVICT_METHODS:
        assert m in common.evict_description(m, 60 * MiB) or m == "none"
    assert "60 MiB" in common.evict_description("rotate", 60 * MiB)
    assert common.evict_description("none") == "no L2 eviction (hot-cache numbers)"


# ------------------------------------------------------------------------------ the R rule
@pytest.mark.parametrize("l2, replay, want", [
    (60 * MiB, 240 * MiB, 2),   # one other copy already touches 4x L2
    (60 * MiB, 241 * MiB, 2),
    (60 * MiB, 239 * MiB, 3),   # just short of 4x: a second other copy
    (60 * MiB, 60 * MiB, 5),    # exactly 4x with 4 others
    (60 * MiB, 37 * MiB, 8),    # qwen3_30b FP8 M=1 size: ceil(240 / 37) = 7 others
    (50 * MiB, 1 << 40, 2),     # huge rows: never fewer than 2
    (60 * MiB, 1 * MiB, 241),
])
def test_rotation_copies_smallest_r_with_4x_l2(l2, replay, want):
    r, note = common.rotation_copies(l2, replay, copy_bytes=100 * MiB, free_bytes=1 << 45)
    assert (r, note) == (want, "")
    assert (r - 1) * replay >= 4 * l2
    assert r == 2 or (r - 2) * replay < 4 * l2  # and the smallest such R


def test_rotation_copies_capped_by_free_memory():
    # 8 copies asked (7 clones of 1 GiB), room for 3 clones after the margin
    r, note = common.rotation_copies(60 * MiB, 37 * MiB, copy_bytes=GiB, free_bytes=5 * GiB,
                                     margin_bytes=2 * GiB)
    assert r == 4
    assert "capped at 4 by free memory" in note and "the rule asks 8" in note
    assert "1.9x L2" in note  # 3 others x 37 / 60
    # the default margin is max(2 GiB, free / 10): 100 GiB free keeps 10 GiB
    r, _ = common.rotation_copies(60 * MiB, MiB, copy_bytes=10 * GiB, free_bytes=100 * GiB)
    assert r == 1 + 90 // 10


def test_rotation_copies_capped_at_max_copies():
    r, note = common.rotation_copies(60 * MiB, 1000, copy_bytes=1000, free_bytes=1 << 45,
                                     max_copies=16)
    assert r == 16 and "the cap of 16 copies" in note


@pytest.mark.parametrize("free, copy", [(3 * GiB, 2 * GiB), (GiB, 1), (0, MiB)])
def test_rotation_copies_does_not_fit(free, copy):
    with pytest.raises(common.RotationDoesNotFit, match="does not fit in free device memory"):
        common.rotation_copies(60 * MiB, 10 * MiB, copy_bytes=copy, free_bytes=free,
                               margin_bytes=2 * GiB)


def test_rotation_copies_exactly_fits_one_clone():
    r, note = common.rotation_copies(60 * MiB, 10 * MiB, copy_bytes=GiB, free_bytes=3 * GiB,
                                     margin_bytes=2 * GiB)
    assert r == 2 and "capped at 2 by free memory" in note


def test_rotation_copies_rejects_bad_arguments():
    with pytest.raises(ValueError):
        common.rotation_copies(60 * MiB, 0, copy_bytes=MiB, free_bytes=GiB)
    with pytest.raises(ValueError):
        common.rotation_copies(60 * MiB, MiB, copy_bytes=MiB, free_bytes=GiB, max_copies=1)


# ------------------------------------------------------------------------------ the copies
def _fp8_layer(e: int = 4, n: int = 16, k: int = 8):
    w1 = torch.randn(e, 2 * n, k).to(torch.float8_e4m3fn)
    w2 = torch.randn(e, k, n).to(torch.float8_e4m3fn)
    quant = QuantConfig(w1_scale=torch.rand(e, 2 * n, 1), w2_scale=torch.rand(e, k, 1),
                        a1_scale=torch.rand(1), a2_scale=torch.rand(1), per_out_ch_quant=True)
    return w1, w2, quant


def test_clone_weights_copies_weights_and_per_expert_scales_only():
    w1, w2, quant = _fp8_layer()
    c1, c2, cq = common.clone_weights((w1, w2, quant), num_experts=4)
    for a, b in ((w1, c1), (w2, c2), (quant.w1_scale, cq.w1_scale),
                 (quant.w2_scale, cq.w2_scale)):
        assert a.data_ptr() != b.data_ptr() and a.stride() == b.stride()
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert cq.a1_scale is quant.a1_scale and cq.a2_scale is quant.a2_scale  # activation side
    assert cq.per_out_ch_quant and cq.scheme == quant.scheme
    assert common.clone_weights((w1, w2, None), 4)[2] is None  # bf16: no quant
    per_expert = (quant.w1_scale.numel() + quant.w2_scale.numel()) * 4
    assert common.weights_nbytes((w1, w2, quant), 4) == w1.numel() + w2.numel() + per_expert
    with pytest.raises(TypeError):
        common.clone_weights((w1, object()), 4)


def test_clone_weights_keeps_strides_of_views():
    w = torch.randn(3, 8, 4).transpose(1, 2)  # a non-contiguous view
    (c,) = common.clone_weights((w,), 3)
    assert c.stride() == w.stride() and torch.equal(c, w)


def test_weight_rotation_for_row_on_the_cpu():
    w1, w2, quant = _fp8_layer()
    replay = 1000
    rot = common.WeightRotation.for_row(torch.device("cpu"), (w1, w2, quant), replay, 4,
                                        l2_bytes=2000, free_bytes=GiB, margin_bytes=0)
    assert rot.r == 9 and rot.note == ""  # 8 others x 1000 bytes >= 4 x 2000
    assert rot.copies[0][0] is w1 and rot.copies[0][2] is quant  # copy 0: the originals
    ptrs = {c[0].data_ptr() for c in rot.copies} | {c[2].w2_scale.data_ptr() for c in rot.copies}
    assert len(ptrs) == 2 * rot.r  # every copy reads its own weights and scales
    built = rot.build(lambda a, b, q: (a, b, q))
    assert [f[0] for f in built] == [c[0] for c in rot.copies]
    first = object()
    assert rot.build(lambda a, b, q: (a, b, q), first=first)[0] is first
    rot.free()
    assert rot.r == 1 and rot.copies[0][0] is w1
    with pytest.raises(common.RotationDoesNotFit):
        common.WeightRotation.for_row(torch.device("cpu"), (w1, w2, quant), replay, 4,
                                      l2_bytes=2000, free_bytes=100, margin_bytes=0)


# ------------------------------------------------------------------------ the cycling order
def test_cycle_runs_fn_i_mod_r():
    seen = []
    cycle = common.Cycle([lambda k=k: seen.append(k) or k for k in range(3)])
    assert cycle.last == -1
    assert [cycle() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert seen == [0, 1, 2, 0, 1, 2, 0] and cycle.last == 0 and cycle.calls == 7
    with pytest.raises(ValueError):
        common.Cycle([])


@pytest.mark.parametrize("warmup, r, want", [(10, 1, 10), (0, 1, 0), (10, 3, 12), (10, 5, 10),
                                             (2, 8, 8), (0, 4, 4), (16, 8, 16)])
def test_warmup_replays(warmup, r, want):
    assert common.warmup_replays(warmup, r) == want


class FakeGraph:
    def __init__(self, k: int, log: list):
        self.k, self.log = k, log

    def replay(self) -> None:
        self.log.append(self.k)


@pytest.mark.parametrize("copies, per_batch_ms, min_ms, want", [
    (1, 3.0, 20.0, 10 + 7 * 8), (3, 5.0, 20.0, 12 + 4 * 9), (2, 0.0, 1.0, None),
    (4, 1.0, 0.0, 12)])
def test_warm_up_runs_until_the_gpu_time(copies, per_batch_ms, min_ms, want):
    # (on the CPU, with a fake timer) the count, then whole rotations until min_ms is spent
    calls: list[int] = []
    batches: list[int] = []

    def timer(fn):
        before = len(calls)
        fn()
        batches.append(len(calls) - before)
        return per_batch_ms
    done = common.warm_up(lambda: calls.append(1), 10, copies, min_ms=min_ms, timer=timer)
    assert done == len(calls)
    assert all(b % copies == 0 and b >= 8 for b in batches)  # whole rotations per batch
    if want is None:  # a timer that never counts: stops at the cap
        assert done <= common.WARMUP_MAX_REPLAYS and done + batches[0] > common.WARMUP_MAX_REPLAYS
    else:
        assert done == want


@pytest.mark.parametrize("r, warmup, iters", [(3, 10, 7), (5, 2, 12), (2, 0, 4)])
def test_time_cuda_rotated_cycles_the_graphs(monkeypatch, r, warmup, iters):
    monkeypatch.setattr(common, "WARMUP_MIN_MS", 0.0)  # the count only (a GPU would time)
    log: list[int] = []
    outs = [torch.full((2,), float(k)) for k in range(r)]

    def fake_capture(fns, warmup=3):
        assert len(fns) == r
        return [FakeGraph(k, log) for k in range(r)], outs

    timed: list[int] = []

    def fake_event_loop(run, evict, n):
        assert evict is common.rotation_spacer  # no memory traffic between the replays
        start = len(log)
        for _ in range(n):
            run()
        timed.extend(log[start:])
        return [float(i + 1) for i in range(n)]
    monkeypatch.setattr(common, "capture_graphs", fake_capture)
    monkeypatch.setattr(common, "event_loop", fake_event_loop)
    timing, out = common.time_cuda_rotated([lambda: None] * r, iters=iters, warmup=warmup)
    assert timed == [i % r for i in range(iters)]  # timed replay i runs graph i % R
    warm = log[:len(log) - iters]
    assert len(warm) == common.warmup_replays(warmup, r) and set(warm) == set(range(r))
    assert all(a != b for a, b in zip(log, log[1:]))  # never one copy twice in a row
    assert timing.mode == "graph" and timing.iters == iters
    assert timing.median_us == pytest.approx((iters + 1) / 2)
    assert torch.equal(out, outs[(iters - 1) % r])  # the last timed replay's output, a copy
    assert out is not outs[(iters - 1) % r]


def test_time_cuda_rotated_falls_back_to_eager_cycling(monkeypatch):
    monkeypatch.setattr(common, "WARMUP_MIN_MS", 0.0)
    def failing_capture(fns, warmup=3):
        raise RuntimeError("capture not supported")
    calls: list[int] = []

    def fake_event_loop(run, evict, n):
        assert evict is common.rotation_spacer
        for _ in range(n):
            run()
        return [1.0] * n
    monkeypatch.setattr(common, "capture_graphs", failing_capture)
    monkeypatch.setattr(common, "_recover_after_capture_failure", lambda: None)
    monkeypatch.setattr(common, "event_loop", fake_event_loop)
    fns = [lambda k=k: calls.append(k) or k for k in range(3)]
    timing, out = common.time_cuda_rotated(fns, iters=5, warmup=4)
    assert calls[-5:] == [0, 1, 2, 0, 1] and len(calls) == 6 + 5
    assert timing.mode == "eager" and "capture not supported" in timing.note and out == 1


def test_time_fn_on_the_cpu_ignores_the_copies():
    n = []
    timing, out = common.time_fn(lambda: n.append(1) or 5, torch.device("cpu"), iters=3,
                                 warmup=1, copies=[lambda: 6, lambda: 7])
    assert out == 5 and timing.mode == "wall"


# ----------------------------------------------------------------------- bench_moe rows
def test_bench_moe_cpu_run_says_no_eviction(tmp_path):
    rc = bench_moe.main(["--device", "cpu", "--selftest", "--shapes", "tiny", "--m", "2",
                         "--dtypes", "bf16", "--evict", "rotate", "--out", str(tmp_path),
                         "--tag", "t"])
    assert rc == 0
    (js,) = tmp_path.glob("*_t.json")
    payload = json.loads(js.read_text())
    assert payload["args"]["evict"] == "rotate" and payload["evict"] == "none"
    assert [(r["evict"], r["evict_copies"]) for r in payload["rows"]] == [("none", None)]
    md = js.with_suffix(".md").read_text()
    assert "no L2 eviction on the CPU" in md


def test_rotation_rows_show_r():
    row = dict(shape="s", dtype="bf16", M=1, backend="cute", us=10.0, tflops=1.0, gbs=1.0,
               pct_floor=50.0, x_baseline=None, rel_err=1e-3, floor_us=5.0, floor_bound="mem",
               experts_touched=2, mode="graph", note="", how="", evict="rotate",
               evict_copies=5, evict_note="")
    assert bench_moe.row_cells(row)[-1] == "graph, rotate R=5"
    row.update(evict="write", evict_copies=None)
    assert bench_moe.row_cells(row)[-1] == "graph"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_moe_rotate_on_a_gpu(tmp_path):
    from conftest import HAS_CUDA
    if not HAS_CUDA:
        pytest.skip("a GPU without a CUDA build of hopper_moe")
    argv = ["--shapes", "tiny", "--m", "1,8", "--dtypes", "bf16", "--backends", "torch,cute",
            "--iters", "20", "--warmup", "2", "--evict", "rotate", "--out", str(tmp_path),
            "--tag", "rot"]
    assert bench_moe.main(argv) == 0
    (js,) = tmp_path.glob("*_rot.json")
    payload = json.loads(js.read_text())
    assert payload["evict"] == "rotate"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = payload["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["evict"] == "rotate" and r["evict_copies"] >= 2, r
        if r["backend"] == "cute":
            assert r["us"] > 0 and r["rel_err"] < 1e-2, r
        if not r["evict_note"]:
            assert (r["evict_copies"] - 1) * r["bytes"] >= 4 * l2, r
    md = js.with_suffix(".md").read_text()
    assert "L2 eviction: rotate" in md and "rotate R=" in md


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_moe_rotate_that_does_not_fit_fails_the_row(tmp_path, monkeypatch):
    from conftest import HAS_CUDA
    if not HAS_CUDA:
        pytest.skip("a GPU without a CUDA build of hopper_moe")
    monkeypatch.setattr(common.torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))
    argv = ["--shapes", "tiny", "--m", "1", "--dtypes", "bf16", "--backends", "cute",
            "--iters", "5", "--warmup", "1", "--evict", "rotate", "--out", str(tmp_path),
            "--tag", "nofit"]
    assert bench_moe.main(argv) == 0
    (js,) = tmp_path.glob("*_nofit.json")
    (row,) = json.loads(js.read_text())["rows"]
    assert row.get("us") is None and "does not fit in free device memory" in row["error"]
