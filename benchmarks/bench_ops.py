"""Benchmark of hopper_moe's non-GEMM ops (routing, align/permute, reduction, activation,
FP8 quantization) at the BENCHMARK.md shapes' E / topk / H / I.

    PYTHONPATH=python python benchmarks/bench_ops.py
    PYTHONPATH=python python benchmarks/bench_ops.py --ops moe_sum,silu_and_mul --m 1,64,4096
    PYTHONPATH=python python benchmarks/bench_ops.py --quick

Per row: median µs of the op in a CUDA graph (L2 evicted between replays), GB/s of the
fewest bytes the op must move, % of floor (floor = bytes / measured copy bandwidth), × baseline
(a torch-native equivalent of the op, timed the same way: its time / the op's time), and a
correctness check of the GPU op against the CPU op (torch.ops.hopper_moe.* on CPU copies of
the same inputs). Without a GPU: each op once on a small CPU input, checked against the
torch-native equivalent, then a clear message, exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

OPS = ["topk_softmax", "moe_align_block_size", "moe_permute", "moe_unpermute", "moe_sum",
       "silu_and_mul", "silu_and_mul_quant", "static_scaled_fp8_quant",
       "dynamic_scaled_fp8_quant", "dynamic_per_token_scaled_fp8_quant",
       "per_token_group_fp8_quant", "shuffle_rows"]
OPS_M_LIST = [1, 4, 16, 64, 256, 1024, 4096]
QUICK_OPS_M_LIST = [1, 64, 4096]
FP8_MAX = 448.0
STATIC_SCALE = 0.05  # |values| of the test data stay far below 448 * 0.05
GROUP = 128
ALIGN_BLOCK = 64


@dataclass
class Case:
    """One op at one size. Inputs live on the benchmark device; `alloc` makes output buffers
    on the device of the inputs it is given, `call` runs the hopper_moe op in place."""
    op: str
    dims: dict[str, int]
    nbytes: int
    inputs: dict[str, torch.Tensor]
    alloc: Callable[[dict], dict]
    call: Callable[[dict, dict], None]
    kinds: dict[str, str]  # output -> "exact" | "rel" | "fp8" (dequantized by deq[output])
    baseline: Callable[[dict], dict] | None = None
    deq: dict[str, Callable[[dict, dict], torch.Tensor]] = field(default_factory=dict)
    special: Callable[[dict, dict], tuple[str, bool]] | None = None


def _ops():
    return torch.ops.hopper_moe


def _routing_inputs(t: int, e: int, k: int, dev, seed: int):
    logits, tw, ti = C.routing(t, e, k, dev, seed=seed)
    return logits, tw, ti


def _slot_order(ti: torch.Tensor):
    """Slots sorted by expert (stable), the inverse permutation and expert offsets."""
    t, k = ti.shape
    flat = ti.flatten().long()
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=ti.device)
    return order, inv.view(t, k)


def _fp8_q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(C.FP8)


def _randn(shape, dev, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, device=dev, generator=gen)


# ------------------------------------------------------------------------------ cases
def case_topk_softmax(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    e, k = s.num_experts, s.top_k
    logits, _, _ = _routing_inputs(t, e, k, dev, seed)

    def alloc(i):
        d = i["gating"].device
        return {"w": torch.empty(t, k, dtype=torch.float32, device=d),
                "ids": torch.empty(t, k, dtype=torch.int32, device=d),
                "tei": torch.empty(t, k, dtype=torch.int32, device=d)}

    def call(i, o):
        _ops().topk_softmax(o["w"], o["ids"], o["tei"], i["gating"], True, None, None)

    def base(i):
        p = torch.softmax(i["gating"], dim=-1)
        w, ids = torch.topk(p, k, dim=-1)
        return {"w": w / w.sum(-1, keepdim=True), "ids": ids.to(torch.int32)}
    return Case("topk_softmax", dict(E=e, K=k), t * e * 4 + t * k * 12, {"gating": logits},
                alloc, call, {"w": "rel", "ids": "exact", "tei": "exact"}, base)


def _align_sizes(numel: int, e: int, bs: int) -> tuple[int, int]:
    try:
        import hopper_moe.ops as hops
        ids = torch.empty(numel, dtype=torch.int32, device="meta")
        st, ex, _ = hops.moe_align_block_size_buffers(ids.view(-1, 1), e, bs)
        return st.numel(), ex.numel()
    except Exception:  # noqa: BLE001  (wrapper absent: the plain upper bound)
        mp = numel + e * (bs - 1)
        return mp, (mp + bs - 1) // bs


def case_moe_align_block_size(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    e, k, bs = s.num_experts, s.top_k, ALIGN_BLOCK
    _, _, ti = _routing_inputs(t, e, k, dev, seed)
    n_sorted, n_blocks = _align_sizes(t * k, e, bs)

    def alloc(i):
        d = i["topk_ids"].device
        return {"sorted": torch.empty(n_sorted, dtype=torch.int32, device=d),
                "experts": torch.empty(n_blocks, dtype=torch.int32, device=d),
                "ntpp": torch.empty(1, dtype=torch.int32, device=d)}

    def call(i, o):
        _ops().moe_align_block_size(i["topk_ids"], e, bs, o["sorted"], o["experts"], o["ntpp"],
                                    None, None)

    def special(got, want) -> tuple[str, bool]:
        g = {kk: v.cpu() for kk, v in got.items()}
        n = int(want["ntpp"][0])
        if int(g["ntpp"][0]) != n:
            return f"MISMATCH num_tokens_post_pad {int(g['ntpp'][0])} vs {n}", False
        nb = n // bs
        if not torch.equal(g["experts"][:nb], want["experts"][:nb]):
            return "MISMATCH experts_ids", False
        # per-expert token sets: sort (expert of the block, token id) pairs within the padded
        # prefix; equal sorted pairs = equal multisets in every expert segment.
        seg = want["experts"][:nb].long().repeat_interleave(bs)
        key = t * k + 1

        def canon(v):
            return torch.sort(seg * key + v[:n].long()).values
        if not torch.equal(canon(g["sorted"]), canon(want["sorted"])):
            return "MISMATCH sorted_token_ids (per-expert sets)", False
        return "ok (exact, per-expert sets)", True
    def base(i):
        ids = i["topk_ids"]
        flat = ids.flatten().long()
        numel = flat.numel()
        counts = torch.zeros(e, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + bs - 1) // bs * bs
        ends = torch.cumsum(padded, 0)
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        first = torch.cumsum(counts, 0) - counts
        pos = (ends - padded)[sorted_e] + torch.arange(numel, device=ids.device) - first[sorted_e]
        st = torch.full((n_sorted,), numel, dtype=torch.int32, device=ids.device)
        st[pos] = order.to(torch.int32)
        blocks = torch.arange(n_blocks, device=ids.device) * bs
        ex = torch.searchsorted(ends, blocks, right=True).clamp(max=e - 1).to(torch.int32)
        return {"sorted": st, "experts": ex, "ntpp": ends[-1:].to(torch.int32)}
    # ids read once, the padded sorted list and one expert id per block written (upper bound)
    nbytes = t * k * 4 + n_sorted * 4 + n_blocks * 4
    return Case("moe_align_block_size", dict(E=e, K=k, block=bs), nbytes, {"topk_ids": ti},
                alloc, call, {}, base, special=special)


def case_moe_permute(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    e, k, h = s.num_experts, s.top_k, s.hidden_size
    _, _, ti = _routing_inputs(t, e, k, dev, seed)
    x = _randn((t, h), dev, seed + 1)
    tei = torch.arange(t * k, dtype=torch.int32, device=dev).view(t, k)

    def alloc(i):
        d = i["x"].device
        return {"permuted": torch.empty(t * k, h, dtype=torch.bfloat16, device=d),
                "efto": torch.empty(e + 1, dtype=torch.int64, device=d),
                "inv": torch.empty(t, k, dtype=torch.int32, device=d),
                "pidx": torch.full((t * k,), t * k, dtype=torch.int32, device=d)}

    def call(i, o):
        _ops().moe_permute(i["x"], i["topk_ids"], i["tei"], None, e, e, k, o["permuted"],
                           o["efto"], o["inv"], o["pidx"])

    def base(i):
        flat = i["topk_ids"].flatten().long()
        order = torch.argsort(flat, stable=True)
        rows = i["x"].index_select(0, order // k)
        counts = torch.zeros(e, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        efto = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        return {"efto": efto, "_rows": rows}
    nbytes = t * h * 2 + t * k * h * 2 + t * k * 4 * 3 + (e + 1) * 8
    return Case("moe_permute", dict(E=e, K=k, H=h), nbytes,
                {"x": x, "topk_ids": ti, "tei": tei}, alloc, call,
                {"permuted": "exact", "efto": "exact", "inv": "exact", "pidx": "exact"}, base)


def case_moe_unpermute(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    e, k, h = s.num_experts, s.top_k, s.hidden_size
    _, tw, ti = _routing_inputs(t, e, k, dev, seed)
    order, inv = _slot_order(ti)
    flat = ti.flatten().long()
    counts = torch.zeros(e, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    efto = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    ph = _randn((t * k, h), dev, seed + 2)

    def alloc(i):
        return {"out": torch.empty(t, h, dtype=torch.bfloat16, device=i["ph"].device)}

    def call(i, o):
        _ops().moe_unpermute(i["ph"], i["tw"], i["inv"], i["efto"], k, o["out"])

    def base(i):
        g = i["ph"].index_select(0, i["inv"].flatten().long()).view(t, k, h).float()
        return {"out": (g * i["tw"][..., None]).sum(1).to(torch.bfloat16)}
    nbytes = t * k * h * 2 + t * h * 2 + t * k * 8
    return Case("moe_unpermute", dict(E=e, K=k, H=h), nbytes,
                {"ph": ph, "tw": tw, "inv": inv.to(torch.int32), "efto": efto},
                alloc, call, {"out": "rel"}, base)


def case_moe_sum(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    k, h = s.top_k, s.hidden_size
    x = _randn((t, k, h), dev, seed)

    def alloc(i):
        return {"out": torch.empty(t, h, dtype=torch.bfloat16, device=i["x"].device)}

    def call(i, o):
        _ops().moe_sum(i["x"], o["out"], None, None)

    def base(i):
        return {"out": i["x"].float().sum(1).to(torch.bfloat16)}
    return Case("moe_sum", dict(K=k, H=h), t * k * h * 2 + t * h * 2, {"x": x}, alloc, call,
                {"out": "rel"}, base)


def case_silu_and_mul(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    k, i_ = s.top_k, s.intermediate_size
    rows = t * k
    x = _randn((rows, 2 * i_), dev, seed)

    def alloc(i):
        return {"out": torch.empty(rows, i_, dtype=torch.bfloat16, device=i["x"].device)}

    def call(i, o):
        _ops().silu_and_mul(o["out"], i["x"])

    def base(i):
        return {"out": F.silu(i["x"][:, :i_]) * i["x"][:, i_:]}
    return Case("silu_and_mul", dict(K=k, I=i_), rows * 3 * i_ * 2, {"x": x}, alloc, call,
                {"out": "rel"}, base)


def case_silu_and_mul_quant(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    k, i_ = s.top_k, s.intermediate_size
    rows = t * k
    x = _randn((rows, 2 * i_), dev, seed)
    scale = torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=dev)

    def alloc(i):
        return {"q": torch.empty(rows, i_, dtype=C.FP8, device=i["x"].device)}

    def call(i, o):
        _ops().silu_and_mul_quant(o["q"], i["x"], i["scale"])

    def base(i):
        y = F.silu(i["x"][:, :i_].float()) * i["x"][:, i_:].float()
        return {"q": _fp8_q(y, i["scale"])}
    return Case("silu_and_mul_quant", dict(K=k, I=i_), rows * 2 * i_ * 2 + rows * i_,
                {"x": x, "scale": scale}, alloc, call, {"q": "fp8"}, base,
                deq={"q": lambda o, i: o["q"].float() * i["scale"].cpu()})


def case_static_scaled_fp8_quant(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    h = s.hidden_size
    x = _randn((t, h), dev, seed)
    scale = torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=dev)

    def alloc(i):
        return {"q": torch.empty(t, h, dtype=C.FP8, device=i["x"].device)}

    def call(i, o):
        _ops().static_scaled_fp8_quant(o["q"], i["x"], i["scale"], None)

    def base(i):
        return {"q": _fp8_q(i["x"], i["scale"])}
    return Case("static_scaled_fp8_quant", dict(H=h), t * h * 3, {"x": x, "scale": scale},
                alloc, call, {"q": "fp8"}, base,
                deq={"q": lambda o, i: o["q"].float() * i["scale"].cpu()})


def case_dynamic_scaled_fp8_quant(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    h = s.hidden_size
    x = _randn((t, h), dev, seed)

    def alloc(i):
        d = i["x"].device
        return {"q": torch.empty(t, h, dtype=C.FP8, device=d),
                "scale": torch.zeros(1, dtype=torch.float32, device=d)}

    def call(i, o):
        o["scale"].zero_()  # the op max-reduces into scale (the allocating wrapper zeroes it)
        _ops().dynamic_scaled_fp8_quant(o["q"], i["x"], o["scale"])

    def base(i):
        sc = (i["x"].abs().amax().float() / FP8_MAX).reshape(1)
        return {"q": _fp8_q(i["x"], sc), "scale": sc}
    return Case("dynamic_scaled_fp8_quant", dict(H=h), t * h * 3 + 4, {"x": x}, alloc, call,
                {"q": "fp8", "scale": "rel"}, base,
                deq={"q": lambda o, i: o["q"].float() * o["scale"].cpu()})


def case_dynamic_per_token_scaled_fp8_quant(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    h = s.hidden_size
    x = _randn((t, h), dev, seed)

    def alloc(i):
        d = i["x"].device
        return {"q": torch.empty(t, h, dtype=C.FP8, device=d),
                "scale": torch.empty(t, 1, dtype=torch.float32, device=d)}

    def call(i, o):
        _ops().dynamic_per_token_scaled_fp8_quant(o["q"], i["x"], o["scale"], None)

    def base(i):
        sc = (i["x"].abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-10)
        return {"q": _fp8_q(i["x"], sc), "scale": sc}
    return Case("dynamic_per_token_scaled_fp8_quant", dict(H=h), t * h * 3 + t * 4, {"x": x},
                alloc, call, {"q": "fp8", "scale": "rel"}, base,
                deq={"q": lambda o, i: o["q"].float() * o["scale"].cpu()})


def case_per_token_group_fp8_quant(s: C.MoEShape, t: int, dev, seed: int) -> Case | None:
    h = s.hidden_size
    if h % GROUP:
        return None
    g = h // GROUP
    x = _randn((t, h), dev, seed)

    def alloc(i):
        d = i["x"].device
        return {"q": torch.empty(t, h, dtype=C.FP8, device=d),
                "s": torch.empty(t, g, dtype=torch.float32, device=d)}

    def call(i, o):
        _ops().per_token_group_fp8_quant(i["x"], o["q"], o["s"], GROUP, 1e-10, -FP8_MAX,
                                         FP8_MAX, False, False, False)

    def base(i):
        xg = i["x"].float().view(t, g, GROUP)
        sc = xg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        return {"q": (xg / sc).clamp(-FP8_MAX, FP8_MAX).to(C.FP8).view(t, h),
                "s": sc.view(t, g)}

    def deq(o, i):
        return (o["q"].float().view(t, g, GROUP) * o["s"].cpu().view(t, g, 1)).view(t, h)
    return Case("per_token_group_fp8_quant", dict(H=h, group=GROUP), t * h * 3 + t * g * 4,
                {"x": x}, alloc, call, {"q": "fp8", "s": "rel"}, base, deq={"q": deq})


def case_shuffle_rows(s: C.MoEShape, t: int, dev, seed: int) -> Case:
    e, k, h = s.num_experts, s.top_k, s.hidden_size
    _, _, ti = _routing_inputs(t, e, k, dev, seed)
    order, _ = _slot_order(ti)
    dst2src = (order // k).to(torch.int32)
    x = _randn((t, h), dev, seed + 1)

    def alloc(i):
        return {"out": torch.empty(t * k, h, dtype=torch.bfloat16, device=i["x"].device)}

    def call(i, o):
        _ops().shuffle_rows(i["x"], i["map"], o["out"])

    def base(i):
        return {"out": i["x"].index_select(0, i["map"].long())}
    return Case("shuffle_rows", dict(K=k, H=h), t * h * 2 + t * k * h * 2 + t * k * 4,
                {"x": x, "map": dst2src}, alloc, call, {"out": "exact"}, base)


BUILDERS: dict[str, Callable[..., Case | None]] = {
    "topk_softmax": case_topk_softmax,
    "moe_align_block_size": case_moe_align_block_size,
    "moe_permute": case_moe_permute,
    "moe_unpermute": case_moe_unpermute,
    "moe_sum": case_moe_sum,
    "silu_and_mul": case_silu_and_mul,
    "silu_and_mul_quant": case_silu_and_mul_quant,
    "static_scaled_fp8_quant": case_static_scaled_fp8_quant,
    "dynamic_scaled_fp8_quant": case_dynamic_scaled_fp8_quant,
    "dynamic_per_token_scaled_fp8_quant": case_dynamic_per_token_scaled_fp8_quant,
    "per_token_group_fp8_quant": case_per_token_group_fp8_quant,
    "shuffle_rows": case_shuffle_rows,
}
assert set(BUILDERS) == set(OPS)


# ---------------------------------------------------------------------------- checking
def compare(case: Case, got: dict, want: dict, inputs_cpu: dict) -> tuple[str, bool]:
    """Compare `got` (any device) with `want` (CPU) on the outputs both have. Exact outputs
    must match bit for bit, float outputs within rel err 1e-2, FP8 outputs in at least 99% of
    their codes and within rel err 2e-2 once dequantized (one e4m3 step is 6-12%)."""
    if case.special is not None and all(k in want for k in ("ntpp", "experts", "sorted")):
        return case.special(got, want)
    got_cpu = {k: v.cpu() for k, v in got.items()}
    parts, ok = [], True
    for key, kind in case.kinds.items():
        if key not in want or key not in got_cpu:
            continue
        g, w = got_cpu[key], want[key].cpu()
        if g.shape != w.shape:
            return f"MISMATCH: {key} shape {tuple(g.shape)} vs {tuple(w.shape)}", False
        if kind == "exact":
            if g.dtype == C.FP8:
                g, w = g.view(torch.uint8), w.view(torch.uint8)
            n = int((g != w).sum())
            if n:
                ok = False
                parts.append(f"{key} {n}/{g.numel()} differ")
        elif kind == "rel":
            err = C.rel_error(g.float(), w.float()) if w.numel() else 0.0
            ok &= err <= 1e-2  # NaN fails
            parts.append(f"{key} rel {C.fmt_err(err)}")
        elif kind == "fp8":
            n = int((g.view(torch.uint8) != w.view(torch.uint8)).sum())
            dq = case.deq[key]
            err = C.rel_error(dq(got_cpu, inputs_cpu), dq({**got_cpu, **want}, inputs_cpu)) \
                if w.numel() else 0.0
            ok &= n <= 0.01 * g.numel() and err <= 2e-2
            parts.append(f"{key} {n}/{g.numel()} codes differ, deq rel {C.fmt_err(err)}")
    if not parts:
        return "ok (exact)", True
    return ("ok: " if ok else "MISMATCH: ") + ", ".join(parts), bool(ok)


def run_cpu_op(case: Case) -> tuple[dict | None, dict, str]:
    ci = {k: v.cpu() for k, v in case.inputs.items()}
    co = case.alloc(ci)
    try:
        case.call(ci, co)
    except Exception as exc:  # noqa: BLE001
        return None, ci, "cpu op failed: " + C.short_error(exc, 100)
    return co, ci, ""


# --------------------------------------------------------------------------------- args
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help="comma list (default all): " + ",".join(OPS))
    p.add_argument("--shapes", default=None,
                   help="comma list of " + ",".join(C.SHAPES) + " (default: BENCHMARK.md's)")
    p.add_argument("--m", default=None, help="token counts (default "
                   + ",".join(map(str, OPS_M_LIST)) + ")")
    p.add_argument("--iters", type=int, default=None, help="timed replays (default 100)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-evict", action="store_true", help="no L2 eviction between replays")
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default="ops", help="file names <gpu>_<tag>.md/.json")
    p.add_argument("--quick", action="store_true",
                   help="mixtral + qwen3_30b, M in " + ",".join(map(str, QUICK_OPS_M_LIST)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="cuda (default when present) or cpu (whole pipeline on the CPU, "
                        "checked against the torch-native equivalents: a harness check)")
    args = p.parse_args(argv)
    args.op_list = C.parse_list(args.ops) or list(OPS)
    args.shape_list = C.parse_list(args.shapes) or (
        ["mixtral", "qwen3_30b"] if args.quick else list(C.DEFAULT_SHAPES))
    args.m_list = C.parse_list(args.m, int) or (QUICK_OPS_M_LIST if args.quick else OPS_M_LIST)
    if args.iters is None:
        args.iters = 50 if args.quick else 100
    for o in args.op_list:
        if o not in BUILDERS:
            p.error(f"unknown op {o!r}; known: {', '.join(OPS)}")
    for s in args.shape_list:
        if s not in C.SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(C.SHAPES)}")
    return args


# --------------------------------------------------------------------------------- rows
HEADERS = ["op", "dims", "M", "µs", "TFLOP/s", "GB/s", "% of floor", "× baseline", "check",
           "baseline µs", "shapes", "timing"]


def dims_text(d: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def row_cells(r: dict[str, Any]) -> list[str]:
    timing = r.get("mode", "") + (f" ({r['note']})" if r.get("note") else "")
    return [r["op"], r["dims"], str(r["M"]), C.fmt(r.get("us")), "—", C.fmt(r.get("gbs"), ".0f"),
            C.fmt(r.get("pct_floor"), ".1f"), C.fmt(r.get("x_baseline"), ".2f"),
            r.get("check", "") + (" !" if r.get("check_ok") is False else ""),
            C.fmt(r.get("baseline_us")), r["shapes"],
            timing if r.get("us") is not None else "failed: " + r.get("error", "")]


def print_row(r: dict[str, Any]) -> None:
    c = row_cells(r)
    print(f"  {c[0]:<34} {c[1]:<20} M={c[2]:<5} {c[3]:>8} µs | {c[5]:>5} GB/s | "
          f"{c[6]:>5} % floor | {c[7]:>5} × base | {c[8]} | {c[11]}", flush=True)


def bench_case(case: Case, shapes: list[str], m: int, device, ceil: C.Ceilings, evict,
               args) -> dict[str, Any]:
    floor_us = case.nbytes / ceil.copy_bw * 1e6
    row: dict[str, Any] = dict(op=case.op, dims=dims_text(case.dims), M=m, shapes=",".join(shapes),
                               bytes=case.nbytes, floor_us=floor_us)
    gi = case.inputs
    go = case.alloc(gi)
    try:
        timing, _ = C.time_fn(lambda: case.call(gi, go), device, iters=args.iters,
                              warmup=args.warmup, evict=evict)
    except Exception as exc:  # noqa: BLE001
        if device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
        row.update(error=C.short_error(exc, 120), check="—", check_ok=None)
        return row
    t = timing.median_us
    row.update(us=t, p10_us=timing.p10_us, p90_us=timing.p90_us, mode=timing.mode,
               note=timing.note, gbs=case.nbytes / t * 1e-3, pct_floor=100 * floor_us / t)
    # correctness: the GPU op against the CPU op; on a CPU run, against the torch-native code
    if device.type == "cuda":
        want, ci, err = run_cpu_op(case)
        if want is None:
            row.update(check=err, check_ok=False)
        else:
            row["check"], row["check_ok"] = compare(case, go, want, ci)
    else:
        ci = {k: v.cpu() for k, v in gi.items()}
        if case.baseline is None:
            row.update(check="no torch-native check", check_ok=None)
        else:
            want = {k: v for k, v in case.baseline(ci).items() if not k.startswith("_")}
            text, ok = compare(case, go, want, ci)
            row.update(check="vs torch-native: " + text, check_ok=ok)
    if case.baseline is not None:
        try:
            bt, _ = C.time_fn(lambda: case.baseline(gi), device, iters=args.iters,
                              warmup=args.warmup, evict=evict)
            row["baseline_us"] = bt.median_us
            row["x_baseline"] = bt.median_us / t
        except Exception as exc:  # noqa: BLE001
            row["baseline_error"] = C.short_error(exc, 100)
    return row


def iter_cases(args, device):
    """Yields (case, shapes sharing it, M) for one (op, M) at a time, merging shapes whose op
    dims are equal; at most one case per shape is alive at once."""
    for op in args.op_list:
        for m in args.m_list:
            group: dict[tuple, tuple[Case, list[str]]] = {}
            for sname in args.shape_list:
                case = BUILDERS[op](C.SHAPES[sname], m, device, args.seed * 7919 + m)
                if case is None:
                    continue
                key = tuple(sorted(case.dims.items()))
                if key in group:
                    group[key][1].append(sname)
                else:
                    group[key] = (case, [sname])
            for key in list(group):
                case, shapes = group.pop(key)
                yield case, shapes, m


def run_no_gpu(args) -> int:
    print(C.no_gpu_banner())
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"hopper_moe could not be imported ({err}); nothing to run.")
        print(C.no_gpu_banner())
        return 0
    shape = C.SHAPES["tiny"]
    dev = torch.device("cpu")
    print(f"each op once on the CPU at M=4, {shape.name} shape (E={shape.num_experts}, "
          f"topk={shape.top_k}, H={shape.hidden_size}, I={shape.intermediate_size}), "
          "checked against its torch-native equivalent:")
    for op in args.op_list:
        case = BUILDERS[op](shape, 4, dev, args.seed)
        if case is None:
            print(f"  {op:<36} skipped (shape)")
            continue
        o = case.alloc(case.inputs)
        try:
            t0 = time.perf_counter()
            case.call(case.inputs, o)
            us = (time.perf_counter() - t0) * 1e6
        except Exception as exc:  # noqa: BLE001
            print(f"  {op:<36} failed: {C.short_error(exc, 110)}")
            continue
        if case.baseline is None:
            text = "no torch-native check"
        else:
            want = {k: v for k, v in case.baseline(case.inputs).items() if not k.startswith("_")}
            text, ok = compare(case, o, want, case.inputs)
            text += "" if ok else " !"
        print(f"  {op:<36} {us:9.0f} µs (CPU wall clock, one call) | {text}")
    print(C.no_gpu_banner())
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        return run_no_gpu(args)
    device = torch.device(args.device or "cuda")
    hm, err = C.import_hopper_moe()
    if hm is None:
        print(f"hopper_moe could not be imported: {err}")
        return 1
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    t0 = time.time()
    env = C.collect_env(device)
    print(f"# bench_ops on {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
          f"hopper_moe {env['hopper_moe']}")
    print(f"# {env['command']}")
    ceil = C.measure_ceilings(device, quick=args.quick)
    print(f"# ceilings: {ceil.describe()}")
    if device.type == "cuda" and args.iters < 50:
        print(f"# note: {args.iters} timed replays (< 50): not a BENCHMARK.md number")
    evict = None if (args.no_evict or device.type != "cuda") else C.L2Evictor(device)
    rows = []
    for case, shapes, m in iter_cases(args, device):
        row = bench_case(case, shapes, m, device, ceil, evict, args)
        rows.append(row)
        print_row(row)
        del case
        if device.type == "cuda" and m >= 1024:
            torch.cuda.empty_cache()
    extra = [
        f"timing: CUDA graph of one op call, {args.warmup} warm-up replays and more until "
        f"{C.WARMUP_MIN_MS:g} ms of GPU time, median of "
        f"{args.iters} replays, " + ("no L2 eviction" if evict is None else
                                     "256 MiB L2 eviction write between replays"),
        "GB/s = fewest bytes the op must move (each input read once, each output written "
        "once) / time; % of floor = (bytes / copy BW) / time",
        "× baseline = torch-native equivalent's time / op time (> 1: the op is faster)",
        "check = GPU op vs CPU op (torch.ops.hopper_moe on CPU copies of the inputs); "
        "'!' marks a mismatch",
        f"moe_align_block_size block_size {ALIGN_BLOCK}; static FP8 scale {STATIC_SCALE}; "
        f"per_token_group group {GROUP}",
    ]
    md = C.env_header_md(f"hopper_moe non-GEMM ops: {env['gpu']}", env, ceil, extra)
    md += "\n" + C.markdown_table(HEADERS, [row_cells(r) for r in rows]) + "\n"
    payload = dict(env=env, ceilings=ceil, args=vars(args), rows=rows)
    stem = f"{C.gpu_slug(env['gpu'])}_{args.tag}"
    md_path, js_path = C.write_results(args.out, stem, md, payload)
    print()
    print(f"# {env['command']}")
    print(f"# {env['gpu']}, {ceil.describe()}")
    print(f"# wrote {C.show_path(md_path)} and {C.show_path(js_path)}")
    compact_h = ["op", "dims", "M", "µs", "GB/s", "% of floor", "× baseline", "check"]
    compact = [[c[0], c[1], c[2], c[3], c[5], c[6], c[7],
                (c[8][:40] + "…") if len(c[8]) > 41 else c[8]] for c in map(row_cells, rows)]
    print(C.text_table(compact_h, compact))
    bad = [r for r in rows if r.get("check_ok") is False or r.get("us") is None]
    if bad:
        print(f"# {len(bad)} row(s) failed or mismatched: see the check column")
    print(f"# done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
