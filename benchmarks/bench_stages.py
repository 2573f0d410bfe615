"""Where the Triton MoE layer's time goes, replay by replay: each stage's time (align, activation
quant, GEMM1 with SiLU*mul, requant, GEMM2, top-k sum) in every call, its spread and a
histogram, next to the whole layer timed as bench_moe.py times it.

    PYTHONPATH=python python benchmarks/bench_stages.py --shape mixtral --dtype bf16 --m 1024
    PYTHONPATH=python python benchmarks/bench_stages.py --shape mixtral --m 1024,4096 \
        --dtype fp8_tensor --iters 200 --out $OUT

Each call is eager (a CUDA graph cannot hold timing events): L2 evicted first (a 256 MiB
write), then an event at the start and one after each stage's launches, through the layer's
`stage_done` hook, so a stage's time is the GPU time between two events. For kernels of
hundreds of microseconds the host runs far ahead and the gaps are the kernels'; for decode's
few-microsecond kernels launch gaps are counted too (bench_moe.py's graph time is the one to
quote there). A mode shift (a stage whose replays fall into two groups) shows in the
histogram and in p10 against p90. Without a GPU the layer runs in Triton's interpreter
(TRITON_INTERPRET=1, the tiny shape only) and stages are timed by the host clock.
Results: <out>/<gpu>_<tag>.md and .json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

STAGES = ("align", "quant1", "gemm1", "quant2", "gemm2", "sum")
HIST_BINS = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mixtral", choices=sorted(C.SHAPES))
    p.add_argument("--dtype", default="bf16", choices=C.SCHEMES)
    p.add_argument("--m", default="1024", help="token counts, comma-separated")
    p.add_argument("--iters", type=int, default=100, help="timed calls per M")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="routing seed (bench_moe.py's default)")
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="stages")
    return p.parse_args(argv)


class StageClock:
    """Timestamps of one call: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[tuple[str, Any]] = []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def __call__(self, stage: str) -> None:
        self.marks.append((stage, self._now()))

    def durations_us(self) -> dict[str, float]:
        """Stage -> microseconds since the previous mark (call after a synchronize)."""
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
        return out


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, int(round(p * (len(s) - 1)))))]
    return q(0.1), statistics.median(s), q(0.9)


def histogram(xs: list[float], bins: int = HIST_BINS) -> list[tuple[float, float, int]]:
    """(low, high, count) of equal-width bins over [min, max]."""
    lo, hi = min(xs), max(xs)
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for x in xs:
        counts[min(bins - 1, int((x - lo) / width))] += 1
    return [(lo + i * width, lo + (i + 1) * width, c) for i, c in enumerate(counts)]


def time_stages(layer, device: torch.device, iters: int, warmup: int
                ) -> dict[str, list[float]]:
    """Per-call stage times (and "total") over `iters` eager calls of layer(stage_done=...)."""
    cuda = device.type == "cuda"
    evict = C.L2Evictor(device) if cuda else None
    for _ in range(max(1, warmup)):
        layer(None)
    clocks = [StageClock(cuda) for _ in range(iters)]
    if cuda:
        torch.cuda.synchronize()
    for clock in clocks:
        if evict is not None:
            evict()
        clock.start()
        layer(clock)
    if cuda:
        torch.cuda.synchronize()
    samples: dict[str, list[float]] = {s: [] for s in STAGES}
    samples["total"] = []
    for clock in clocks:
        d = clock.durations_us()
        for s in STAGES:
            samples[s].append(d.get(s, 0.0))
        samples["total"].append(sum(d.values()))
    return samples


def main(argv=None) -> int:
    args = parse_args(argv)
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"bench_stages: hopper_moe does not import: {err}")
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type == "cpu" and not interp:
        print(C.no_gpu_banner())
        print("bench_stages: the Triton layer needs a GPU, or TRITON_INTERPRET=1 with --shape "
              "tiny")
        return 0
    if device.type == "cpu" and args.shape != "tiny":
        print(f"bench_stages: on the CPU (interpreter) only --shape tiny runs, not {args.shape}")
        return 0
    from hopper_moe.backends.triton import fused_experts_triton

    shape = C.SHAPES[args.shape]
    ok, why = C.scheme_applies(shape, args.dtype)
    if not ok:
        print(why)
        return 0
    w1, w2 = C.make_weights(shape, device, seed=1)
    quant = None
    if args.dtype != "bf16":
        from hopper_moe.quant import make_quant_config
        w1, w2, quant = make_quant_config(w1, w2, args.dtype)
    env = C.collect_env(device)
    rows, payload_rows = [], []
    for m in C.parse_list(args.m, int):
        _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, device, seed=args.seed)
        x = C.make_hidden(m, shape.hidden_size, device, seed=args.seed + 1)

        def layer(clock, x=x, tw=tw, ti=ti):
            return fused_experts_triton(x, w1, w2, tw, ti, quant=quant, stage_done=clock)

        graph_timing, _ = C.time_fn(lambda: layer(None), device, iters=args.iters,
                                    warmup=args.warmup, evict=C.L2Evictor(device)
                                    if device.type == "cuda" else None)
        samples = time_stages(layer, device, args.iters, args.warmup)
        counts = torch.bincount(ti.flatten().long().cpu(), minlength=shape.num_experts)
        for stage in (*STAGES, "total"):
            p10, med, p90 = quantiles(samples[stage])
            rows.append([shape.name, args.dtype, m, stage, C.fmt(p10), C.fmt(med), C.fmt(p90),
                         f"{100 * (p90 - p10) / med:.0f}%" if med > 0 else "—"])
        rows.append([shape.name, args.dtype, m, f"layer ({graph_timing.mode})",
                     C.fmt(graph_timing.p10_us), C.fmt(graph_timing.median_us),
                     C.fmt(graph_timing.p90_us), ""])
        payload_rows.append(dict(shape=shape.name, dtype=args.dtype, M=m,
                                 rows_per_expert=counts.tolist(), samples_us=samples,
                                 layer_us=graph_timing.median_us,
                                 layer_p10_us=graph_timing.p10_us,
                                 layer_p90_us=graph_timing.p90_us,
                                 histograms={s: histogram(samples[s])
                                             for s in ("gemm1", "gemm2", "total")}))
    headers = ["shape", "dtype", "M", "stage", "p10 µs", "median µs", "p90 µs", "p90-p10"]
    print(C.text_table(headers, rows))
    lines = [C.env_header_md("hopper_moe Triton layer by stage: " + env.get("gpu", "?"), env,
                             None, [f"stages: eager calls with events between stages, "
                                    f"{args.iters} per M, L2 evicted before each; the layer "
                                    "row: bench_moe.py's graph timing"]),
             C.markdown_table(headers, rows), ""]
    for r in payload_rows:
        lines.append(f"M = {r['M']}: rows per expert {r['rows_per_expert']}")
        for stage, hist in r["histograms"].items():
            bars = ", ".join(f"{lo:.0f}-{hi:.0f}: {c}" for lo, hi, c in hist if c)
            lines.append(f"- {stage} histogram (µs: calls): {bars}")
        lines.append("")
    md, js = C.write_results(args.out, f"{C.gpu_slug(env.get('gpu', 'cpu'))}_{args.tag}",
                             "\n".join(lines), dict(env=env, args=vars(args), rows=payload_rows))
    print(f"# wrote {C.show_path(md)} and {C.show_path(js)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
