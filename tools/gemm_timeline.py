"""Where a GEMM-only replay's time goes, CTA by CTA: the grouped GEMM's timeline stamps.

Needs an extension built with the stamps compiled in (a diagnosis build):

    HOPPER_MOE_NVCC_FLAGS=-DHOPPER_MOE_GEMM_TIMELINE python setup.py build_ext --inplace
    PYTHONPATH=python python tools/gemm_timeline.py --shape mixtral --dtype fp8_tensor --m 1

One eager call of bench_moe.py's GEMM-only pair (the row's inputs and routing), after the
benchmark's L2 eviction (--evict write or clean). Each CTA of each launch stores
%globaltimer (ns) at its start, when its prefix table is ready, after its producer's wait for
the previous kernel, when the producer has issued its last copy, at its first k-tile's
arrival and at the start of each unit, as one row of the launch's record (plain stores at the
CTA's end, which hold back no later launch; `torch.ops.hopper_moe._gemm_timeline()` returns
the records since the last read, one per launch, and clears them). Printed per launch,
relative to the first launch's earliest start, in microseconds: min / median / max over the
CTAs of each stamp, the units per CTA, and the spans that matter for the floor (first byte,
the last wave, the overlap with the next launch). `--raw FILE` keeps the records (torch.save).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_moe  # noqa: E402
import common as C  # noqa: E402

# A CTA's row (gemm::TimelineField in csrc/include/hopper_moe/gemm/moe_gemm_sm90.h): the
# producer's marker, the launch's shape and the producer's stamps, then the consumers' marker,
# first k-tile, units, the first UNITS units' starts and end.
UNITS = 8
PRODUCER = ("marker_p", "n", "k", "silu", "splits", "grid", "cta", "sm", "start", "ready",
            "waited", "issued")
CONSUMER = ("marker_c", "first", "units") + tuple(f"u{j}" for j in range(UNITS)) + ("end",)
FIELDS = PRODUCER + CONSUMER


def parse(records) -> dict[tuple, dict[int, dict[str, int]]]:
    """{launch key (n, k, silu, splits, grid): {cta: {stamp: ns}}} from the records
    ([launches, max CTAs, len(FIELDS)] int64, as _gemm_timeline returns them)."""
    launches: dict[tuple, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    rows = records.tolist() if hasattr(records, "tolist") else records
    for launch in rows:
        for row in launch:
            f = dict(zip(FIELDS, (int(v) for v in row)))
            if not f["marker_p"]:
                continue  # no CTA of that index in the launch
            key = tuple(f[name] for name in ("n", "k", "silu", "splits", "grid"))
            cta = launches[key][f["cta"]]
            cta["sm"] = f["sm"]
            for name in ("start", "ready", "waited", "issued"):
                cta[name] = f[name]
            if f["marker_c"]:
                if f["first"]:  # 0: the CTA had no unit
                    cta["first"] = f["first"]
                cta["end"] = f["end"]
                cta["units"] = f["units"]
                for j in range(UNITS):
                    if f[f"u{j}"]:
                        cta[f"u{j}"] = f[f"u{j}"]
    return launches


def spread(values: list[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def report(launches: dict[tuple, dict[int, dict[str, int]]]) -> str:
    """The per-launch table, in order of the launches' first start."""
    if not launches:
        return "no timeline records: is the extension built with -DHOPPER_MOE_GEMM_TIMELINE?"
    order = sorted(launches, key=lambda k: min(c.get("start", 1 << 62)
                                               for c in launches[k].values()))
    t0 = min(c["start"] for c in launches[order[0]].values() if "start" in c)
    us = lambda t: (t - t0) / 1e3  # noqa: E731
    out = ["# times in us from the first launch's earliest CTA start; min / median / max "
           "over a launch's CTAs"]
    for key in order:
        ctas = launches[key]
        n, k, silu, splits, grid = key
        out.append(f"\n## launch n={n} k={k} silu_mul={silu} k_splits={splits} grid={grid} "
                   f"({len(ctas)} CTAs reported)")
        out.append("| stamp | min | median | max |")
        out.append("|---|---|---|---|")
        names = ["start", "ready", "waited", "first", "issued"]
        names += sorted({s for c in ctas.values() for s in c if re.fullmatch(r"u\d+", s)},
                        key=lambda s: int(s[1:]))
        names.append("end")
        for name in names:
            vals = [us(c[name]) for c in ctas.values() if name in c]
            if vals:
                out.append("| {} | {:.1f} | {:.1f} | {:.1f} |".format(name, *spread(vals)))
        units = [c["units"] for c in ctas.values() if "units" in c]
        if units:
            hist = defaultdict(int)
            for u in units:
                hist[u] += 1
            out.append("units per CTA: " + ", ".join(f"{u}: {hist[u]} CTAs"
                                                     for u in sorted(hist)))
        firsts = [(c["first"] - c["start"]) / 1e3 for c in ctas.values()
                  if c.get("first") and "start" in c]
        if firsts:
            out.append("start -> first k-tile, us: min {:.1f}, median {:.1f}, max {:.1f}"
                       .format(*spread(firsts)))
        ends = sorted(us(c["end"]) for c in ctas.values() if "end" in c)
        if ends:
            out.append(f"CTA ends: 10% {ends[len(ends) // 10]:.1f}, 50% "
                       f"{ends[len(ends) // 2]:.1f}, 90% {ends[9 * len(ends) // 10]:.1f}, "
                       f"last {ends[-1]:.1f}")
    return "\n".join(out)


def run_once(fn, evict):
    """One call of fn after the eviction: the timeline records of its launches."""
    torch.cuda.synchronize()
    if evict is not None:
        evict()
    torch.cuda.synchronize()
    torch.ops.hopper_moe._gemm_timeline()  # drops what earlier launches recorded
    fn()
    torch.cuda.synchronize()
    return torch.ops.hopper_moe._gemm_timeline()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mixtral", choices=sorted(C.SHAPES))
    p.add_argument("--dtype", default="fp8_tensor")
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--evict", default="clean", choices=("write", "clean", "none"))
    p.add_argument("--seed", type=int, default=0, help="bench_moe.py's seed")
    p.add_argument("--raw", help="also save the records to this file (torch.save)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_timeline: needs a GPU")
        return 0
    device = torch.device("cuda")
    lib = bench_moe.Lib(selftest=False)
    if lib.hm is None:
        print(f"gemm_timeline: hopper_moe does not import: {lib.import_error}")
        return 1
    shape = C.SHAPES[args.shape]
    w1, w2 = C.make_weights(shape, device, seed=args.seed + 101)
    w1q, w2q, quant = lib.quantize(w1, w2, args.dtype, False)
    x, tw, ti, touched, nbytes = bench_moe.row_inputs(shape, args.dtype, args.m, quant, device,
                                                      args.seed, 0.0, True)
    fn, how = lib.gemm_only("cute", args.dtype, x, w1q, w2q, tw, ti, quant)
    if fn is None:
        print(f"gemm_timeline: no GEMM-only pair: {how}")
        return 1
    if not hasattr(torch.ops.hopper_moe, "_gemm_timeline"):
        print("gemm_timeline: the extension has no timeline: build it with "
              "HOPPER_MOE_NVCC_FLAGS=-DHOPPER_MOE_GEMM_TIMELINE")
        return 1
    evict = C.make_evictor(args.evict, device)
    for _ in range(3):
        run_once(fn, evict)  # warm-up (handles, descriptors), records dropped
    records = run_once(fn, evict)
    if args.raw:
        torch.save(records, args.raw)
    bw = C.measure_ceilings(device, quick=True).copy_bw
    print(f"# {args.shape} {args.dtype} M={args.m} GEMM-only ({how}), L2 eviction {args.evict}; "
          f"{touched} experts, floor {nbytes / bw * 1e6:.1f} us at {bw / 1e12:.2f} TB/s")
    print(report(parse(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
