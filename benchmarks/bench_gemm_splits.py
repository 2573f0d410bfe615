"""Each GEMM of the cute layer alone, at decode, with the grouped GEMM's K split chosen by
heuristics/sm90.h and forced to 1, 2, 3, 4 and 8 (the op's config, k_splits=N).

    python benchmarks/bench_gemm_splits.py --shapes mixtral,qwen3_30b --m 1,2,4,16

One CUDA graph per (GEMM, split), L2 evicted between replays, median of --iters replays; the
floor is the bytes of the weights of the experts that have rows at the copy bandwidth
measured in the same run. GEMM1 is [M*topk, H] x [E, 2I, H]; GEMM2 [M*topk, I] x [E, H, I];
the activations are random (the timing does not depend on them). Needs an SM90 GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

SPLITS = ("", "1", "2", "3", "4", "8")  # "": the heuristic's choice


def split_config(split: str) -> str:
    """The grouped GEMM's config for a split of SPLITS: "" (the heuristic's) or k_splits=N."""
    return f"k_splits={split}" if split else ""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="mixtral,qwen3_30b")
    p.add_argument("--dtypes", default="bf16,fp8", help="bf16 and/or fp8 (e4m3, unit scales)")
    p.add_argument("--m", default="1,2,4,16", help="token counts")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="routing seed (bench_moe.py's)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print(C.no_gpu_banner())
        print("bench_gemm_splits: the grouped GEMM is sm_90a code; this needs an SM90 GPU")
        return 0
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"bench_gemm_splits: hopper_moe does not import: {err}")
        return 1
    from hopper_moe import ops

    dev = torch.device("cuda")
    evict = C.L2Evictor(dev)
    bw = C.measure_ceilings(dev, quick=True).copy_bw
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s; cells: split: median us (% of floor)")
    for shape_name in C.parse_list(args.shapes, str):
        shape = C.SHAPES[shape_name]
        e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
        gen = torch.Generator(device=dev).manual_seed(1)
        for dtype in C.parse_list(args.dtypes, str):
            w1 = torch.randn(e, 2 * i, h, device=dev, generator=gen).mul_(h ** -0.5)
            w2 = torch.randn(e, h, i, device=dev, generator=gen).mul_(i ** -0.5)
            wdt = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
            w1, w2 = w1.to(wdt), w2.to(wdt)
            for m in C.parse_list(args.m, int):
                _, _, ti = C.routing(m, e, shape.top_k, dev, seed=args.seed)
                counts = torch.bincount(ti.flatten().long(), minlength=e)
                offs = torch.zeros(e + 1, dtype=torch.int64, device=dev)
                offs[1:] = counts.cumsum(0)
                active = int((counts > 0).sum())
                rows = ti.numel()
                for name, w, k in (("gemm1", w1, h), ("gemm2", w2, i)):
                    n = w.shape[1]
                    a = torch.randn(rows, k, device=dev, generator=gen).to(wdt)
                    sa = torch.ones(1, device=dev) if dtype == "fp8" else None
                    sb = torch.ones(e, device=dev) if dtype == "fp8" else None
                    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
                    floor_us = active * n * k * w.element_size() / bw * 1e6
                    cells = []
                    for s in SPLITS:
                        t, _ = C.time_fn(
                            lambda a=a, w=w, sa=sa, sb=sb, out=out, config=split_config(s):
                            ops.moe_grouped_gemm(a, w, offs, sa, sb, out=out, config=config),
                            dev, iters=args.iters, warmup=args.warmup, evict=evict)
                        cells.append(f"{s or 'auto'}: {t.median_us:.1f} "
                                     f"({100 * floor_us / t.median_us:.0f}%)")
                    print(f"{shape_name} {dtype} M={m} {name} experts={active} "
                          f"floor={floor_us:.1f} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
