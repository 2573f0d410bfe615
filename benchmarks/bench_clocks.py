"""The Triton layer's graph replayed with the GPU's clock, power and throttle reasons sampled
by nvidia-smi alongside, to tell a kernel's spread from the GPU's power management.

    python benchmarks/bench_clocks.py --shape mixtral --dtype bf16 --m 1024

Two passes of --iters replays, L2 evicted before each: "sync" waits for every replay (its
end time is matched to the nearest nvidia-smi sample), "burst" is bench_moe.py's timing core
(common.event_loop: all replays queued, one synchronize). Prints each pass's p10 / median / p90 and a 50 us histogram, then
the mean SM clock and power of the samples nearest to the fast and the slow half of the sync
replays, the throttle reasons seen and the clock range. The raw samples go to --out. Needs a
CUDA GPU and nvidia-smi.
"""
from __future__ import annotations

import argparse
import bisect
import datetime
import os
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mixtral")
    p.add_argument("--dtype", default="bf16", help="bf16 or an FP8 scheme of bench_moe.py")
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--sample-ms", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".")
    return p.parse_args(argv)


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    n = len(s)
    return s[n // 10], s[n // 2], s[min(n - 1, 9 * n // 10)]


def read_samples(path: str) -> list[tuple[float, float, float, str]]:
    """(unix time, SM MHz, W, throttle reasons) per nvidia-smi line that parses."""
    out = []
    with open(path) as f:
        for line in f:
            p = [v.strip() for v in line.split(",")]
            try:
                ts = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                out.append((ts, float(p[1]), float(p[2]), p[4]))
            except (ValueError, IndexError):
                continue
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        print(C.no_gpu_banner())
        print("bench_clocks: needs a CUDA GPU and nvidia-smi")
        return 0
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"bench_clocks: hopper_moe does not import: {err}")
        return 1
    from hopper_moe.backends.triton import fused_experts_triton

    dev = torch.device("cuda")
    shape = C.SHAPES[args.shape]
    w1, w2 = C.make_weights(shape, dev, seed=1)
    quant = None
    if args.dtype != "bf16":
        from hopper_moe.quant import make_quant_config
        w1, w2, quant = make_quant_config(w1, w2, args.dtype)
    _, tw, ti = C.routing(args.m, shape.num_experts, shape.top_k, dev, seed=args.seed)
    x = C.make_hidden(args.m, shape.hidden_size, dev, seed=args.seed + 1)
    graph, _ = C.capture_graph(lambda: fused_experts_triton(x, w1, w2, tw, ti, quant=quant))
    evict = C.L2Evictor(dev)
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"clocks_{args.shape}_{args.dtype}_m{args.m}.csv")
    with open(path, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}",
                                "--format=csv,noheader,nounits", "-lms", str(args.sample_ms)],
                               stdout=log)
        try:
            time.sleep(1.0)
            sync = []
            for _ in range(args.iters):
                evict()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                sync.append((time.time(), s.elapsed_time(e) * 1e3))
            burst = C.event_loop(graph.replay, evict, args.iters)
            time.sleep(0.3)
        finally:
            smi.terminate()
            smi.wait()
    samples = read_samples(path)
    print(f"# {args.shape} {args.dtype} M = {args.m}: {len(samples)} nvidia-smi samples "
          f"in {path}")
    for name, us in (("sync", [u for _, u in sync]), ("burst", burst)):
        p10, med, p90 = quantiles(us)
        hist: dict[int, int] = {}
        for u in us:
            hist[int(u // 50) * 50] = hist.get(int(u // 50) * 50, 0) + 1
        print(f"{name}: p10 {p10:.0f} us, median {med:.0f}, p90 {p90:.0f}; histogram "
              + ", ".join(f"{lo}-{lo + 50}: {c}" for lo, c in sorted(hist.items())))
    if samples:
        times = [s[0] for s in samples]
        p10, _, p90 = quantiles([u for _, u in sync])
        cut = (p10 + p90) / 2
        groups: dict[str, list] = {"fast": [], "slow": []}
        for t, u in sync:
            i = min(max(bisect.bisect_left(times, t) - 1, 0), len(samples) - 1)
            groups["fast" if u < cut else "slow"].append(samples[i])
        for name, g in groups.items():
            if g:
                print(f"{name} sync replays (< / >= {cut:.0f} us): {len(g)}, nearest samples' "
                      f"SM clock {sum(s[1] for s in g) / len(g):.0f} MHz, power "
                      f"{sum(s[2] for s in g) / len(g):.0f} W")
        print("throttle reasons seen:", " ".join(sorted({s[3] for s in samples})))
        print(f"SM clock over the run: {min(s[1] for s in samples):.0f}-"
              f"{max(s[1] for s in samples):.0f} MHz (idle moments included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
