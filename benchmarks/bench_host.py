"""Host cost of an eager fused_experts call: the CPU time from the call to its return (the
kernels enqueued, not run), per backend, scheme and shape, at small token counts; and the
time of `import hopper_moe` in a fresh interpreter.

Per row: `calls` eager calls back to back after a warm-up (so every kernel is compiled and
every cache filled), timed with time.perf_counter around each call alone; the GPU is
synchronized every `sync_every` calls outside the timed region so the launch queue never
fills (a full queue would make enqueueing wait for the GPU). Reports the median and p90 per
call, and the span of CUDA events recorded before and after one eager call (median): where
the host is slower than the kernels, the GPU waits for each launch and this span is about
the host time, not the kernels' time (graph-replayed kernel times: bench_moe.py).

    python benchmarks/bench_host.py [--shapes qwen3_30b,mixtral] [--dtypes bf16,fp8_tensor]
        [--backends sm90,triton,torch] [--m 1] [--calls 300] [--out DIR] [--tag host]
        [--profile] [--op-profile]

`--backends` also takes `sm90_steps`: the sm90 layer composed step by step in Python
(hopper_moe.backends.sm90.run_steps), the same kernels as backend "sm90"'s one op call.

Results: <out>/<gpu>_<tag>.md. Needs a CUDA device; without one it says so and exits 0.
Benchmarks never assert.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402


# Not a backend: the sm90 layer composed in Python, one call per step (the backend before its
# C++ op), timed beside backend "sm90" to show what the op saves.
STEPS = "sm90_steps"


def import_seconds(repeats: int = 3) -> list[tuple[str, float]]:
    """Wall time of imports in fresh interpreters: `import torch` alone, `import hopper_moe`
    (torch included, as a user pays it) and `import hopper_moe` in an interpreter that has
    already imported torch (hopper_moe's own share)."""
    timed = "import time; t = time.perf_counter(); import {m}; print(time.perf_counter() - t)"
    codes = {"torch": timed.format(m="torch"), "hopper_moe": timed.format(m="hopper_moe"),
             "hopper_moe after torch": "import torch; " + timed.format(m="hopper_moe")}
    out = []
    for label, code in codes.items():
        for _ in range(repeats):
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=os.environ.copy())
            out.append((label, float(r.stdout.strip() or "nan")))
    return out


def host_us_per_call(fn, calls: int, sync_every: int = 20) -> tuple[float, float]:
    samples = []
    for i in range(calls):
        if i % sync_every == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def profile_calls(fn, calls: int, top: int = 25) -> str:
    """cProfile of `calls` eager calls: the `top` functions by own time (µs per call)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize()
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def torch_profile_calls(fn, calls: int = 50, rows: int = 18) -> str:
    """torch.profiler over `calls` eager calls: the ops, runtime calls and kernels by own CPU
    time (what a C++ op spends its host time on, which cProfile cannot see)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows,
                                     max_name_column_width=60)


def event_span_us(fn, iters: int = 50) -> float:
    """Median span of CUDA events recorded before and after one eager call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3_30b,mixtral")
    p.add_argument("--dtypes", default="bf16,fp8_tensor")
    p.add_argument("--backends", default="sm90,triton,torch")
    p.add_argument("--m", default="1")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="host")
    p.add_argument("--profile", action="store_true",
                   help="also profile each row's calls with cProfile: the top functions by "
                        "own time go to <out>/<gpu>_<tag>_profile.txt")
    p.add_argument("--op-profile", action="store_true",
                   help="also profile 50 calls of each row with torch.profiler (ATen ops, CUDA "
                        "runtime calls, kernels): <out>/<gpu>_<tag>_ops.txt")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("NO GPU FOUND: the host cost of a CUDA launch needs a CUDA device")
        return 0
    imports = import_seconds()
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"hopper_moe does not import: {err}")
        return 0
    from hopper_moe.backends.sm90 import run_steps as steps
    from hopper_moe.quant import make_quant_config

    dev = torch.device("cuda")
    rows = []
    profiles: list[tuple[str, str]] = []
    op_profiles: list[tuple[str, str]] = []
    for shape_name in C.parse_list(args.shapes):
        shape = C.SHAPES[shape_name]
        w1, w2 = C.make_weights(shape, dev, seed=0)
        for scheme in C.parse_list(args.dtypes):
            if scheme == "bf16":
                w1q, w2q, quant = w1, w2, None
            else:
                w1q, w2q, quant = make_quant_config(w1, w2, scheme)
            for m in C.parse_list(args.m, int):
                x = C.make_hidden(m, shape.hidden_size, dev, seed=1)
                _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, dev, seed=2)
                for backend in C.parse_list(args.backends):
                    def call():
                        if backend == STEPS:
                            return steps(x, w1q, w2q, tw, ti, quant=quant)
                        return hm.fused_experts(x, w1q, w2q, tw, ti, quant=quant,
                                                backend=backend)
                    try:
                        for _ in range(5):
                            call()
                        torch.cuda.synchronize()
                        med, p90 = host_us_per_call(call, args.calls)
                        span = event_span_us(call)
                        title = f"{shape_name} {scheme} M={m} {backend}"
                        if args.profile:
                            profiles.append((title, profile_calls(call, args.calls)))
                        if args.op_profile:
                            op_profiles.append((title, torch_profile_calls(call)))
                        rows.append((shape_name, scheme, m, backend, med, p90, span, ""))
                    except Exception as exc:  # noqa: BLE001  (a row says why it is missing)
                        rows.append((shape_name, scheme, m, backend, None, None, None,
                                     C.short_error(exc)))
                    print(C.fmt(rows[-1][4]), "us host", rows[-1][:4], flush=True)
        del w1, w2
    env = C.collect_env(dev)
    lines = [f"# hopper_moe host cost per eager call: {env.get('gpu', dev)}", "",
             "```", C.command_line(), "```", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "`import` in a fresh interpreter, wall s: " + ", ".join(
        f"{mod} {sec:.2f}" for mod, sec in imports), "",
        f"{args.calls} eager calls per row after 5 warm-up calls; host µs = perf_counter "
        "around one call (the GPU synchronized every 20 calls, outside the timed region); "
        "event span µs = CUDA events recorded around one eager call, median of 50 (a host-bound "
        "call shows about its host time there).", "",
        "| shape | dtype | M | backend | host µs median | host µs p90 | event span µs | note |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {C.fmt(r[4])} | {C.fmt(r[5])} | "
                     f"{C.fmt(r[6])} | {r[7]} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{C.gpu_slug(torch.cuda.get_device_name())}_{args.tag}.md")
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"# wrote {path}")
    for suffix, found in (("_profile.txt", profiles), ("_ops.txt", op_profiles)):
        if found:
            ppath = path[:-3] + suffix
            with open(ppath, "w") as f:
                for title, stats in found:
                    f.write(f"## {title}\n{stats}\n")
            print(f"# wrote {ppath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
