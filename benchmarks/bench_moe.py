"""Whole-layer (and GEMM-only) MoE benchmark of hopper_moe, as docs/BENCHMARK.md defines it.

    PYTHONPATH=python python benchmarks/bench_moe.py                       # everything
    PYTHONPATH=python python benchmarks/bench_moe.py --quick               # a few rows
    PYTHONPATH=python python benchmarks/bench_moe.py --shapes mixtral --m 1,4,16 \
        --dtypes bf16,fp8_tensor --backends torch,triton,cute --plot
    PYTHONPATH=python python benchmarks/bench_moe.py --gemm-only --dtypes fp8_tensor
    PYTHONPATH=python python benchmarks/bench_moe.py --evict rotate      # weight-copy rotation

Per row: median µs of the layer in a CUDA graph with L2 evicted between replays (--evict: a
256 MiB write, the write then a read, a rotation through R weight copies, or none), TFLOP/s,
GB/s, % of the roofline floor, × baseline (torch backend time / this time) and the relative
error against hopper_moe.reference on the same inputs. Ceilings are measured in the same run.
Results: benchmarks/results/<gpu>_<tag>.md and .json. Without a GPU, runs one small layer on
the CPU, says so, and exits 0. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import peer_cutlass  # noqa: E402  (compiles nothing until a CUTLASS row runs)

BASELINE = "torch"
CANDIDATE_BACKENDS = ["torch", "triton", "cute", "auto"]
# --gemm-only --backends ...,read: the pure weight read timed as the GEMM rows
# (read_control.py); a control, never a row's best.
READ_CONTROL = "read"
# --backends ...,peer (or by default when its kernel has been extracted): the serving engine's
# Triton pipeline (peer_vllm.py), timed like a backend in the same run.
PEER = "peer"
# The peer's tile choices (peer_vllm.VARIANTS): the engine's own, its default rule, swap-AB
# flipped. The summary's "best × peer" takes the fastest peer row that ran.
PEER_BACKENDS = {"peer": "engine", "peer_default": "default", "peer_swap": "swap"}
# --gemm-only --backends ...,cutlass_coop,cutlass_pingpong: a CUTLASS 3.x ptr-array grouped
# GEMM from the same headers (peer_cutlass.py), GEMM-only; the summary's "best × cutlass"
# takes the fastest of them. Like the peer, never a row's best.
CUTLASS_BACKENDS = tuple(peer_cutlass.BACKENDS)
# --backends ...,sm90_steps: the sm90 layer composed op by op in Python
# (hopper_moe.backends.sm90.run_steps: moe_permute's copy of the rows, then the GEMM chain):
# under CUDA graphs the previous form of the layer op's GPU work, an A/B control in the same
# run. Never a row's best.
STEPS = "sm90_steps"
# Starts the error of a row its backend cannot run (no CUTLASS variant for the scheme, or a
# hopper_moe backend whose supports() says no): the row is not called and reads n/a, not fail.
NOT_APPLICABLE = "not applicable: "
NOT_OURS = ("reference", READ_CONTROL, STEPS, *PEER_BACKENDS, *CUTLASS_BACKENDS)
# Relative errors above these are marked "!" (the tests own the real tolerances).
ERR_MARK = {"bf16": 1e-2, "fp8_tensor": 6e-2, "fp8_channel": 6e-2, "fp8_block": 6e-2}


# ------------------------------------------------------------------------ the library
class Lib:
    """The calls the benchmark makes, on hopper_moe or (with --selftest) the harness
    stand-in. Every call either works or raises; nothing here is timed."""

    def __init__(self, selftest: bool, peer_dir: str | None = None):
        self.selftest = selftest
        self.peer_dir = peer_dir  # the peer's extracted kernel (None: peer_vllm's default)
        self._peers: dict[str, Any] = {}
        self.notes: list[str] = []
        if selftest:
            self.hm = C.HarnessLib
            self.import_error = None
            self.notes.append("--selftest: backends are the harness's own torch "
                              "implementations, not hopper_moe")
        else:
            self.hm, self.import_error = C.import_hopper_moe()

    @property
    def version(self) -> str:
        return getattr(self.hm, "__version__", "?")

    def fused_experts(self, x, w1, w2, tw, ti, quant, backend):
        if backend in PEER_BACKENDS:
            return self.peer(backend)(x, w1, w2, tw, ti, quant)
        if backend == STEPS:
            return self.module("backends.sm90").run_steps(x, w1, w2, tw, ti, quant=quant)
        return self.hm.fused_experts(x, w1, w2, tw, ti, quant=quant, backend=backend)

    def peer(self, backend: str = PEER):
        """The engine's Triton pipeline on the kernel extracted into peer_dir, with the tile
        choice of `backend` (PEER_BACKENDS); raises with how to extract it when there is none."""
        if backend not in self._peers:
            import peer_vllm
            self._peers[backend] = peer_vllm.VllmTritonPipeline(self.peer_dir,
                                                                PEER_BACKENDS[backend])
        return self._peers[backend]

    def peer_available(self) -> bool:
        import peer_vllm
        return os.path.isfile(os.path.join(self.peer_dir or peer_vllm.default_dir(),
                                           peer_vllm.MODULE_FILE))

    def module(self, name: str):
        """hopper_moe.<name> as a module (None when it does not import)."""
        if self.selftest:
            return None
        try:
            return importlib.import_module(f"hopper_moe.{name}")
        except Exception:  # noqa: BLE001
            return None

    def unsupported(self, backend: str, x, w1, w2, quant) -> str | None:
        """Why hopper_moe's `backend` cannot run this row (the backend's own supports(), as
        "auto" asks it), or None: a row it cannot run is not attempted (a failed call just
        before a row was seen to slow that row by 5-11%)."""
        api = self.module("api")
        table = getattr(api, "_BACKENDS", None)
        canonical = getattr(api, "_canonical", None)
        if table is None or canonical is None:
            return None
        entry = table.get(canonical(backend))
        if entry is None or not hasattr(entry, "supports") or \
                entry.supports(x.device, x.dtype, w1, w2, quant):
            return None
        return f"backend {backend!r} does not run this scheme or shape"

    def reference(self, x, w1, w2, tw, ti, quant):
        """fp32 output: the reference gets fp32 hidden states (an exact upcast of the bf16
        ones), and returns in the hidden states' dtype."""
        if self.selftest:
            return self.hm.fused_experts_ref(x.float(), w1, w2, tw, ti, quant=quant)
        ref = getattr(self.module("reference"), "fused_experts_ref", None)
        if ref is None:
            raise RuntimeError("hopper_moe.reference.fused_experts_ref does not exist")
        return ref(x.float(), w1, w2, tw, ti, quant=quant)

    def quantize(self, w1, w2, scheme, static_act):
        if scheme == "bf16":
            return w1, w2, None
        if self.selftest:
            raise NotImplementedError("--selftest covers bf16 only")
        from hopper_moe.quant import make_quant_config
        return make_quant_config(w1, w2, scheme, static_act=static_act)

    def available_backends(self, device: torch.device) -> tuple[list[str], str]:
        """Backends that run a tiny bf16 layer on `device`: the library's own list when it
        has one, else a probe of each candidate."""
        if self.selftest:
            return self.hm.available_backends(device), "harness selftest list"
        fn = getattr(self.module("api"), "available_backends", None) or \
            getattr(self.hm, "available_backends", None)
        if callable(fn):
            try:
                names = list(fn(device))
                if names:
                    return names, "hopper_moe.api.available_backends"
            except Exception as exc:  # noqa: BLE001
                self.notes.append("available_backends() raised " + C.short_error(exc))
        shape = C.SHAPES["tiny"]
        w1, w2 = C.make_weights(shape, device, seed=7)
        _, tw, ti = C.routing(4, shape.num_experts, shape.top_k, device, seed=7)
        x = C.make_hidden(4, shape.hidden_size, device, seed=7)
        keep = []
        for b in CANDIDATE_BACKENDS:
            try:
                out = self.fused_experts(x, w1, w2, tw, ti, None, b)
                if isinstance(out, torch.Tensor) and out.shape == x.shape:
                    keep.append(b)
            except Exception as exc:  # noqa: BLE001
                self.notes.append(f"backend {b} not available: " + C.short_error(exc, 100))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return keep, "probed on a tiny layer"

    # GEMM-only ---------------------------------------------------------------------
    def gemm_only(self, backend: str, scheme: str, x, w1, w2, tw, ti, quant
                  ) -> tuple[Callable[[], Any] | None, str]:
        """A zero-argument callable that runs only GEMM1 and GEMM2 of `backend` on operands
        prepared here (permuted, quantized), and a label saying how; or (None, why not).
        Order: the library's hook hopper_moe.api.make_gemm_only(backend, x, w1, w2,
        topk_weights, topk_ids, quant=...), then the harness's own pairs: torch._grouped_mm
        (bf16, torch backend) and torch.ops.hopper_moe.cutlass_moe_mm (fp8 per-tensor /
        per-channel, cute backend)."""
        device = x.device
        if backend == READ_CONTROL:
            import read_control
            return read_control.gemm_only_read(x, w1, w2, ti)
        if backend in PEER_BACKENDS:
            return None, "the peer's GEMMs are not timed alone"
        if backend in CUTLASS_BACKENDS:
            try:
                fn = peer_cutlass.gemm_pair(backend, scheme, x, w1, w2, ti)
            except NotImplementedError as exc:
                return None, NOT_APPLICABLE + C.short_error(exc, 100)
            return fn, "CUTLASS " + fn.variant
        hook = getattr(self.module("api"), "make_gemm_only", None)
        if hook is not None and not self.selftest:
            try:
                fn = hook(backend, x, w1, w2, tw, ti, quant=quant)
                if fn is not None:
                    return fn, "library make_gemm_only"
            except NotImplementedError as exc:
                why = C.short_error(exc, 100)
            except Exception as exc:  # noqa: BLE001
                return None, "make_gemm_only raised " + C.short_error(exc, 100)
            else:
                why = "make_gemm_only returned None"
        else:
            why = "hopper_moe exposes no make_gemm_only hook"
        if backend in ("torch", "grouped_mm") and scheme == "bf16" and \
                C.grouped_mm_available(device):
            return _grouped_mm_pair(x, w1, w2, ti), "harness torch._grouped_mm pair"
        if backend == "cute" and scheme in ("fp8_tensor", "fp8_channel") and \
                hasattr(torch.ops.hopper_moe, "cutlass_moe_mm"):
            try:
                return _cutlass_pair(x, w1, w2, ti, quant, scheme), "harness cutlass_moe_mm pair"
            except Exception as exc:  # noqa: BLE001
                return None, "cutlass_moe_mm pair failed: " + C.short_error(exc, 100)
        return None, why + f"; no harness GEMM pair for backend {backend} / {scheme}"


def _grouped_mm_pair(x, w1, w2, ti):
    e, two_i, _ = w1.shape
    _, tok, offs = C.sort_by_expert(ti, e)
    a1 = x.index_select(0, tok).contiguous()
    gen = torch.Generator(device=x.device).manual_seed(11)
    a2 = torch.randn(a1.shape[0], two_i // 2, dtype=x.dtype, device=x.device, generator=gen)
    b1, b2 = w1.transpose(1, 2), w2.transpose(1, 2)

    def run():
        return (torch._grouped_mm(a1, b1, offs=offs), torch._grouped_mm(a2, b2, offs=offs))
    return run


def _cutlass_pair(x, w1q, w2q, ti, quant, scheme):
    """GEMM1 + GEMM2 through torch.ops.hopper_moe.cutlass_moe_mm (OPS.md contract): the
    activations are quantized and permuted here, outside the timed callable."""
    ops = torch.ops.hopper_moe
    dev = x.device
    e, two_i, h = w1q.shape
    i = two_i // 2
    m, k = ti.shape
    rows = m * k
    expert_offsets = torch.empty(e + 1, dtype=torch.int32, device=dev)
    ps1 = torch.empty(e, 3, dtype=torch.int32, device=dev)
    ps2 = torch.empty(e, 3, dtype=torch.int32, device=dev)
    a_map = torch.empty(rows, dtype=torch.int32, device=dev)
    c_map = torch.empty(rows, dtype=torch.int32, device=dev)
    ops.get_cutlass_moe_mm_data(ti, expert_offsets, ps1, ps2, a_map, c_map, e, i, h, None, True)
    per_tok = scheme == "fp8_channel"
    xf = x.float()
    if per_tok:
        a_scale = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    else:
        a_scale = (xf.abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
    a1 = (xf / a_scale).clamp(-448, 448).to(C.FP8)[a_map.long()].contiguous()
    a1_scale = a_scale[a_map.long()].contiguous() if per_tok else a_scale
    gen = torch.Generator(device=dev).manual_seed(13)
    a2 = torch.randn(rows, i, device=dev, generator=gen).to(C.FP8)
    a2_scale = torch.full((rows, 1) if per_tok else (1,), 0.05, device=dev)
    w1s = quant.w1_scale.reshape(e, -1).float()
    w2s = quant.w2_scale.reshape(e, -1).float()
    w1s = w1s.reshape(e) if w1s.shape[1] == 1 else w1s.contiguous()
    w2s = w2s.reshape(e) if w2s.shape[1] == 1 else w2s.contiguous()
    ab1 = torch.full((e,), h, dtype=torch.int64, device=dev)
    c1s = torch.full((e,), two_i, dtype=torch.int64, device=dev)
    ab2 = torch.full((e,), i, dtype=torch.int64, device=dev)
    c2s = torch.full((e,), h, dtype=torch.int64, device=dev)
    c1 = torch.empty(rows, two_i, dtype=torch.bfloat16, device=dev)
    c2 = torch.empty(rows, h, dtype=torch.bfloat16, device=dev)
    per_ch = w1s.dim() == 2
    offsets = expert_offsets[:-1]
    try:
        ops.cutlass_moe_mm(c1, a1, w1q, a1_scale, w1s, offsets, ps1, ab1, ab1, c1s, per_tok,
                           per_ch)
    except RuntimeError:
        offsets = expert_offsets[:-1].to(torch.int64)  # OPS.md says int64 [E]
        ops.cutlass_moe_mm(c1, a1, w1q, a1_scale, w1s, offsets, ps1, ab1, ab1, c1s, per_tok,
                           per_ch)

    def run():
        ops.cutlass_moe_mm(c1, a1, w1q, a1_scale, w1s, offsets, ps1, ab1, ab1, c1s, per_tok,
                           per_ch)
        ops.cutlass_moe_mm(c2, a2, w2q, a2_scale, w2s, offsets, ps2, ab2, ab2, c2s, per_tok,
                           per_ch)
        return c2
    return run


# -------------------------------------------------------------------------------- args
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma list of " + ",".join(C.SHAPES) + " (default: all of "
                        "BENCHMARK.md; tiny is a smoke-test shape)")
    p.add_argument("--m", default=None, help="comma list of token counts (default: "
                   + ",".join(map(str, C.M_LIST)) + ")")
    p.add_argument("--dtypes", default="bf16,fp8_tensor",
                   help="comma list of " + ",".join(C.SCHEMES) + " (default bf16,fp8_tensor; "
                        "fp8_block runs only where H and I are multiples of 128)")
    p.add_argument("--backends", default=None,
                   help="comma list of torch,triton,cute,auto,reference,read,peer,"
                        "peer_default,peer_swap (default: every available backend, and the "
                        "three peer ones when the peer's kernel has been extracted; reference, "
                        "the fp32 check, only when named; read, with --gemm-only: a kernel "
                        "that only reads the GEMMs' weights, read_control.py; peer*: the "
                        "engine's Triton pipeline with its own tiles, its default rule, "
                        "swap-AB flipped, peer_vllm.py; sm90_steps: the sm90 layer composed "
                        "op by op, an A/B control)")
    p.add_argument("--peer-dir", default=None,
                   help="folder of the engine's extracted Triton kernel and configs for the "
                        "peer backend (default: peer_vllm.default_dir(); made by python "
                        "benchmarks/peer_vllm.py extract SOURCE)")
    p.add_argument("--gemm-only", action="store_true",
                   help="time only GEMM1 + GEMM2 where a backend exposes them")
    p.add_argument("--zipf", type=float, nargs="?", const=1.2, default=0.0,
                   help="skewed routing: add -s*log(rank) to the logits (default s=1.2)")
    p.add_argument("--static-act", action="store_true",
                   help="FP8 per-tensor with static activation scales (default dynamic)")
    p.add_argument("--iters", type=int, default=None, help="timed replays (default 100, >= 50)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up replays (default 10)")
    C.add_evict_args(p)
    p.add_argument("--no-graph", action="store_true", help="eager timing instead of graphs")
    p.add_argument("--out", default=os.path.join(C.REPO_ROOT, "benchmarks", "results"),
                   help="result folder (default benchmarks/results)")
    p.add_argument("--tag", default=None, help="file names <gpu>_<tag>.md/.json "
                   "(default moe, moe_gemm with --gemm-only, plus _zipf)")
    p.add_argument("--plot", action="store_true",
                   help="PNGs: latency and %% of floor vs M, one per shape x dtype")
    p.add_argument("--quick", action="store_true",
                   help="mixtral + qwen3_30b, M in " + ",".join(map(str, C.QUICK_M_LIST))
                        + ", 50 replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="cuda (default when present) or cpu (runs the whole pipeline on the "
                        "CPU with wall-clock timing: a harness check, not a benchmark)")
    p.add_argument("--selftest", action="store_true",
                   help="time the harness's own torch layers instead of hopper_moe (bf16)")
    args = p.parse_args(argv)
    C.resolve_evict(p, args)
    args.shape_list = C.parse_list(args.shapes) or (
        ["mixtral", "qwen3_30b"] if args.quick else list(C.DEFAULT_SHAPES))
    args.m_list = C.parse_list(args.m, int) or (C.QUICK_M_LIST if args.quick else C.M_LIST)
    args.dtype_list = C.parse_list(args.dtypes)
    args.backend_list = C.parse_list(args.backends)
    if args.iters is None:
        args.iters = 50 if args.quick else 100
    if args.quick:
        args.warmup = min(args.warmup, 5)
    for s in args.shape_list:
        if s not in C.SHAPES:
            p.error(f"unknown shape {s!r}; known: {', '.join(C.SHAPES)}")
    for d in args.dtype_list:
        if d not in C.SCHEMES:
            p.error(f"unknown dtype {d!r}; known: {', '.join(C.SCHEMES)}")
    if args.tag is None:
        args.tag = "moe_gemm" if args.gemm_only else "moe"
        if args.zipf:
            args.tag += "_zipf"
    return args


# ---------------------------------------------------------------------------- no GPU
def run_no_gpu(args) -> int:
    """One small layer through the CPU path (reference and torch backends)."""
    print(C.no_gpu_banner())
    lib = Lib(args.selftest, args.peer_dir)
    if lib.hm is None:
        print(f"hopper_moe could not be imported ({lib.import_error}); nothing to run.")
        print(C.no_gpu_banner())
        return 0
    shape = C.SHAPES["tiny"]
    m = 4
    dev = torch.device("cpu")
    w1, w2 = C.make_weights(shape, dev, seed=args.seed)
    _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, dev, seed=args.seed)
    x = C.make_hidden(m, shape.hidden_size, dev, seed=args.seed + 1)
    print(f"layer: M={m} E={shape.num_experts} topk={shape.top_k} H={shape.hidden_size} "
          f"I={shape.intermediate_size}, bf16, hopper_moe {lib.version}")
    try:
        ref = lib.reference(x, w1, w2, tw, ti, None)
        print(f"reference (fp32): out[0,:4] = {ref[0, :4].float().tolist()}, "
              f"||out|| = {ref.float().norm().item():.4f}")
    except Exception as exc:  # noqa: BLE001
        ref = None
        print("reference failed: " + C.short_error(exc))
    for b in ("reference", "torch"):
        try:
            t, out = C.time_wall(lambda: lib.fused_experts(x, w1, w2, tw, ti, None, b),
                                 iters=10, warmup=1)
        except Exception as exc:  # noqa: BLE001
            print(f"backend {b}: failed: " + C.short_error(exc))
            continue
        print(f"backend {b}: {t.median_us:.0f} µs (CPU wall clock, median of {t.iters}), "
              f"out[0,:4] = {[round(v, 4) for v in out[0, :4].float().tolist()]}, "
              f"rel err vs reference {C.fmt_err(C.rel_error(out, ref))}")
    print(C.no_gpu_banner())
    return 0


# ---------------------------------------------------------------------------- the rows
def build_row(shape: C.MoEShape, scheme: str, m: int, backend: str, timing: C.Timing | None,
              flops: int, nbytes: int, floor: float, bound: str, touched: int,
              err: float | None, error: str = "", how: str = "", evict: str = "none",
              evict_copies: int | None = None, evict_note: str = "") -> dict[str, Any]:
    """One result row. evict: the L2 eviction method that ran (C.EVICT_METHODS; none on the
    CPU); evict_copies: R, the weight copies of --evict rotate (None otherwise)."""
    row: dict[str, Any] = dict(
        shape=shape.name, E=shape.num_experts, topk=shape.top_k, H=shape.hidden_size,
        I=shape.intermediate_size, dtype=scheme, M=m, backend=backend, experts_touched=touched,
        flops=flops, bytes=nbytes, floor_us=floor, floor_bound=bound, rel_err=err,
        error=error, how=how, evict=evict, evict_copies=evict_copies, evict_note=evict_note)
    if timing is not None:
        t = timing.median_us
        row.update(us=t, p10_us=timing.p10_us, p90_us=timing.p90_us, iters=timing.iters,
                   mode=timing.mode, note=timing.note, tflops=flops / t * 1e-6,
                   gbs=nbytes / t * 1e-3, pct_floor=100.0 * floor / t)
    return row


def fill_baseline(rows: list[dict[str, Any]]) -> None:
    base = {(r["shape"], r["dtype"], r["M"]): r["us"] for r in rows
            if r["backend"] == BASELINE and r.get("us")}
    for r in rows:
        b = base.get((r["shape"], r["dtype"], r["M"]))
        r["x_baseline"] = (b / r["us"]) if (b and r.get("us")) else None


def err_cell(r: dict[str, Any]) -> str:
    e = r.get("rel_err")
    s = C.fmt_err(e)
    if e is not None and (math.isnan(e) or e > ERR_MARK.get(r["dtype"], 1e-2)):
        s += " !"
    return s


ROW_HEADERS = ["shape", "dtype", "M", "backend", "µs", "TFLOP/s", "GB/s", "% of floor",
               "× baseline", "rel err", "floor µs", "experts", "timing"]


def row_cells(r: dict[str, Any]) -> list[str]:
    if r.get("us") is None:
        return [r["shape"], r["dtype"], str(r["M"]), r["backend"], "—", "—", "—", "—", "—",
                err_cell(r), C.fmt(r["floor_us"]) + " " + r["floor_bound"],
                str(r["experts_touched"]), "failed: " + r.get("error", "")]
    timing = r["mode"] + (f" ({r['note']})" if r.get("note") else "")
    if r.get("evict_copies"):
        timing += f", rotate R={r['evict_copies']}"
        if r.get("evict_note"):
            timing += f" ({r['evict_note']})"
    if r.get("how"):
        timing += f" [{r['how']}]"
    return [r["shape"], r["dtype"], str(r["M"]), r["backend"], C.fmt(r["us"]),
            C.fmt(r["tflops"], ".1f"), C.fmt(r["gbs"], ".0f"), C.fmt(r["pct_floor"], ".1f"),
            C.fmt(r.get("x_baseline"), ".2f"), err_cell(r),
            C.fmt(r["floor_us"]) + " " + r["floor_bound"], str(r["experts_touched"]), timing]


def compact_table(rows: list[dict[str, Any]], backends: list[str]) -> tuple[list[str], list]:
    """One line per (shape, dtype, M): floor, each backend's µs (% of floor), the best of
    hopper_moe's backends, its speed against torch and, when the peer ran, against the peer
    (peer µs / best µs: above 1 is faster than the peer)."""
    with_peer = any(b in PEER_BACKENDS for b in backends)
    with_cutlass = any(b in CUTLASS_BACKENDS for b in backends)
    headers = ["shape", "dtype", "M", "floor µs"] + [f"{b} µs (%fl)" for b in backends] + \
              ["best", "best × torch"] + (["best × peer"] if with_peer else []) + \
              (["best × cutlass"] if with_cutlass else []) + ["max err"]
    keyed: dict[tuple, dict[str, dict]] = {}
    order: list[tuple] = []
    for r in rows:
        k = (r["shape"], r["dtype"], r["M"])
        if k not in keyed:
            keyed[k] = {}
            order.append(k)
        keyed[k][r["backend"]] = r
    out = []
    for k in order:
        by = keyed[k]
        any_r = next(iter(by.values()))
        cells = [k[0], k[1], str(k[2]), C.fmt(any_r["floor_us"])]
        timed = {b: r for b, r in by.items() if r.get("us") and b not in NOT_OURS}
        for b in backends:
            r = by.get(b)
            if r is None:
                cells.append("")
            elif r.get("us") is None:
                cells.append("n/a" if NOT_APPLICABLE in str(r.get("error") or "") else "fail")
            else:
                cells.append(f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
        if timed:
            best = min(timed, key=lambda b: timed[b]["us"])
            base = by.get(BASELINE, {}).get("us")
            cells += [best, C.fmt(base / timed[best]["us"], ".2f") if base else "—"]
            if with_peer:
                peer = min((by[b]["us"] for b in PEER_BACKENDS if by.get(b, {}).get("us")),
                           default=None)
                cells.append(C.fmt(peer / timed[best]["us"], ".2f") if peer else "—")
            if with_cutlass:
                cut = min((by[b]["us"] for b in CUTLASS_BACKENDS if by.get(b, {}).get("us")),
                          default=None)
                cells.append(C.fmt(cut / timed[best]["us"], ".2f") if cut else "—")
        else:
            cells += ["—", "—"] + (["—"] if with_peer else []) + (["—"] if with_cutlass else [])
        errs = [r["rel_err"] for r in by.values() if r.get("rel_err") is not None]
        cells.append(C.fmt_err(max(errs)) if errs else "—")
        out.append(cells)
    return headers, out


def print_row(r: dict[str, Any]) -> None:
    c = row_cells(r)
    print(f"  {c[0]:<16} {c[1]:<11} M={c[2]:<5} {c[3]:<10} {c[4]:>9} µs | {c[5]:>7} TFLOP/s | "
          f"{c[6]:>6} GB/s | {c[7]:>5} % floor | {c[8]:>5} × base | err {c[9]:<9} | "
          f"floor {c[10]} | {c[12]}", flush=True)


# ------------------------------------------------------------------------------- main
def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but no GPU is visible.")
        return run_no_gpu(args)
    lib = Lib(args.selftest, args.peer_dir)
    if lib.hm is None:
        print(f"hopper_moe could not be imported: {lib.import_error}\n"
              "Build it (tools/dev_build.sh) and run with PYTHONPATH=python, or use --selftest.")
        return 1
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = C.collect_env(device)
    if args.selftest:
        env["hopper_moe"] = "not used (--selftest)"
    print(f"# bench_moe on {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
          f"hopper_moe {env['hopper_moe']}")
    print(f"# {env['command']}")
    if device.type == "cpu":
        print("# --device cpu: wall-clock timing, CPU ceilings; a harness check, not a benchmark")

    ceil = C.measure_ceilings(device, quick=args.quick)
    print(f"# ceilings: {ceil.describe()}")
    if device.type == "cuda" and args.iters < 50:
        print(f"# note: {args.iters} timed replays (< 50): not a BENCHMARK.md number")
    for n in ceil.notes:
        print(f"# note: {n}")

    if args.backend_list:
        backends, how = list(args.backend_list), "--backends"
    else:
        backends, how = lib.available_backends(device)
        backends = [b for b in backends if b != "reference"]
        if backends and "auto" not in backends and not args.selftest:
            backends.append("auto")  # the dispatcher's choice, timed like a backend
        if backends and not args.selftest and device.type == "cuda" and lib.peer_available():
            backends += list(PEER_BACKENDS)  # the engine's pipeline, same run (peer_vllm.py)
    if BASELINE not in backends:
        lib.notes.append(f"baseline backend {BASELINE!r} not in this run: × baseline is empty")
    print(f"# backends ({how}): {', '.join(backends) or 'none'}")
    for n in lib.notes:
        print(f"# note: {n}")
    if not backends:
        print("no backend to time.")
        return 1

    evict = C.make_evictor(args.evict, device)
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for shape_name in args.shape_list:
        shape = C.SHAPES[shape_name]
        schemes = []
        for scheme in args.dtype_list:
            ok, why = C.scheme_applies(shape, scheme)
            if ok:
                schemes.append(scheme)
            else:
                notes.append(why)
                print("# " + why)
        if not schemes:
            continue
        w1, w2 = C.make_weights(shape, device, seed=args.seed + 101)
        for scheme in schemes:
            try:
                w1q, w2q, quant = lib.quantize(w1, w2, scheme, args.static_act)
            except Exception as exc:  # noqa: BLE001
                why = f"{shape.name} {scheme}: quantization failed: " + C.short_error(exc)
                notes.append(why)
                print("# " + why)
                continue
            print(f"## {shape.name} (E={shape.num_experts}, topk={shape.top_k}, "
                  f"H={shape.hidden_size}, I={shape.intermediate_size}) {scheme}"
                  + (" GEMM-only" if args.gemm_only else ""), flush=True)
            for m in args.m_list:
                rows += run_m(args, lib, device, ceil, evict, shape, scheme, m, w1q, w2q,
                              quant, backends, notes)
            del w1q, w2q, quant
        del w1, w2
        if device.type == "cuda":
            torch.cuda.empty_cache()

    fill_baseline(rows)
    return report(args, env, ceil, backends, rows, notes + lib.notes, device)


def row_inputs(shape: C.MoEShape, scheme: str, m: int, quant, device, seed: int,
               zipf: float, gemm_only: bool):
    """One row's inputs and bytes: (x, topk_weights, topk_ids, experts touched, bytes of the
    floor), from the row's seed (seed * 100003 + m) as every benchmark of a row derives them."""
    row_seed = seed * 100003 + m
    _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, device, seed=row_seed, zipf=zipf)
    x = C.make_hidden(m, shape.hidden_size, device, seed=row_seed + 1)
    touched = C.experts_touched(ti, shape.num_experts)
    sbytes = C.scale_bytes(quant, shape.num_experts, touched)
    if gemm_only:
        nbytes = C.gemm_only_bytes(shape, m, scheme, touched, sbytes)
    else:
        nbytes = C.layer_bytes(shape, m, scheme, touched, sbytes)
    return x, tw, ti, touched, nbytes


def row_fn(lib: Lib, backend: str, scheme: str, x, tw, ti, gemm_only: bool, w1, w2, quant
           ) -> tuple[Callable[[], Any] | None, str]:
    """The zero-argument callable a row times on these weights (the layer, or GEMM1 + GEMM2
    with gemm_only) and how it runs; (None, why not) when GEMM-only is not possible."""
    why = None if backend in NOT_OURS else lib.unsupported(backend, x, w1, w2, quant)
    if why is not None:
        return None, NOT_APPLICABLE + why
    if gemm_only:
        return lib.gemm_only(backend, scheme, x, w1, w2, tw, ti, quant)
    if backend == READ_CONTROL:
        return None, "the read control runs with --gemm-only only"
    if backend in CUTLASS_BACKENDS:
        return None, "the CUTLASS peer runs with --gemm-only only"

    def fn():
        return lib.fused_experts(x, w1, w2, tw, ti, quant, backend)
    how = ""
    if backend in PEER_BACKENDS:
        how = "peer: " + lib.peer(backend).config_for(x.shape[0], w1, w2, quant)[1]
    explain = getattr(lib.hm, "explain_backend", None)
    if backend == "auto" and explain is not None:
        how = "auto: " + explain(x.shape[0], w1, w2, ti.shape[1], quant=quant,
                                 dtype=x.dtype).backend
    return fn, how


def copy_fn_builder(lib: Lib, backend: str, scheme: str, x, tw, ti, gemm_only: bool
                    ) -> Callable[..., Callable[[], Any]]:
    """make_fn(w1, w2, quant) for C.WeightRotation.build: row_fn on one weight copy; raises
    when that copy gets no callable."""
    def make_fn(w1, w2, quant) -> Callable[[], Any]:
        fn, how = row_fn(lib, backend, scheme, x, tw, ti, gemm_only, w1, w2, quant)
        if fn is None:
            raise RuntimeError("no callable on a weight copy: " + how)
        return fn
    return make_fn


def row_rotation(args, device, shape: C.MoEShape, nbytes: int, weights: tuple
                 ) -> tuple[C.WeightRotation | None, str]:
    """--evict rotate on a GPU: the row's weight copies, or (None, why) when they do not fit
    (the row's error); (None, "") for the other methods and on the CPU."""
    if args.evict != "rotate" or device.type != "cuda":
        return None, ""
    try:
        return C.WeightRotation.for_row(device, weights, nbytes, shape.num_experts), ""
    except (C.RotationDoesNotFit, TypeError) as exc:
        return None, str(exc)


def run_m(args, lib: Lib, device, ceil: C.Ceilings, evict, shape: C.MoEShape, scheme: str,
          m: int, w1q, w2q, quant, backends: list[str], notes: list[str]) -> list[dict]:
    x, tw, ti, touched, nbytes = row_inputs(shape, scheme, m, quant, device, args.seed,
                                            args.zipf, args.gemm_only)
    flops = C.layer_flops(shape, m)
    floor, bound = C.floor_us(nbytes, flops, ceil.copy_bw, ceil.peak(scheme))

    ref = None
    ref_err = ""
    if not args.gemm_only:
        try:
            with torch.no_grad():
                ref = lib.reference(x, w1q, w2q, tw, ti, quant)
        except Exception as exc:  # noqa: BLE001
            ref_err = "reference failed: " + C.short_error(exc, 100)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # after the reference, whose buffers would otherwise count against the copies
    rot, rot_err = row_rotation(args, device, shape, nbytes, (w1q, w2q, quant))
    method = args.evict if device.type == "cuda" else "none"
    ev = dict(evict=method, evict_copies=rot.r if rot else None,
              evict_note=rot.note if rot else "")
    out_rows = []
    for b in backends:
        if rot_err:
            row = build_row(shape, scheme, m, b, None, flops, nbytes, floor, bound, touched,
                            None, error=rot_err, **ev)
            out_rows.append(row)
            continue
        fn, how = row_fn(lib, b, scheme, x, tw, ti, args.gemm_only, w1q, w2q, quant)
        if fn is None:
            row = build_row(shape, scheme, m, b, None, flops, nbytes, floor, bound,
                            touched, None, error="GEMM-only not possible: " + how
                            if args.gemm_only else how, **ev)
            out_rows.append(row)
            continue
        try:
            with torch.no_grad():
                copies = None
                if rot is not None:
                    make_fn = copy_fn_builder(lib, b, scheme, x, tw, ti, args.gemm_only)
                    copies = rot.build(make_fn, first=fn)
                timing, out = C.time_fn(fn, device, iters=args.iters, warmup=args.warmup,
                                        evict=evict, use_graph=not args.no_graph,
                                        copies=copies)
                del copies
        except Exception as exc:  # noqa: BLE001
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001
                    pass
            row = build_row(shape, scheme, m, b, None, flops, nbytes, floor, bound, touched,
                            None, error=C.short_error(exc, 120), how=how, **ev)
        else:
            err = None
            if not args.gemm_only:
                err = C.rel_error(out, ref) if ref is not None else float("nan")
            row = build_row(shape, scheme, m, b, timing, flops, nbytes, floor, bound,
                            touched, err, error=ref_err, how=how, **ev)
            del out
        out_rows.append(row)
    fill_baseline(out_rows)
    for row in out_rows:
        print_row(row)
    del ref
    if rot is not None:
        rot.free()
        del rot
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_rows


def read_control_note() -> str:
    import read_control
    return read_control.describe()


def report(args, env, ceil: C.Ceilings, backends: list[str], rows: list[dict],
           notes: list[str], device) -> int:
    fill_baseline(rows)
    stem = f"{C.gpu_slug(env['gpu'])}_{args.tag}"
    what = "GEMM1 + GEMM2 only" if args.gemm_only else "whole MoE layer"
    extra = [
        f"work: {what}; routing softmax over N(0,1) logits, top-k, renormalized"
        + (f", Zipf skew s={args.zipf}" if args.zipf else "") + f"; seed {args.seed}",
        (f"timing: {'eager' if args.no_graph else 'CUDA graph'} of one call"
         + (" per weight copy" if args.evict == "rotate" else "")
         + f", {args.warmup} warm-up replays and more until {C.WARMUP_MIN_MS:g} ms of GPU "
         f"time, median of {args.iters} timed replays; "
         + C.evict_description(args.evict, C.l2_cache_bytes(device)))
        if device.type == "cuda"
        else "timing: CPU wall clock, median (a harness check); no L2 eviction on the CPU",
        "floor = max(bytes / copy BW, flops / dense peak); bytes = touched experts x 3HI x "
        "bytes/weight + scales + " + ("GEMM activations in/out" if args.gemm_only
                                      else "M x H x (2 + 2)") + "; flops = 2 M topk 3 H I",
        f"× baseline = {BASELINE} backend time / this time (> 1 is faster than {BASELINE}); "
        "rel err = ||out - ref|| / ||ref|| vs hopper_moe.reference in fp32 on the same inputs"
        " ('!' = above " + ", ".join(f"{k} {v:g}" for k, v in ERR_MARK.items()) + ")",
        f"backends: {', '.join(backends)}",
    ] + ([read_control_note()] if READ_CONTROL in backends else []) + \
        [f"note: {n}" for n in dict.fromkeys(notes)]
    md = C.env_header_md(f"hopper_moe {what}: {env['gpu']}", env, ceil, extra)
    ch, crows = compact_table(rows, backends)
    md += "\n## Summary\n\n" + C.markdown_table(ch, crows) + "\n"
    md += "\n## All rows\n\n" + C.markdown_table(ROW_HEADERS, [row_cells(r) for r in rows]) + "\n"
    payload = dict(env=env, ceilings=ceil, evict=args.evict if device.type == "cuda" else "none",
                   args={k: v for k, v in vars(args).items()},
                   backends=backends, notes=list(dict.fromkeys(notes)), rows=rows)
    md_path, js_path = C.write_results(args.out, stem, md, payload)
    if args.plot:
        try:
            import plot as P
            paths, msg = P.plot_moe(payload, args.out, stem)
            print(msg)
        except Exception as exc:  # noqa: BLE001
            print("plot failed: " + C.short_error(exc))
    print()
    print(f"# {env['command']}")
    print(f"# {env['gpu']}, {ceil.describe()}")
    print(f"# wrote {C.show_path(md_path)} and {C.show_path(js_path)}")
    print(C.text_table(ch, crows))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        return run_no_gpu(args)
    t0 = time.time()
    rc = run(args)
    print(f"# done in {time.time() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
