"""``python -m hopper_moe.oracle --measure``: time every backend on this GPU and write the
measured table ``fused_experts(backend="auto")`` reads (hopper_moe.oracle).

    python -m hopper_moe.oracle --measure                         # the shipped shapes, all schemes
    python -m hopper_moe.oracle --measure --shape 64,6,5120,1536  # your layer: E,topk,H,I
    python -m hopper_moe.oracle --measure --schemes bf16,fp8_block --m 1,8,64,512,4096

Per (shape, scheme, token count M) and backend: the whole layer (fused_experts) captured in a
CUDA graph, warm-up replays, then the median of --iters replays timed with CUDA events, L2
evicted (a 256 MiB write) before each, as benchmarks/bench_moe.py times it (a backend whose
layer cannot be captured is timed eagerly, the same way); two passes over the backends in
opposite orders, the smaller median of each kept. Inputs are random: weights N(0, 1/H),
routing softmax top-k of N(0, 1) logits. The table goes to --out (default: the folder in
$HOPPER_MOE_CONFIG_DIR, else the current folder) as ``oracle,device_name=<GPU>.json``; put
it in $HOPPER_MOE_CONFIG_DIR to use it (it wins over the shipped table of the same GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Callable, Optional

import torch

from . import api, settings
from .oracle import measured_file_name
from .quant import make_quant_config

__all__ = ["SHAPES", "main", "measure_layer"]

# The layers of docs/BENCHMARK.md: (E, topk, H, I).
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "mixtral": (8, 2, 4096, 14336),
    "mixtral_tp2": (8, 2, 4096, 7168),
    "qwen3_30b": (128, 8, 2048, 768),
    "qwen3_235b_tp4": (128, 8, 4096, 384),
    "deepseek_v3_tp8": (256, 8, 7168, 256),
    "gpt_oss_120b": (128, 4, 2880, 2880),
}
SCHEMES = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
M_LIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_MEASURED = ("sm90", "triton", "torch")
_EVICT_BYTES = 256 << 20


def _time_replays(fn: Callable[[], object], evict: Callable[[], None], iters: int,
                  warmup: int) -> float:
    """Median µs of fn over iters runs, each after evict(), events around fn only."""
    for _ in range(warmup):
        evict()
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(start, end):
        evict()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))


def measure_layer(call: Callable[[], object], evict: Callable[[], None], iters: int,
                  warmup: int) -> tuple[float, str]:
    """(median µs, "graph" or "eager") of one layer call."""
    call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        return _time_replays(graph.replay, evict, iters, warmup), "graph"
    except Exception:  # a backend with a host sync cannot be captured: time it eagerly
        torch.cuda.synchronize()
        return _time_replays(call, evict, iters, warmup), "eager"


def _routing(m: int, num_experts: int, top_k: int, device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(m, num_experts, generator=gen, device="cpu")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(device), ids.to(device=device, dtype=torch.int32)


def _applies(shape, scheme: str) -> bool:
    return scheme != "fp8_block" or (shape[2] % 128 == 0 and shape[3] % 128 == 0)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hopper_moe.oracle",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="time the backends, write the table")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--shape", action="append", default=[],
                   help="an extra layer E,topk,H,I (repeatable)")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--m", default=",".join(map(str, M_LIST)))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="folder of the table (default: "
                   "$HOPPER_MOE_CONFIG_DIR, else the current folder)")
    args = p.parse_args(argv)
    if not args.measure:
        p.print_help()
        return 0
    if not torch.cuda.is_available():
        print("hopper_moe.oracle --measure needs a CUDA GPU; none is available. Nothing "
              "measured.")
        return 1
    shapes = {}
    for name in filter(None, args.shapes.split(",")):
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        shapes[name] = SHAPES[name]
    for text in args.shape:
        try:
            e, k, h, i = (int(v) for v in text.split(","))
        except ValueError:
            p.error(f"--shape must be E,topk,H,I (four ints), got {text!r}")
        shapes[f"E{e}_k{k}_H{h}_I{i}"] = (e, k, h, i)
    schemes = [s for s in args.schemes.split(",") if s]
    for s in schemes:
        if s not in SCHEMES:
            p.error(f"unknown scheme {s!r}; known: {', '.join(SCHEMES)}")
    ms = sorted({int(v) for v in args.m.split(",") if v})
    if not ms or ms[0] < 1:
        p.error("--m must list token counts >= 1")
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(device)
    scratch = torch.empty(_EVICT_BYTES, dtype=torch.uint8, device=device)

    def evict() -> None:
        scratch.fill_(1)

    entries = []
    available = [b for b in _MEASURED if b in api.available_backends("cuda")]
    print(f"# hopper_moe.oracle --measure on {gpu}; backends {', '.join(available)}",
          flush=True)
    for shape_name, (e, k, h, i) in shapes.items():
        gen = torch.Generator(device="cpu").manual_seed(1)
        cpu = torch.device("cpu")  # the generator's device, whatever the default device is
        w1 = (torch.randn(e, 2 * i, h, generator=gen, device=cpu) / h ** 0.5).to(device, dtype)
        w2 = (torch.randn(e, h, i, generator=gen, device=cpu) / i ** 0.5).to(device, dtype)
        x_all = torch.randn(max(ms), h, generator=gen, device=cpu).to(device, dtype)
        for scheme in schemes:
            if not _applies((e, k, h, i), scheme):
                continue
            w1q, w2q, quant = make_quant_config(w1, w2, scheme)
            runnable = [b for b in available
                        if api._BACKENDS[b].supports(device, dtype, w1q, w2q, quant)]
            for b in runnable:
                if b == "triton":
                    from .warm import warmup
                    warmup(w1q, w2q, k, max(ms), dtype=dtype, quant=quant, backend=b)
            for m in ms:
                tw, ti = _routing(m, e, k, device, seed=m)
                x = x_all[:m]
                # Two passes in opposite orders, the smaller median per backend: a backend
                # timed right after a slow one (heat, clocks) must not lose a close row.
                us_only: dict[str, float] = {}
                for order in (runnable, runnable[::-1]):
                    for b in order:
                        def call(b=b):
                            return api.fused_experts(x, w1q, w2q, tw, ti, quant=quant,
                                                     backend=b)
                        us, _ = measure_layer(call, evict, args.iters, args.warmup)
                        us_only[b] = round(min(us, us_only.get(b, us)), 2)
                best = min(us_only, key=us_only.get)
                entries.append(dict(name=shape_name, shape=dict(E=e, topk=k, H=h, I=i),
                                    scheme=scheme, m=m, us=us_only, fastest=best))
                cells = "  ".join(f"{b} {v:9.1f}" for b, v in us_only.items())
                print(f"{shape_name:16s} {scheme:12s} M={m:<5d} {cells}  -> {best}", flush=True)
            del w1q, w2q, quant
        del w1, w2, x_all
        torch.cuda.empty_cache()
    table = dict(
        device_name=gpu,
        command="python -m hopper_moe.oracle " + " ".join(sys.argv[1:] if argv is None
                                                          else argv),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        torch=torch.__version__, dtype=args.dtype, iters=args.iters,
        method="CUDA graph of fused_experts, L2 evicted (256 MiB write) before each replay, "
               "median of iters replays, microseconds",
        entries=entries)
    folder = args.out or settings.CONFIG_DIR or os.getcwd()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, measured_file_name(gpu))
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    print(f"# wrote {path} ({len(entries)} entries)")
    return 0
