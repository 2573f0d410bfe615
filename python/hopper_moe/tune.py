"""Tune the tile configs of the Triton MoE backend for one layer shape and quant scheme.

    python -m hopper_moe.tune --shape mixtral --dtype fp8_channel --out DIR
    python -m hopper_moe.tune --E 8 --H 4096 --I 14336 --topk 2 --dtype bf16 --m 1,16,256
    python -m hopper_moe.tune --shape qwen3_30b --dtype bf16 --dry-run    # no GPU needed
    python -m hopper_moe.tune --shape mixtral --dtype bf16 --space quick   # <= 60 configs per M
    python -m hopper_moe.tune --shape mixtral --dtype bf16 --space quick --jobs 12  # compile
                                                                # in 12 processes first

For every token count M it times the whole `fused_experts_triton` layer with each config of a
pruned search space (CUDA graph of one call, median of replays, L2 evicted between replays:
the timing core of benchmarks/common.py), rejects candidates whose output is off (checked
against the fp32 reference, relative to the accuracy of the first candidate, the default
config), and writes the fastest config of each M to the JSON file that
`kernels.moe_gemm_configs.get_config` reads: `<out>/<configs.config_file_name(E, I,
scheme)>`, keyed by M, written after each M so that `--resume` skips the M values already in
the file. Use the file with HOPPER_MOE_CONFIG_DIR=<out> (set before hopper_moe is imported),
or copy it into python/hopper_moe/configs/.

Search space: BLOCK_M 16/32/64/128, BLOCK_N 32..256, BLOCK_K 64/128/256, GROUP_M 1/8/16,
SWAP_AB, ONE_SLOT_PER_BLOCK, num_warps 4/8, num_stages 2..5, FP8_FAST_ACC (per-tensor and
per-channel FP8 only), pruned by `why_pruned`. A fast-accumulation candidate passes the same
accuracy check as every other one (`judge`).
Needs a source checkout (it loads benchmarks/common.py) and, except for --dry-run, a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .kernels import moe_gemm_configs as configs

SCHEMES = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (32, 64, 128, 256)
BLOCK_KS = (64, 128, 256)
GROUP_MS = (1, 8, 16)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4, 5)
# The keys a tuned entry holds. All of them are written, so that get_config (which fills
# missing keys from the default config of the looked-up M) runs exactly what was timed.
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SWAP_AB", "ONE_SLOT_PER_BLOCK",
               "num_warps", "num_stages", "FP8_FAST_ACC")
# The schemes whose kernel can accumulate the whole K loop in the tensor core.
FAST_ACC_SCHEMES = ("fp8_tensor", "fp8_channel")
# H100/H200: 228 KB of shared memory per SM, at most 227 KB of it for one block.
SMEM_LIMIT = 227 * 1024
# Acceptance of a candidate's output against the fp32 reference: relative error (norm) at
# most ERR_FACTOR x the first candidate's + ERR_SLACK, never above ERR_MAX; and no token row
# off by more than ROW_MAX (relative), so one wrong row of a large batch is caught too.
ERR_FACTOR = 1.25
ERR_SLACK = {"bf16": 1e-3, "fp8_tensor": 5e-3, "fp8_channel": 5e-3, "fp8_block": 5e-3}
ERR_MAX = {"bf16": 1e-2, "fp8_tensor": 6e-2, "fp8_channel": 6e-2, "fp8_block": 6e-2}
ROW_MAX = {"bf16": 0.05, "fp8_tensor": 0.25, "fp8_channel": 0.25, "fp8_block": 0.25}


# -------------------------------------------------------------------- benchmark helpers
@functools.lru_cache(maxsize=None)
def bench_common():
    """benchmarks/common.py of this checkout (shapes, inputs, the timing core)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
    if not path.is_file():
        raise SystemExit(f"hopper_moe.tune needs a source checkout: {path} not found")
    spec = importlib.util.spec_from_file_location("hopper_moe_bench_common", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------ search space
def elem_bytes(scheme: str) -> int:
    return 2 if scheme == "bf16" else 1


def smem_bytes(cfg: dict, scheme: str) -> int:
    """Operand tiles of all pipeline stages: num_stages x (BLOCK_M + BLOCK_N) x BLOCK_K."""
    return cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] \
        * elem_bytes(scheme)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def why_pruned(cfg: dict, scheme: str, m: int | None = None, top_k: int = 1,
               num_experts: int = 1) -> str | None:
    """Why `cfg` is not worth timing (None: keep it). Without m only the rules that hold for
    every batch size are applied."""
    if smem_bytes(cfg, scheme) > SMEM_LIMIT:
        return "shared memory"
    if cfg["SWAP_AB"] and cfg["BLOCK_M"] > 64:
        return "swap-AB needs BLOCK_M <= 64"
    if scheme == "fp8_block" and (cfg["BLOCK_K"] != 128 or cfg["BLOCK_N"] > 128):
        return "fp8_block needs BLOCK_K = 128, BLOCK_N <= 128"
    if cfg["ONE_SLOT_PER_BLOCK"] and (cfg["BLOCK_M"] != 16 or cfg["GROUP_M"] != 1):
        return "one slot per block: BLOCK_M 16, GROUP_M 1"
    if cfg["FP8_FAST_ACC"] and scheme not in FAST_ACC_SCHEMES:
        return "fast accumulation: per-tensor / per-channel FP8 only"
    if m is None:
        return None
    # An expert receives at most m rows (a token picks an expert once).
    if cfg["BLOCK_M"] > max(16, _pow2_at_least(m)):
        return "BLOCK_M above M"
    rows = configs.expected_max_rows(m, top_k, num_experts)
    # A token block more than twice the fullest expert's rows only multiplies padding.
    if cfg["BLOCK_M"] > 2 * max(16, _pow2_at_least(math.ceil(rows))):
        return "BLOCK_M above twice the fullest expert"
    # A swap-AB block under half the fullest expert streams that expert's weights 3+ times;
    # the standard mapping covers those sizes.
    if cfg["SWAP_AB"] and rows > 2 * cfg["BLOCK_M"]:
        return "swap-AB block under half the fullest expert"
    # With at most one block per expert, consecutive blocks never share weights.
    if cfg["GROUP_M"] > 1 and m <= cfg["BLOCK_M"]:
        return "GROUP_M > 1 with one block per expert"
    if cfg["ONE_SLOT_PER_BLOCK"] and m * top_k > num_experts:
        return "one slot per block only for M*topk <= E"
    return None


def all_configs() -> list[dict]:
    """The product of every option before pruning (one slot per block only exists with
    BLOCK_M 16 and GROUP_M 1: the block holds one row, nothing to group)."""
    out = []
    for bm, bn, bk, gm, swap, one, nw, ns, fast in itertools.product(
            BLOCK_MS, BLOCK_NS, BLOCK_KS, GROUP_MS, (False, True), (False, True), NUM_WARPS,
            NUM_STAGES, (False, True)):
        if one and (bm != 16 or gm != 1):
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, SWAP_AB=swap,
                        ONE_SLOT_PER_BLOCK=one, num_warps=nw, num_stages=ns, FP8_FAST_ACC=fast))
    return out


def quick_configs() -> list[dict]:
    """A hand-picked subset of all_configs() (71 before pruning) for a tuning pass of a few
    minutes: swap-AB tiles of 16/32/64 token rows for decode, the one-slot tiles, the
    standard-mapping tiles that win at large M on Hopper (64/128 x 128/256, 8 warps, 3-4
    stages), and the large ones again with FP8 fast accumulation (pruned for the other
    schemes), which keeps 128 x 256 tiles free of spills."""
    rows = [(bm, bn, bk, 1, True, False, 4, ns)
            for bm in (16, 32, 64) for bn in (64, 128) for bk in (128, 256) for ns in (3, 4, 5)]
    rows += [(16, bn, bk, 1, True, True, 4, ns)
             for bn in (64, 128) for bk in (128, 256) for ns in (4, 5)]
    rows += [(16, 128, 128, 1, False, False, 4, 4), (32, 128, 128, 16, False, False, 4, 3),
             (64, 64, 128, 1, False, False, 4, 4), (64, 128, 64, 8, False, False, 4, 3),
             (64, 128, 128, 8, False, False, 4, 3), (64, 128, 64, 8, False, False, 8, 4),
             (64, 256, 64, 8, False, False, 8, 3), (128, 128, 64, 8, False, False, 8, 3),
             (128, 128, 128, 8, False, False, 8, 3), (128, 256, 64, 16, False, False, 8, 3),
             (128, 256, 64, 16, False, False, 8, 4), (128, 256, 128, 16, False, False, 8, 3),
             (128, 256, 64, 1, False, False, 8, 4), (128, 256, 128, 16, False, False, 8, 4),
             (128, 128, 128, 16, False, False, 8, 4), (64, 256, 128, 8, False, False, 8, 4)]
    rows = [r + (False,) for r in rows]
    rows += [r[:-1] + (True,) for r in rows if r[0] >= 64 and not r[4] and r[6] == 8]
    return [dict(zip(CONFIG_KEYS, r)) for r in rows]


SPACES = {"full": all_configs, "quick": quick_configs}


def search_space(m: int, scheme: str, top_k: int, num_experts: int,
                 space: str = "full") -> list[dict]:
    return [c for c in SPACES[space]()
            if why_pruned(c, scheme, m, top_k, num_experts) is None]


def prune_summary(m: int, scheme: str, top_k: int, num_experts: int,
                  space: str = "full") -> dict[str, int]:
    """Number of configs each rule removes first, and 'kept'."""
    counts: dict[str, int] = {}
    for c in SPACES[space]():
        why = why_pruned(c, scheme, m, top_k, num_experts) or "kept"
        counts[why] = counts.get(why, 0) + 1
    return counts


def baseline_config(m: int, top_k: int, num_experts: int, scheme: str) -> dict:
    """The first candidate: the default heuristic's config (what runs without a tuned file)."""
    cfg = dict(configs.default_config(m, top_k, num_experts, scheme))
    cfg.setdefault("ONE_SLOT_PER_BLOCK", False)
    cfg.setdefault("FP8_FAST_ACC", False)
    return {k: cfg[k] for k in CONFIG_KEYS}


# ---------------------------------------------------------------------------- the file
def output_path(out_dir: str | os.PathLike, num_experts: int, intermediate: int, scheme: str,
                device_name: str | None = None) -> Path:
    return Path(out_dir) / configs.config_file_name(num_experts, intermediate, scheme,
                                                    device_name)


def load_table(path: str | os.PathLike) -> dict[int, dict]:
    """{M: config} of a tuned file ({} when it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return {}
    with open(path) as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def save_entry(path: str | os.PathLike, m: int, cfg: dict) -> None:
    """Add (or replace) the entry of M, keys sorted by M; atomic (write, then rename)."""
    path = Path(path)
    table = load_table(path)
    table[int(m)] = {k: cfg[k] for k in CONFIG_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump({str(k): table[k] for k in sorted(table)}, f, indent=4)
        f.write("\n")
    os.replace(tmp, path)


def pending_ms(ms: list[int], path: str | os.PathLike, resume: bool) -> list[int]:
    """The M values still to tune: all of them, or with resume those not in the file yet."""
    done = set(load_table(path)) if resume else set()
    return [m for m in ms if m not in done]


# ----------------------------------------------------------------------- the candidates
@dataclass
class Layer:
    """One MoE layer's inputs at one M; calling it runs fused_experts_triton."""
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    quant: Any = None

    def __call__(self) -> torch.Tensor:
        from .backends.triton import fused_experts_triton
        return fused_experts_triton(self.x, self.w1, self.w2, self.topk_weights, self.topk_ids,
                                    quant=self.quant)

    def reference(self) -> torch.Tensor:
        """fp32 reference at the Triton layer's storage precision."""
        from .reference import fused_experts_ref
        from .backends.triton import precision
        return fused_experts_ref(self.x, self.w1, self.w2, self.topk_weights, self.topk_ids,
                                 quant=self.quant, **precision(self.quant))


def make_weights(shape, scheme: str, device, seed: int):
    """(w1, w2, quant) of a shape (benchmarks/common.py's weights; FP8 per the scheme,
    dynamic activation scales)."""
    from .quant import make_quant_config
    w1, w2 = bench_common().make_weights(shape, torch.device(device), seed)
    return make_quant_config(w1, w2, scheme)


def make_layer(shape, w1, w2, quant, m: int, device, seed: int) -> Layer:
    C = bench_common()
    device = torch.device(device)
    _, tw, ti = C.routing(m, shape.num_experts, shape.top_k, device, seed=seed + m)
    x = C.make_hidden(m, shape.hidden_size, device, seed=seed + m)
    return Layer(x, w1, w2, tw, ti, quant)


@contextlib.contextmanager
def forced_config(cfg: dict):
    """Make fused_experts_triton use `cfg` whatever get_config would say."""
    from .backends import triton as backend
    orig = backend.get_config
    backend.get_config = lambda *args, **kwargs: dict(cfg)
    try:
        yield
    finally:
        backend.get_config = orig


def judge(out: torch.Tensor, ref: torch.Tensor, scheme: str,
          base_err: float | None = None) -> tuple[float, str | None]:
    """(relative error of out vs ref, why it is rejected or None). base_err: the first
    candidate's error (None while judging the first candidate itself)."""
    o, r = out.double(), ref.to(out.device).double()
    if not torch.isfinite(o).all():
        return float("nan"), "non-finite output"
    err = (o - r).norm().item() / max(r.norm().item(), 1e-30)
    limit = ERR_MAX[scheme]
    if base_err is not None:
        limit = min(limit, ERR_FACTOR * base_err + ERR_SLACK[scheme])
    if not err <= limit:
        return err, f"rel err {err:.2e} > {limit:.2e}"
    row_ref = r.norm(dim=1)
    rows = (o - r).norm(dim=1) / row_ref.clamp_min(1e-3 * row_ref.mean().item() + 1e-30)
    worst = rows.max().item() if rows.numel() else 0.0
    if worst > ROW_MAX[scheme]:
        return err, f"token row {int(rows.argmax())} off by {worst:.2e}"
    return err, None


@dataclass
class Result:
    config: dict
    us: float = float("nan")
    err: float = float("nan")
    rejected: str | None = None  # why (failed to compile/run, wrong output, other timing)
    mode: str = ""


def evaluate(layer: Layer, cfg: dict, ref: torch.Tensor, scheme: str,
             timer: Callable[[Callable[[], Any]], tuple[Any, Any]],
             base_err: float | None = None) -> Result:
    """Time the layer with `cfg` (timer(fn) -> (Timing, last output)), then check the output
    of the timed calls against the reference."""
    res = Result(dict(cfg))
    try:
        with forced_config(cfg):
            timing, out = timer(layer)
    except Exception as exc:  # noqa: BLE001  (out of resources, compile error, ...)
        res.rejected = "failed: " + bench_common().short_error(exc, 120)
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
            except Exception as lost:  # noqa: BLE001  (a sticky CUDA error: stop here)
                raise RuntimeError(f"CUDA context lost with config {cfg}: a kernel bug; the "
                                   "M values done so far are in the file") from lost
        return res
    res.us, res.mode = timing.median_us, timing.mode
    res.err, res.rejected = judge(out, ref, scheme, base_err)
    return res


class Progress:
    """tqdm when installed, else a counter line (rewritten in place on a terminal)."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self.best = float("inf")
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
        except ImportError:
            self.bar = None
        self.tty = sys.stderr.isatty()

    def update(self, best_us: float) -> None:
        self.n += 1
        self.best = min(self.best, best_us)
        if self.bar is not None:
            self.bar.set_postfix_str(f"best {self.best:.1f} us")
            self.bar.update(1)
        elif self.tty or self.n == self.total or self.n % max(1, self.total // 10) == 0:
            line = f"{self.desc}: {self.n}/{self.total} configs, best {self.best:.1f} us"
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            print(file=sys.stderr)


def tune_one_m(layer: Layer, m: int, shape, scheme: str, timer,
               space_name: str = "full") -> tuple[Result, Result, int]:
    """(best, baseline, number rejected) for one M. The baseline (default config) is timed
    first; its error against the reference is the yardstick of every other candidate."""
    ref = layer.reference()
    base = evaluate(layer, baseline_config(m, shape.top_k, shape.num_experts, scheme), ref,
                    scheme, timer)
    if base.rejected:
        raise RuntimeError(f"M={m}: the default config {base.config} fails ({base.rejected}): "
                           "a kernel bug, not a tuning question")
    best, rejected = base, 0
    space = search_space(m, scheme, shape.top_k, shape.num_experts, space_name)
    bar = Progress(len(space), f"M={m}")
    for cfg in space:
        res = evaluate(layer, cfg, ref, scheme, timer, base.err)
        if res.rejected is None and res.mode != base.mode:
            res.rejected = f"timed {res.mode}, the baseline {base.mode}"
        if res.rejected:
            rejected += 1
        elif res.us < best.us:
            best = res
        bar.update(best.us)
    bar.close()
    return best, base, rejected


# ------------------------------------------------------------------ parallel compilation
def compile_plan(shape, scheme: str, ms: list[int], space_name: str) -> list[tuple[int, dict]]:
    """Every distinct config the tuning of `ms` will run (the defaults included), each with
    the smallest M that runs it. Token counts are never specialized on (the zero-recompile
    guarantee), so a config compiled at one M is the same binary at every M."""
    plan: dict[str, tuple[int, dict]] = {}
    for m in sorted(ms):
        base = baseline_config(m, shape.top_k, shape.num_experts, scheme)
        for cfg in [base] + search_space(m, scheme, shape.top_k, shape.num_experts, space_name):
            plan.setdefault(json.dumps(cfg, sort_keys=True), (m, cfg))
    return list(plan.values())


def _compile_worker(shape_fields: tuple, scheme: str, items: list, seed: int,
                    device: str) -> list[str]:
    """Run each (M, config) once, so that Triton's on-disk cache holds its kernels. Returns
    the failures (the timing pass reports them again, as rejected candidates)."""
    C = bench_common()
    shape = C.MoEShape(*shape_fields)
    device = torch.device(device)
    try:
        w1, w2, quant = make_weights(shape, scheme, device, seed)
    except torch.OutOfMemoryError:
        return [f"a worker had no memory for the weights; the timing pass compiles its "
                f"{len(items)} configs"]
    failed = []
    for m, cfg in items:
        layer = make_layer(shape, w1, w2, quant, m, device, seed)
        try:
            with forced_config(cfg):
                layer()
            if device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (the timing pass rejects it with the reason)
            failed.append(f"M={m} {cfg}: {C.short_error(exc, 120)}")
    return failed


def precompile(shape, scheme: str, ms: list[int], space_name: str, jobs: int,
               seed: int = 0, device: str = "cuda") -> tuple[int, list[str]]:
    """Compile every config of the tuning run in `jobs` processes at once (Triton compiles on
    the CPU, one config at a time per process); the timing pass, one process on the GPU, then
    loads the kernels from the cache. Fewer processes run when the weights of `jobs` copies
    of the layer would not fit in GPU memory. Returns (configs planned, the failures)."""
    import concurrent.futures
    import multiprocessing

    from hopper_moe import tune as this  # by name: under `python -m` this file is __main__

    plan = compile_plan(shape, scheme, ms, space_name)
    if device == "cuda":
        # Each worker holds the layer's weights (FP8 quantization passes through fp32): as
        # many workers as fit in 80% of the free memory.
        per_worker = 3 * shape.num_experts * shape.hidden_size * shape.intermediate_size \
            * (2 if scheme == "bf16" else 10) + (2 << 30)
        jobs = max(1, min(jobs, int(0.8 * torch.cuda.mem_get_info()[0]) // per_worker))
    # Spread large and small tiles evenly: worker i takes every jobs-th config.
    chunks = [plan[i::jobs] for i in range(jobs) if plan[i::jobs]]
    fields = (shape.name, shape.num_experts, shape.top_k, shape.hidden_size,
              shape.intermediate_size)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
        futures = [pool.submit(this._compile_worker, fields, scheme, chunk, seed, device)
                   for chunk in chunks]
        failed = [line for fut in futures for line in fut.result()]
    return len(plan), failed


def tune_shape(shape, scheme: str, ms: list[int], path: Path, device, timer,
               seed: int = 0, space_name: str = "full") -> list[list]:
    """Tune every M of `ms` in turn, adding each winner to the file at `path` as soon as it
    is known. Returns the rows of the summary table."""
    w1, w2, quant = make_weights(shape, scheme, device, seed)
    rows = []
    for m in ms:
        layer = make_layer(shape, w1, w2, quant, m, device, seed)
        best, base, rejected = tune_one_m(layer, m, shape, scheme, timer, space_name)
        save_entry(path, m, best.config)
        cfg = " ".join(f"{k}={best.config[k]}" for k in CONFIG_KEYS)
        print(f"M={m}: {best.us:.1f} us (default {base.us:.1f} us, x{base.us / best.us:.2f}), "
              f"rel err {best.err:.1e}, {rejected} rejected; {cfg}", flush=True)
        rows.append([m, f"{best.us:.1f}", f"{base.us:.1f}", f"{base.us / best.us:.2f}",
                     f"{best.err:.1e}", rejected, cfg])
    return rows


# -------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hopper_moe.tune", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="a benchmarks/common.py shape: mixtral, qwen3_30b, ...")
    p.add_argument("--E", type=int, help="number of experts (with --H --I --topk)")
    p.add_argument("--H", type=int, help="hidden size")
    p.add_argument("--I", type=int, help="intermediate size per expert")
    p.add_argument("--topk", type=int, help="experts per token")
    p.add_argument("--dtype", choices=SCHEMES, default="bf16")
    p.add_argument("--m", help="token counts, comma-separated (default: configs.M_BUCKETS)")
    p.add_argument("--out", default=".", help="folder of the tuned file (default: .)")
    p.add_argument("--device-name", help="name the file for this device instead of the "
                   "current GPU's torch.cuda.get_device_name(), e.g. 'NVIDIA H200'")
    p.add_argument("--resume", action="store_true",
                   help="keep the file's entries and skip their M values")
    p.add_argument("--space", choices=sorted(SPACES), default="full",
                   help="full: every option pruned by the rules; quick: a hand-picked ~60 "
                   "(minutes instead of hours; see quick_configs)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the pruned search space per M (no GPU needed)")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile the configs in this many processes first (Triton's cache "
                   "then serves the timing pass); 1: compile while timing")
    p.add_argument("--iters", type=int, default=30, help="timed graph replays per config")
    p.add_argument("--warmup", type=int, default=5, help="untimed replays per config")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def resolve_shape(args):
    C = bench_common()
    custom = [args.E, args.H, args.I, args.topk]
    if args.shape is not None:
        if any(v is not None for v in custom):
            raise SystemExit("give either --shape or --E --H --I --topk, not both")
        if args.shape not in C.SHAPES:
            raise SystemExit(f"unknown shape {args.shape!r} (known: {', '.join(C.SHAPES)})")
        return C.SHAPES[args.shape]
    if any(v is None for v in custom):
        raise SystemExit("give --shape, or all of --E --H --I --topk")
    return C.MoEShape(f"E{args.E}_H{args.H}_I{args.I}_k{args.topk}", args.E, args.topk,
                      args.H, args.I)


def main(argv=None) -> int:
    args = parse_args(argv)
    C = bench_common()
    shape = resolve_shape(args)
    ok, why = C.scheme_applies(shape, args.dtype)
    if not ok:
        raise SystemExit(why)
    ms = C.parse_list(args.m, int) or list(configs.M_BUCKETS)
    if any(m < 1 for m in ms):
        raise SystemExit("--m: token counts must be >= 1")
    path = output_path(args.out, shape.num_experts, shape.intermediate_size, args.dtype,
                       args.device_name)
    todo = pending_ms(ms, path, args.resume)
    print(f"{shape.name}: E={shape.num_experts} topk={shape.top_k} H={shape.hidden_size} "
          f"I={shape.intermediate_size}, {args.dtype} -> {path}")
    if args.resume and len(todo) < len(ms):
        print(f"resume: M = {', '.join(str(m) for m in ms if m not in todo)} already in the "
              "file, skipped")

    if args.dry_run:
        total = 0
        for m in todo:
            counts = prune_summary(m, args.dtype, shape.top_k, shape.num_experts, args.space)
            kept = counts.pop("kept", 0)
            total += kept + 1
            removed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            print(f"M={m}: {kept} configs (+ the default) of {kept + sum(counts.values())}; "
                  f"pruned: {removed}")
        print(f"total: {total} timed runs for {len(todo)} M values")
        return 0
    if not torch.cuda.is_available():
        print("hopper_moe.tune needs a CUDA GPU: torch.cuda.is_available() is False. "
              "Use --dry-run to list the search space.", file=sys.stderr)
        return 2
    if not todo:
        print("nothing to tune")
        return 0
    if path.is_file() and not args.resume:
        print(f"note: replacing {path} (use --resume to keep its entries)")
        path.unlink()

    if args.jobs < 1:
        raise SystemExit("--jobs must be >= 1")
    if args.jobs > 1:
        t0 = time.perf_counter()
        n, failed = precompile(shape, args.dtype, todo, args.space, args.jobs, args.seed)
        for line in failed:
            print(f"compile failed: {line}", file=sys.stderr)
        print(f"compiled {n - len(failed)} of {n} configs in up to {args.jobs} processes, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    device = torch.device("cuda")
    timer = functools.partial(C.time_cuda, iters=args.iters, warmup=args.warmup,
                              evict=C.L2Evictor(device))
    rows = tune_shape(shape, args.dtype, todo, path, device, timer, args.seed, args.space)
    print()
    print(C.text_table(["M", "best us", "default us", "speed-up", "rel err", "rejected",
                        "config"], rows))
    print(f"\nwrote {path}; use it with HOPPER_MOE_CONFIG_DIR={path.parent.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
