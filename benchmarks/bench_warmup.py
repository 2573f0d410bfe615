"""After `hopper_moe.warmup`, does serving still compile or stall? Per scheme: the time of
warmup itself, then --n random token counts in 1..--max-m through
`fused_experts(backend=--backend)`, each call's first (synchronized, wall-clock) time against
its steady state (median of --reps more calls at the same M), and the Triton kernels compiled
during the sequence.

    PYTHONPATH=python python benchmarks/bench_warmup.py                       # qwen3_30b
    PYTHONPATH=python python benchmarks/bench_warmup.py --shape deepseek_v3_tp8 \
        --dtypes fp8_block --n 300 --max-m 16384 --out $OUT

The pass criterion the project holds itself to: 0 kernels compiled after warmup and no first
call above 1.5x its steady state. Every first call is a new process-level M (no M repeats).

The control: before each new M (from the second on), one call at the previous M, which has
run before, with routing drawn anew and timed exactly as a first call (synchronized GPU, the
same bookkeeping before it), against that M's steady state. A first-call excess that the
control shows too belongs to the call's position (caches cold after the synchronization and
the routing draw, a garbage collection), not to the token count being new. --gc freeze
moves every object alive after warmup out of the collector's generations (gc.freeze(), as
serving engines do after start-up), --gc off disables collection during the sequence.
Results: <out>/<gpu>_<tag>.md and .json. Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

LIMIT = 1.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3_30b", choices=sorted(C.SHAPES))
    p.add_argument("--dtypes", default="bf16,fp8_tensor,fp8_channel,fp8_block")
    p.add_argument("--backend", default="auto")
    p.add_argument("--n", type=int, default=300, help="random token counts per scheme")
    p.add_argument("--max-m", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3, help="steady-state calls per M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="warmup")
    p.add_argument("--gc", default="on", choices=["on", "freeze", "off"],
                   help="Python's garbage collector during the sequence (see the docstring)")
    p.add_argument("--profile", action="store_true",
                   help="cProfile every first call and one steady call per M; print the "
                        "functions whose time per call differs most between them")
    return p.parse_args(argv)


def one_scheme(hm, shape: C.MoEShape, scheme: str, args, device) -> dict[str, Any]:
    from hopper_moe.quant import make_quant_config
    from hopper_moe.warm import _compiled_variants

    w1, w2 = C.make_weights(shape, device, seed=args.seed + 101)
    w1, w2, quant = make_quant_config(w1, w2, scheme)
    x = C.make_hidden(args.max_m, shape.hidden_size, device, seed=args.seed + 1)
    t0 = time.perf_counter()
    report = hm.warmup(w1, w2, shape.top_k, args.max_m, quant=quant, backend=args.backend)
    warm_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    ms = rng.sample(range(1, args.max_m + 1), args.n)
    before = _compiled_variants()
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    rows = []
    prof_first, prof_steady = cProfile.Profile(), cProfile.Profile()

    def once(xm, tw, ti):
        """(host ms until fused_experts returned, wall ms until the GPU finished)"""
        t = time.perf_counter()
        hm.fused_experts(xm, w1, w2, tw, ti, quant=quant, backend=args.backend)
        h = time.perf_counter()
        torch.cuda.synchronize()
        return (h - t) * 1e3, (time.perf_counter() - t) * 1e3

    for i, m in enumerate(ms):
        control = None
        if rows:  # the previous M again, routed anew, timed like a first call
            prev = rows[-1]
            _, cw, ci = C.routing(prev["M"], shape.num_experts, shape.top_k, device,
                                  seed=args.seed + 100_000 + i)
            torch.cuda.synchronize()
            torch.cuda.memory_stats()
            control = once(x[:prev["M"]], cw, ci)
        _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, device, seed=args.seed + i)
        xm = x[:m]
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        if args.profile:
            prof_first.enable()
        first_host, first = once(xm, tw, ti)
        if args.profile:
            prof_first.disable()
        # cudaMalloc calls the caching allocator made during the first call (a size class the
        # pool had no free block for).
        allocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs
        if args.profile:
            prof_steady.enable()
            once(xm, tw, ti)
            prof_steady.disable()
        steady = [once(xm, tw, ti) for _ in range(args.reps)]
        s = statistics.median(w for _, w in steady)
        rows.append(dict(M=m, first_ms=first, steady_ms=s, ratio=first / s,
                         first_host_ms=first_host,
                         steady_host_ms=statistics.median(h for h, _ in steady),
                         device_allocs=allocs,
                         control_M=None if control is None else rows[-1]["M"],
                         control_ms=None if control is None else control[1],
                         control_ratio=None if control is None
                         else control[1] / rows[-1]["steady_ms"]))
    after = _compiled_variants()
    gc.enable()
    gc.unfreeze()
    if args.profile:
        print_profile_difference(scheme, prof_first, prof_steady, len(ms))
    worst = max(rows, key=lambda r: r["ratio"])
    return dict(scheme=scheme, warmup_s=warm_s, warmup_compile_s=report.compile_s,
                warmup_run_s=report.run_s, warmup_kernels=report.kernels_compiled,
                classes={k: len(v) for k, v in report.token_counts.items()},
                compiled_after=None if before is None or after is None else after - before,
                worst_ratio=worst["ratio"], worst_m=worst["M"],
                over_limit=sum(r["ratio"] > LIMIT for r in rows),
                first_median_ms=statistics.median(r["first_ms"] for r in rows),
                calls_with_alloc=sum(r["device_allocs"] > 0 for r in rows),
                control_over_limit=sum(r["control_ratio"] is not None
                                       and r["control_ratio"] > LIMIT for r in rows),
                control_worst=max((r["control_ratio"] for r in rows
                                   if r["control_ratio"] is not None), default=None),
                gc=args.gc, rows=rows)


def print_profile_difference(scheme: str, first, steady, calls: int, top: int = 15) -> None:
    """The functions whose own time per call is larger in first calls than in steady ones."""
    def per_function(prof):
        return {k: v[2] for k, v in pstats.Stats(prof).stats.items()}  # tottime
    a, b = per_function(first), per_function(steady)
    diff = sorted(((a.get(k, 0.0) - b.get(k, 0.0), k) for k in set(a) | set(b)), reverse=True)
    print(f"{scheme}: own time per call, first calls minus steady calls (cProfile, "
          f"{calls} of each; µs):")
    for d, (path, line, name) in diff[:top]:
        print(f"  {d / calls * 1e6:9.1f}  {name}  {os.path.basename(path)}:{line}")


HEADERS = ["scheme", "warmup s (compile + run)", "kernels compiled by warmup",
           "classes per backend", "calls", "kernels compiled after", "worst first/steady",
           f"calls > {LIMIT}x", "first-call median ms", "first calls with a cudaMalloc",
           f"control calls > {LIMIT}x (worst)", "gc"]


def cells(r: dict[str, Any], n: int) -> list[str]:
    return [r["scheme"], f"{r['warmup_s']:.1f} ({r['warmup_compile_s']:.1f} + "
            f"{r['warmup_run_s']:.1f})", C.fmt(r["warmup_kernels"], "d"),
            ", ".join(f"{k} {v}" for k, v in r["classes"].items()), str(n),
            C.fmt(r["compiled_after"], "d"), f"{r['worst_ratio']:.2f} (M = {r['worst_m']})",
            str(r["over_limit"]), f"{r['first_median_ms']:.3f}", str(r["calls_with_alloc"]),
            f"{r['control_over_limit']} ({C.fmt(r['control_worst'], '.2f')})", r["gc"]]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_warmup needs a CUDA GPU (compilation and first-call latency of the GPU "
              "backends); torch.cuda.is_available() is False. Nothing measured.")
        return 0
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"hopper_moe could not be imported: {err}")
        return 1
    shape = C.SHAPES[args.shape]
    device = torch.device("cuda", torch.cuda.current_device())
    env = C.collect_env(device)
    results = []
    for scheme in C.parse_list(args.dtypes):
        ok, why = C.scheme_applies(shape, scheme)
        if not ok:
            print(why)
            continue
        r = one_scheme(hm, shape, scheme, args, device)
        results.append(r)
        print(C.text_table(HEADERS, [cells(r, args.n)]), flush=True)
    rows = [cells(r, args.n) for r in results]
    extra = [f"shape {shape.name} (E={shape.num_experts} topk={shape.top_k} "
             f"H={shape.hidden_size} I={shape.intermediate_size}), backend {args.backend}, "
             f"{args.n} distinct random M in 1..{args.max_m} (seed {args.seed}) after "
             f"warmup(max_num_tokens={args.max_m}); first call: one synchronized call (wall "
             f"clock); steady: median of {args.reps} more at the same M"]
    md = [C.env_header_md("After warmup: compilation and first-call latency", env, None,
                          extra), "", C.markdown_table(HEADERS, rows), ""]
    for r in results:
        top = sorted(r["rows"], key=lambda x: -x["ratio"])[:5]
        md += [f"## {r['scheme']}: the five slowest first calls relative to steady state", "",
               C.markdown_table(["M", "first ms", "steady ms", "ratio", "first host ms",
                                 "steady host ms", "cudaMalloc in first call"],
                                [[x["M"], f"{x['first_ms']:.3f}", f"{x['steady_ms']:.3f}",
                                  f"{x['ratio']:.2f}", f"{x['first_host_ms']:.3f}",
                                  f"{x['steady_host_ms']:.3f}", x["device_allocs"]]
                                 for x in top]), ""]
        slow = [x for x in r["rows"] if x["ratio"] > 1.2]
        if slow:
            md += [f"{r['scheme']}: of {len(slow)} first calls above 1.2x, "
                   f"{sum(x['device_allocs'] > 0 for x in slow)} made a cudaMalloc; their host "
                   f"time exceeded steady state by a median "
                   f"{statistics.median(x['first_host_ms'] - x['steady_host_ms'] for x in slow):.3f}"
                   f" ms, their wall time by "
                   f"{statistics.median(x['first_ms'] - x['steady_ms'] for x in slow):.3f} ms.", ""]
    stem = f"{C.gpu_slug(env['gpu'])}_{args.tag}"
    md_path, js_path = C.write_results(args.out, stem, "\n".join(md),
                                       dict(env=env, args=vars(args), results=results))
    print(f"\nwrote {C.show_path(md_path)} and {C.show_path(js_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
