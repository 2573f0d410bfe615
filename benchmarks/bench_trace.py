"""Per-kernel device times of one MoE layer (or its two GEMMs) replayed as a CUDA graph.

    PYTHONPATH=python python benchmarks/bench_trace.py --shapes mixtral --dtypes fp8_tensor \
        --m 1,2 --gemm-only
    PYTHONPATH=python python benchmarks/bench_trace.py --shapes qwen3_30b --m 1,4,16

bench_moe.py times a replay with CUDA events: launch latency, the gaps between kernels and
each kernel's ramp and drain all land in one number. This replays the same graph (L2 evicted
before each replay as there, --evict write / clean / rotate / none, default a 256 MiB write;
rotate cycles through one graph per weight copy with a spin kernel between replays) under
torch.profiler and prints, per kernel of the replay in launch order, its median device
duration and the median gap between the previous kernel's end and its start (negative: the
launches overlapped, as programmatic dependent launches do), then the replay's device span
(first kernel's start to last kernel's end) next to the event-timed median, and the device
time around it: from the end of the marker kernel launched just before the replay to the
replay's first kernel's start, and from its last kernel's end to the start of the marker
after it (where the events' extra time over the span is spent). --read-control adds the
time of a kernel that only reads the floor's bytes (read_control.py), timed as the rows are,
under the same eviction (under rotate: R buffers of those bytes, read in turn). Needs a GPU;
the profiler's own overhead is not in the device times.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe as B  # noqa: E402
import common as C  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral")
    p.add_argument("--dtypes", default="bf16,fp8_tensor")
    p.add_argument("--m", default="1,4,16")
    p.add_argument("--backend", default="cute")
    p.add_argument("--gemm-only", action="store_true", help="GEMM1 + GEMM2 only")
    p.add_argument("--static-act", action="store_true", help="static FP8 activation scales")
    C.add_evict_args(p)
    p.add_argument("--read-control", action="store_true",
                   help="also time a kernel that only reads the row's floor bytes "
                        "(read_control.py), the same way: what a pure stream of them takes")
    p.add_argument("--iters", type=int, default=20, help="profiled replays")
    p.add_argument("--seed", type=int, default=0, help="bench_moe.py's routing seed")
    args = p.parse_args(argv)
    C.resolve_evict(p, args)
    return args


def short(name: str, width: int = 60) -> str:
    """A kernel's name without its template arguments' bulk."""
    base = name.split("(")[0]
    if "<" in base:
        head, _, rest = base.partition("<")
        base = head + "<" + rest[:width - len(head) - 2] + ("...>" if len(rest) > width else "")
    return base[:width + 4]


class Replay(list):
    """The kernels of one replay, [(name, start us, end us)] in start order, plus the end of
    the marker kernel before it (begin_end) and the start of the one after it (end_start)."""
    begin_end: float = 0.0
    end_start: float = 0.0


def kernels_per_replay(prof, begin: str, end: str) -> list[Replay]:
    """The replays between a kernel whose name contains `begin` and the next one whose name
    contains `end` (the markers around each replay), each its device kernels."""
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    events.sort(key=lambda e: e.time_range.start)
    replays: list[Replay] = []
    current: Replay | None = None
    for e in events:
        if begin in e.name:
            current = Replay()
            current.begin_end = float(e.time_range.end)
        elif end in e.name:
            if current:
                current.end_start = float(e.time_range.start)
                replays.append(current)
            current = None
        elif current is not None:
            current.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return replays


def summarize(replays: list[Replay]) -> list[str]:
    counts = {len(r) for r in replays}
    if len(counts) != 1:
        return [f"replays have different kernel counts {sorted(counts)}: not summarized"]
    lines = ["| # | kernel | device us (median) | gap before, us |", "|---|---|---|---|"]
    n = counts.pop()
    for i in range(n):
        dur = statistics.median(r[i][2] - r[i][1] for r in replays)
        gap = "" if i == 0 else f"{statistics.median(r[i][1] - r[i - 1][2] for r in replays):.1f}"
        lines.append(f"| {i} | `{short(replays[0][i][0])}` | {dur:.1f} | {gap} |")
    span = statistics.median(max(k[2] for k in r) - r[0][1] for r in replays)
    busy = statistics.median(sum(k[2] - k[1] for k in r) for r in replays)
    lead = statistics.median(r[0][1] - r.begin_end for r in replays)
    tail = statistics.median(r.end_start - max(k[2] for k in r) for r in replays)
    lines.append(f"\ndevice span {span:.1f} us (first start to last end), kernel time summed "
                 f"{busy:.1f} us; around the replay: {lead:.1f} us from the marker kernel "
                 f"before it to its first kernel's start, {tail:.1f} us from its last kernel's "
                 f"end to the marker after it")
    return lines


def read_control(args, dev: torch.device, shape: C.MoEShape, nbytes: int, evict) -> str:
    """read_control.py's kernel over a buffer of the floor's bytes, timed as the rows are (a
    CUDA graph, warm-up by GPU time, events): `evict` between reads, or under rotate R such
    buffers, one graph each, read in turn (R from the same rule as the weight copies)."""
    import read_control as RC
    buf = torch.ones(-(-int(nbytes) // 16) * 4, dtype=torch.int32, device=dev)
    rot, why = B.row_rotation(args, dev, shape, nbytes, (buf,))
    if why:
        return "read control: " + why
    bufs = rot.copies if rot is not None else [(buf,)]
    fns = [RC.make_buffer_read(b) for (b,) in bufs]
    timing, _ = C.time_fn(fns[0], dev, iters=max(args.iters, 50), warmup=10, evict=evict,
                          copies=fns if rot is not None else None)
    copies = f", R = {len(bufs)} buffers in turn" if rot is not None else ""
    return (f"read control: one kernel reading the floor's {nbytes / 1e6:.1f} MB{copies} "
            f"(benchmarks/read_control.py), {timing.mode} median {timing.median_us:.1f} us")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(C.no_gpu_banner())
        print("bench_trace: needs a GPU")
        return 0
    from torch.profiler import ProfilerActivity, profile

    lib = B.Lib(selftest=False)
    if lib.hm is None:
        print(f"bench_trace: hopper_moe does not import: {lib.import_error}")
        return 1
    dev = torch.device("cuda")
    evict = C.make_evictor(args.evict, dev)
    ceil = C.measure_ceilings(dev, quick=True)
    print(f"# {' '.join(sys.argv)}\n# copy {ceil.copy_bw / 1e12:.2f} TB/s; backend "
          f"{args.backend}; {'GEMM1 + GEMM2' if args.gemm_only else 'whole layer'}; "
          f"PDL {'off' if os.environ.get('HOPPER_MOE_PDL') == '0' else 'on'}; "
          + C.evict_description(args.evict, C.l2_cache_bytes(dev)))
    for shape_name in C.parse_list(args.shapes, str):
        shape = C.SHAPES[shape_name]
        w1, w2 = C.make_weights(shape, dev, seed=args.seed + 101)
        for scheme in C.parse_list(args.dtypes, str):
            w1q, w2q, quant = lib.quantize(w1, w2, scheme, args.static_act)
            for m in C.parse_list(args.m, int):
                x, tw, ti, _, nbytes = B.row_inputs(shape, scheme, m, quant, dev, args.seed,
                                                    0.0, args.gemm_only)
                fn, how = B.row_fn(lib, args.backend, scheme, x, tw, ti, args.gemm_only, w1q,
                                   w2q, quant)
                if fn is None:
                    print(f"## {shape.name} {scheme} M={m}: {how}")
                    continue
                rot, why = B.row_rotation(args, dev, shape, nbytes, (w1q, w2q, quant))
                if why:
                    print(f"## {shape.name} {scheme} M={m}: {why}")
                    continue
                fns = [fn]
                if rot is not None:
                    fns = rot.build(B.copy_fn_builder(lib, args.backend, scheme, x, tw, ti,
                                                      args.gemm_only), first=fn)
                with torch.no_grad():
                    graphs, _ = C.capture_graphs(fns)
                    replay = C.Cycle([g.replay for g in graphs])
                    C.warm_up(replay, 5, len(graphs))
                    timed = C.event_loop(replay, evict, max(args.iters, 20))
                    torch.cuda.synchronize()
                    marker = torch.zeros(1, dtype=torch.int32, device=dev)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.iters):
                            if evict is not None:
                                evict()
                            torch.neg(marker, out=marker)  # the markers around a replay
                            replay()
                            torch.bitwise_not(marker, out=marker)
                        torch.cuda.synchronize()
                floor = nbytes / ceil.copy_bw * 1e6
                copies = f", rotating R = {rot.r} weight copies" if rot is not None else ""
                if rot is not None and rot.note:
                    copies += f" ({rot.note})"
                print(f"\n## {shape.name} {scheme} M={m}: events median "
                      f"{statistics.median(timed):.1f} us, bytes floor {floor:.1f} us{copies}")
                del graphs, replay, fns
                if rot is not None:  # the weight copies go before the read control's buffers
                    rot.free()
                    del rot
                if args.read_control:
                    print(read_control(args, dev, shape, nbytes, evict))
                replays = kernels_per_replay(prof, "neg_kernel", "bitwise_not")
                if not replays:
                    names = sorted({short(e.name) for e in prof.events()
                                    if e.device_type == torch.autograd.DeviceType.CUDA})
                    print("no replay boundary found; device events: " + ", ".join(names))
                for line in summarize(replays):
                    print(line)
            del w1q, w2q, quant
        del w1, w2
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
