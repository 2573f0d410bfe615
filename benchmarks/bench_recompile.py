"""What the no-recompilation guarantee of the Triton MoE kernel buys: latency of the first call
at each token count of a random sequence, and of the calls after it, with and without it.

    PYTHONPATH=python python benchmarks/bench_recompile.py                  # qwen3_30b, bf16
    PYTHONPATH=python python benchmarks/bench_recompile.py --shape mixtral --dtype fp8_channel \
        --n 200 --max-m 8192 --out $OUT

Variants (same process, same inputs, same sequence of M):
  guarded    the shipped `moe_gemm_kernel` (token-dependent integers in do_not_specialize);
  unguarded  `triton.jit(moe_gemm_kernel.fn)`: the same kernel specialized on every integer,
             swapped into fused_moe as tests/test_triton_moe.py's counter test does.
For each of `--n` random M in 1..--max-m (seed --seed): the wall time of one synchronized call
of `fused_experts_triton` (first call: includes any compilation), then the median of --reps
more (steady state), and the number of compiled variants of the kernel after it. Each variant
compiles into its own empty Triton cache directory (unless --keep-cache), so a first call pays
a real compilation, not a disk-cache load; a third copy of the kernel runs once beforehand so
neither variant pays for process start-up. Results: <out>/<gpu>_<tag>.md and .json.
Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3_30b", choices=sorted(C.SHAPES))
    p.add_argument("--dtype", default="bf16", choices=C.SCHEMES)
    p.add_argument("--n", type=int, default=200, help="token counts in the sequence")
    p.add_argument("--max-m", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=5, help="steady-state calls per M")
    p.add_argument("--keep-cache", action="store_true",
                   help="use the usual Triton cache directory (first calls may load from disk)")
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="recompile")
    return p.parse_args(argv)


def compiled_variants(kernel) -> int | None:
    """Compiled specializations of a Triton kernel over all devices (None if this Triton
    keeps them elsewhere)."""
    try:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


@contextlib.contextmanager
def kernel_swapped(kernel, cache_dir: str | None):
    """fused_experts_triton launches `kernel`, compiling into `cache_dir` (None: unchanged)."""
    from hopper_moe.kernels import moe_gemm  # the backend looks the kernel up there per launch
    orig, old_dir = moe_gemm.moe_gemm_kernel, os.environ.get("TRITON_CACHE_DIR")
    moe_gemm.moe_gemm_kernel = kernel
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        moe_gemm.moe_gemm_kernel = orig
        if cache_dir is not None:
            if old_dir is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old_dir


def run_sequence(kernel, call, inputs, reps: int) -> list[dict[str, Any]]:
    """One row per M: first-call and steady-state wall time (ms), variants after the call."""
    rows = []
    for m, args in inputs:
        def once():
            call(*args)
            torch.cuda.synchronize()
        before = compiled_variants(kernel)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        first = (time.perf_counter() - t0) * 1e3
        after = compiled_variants(kernel)
        steady, _ = C.time_wall(once, iters=reps, warmup=0)
        rows.append(dict(M=m, first_ms=first, steady_ms=steady.median_us / 1e3,
                         variants=after,
                         compiled=None if before is None else after - before))
    return rows


def summarize(name: str, rows: list[dict[str, Any]], variants: int | None) -> dict[str, Any]:
    firsts = [r["first_ms"] for r in rows]
    steadies = [r["steady_ms"] for r in rows]
    return dict(variant=name, calls=len(rows), compiled_variants=variants,
                calls_that_compiled=None if variants is None else
                sum(1 for r in rows if r["compiled"]),
                first_total_s=sum(firsts) / 1e3, first_max_ms=max(firsts),
                first_median_ms=statistics.median(firsts),
                steady_median_ms=statistics.median(steadies),
                overhead_total_s=sum(f - s for f, s in zip(firsts, steadies)) / 1e3)


SUMMARY_HEADERS = ["variant", "compiled variants", "calls that compiled", "first-call total s",
                   "first-call max ms", "first-call median ms", "steady median ms",
                   "first - steady total s"]


def summary_cells(s: dict[str, Any]) -> list[str]:
    return [s["variant"], C.fmt(s["compiled_variants"], "d"), C.fmt(s["calls_that_compiled"], "d"),
            C.fmt(s["first_total_s"], ".2f"), C.fmt(s["first_max_ms"], ".1f"),
            C.fmt(s["first_median_ms"], ".3f"), C.fmt(s["steady_median_ms"], ".3f"),
            C.fmt(s["overhead_total_s"], ".2f")]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_recompile needs a CUDA GPU (compile and launch latency of the compiled "
              "Triton kernel); torch.cuda.is_available() is False. Nothing measured.")
        return 0
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"hopper_moe could not be imported: {err}")
        return 1
    import triton

    from hopper_moe.quant import make_quant_config
    from hopper_moe.backends.triton import fused_experts_triton
    from hopper_moe.kernels import moe_gemm

    shape = C.SHAPES[args.shape]
    ok, why = C.scheme_applies(shape, args.dtype)
    if not ok:
        print(why)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    env = C.collect_env(device)
    w1, w2 = C.make_weights(shape, device, seed=args.seed + 101)
    w1, w2, quant = make_quant_config(w1, w2, args.dtype)
    x = C.make_hidden(args.max_m, shape.hidden_size, device, seed=args.seed + 1)
    rng = random.Random(args.seed)
    ms = [rng.randint(1, args.max_m) for _ in range(args.n)]
    inputs = []
    for i, m in enumerate(ms):
        _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, device, seed=args.seed + i)
        inputs.append((m, (x[:m], w1, w2, tw, ti)))

    def call(xm, a, b, tw, ti):
        fused_experts_triton(xm, a, b, tw, ti, quant=quant)

    tmp = tempfile.TemporaryDirectory(prefix="bench_recompile_")

    def cache(name: str) -> str | None:
        return None if args.keep_cache else os.path.join(tmp.name, name)

    print(f"# bench_recompile on {env['gpu']} | torch {env['torch']} | triton {env['triton']}")
    print(f"# {env['command']}")
    print(f"# {shape.name} (E={shape.num_experts} topk={shape.top_k} H={shape.hidden_size} "
          f"I={shape.intermediate_size}), {args.dtype}, {args.n} random M in 1..{args.max_m} "
          f"(seed {args.seed})", flush=True)
    # Process start-up (driver, Triton's launcher, first ops) on a throwaway copy.
    warm = triton.jit(moe_gemm.moe_gemm_kernel.fn,
                      do_not_specialize=moe_gemm.TOKEN_DEPENDENT_ARGS)
    with kernel_swapped(warm, cache("warmup")):
        call(*inputs[0][1])
        torch.cuda.synchronize()

    variants = {"guarded": moe_gemm.moe_gemm_kernel,
                "unguarded": triton.jit(moe_gemm.moe_gemm_kernel.fn)}
    per_call: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, int | None] = {}
    for name, kernel in variants.items():
        with kernel_swapped(kernel, cache(name)):
            per_call[name] = run_sequence(kernel, call, inputs, args.reps)
        counts[name] = compiled_variants(kernel)
        print(f"  {name}: done", flush=True)
    tmp.cleanup()
    report(args, env, shape, ms, per_call, counts)
    return 0


def report(args, env: dict[str, Any], shape: C.MoEShape, ms: list[int],
           per_call: dict[str, list[dict[str, Any]]], counts: dict[str, int | None]) -> None:
    """Summary table on the terminal; markdown and JSON to args.out."""
    summaries = [summarize(name, rows, counts[name]) for name, rows in per_call.items()]
    rows = [summary_cells(s) for s in summaries]
    print()
    print(C.text_table(SUMMARY_HEADERS, rows))
    extra = [f"shape {shape.name}, {args.dtype}, {args.n} random M in 1..{args.max_m} "
             f"(seed {args.seed}); first call: one synchronized call (wall clock); steady: "
             f"median of {args.reps} more",
             "Triton cache: " + ("the usual directory" if args.keep_cache else
                                 "a new empty directory per variant")]
    md = [C.env_header_md("Recompilation: first-call vs steady-state latency", env, None,
                          extra), "", C.markdown_table(SUMMARY_HEADERS, rows), ""]
    for name, calls in per_call.items():
        compiled = [(i, r) for i, r in enumerate(calls) if r["compiled"]]
        md += [f"## {name}: the calls that compiled ({len(compiled)})", "",
               C.markdown_table(["call", "M", "first ms", "steady ms", "variants after"],
                                [[i, r["M"], C.fmt(r["first_ms"], ".1f"),
                                  C.fmt(r["steady_ms"], ".3f"), r["variants"]]
                                 for i, r in compiled]), ""]
    payload = dict(env=env, args=vars(args), ms=ms, summary=summaries, calls=per_call)
    stem = f"{C.gpu_slug(env['gpu'])}_{args.tag}"
    md_path, js_path = C.write_results(args.out, stem, "\n".join(md), payload)
    print(f"\nwrote {C.show_path(md_path)} and {C.show_path(js_path)}")

if __name__ == "__main__":
    sys.exit(main())
