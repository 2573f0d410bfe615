"""Shared pieces of the hopper_moe benchmarks (method: docs/BENCHMARK.md).

- the BENCHMARK.md shape table and token counts;
- the ceilings measured in the same run (copy bandwidth, dense bf16 and FP8 GEMM rates);
- the timing core: CUDA-graph capture, L2 eviction between replays, CUDA events around the
  replay only, median (eager fallback when capture fails); a wall-clock variant for CPU runs;
- the L2 eviction methods (--evict write / clean / rotate / none): the 256 MiB write, or a
  rotation through R copies of a row's weights with one graph per copy;
- the roofline floor of one MoE layer;
- routing and input generation (random data only, fixed seeds);
- markdown / JSON output and the environment header.

Benchmarks never assert: anything odd is printed next to the number it concerns.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: w1 [E, 2I, H], w2 [E, H, I]."""
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    why: str = ""


SHAPES: dict[str, MoEShape] = {s.name: s for s in [
    MoEShape("mixtral", 8, 2, 4096, 14336, "few large experts; classic decode case"),
    MoEShape("mixtral_tp2", 8, 2, 4096, 7168, "tensor-parallel shard"),
    MoEShape("qwen3_30b", 128, 8, 2048, 768, "many small experts: latency-bound decode"),
    MoEShape("qwen3_235b_tp4", 128, 8, 4096, 384, "small shard"),
    MoEShape("deepseek_v3_tp8", 256, 8, 7168, 256, "block-FP8 [128,128], many experts"),
    MoEShape("gpt_oss_120b", 128, 4, 2880, 2880, "mid-size experts"),
    # Not in BENCHMARK.md: a small layer for smoke runs (CPU runs, --quick checks).
    MoEShape("tiny", 8, 2, 256, 512, "smoke test only"),
]}
DEFAULT_SHAPES = ["mixtral", "mixtral_tp2", "qwen3_30b", "qwen3_235b_tp4", "deepseek_v3_tp8",
                  "gpt_oss_120b"]
M_LIST = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
QUICK_M_LIST = [1, 16, 256, 4096]
SCHEMES = ("bf16", "fp8_tensor", "fp8_channel", "fp8_block")
BLOCK = 128  # fp8_block: [128, 128] weight blocks, 1x128 activation groups


def scheme_applies(shape: MoEShape, scheme: str) -> tuple[bool, str]:
    """Whether `scheme` makes sense for `shape` (block FP8 needs H and I multiples of 128)."""
    if scheme not in SCHEMES:
        return False, f"unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})"
    if scheme == "fp8_block" and (shape.hidden_size % BLOCK or shape.intermediate_size % BLOCK):
        return False, (f"fp8_block skipped for {shape.name}: H={shape.hidden_size}, "
                       f"I={shape.intermediate_size} are not multiples of {BLOCK}")
    return True, ""


def parse_list(text: str | None, cast: Callable[[str], Any] = str) -> list:
    if text is None:
        return []
    return [cast(t.strip()) for t in text.split(",") if t.strip()]


def import_hopper_moe():
    """Import hopper_moe, adding <repo>/python to sys.path when it is not installed.
    Returns (module or None, error string or None)."""
    err = ""
    for attempt in range(2):
        try:
            return importlib.import_module("hopper_moe"), None
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
        src = os.path.join(REPO_ROOT, "python")
        if attempt == 0 and src not in sys.path:
            sys.path.insert(0, src)
    return None, err


def short_error(exc: BaseException, limit: int = 160) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
    text = msg[0] if msg else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------- environment
def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'cpu' -> 'cpu': used in result file names."""
    s = name.lower().replace("nvidia", "").strip()
    out = "".join(c if c.isalnum() else "_" for c in s)
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_") or "gpu"


def command_line() -> str:
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT)
    return f"python {script} {args}".strip()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def collect_env(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "command": command_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = "not installed"
    hm, err = import_hopper_moe()
    env["hopper_moe"] = (getattr(hm, "__version__", "?") if hm is not None
                         else f"import failed: {err}")
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        env["git"] = commit + ("-dirty" if dirty else "")
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env["gpu"] = p.name
        env["sm_count"] = p.multi_processor_count
        env["capability"] = f"{p.major}.{p.minor}"
        env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        l2 = getattr(p, "L2_cache_size", None)
        if l2:
            env["l2_mib"] = round(l2 / 2**20, 1)
    else:
        env["gpu"] = "cpu"
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


# ------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    """Median and spread of one timed region, in microseconds."""
    median_us: float
    p10_us: float
    p90_us: float
    iters: int
    mode: str  # "graph", "eager" (capture failed or not asked), "wall" (CPU)
    note: str = ""


def _summary(samples_us: Sequence[float], mode: str, note: str = "") -> Timing:
    xs = sorted(samples_us)
    n = len(xs)

    def q(p: float) -> float:
        return xs[min(n - 1, max(0, int(round(p * (n - 1)))))]
    return Timing(statistics.median(xs), q(0.1), q(0.9), n, mode, note)


class L2Evictor:
    """Writes a 256 MiB buffer (over 4x the H200's 60 MB L2) so the next timed region reads
    its weights from HBM, as a decode step does. Runs outside the timed region.

    clean=True then reads a second 256 MiB buffer: the write leaves L2 full of dirty lines,
    whose write-back to HBM otherwise lands in the timed region (tens of MB of writes that are
    not the timed work's); after the read L2 holds clean lines only."""

    def __init__(self, device: torch.device, nbytes: int = 256 << 20, clean: bool = False):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        self._v = 0
        self.clean = clean
        if clean:
            self._read = torch.zeros(nbytes // 4, dtype=torch.int32, device=device)
            self._sink = torch.empty((), dtype=torch.int64, device=device)

    def __call__(self) -> None:
        self._v = (self._v + 1) & 0xFFFF
        self.buf.fill_(self._v)
        if self.clean:
            torch.sum(self._read, dim=0, dtype=torch.int64, out=self._sink)


def capture_graph(fn: Callable[[], Any], warmup: int = 3, pool: Any = None):
    """Run `fn` eagerly on a side stream (compiles, autotunes, creates handles), then capture
    one call in a CUDA graph (in memory pool `pool`: None gives the graph its own). Returns
    (graph, static output). Raises when capture fails; the caller's stream is restored either
    way (the stream context is the outermost one)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        try:
            out = fn()
        except BaseException:
            try:
                # end the (invalidated) capture; the first error is the one to report
                g.capture_end()
            except Exception:  # noqa: BLE001
                pass
            raise
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g, out


def _detach_copy(out: Any) -> Any:
    """A copy of a graph's static output (tensors, or tuples/lists/dicts of them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach_copy(o) for o in out)
    if isinstance(out, dict):
        return {k: _detach_copy(v) for k, v in out.items()}
    return out


def event_loop(run: Callable[[], Any], evict: Callable[[], None] | None, iters: int) -> list[float]:
    """The timed core: for each iteration, [evict] then events around `run` only. The host
    enqueues everything before one synchronize, and a sleep kernel up front lets it get ahead,
    so the start event is never stamped while the GPU waits on the host."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)  # about 1 ms at H200 clocks
    for i in range(iters):
        if evict is not None:
            evict()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def time_cuda(fn: Callable[[], Any], *, iters: int = 100, warmup: int = 10,
              evict: Callable[[], None] | None = None, use_graph: bool = True
              ) -> tuple[Timing, Any]:
    """Time `fn` on the current CUDA device: CUDA graph of one call, `warmup` replays, then
    `iters` timed replays with eviction between them; median. Falls back to eager timing (and
    says why in Timing.note) when capture fails. Returns (timing, output of the last call)."""
    return _time_cycled([fn], iters=iters, warmup=warmup, between=evict, use_graph=use_graph)


def _time_cycled(fns: Sequence[Callable[[], Any]], *, iters: int, warmup: int,
                 between: Callable[[], None] | None, use_graph: bool) -> tuple[Timing, Any]:
    """The timing of time_cuda and time_cuda_rotated: one CUDA graph per callable,
    warm_up(warmup, len(fns)) (the count, then 20 ms of GPU time), then `iters` timed
    replays, replay i on graph i % len(fns), `between` before each (outside the events);
    median. Falls back to eager calls cycled the same way when a capture fails. Returns
    (timing, output of the last timed replay)."""
    note = ""
    r = len(fns)
    if use_graph:
        try:
            graphs, outs = capture_graphs(fns)
        except Exception as exc:  # noqa: BLE001  (host sync, unsupported op, ...)
            _recover_after_capture_failure()
            note = "graph capture failed, eager timing: " + short_error(exc, 120)
        else:
            replay = Cycle([g.replay for g in graphs])
            warm_up(replay, warmup, r)
            samples = event_loop(replay, between, iters)
            out = _detach_copy(outs[replay.last])
            del graphs, outs, replay
            return _summary(samples, "graph"), out
    holder: dict[str, Any] = {}
    calls = Cycle(fns)

    def eager() -> None:
        holder["out"] = calls()
    warm_up(eager, max(1, warmup), r)
    samples = event_loop(eager, between, iters)
    return _summary(samples, "eager", note), holder.get("out")


def _recover_after_capture_failure() -> None:
    """A failed capture can leave the stream capturing or an error pending: end it and
    synchronize so later work runs normally."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def time_wall(fn: Callable[[], Any], *, iters: int = 10, warmup: int = 2) -> tuple[Timing, Any]:
    """Wall-clock median for CPU runs (no graphs, no eviction)."""
    out = None
    for _ in range(max(1, warmup)):
        out = fn()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _summary(samples, "wall"), out


def time_fn(fn: Callable[[], Any], device: torch.device, *, iters: int, warmup: int,
            evict: Callable[[], None] | None = None, use_graph: bool = True,
            copies: Sequence[Callable[[], Any]] | None = None) -> tuple[Timing, Any]:
    """time_cuda on a CUDA device, time_wall on the CPU. `copies` (--evict rotate): `fn` built
    on each weight copy (WeightRotation.build), timed in rotation by time_cuda_rotated with
    `evict` (make_evictor's rotation_spacer) between replays; the CPU times `fn` alone."""
    if device.type == "cuda":
        if copies:
            return time_cuda_rotated(copies, iters=iters, warmup=warmup, use_graph=use_graph,
                                     between=evict)
        return time_cuda(fn, iters=iters, warmup=warmup, evict=evict, use_graph=use_graph)
    return time_wall(fn, iters=max(3, min(iters, 10)), warmup=min(warmup, 2))


# ------------------------------------------------------------------ L2 eviction methods
EVICT_METHODS = ("write", "clean", "rotate", "none")
ROTATE_L2_FACTOR = 4  # rotate: bytes the other copies touch between two uses of one, in L2s
ROTATE_MAX_COPIES = 256  # rotate: at most this many copies (rows of a few MB would ask more)
ROTATE_L2_FALLBACK = 64 << 20  # rotate: the L2 size assumed when the device does not say
_ACT_SCALE_FIELDS = ("a1_scale", "a2_scale")  # activation-side: shared by every copy


def add_evict_args(p: argparse.ArgumentParser) -> None:
    """--evict and its two older spellings, --clean-l2 and --no-evict (resolve_evict)."""
    p.add_argument("--evict", choices=EVICT_METHODS, default=None,
                   help="L2 eviction between timed replays: write (default: a 256 MiB write, "
                        "common.L2Evictor), clean (the write, then a 256 MiB read, so the "
                        "timed region starts with no dirty lines to write back), rotate "
                        "(R copies of the row's weights, one CUDA graph per copy, replay i "
                        "runs copy i mod R; common.WeightRotation), none (hot-cache numbers)")
    p.add_argument("--clean-l2", action="store_true", help="the same as --evict clean")
    p.add_argument("--no-evict", action="store_true", help="the same as --evict none")


def resolve_evict(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Sets args.evict to the method asked for (default write) from --evict, --clean-l2 and
    --no-evict, and args.clean_l2 / args.no_evict to match it. Contradictory flags are an
    argparse error (exit 2, the message on stderr)."""
    aliases = [(flag, method) for flag, method, on in (("--clean-l2", "clean", args.clean_l2),
                                                       ("--no-evict", "none", args.no_evict))
               if on]
    if len(aliases) > 1:
        p.error("--clean-l2 and --no-evict contradict each other (--evict clean or none)")
    if aliases and args.evict is not None and args.evict != aliases[0][1]:
        flag, method = aliases[0]
        p.error(f"--evict {args.evict} contradicts {flag} (which means --evict {method})")
    args.evict = args.evict or (aliases[0][1] if aliases else "write")
    args.clean_l2 = args.evict == "clean"
    args.no_evict = args.evict == "none"
    return args.evict


def make_evictor(method: str, device: torch.device) -> Callable[[], None] | None:
    """The work between replays for `method`: an L2Evictor for write and clean,
    rotation_spacer for rotate (the rotation itself evicts), None for none and on the CPU."""
    if method not in EVICT_METHODS:
        raise ValueError(f"unknown L2 eviction method {method!r} (known: {EVICT_METHODS})")
    if device.type != "cuda" or method == "none":
        return None
    if method == "rotate":
        return rotation_spacer
    return L2Evictor(device, clean=method == "clean")


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (0 when unknown or not a CUDA device)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


def evict_description(method: str, l2_bytes: int = 0) -> str:
    """The report's words for an L2 eviction method (one of EVICT_METHODS)."""
    if method == "write":
        return ("L2 eviction: write, a 256 MiB write between replays (outside the timed "
                "region)")
    if method == "clean":
        return ("L2 eviction: clean, a 256 MiB write then a 256 MiB read between replays "
                "(outside the timed region; no dirty lines in L2 at the start)")
    if method == "rotate":
        l2 = f" ({l2_bytes / 2**20:.0f} MiB)" if l2_bytes else ""
        return ("L2 eviction: rotate, R copies of the row's weights (w1, w2 and their "
                "per-expert scales; copy 0 the originals), one CUDA graph per copy, replay i "
                "runs copy i mod R, between replays only a ~50 us spin kernel that touches no "
                "memory (the host's launch stays out of the timed region); R per row (column "
                "timing, json evict_copies) is the smallest >= 2 whose other R - 1 copies' replays "
                f"touch >= {ROTATE_L2_FACTOR}x L2{l2} between two uses of a copy (a replay "
                "touches the row's floor bytes), capped by free memory; warm-up rounded up "
                "to a multiple of R")
    if method == "none":
        return "no L2 eviction (hot-cache numbers)"
    raise ValueError(f"unknown L2 eviction method {method!r} (known: {EVICT_METHODS})")


class RotationDoesNotFit(RuntimeError):
    """Not even one more copy of the row's weights fits in free device memory."""


def rotation_copies(l2_bytes: int, replay_bytes: int, copy_bytes: int, free_bytes: int, *,
                    factor: float = ROTATE_L2_FACTOR, margin_bytes: int | None = None,
                    max_copies: int = ROTATE_MAX_COPIES) -> tuple[int, str]:
    """R, the number of weight copies --evict rotate cycles through: the smallest R >= 2 with
    (R - 1) * replay_bytes >= factor * l2_bytes, the bytes the other copies' replays touch
    between two uses of one copy. Copy 0 is the original weights, so R - 1 clones of
    copy_bytes each must fit in free_bytes less margin_bytes (default max(2 GiB, free / 10),
    room for the graphs' own buffers); R is capped there and at max_copies.
    Returns (R, note): why R is below what the rule asks, "" when it is not.
    Raises RotationDoesNotFit when not even R = 2 fits."""
    if replay_bytes <= 0:
        raise ValueError(f"replay_bytes must be > 0, got {replay_bytes}")
    if max_copies < 2:
        raise ValueError(f"max_copies must be >= 2, got {max_copies}")
    want = max(2, 1 + -(-int(factor * l2_bytes) // int(replay_bytes)))
    margin = max(2 << 30, free_bytes // 10) if margin_bytes is None else margin_bytes
    room = free_bytes - margin
    fit = 1 + room // copy_bytes if copy_bytes > 0 else want
    if fit < 2:
        raise RotationDoesNotFit(
            f"--evict rotate: one more copy of the weights ({copy_bytes / 2**20:.0f} MiB) "
            f"does not fit in free device memory ({free_bytes / 2**20:.0f} MiB, keeping "
            f"{margin / 2**20:.0f} MiB free)")
    r = min(want, fit, max_copies)
    if r == want:
        return r, ""
    why = "free memory" if fit <= max_copies else f"the cap of {max_copies} copies"
    touched = (r - 1) * replay_bytes / l2_bytes if l2_bytes else float("inf")
    return r, (f"R capped at {r} by {why} (the rule asks {want}): the other copies' replays "
               f"touch {touched:.1f}x L2 between two uses of a copy")


def _per_expert_fields(quant: Any, num_experts: int) -> list[str]:
    """Names of the weight-side, per-expert tensors of a quantization config (a dataclass):
    leading dimension num_experts, not an activation scale."""
    if not dataclasses.is_dataclass(quant):
        raise TypeError(f"cannot copy the weights of a {type(quant).__name__} quantization "
                        "config (expected a dataclass such as hopper_moe.QuantConfig)")
    names = []
    for f in dataclasses.fields(quant):
        t = getattr(quant, f.name)
        if (isinstance(t, torch.Tensor) and f.name not in _ACT_SCALE_FIELDS and t.dim() >= 1
                and t.shape[0] == num_experts):
            names.append(f.name)
    return names


def weights_nbytes(weights: Sequence[Any], num_experts: int) -> int:
    """Bytes of what clone_weights copies."""
    total = 0
    for w in weights:
        if isinstance(w, torch.Tensor):
            total += w.numel() * w.element_size()
        elif w is not None:
            for name in _per_expert_fields(w, num_experts):
                t = getattr(w, name)
                total += t.numel() * t.element_size()
    return total


def clone_weights(weights: Sequence[Any], num_experts: int) -> tuple:
    """One copy of a row's weights, e.g. (w1, w2, quant): tensors are cloned (strides kept),
    None stays None, and a quantization config (a dataclass) is replaced by one whose
    per-expert weight-side tensors (w1_scale, w2_scale) are cloned; its activation scales and
    flags are shared with the original."""
    out: list[Any] = []
    for w in weights:
        if isinstance(w, torch.Tensor):
            out.append(w.clone())
        elif w is None:
            out.append(None)
        else:
            names = _per_expert_fields(w, num_experts)
            out.append(dataclasses.replace(w, **{n: getattr(w, n).clone() for n in names}))
    return tuple(out)


class WeightRotation:
    """--evict rotate: R copies of a row's weights (copy 0 the originals, then R - 1 clones),
    so that timing the row's callable built on each copy, replay i on copy i mod R, streams
    each replay's weights from HBM with no eviction work between replays (time_fn's
    `copies`). R comes from rotation_copies; free() drops the clones."""

    def __init__(self, copies: Sequence[tuple], note: str = ""):
        self.copies: list[tuple] = list(copies)
        self.note = note

    @property
    def r(self) -> int:
        return len(self.copies)

    @classmethod
    def for_row(cls, device: torch.device, weights: Sequence[Any], replay_bytes: int,
                num_experts: int, *, l2_bytes: int | None = None,
                free_bytes: int | None = None, margin_bytes: int | None = None,
                max_copies: int = ROTATE_MAX_COPIES) -> "WeightRotation":
        """The copies of `weights` for a row whose replay touches replay_bytes (its floor
        bytes). l2_bytes and free_bytes default to the device's (the L2 size, or
        ROTATE_L2_FALLBACK when it does not say; torch.cuda.mem_get_info after emptying the
        allocator's cache). Raises RotationDoesNotFit (a message for the row) when not even
        one clone fits, or when cloning runs out of memory."""
        note = ""
        if l2_bytes is None:
            l2_bytes = l2_cache_bytes(device)
            if not l2_bytes:
                l2_bytes = ROTATE_L2_FALLBACK
                note = f"L2 size unknown: {ROTATE_L2_FALLBACK >> 20} MiB assumed"
        if free_bytes is None:
            torch.cuda.empty_cache()
            free_bytes = torch.cuda.mem_get_info(device)[0]
        copy_bytes = weights_nbytes(weights, num_experts)
        r, why = rotation_copies(l2_bytes, replay_bytes, copy_bytes, free_bytes,
                                 margin_bytes=margin_bytes, max_copies=max_copies)
        copies = [tuple(weights)]
        try:
            for _ in range(r - 1):
                copies.append(clone_weights(weights, num_experts))
        except torch.cuda.OutOfMemoryError as exc:
            del copies
            torch.cuda.empty_cache()
            raise RotationDoesNotFit(f"--evict rotate: {r} weight copies of "
                                     f"{copy_bytes / 2**20:.0f} MiB: " + short_error(exc, 80))
        return cls(copies, "; ".join(n for n in (note, why) if n))

    def build(self, make_fn: Callable[..., Callable[[], Any]],
              first: Callable[[], Any] | None = None) -> list[Callable[[], Any]]:
        """[make_fn(*copy) for each copy]; `first`, when given, stands for copy 0 (a callable
        already built on the original weights)."""
        fns = [first if first is not None else make_fn(*self.copies[0])]
        fns += [make_fn(*c) for c in self.copies[1:]]
        return fns

    def free(self) -> None:
        """Drops the clones (the caller's originals stay)."""
        self.copies = self.copies[:1]


class Cycle:
    """A zero-argument callable whose i-th call (counting from 0) runs fns[i % len(fns)];
    `last` is the index the latest call ran (-1 before the first), `calls` the count."""

    def __init__(self, fns: Sequence[Callable[[], Any]]):
        if not fns:
            raise ValueError("Cycle needs at least one callable")
        self.fns = list(fns)
        self.calls = 0
        self.last = -1

    def __call__(self) -> Any:
        k = self.calls % len(self.fns)
        self.calls += 1
        self.last = k
        return self.fns[k]()


def warmup_replays(warmup: int, copies: int) -> int:
    """Warm-up replays before a rotation's timed ones: `warmup` rounded up to a multiple of
    `copies` and at least `copies` (each graph replayed once), so that timed replay i runs
    copy i mod R and the first timed one follows the other R - 1 copies, as every later one.
    One copy (no rotation): `warmup` as it is."""
    if copies <= 1:
        return max(0, warmup)
    return max(1, -(-max(0, warmup) // copies)) * copies


WARMUP_MIN_MS = 20.0  # warm_up: GPU time spent in warm-up replays before the timed ones
WARMUP_MAX_REPLAYS = 20_000


def gpu_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds the current CUDA stream spends on the work `fn` enqueues (events around
    it, synchronized)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def warm_up(run: Callable[[], Any], warmup: int, copies: int = 1, *,
            min_ms: float | None = None,
            timer: Callable[[Callable[[], Any]], float] | None = None) -> int:
    """The warm-up before timed replays: warmup_replays(warmup, copies) calls of `run`, then
    more in batches of whole rotations (about 8 calls) until `timer` (gpu_ms on a CUDA device;
    none elsewhere) has counted `min_ms` (default WARMUP_MIN_MS) in them, at most
    WARMUP_MAX_REPLAYS calls. A count alone is not enough: right after a capture the first
    few milliseconds of replays ran ~10% slower on the H200 (FP8 GEMM-only M = 1 under
    rotation: 104-107 us against 97 for the same graphs a loop later;
    benchmarks/notes/measurement.md). Returns the calls made."""
    done = warmup_replays(warmup, copies)
    for _ in range(done):
        run()
    min_ms = WARMUP_MIN_MS if min_ms is None else min_ms
    if timer is None:
        if not torch.cuda.is_available():
            return done
        timer = gpu_ms
    r = max(1, copies)
    batch = r * max(1, -(-8 // r))

    def one_batch() -> None:
        for _ in range(batch):
            run()
    spent = 0.0
    while spent < min_ms and done + batch <= WARMUP_MAX_REPLAYS:
        spent += timer(one_batch)
        done += batch
    return done


def capture_graphs(fns: Sequence[Callable[[], Any]], warmup: int = 3
                   ) -> tuple[list[Any], list[Any]]:
    """capture_graph for each callable: (graphs, static outputs). Two or more share one
    memory pool: their buffers are not live across replays and the graphs replay one at a
    time, in capture order (Cycle), so one set of buffers serves them all."""
    pool = torch.cuda.graph_pool_handle() if len(fns) > 1 else None
    graphs: list[Any] = []
    outs: list[Any] = []
    for fn in fns:
        g, out = capture_graph(fn, warmup, pool=pool)
        graphs.append(g)
        outs.append(out)
    return graphs, outs


def time_cuda_rotated(fns: Sequence[Callable[[], Any]], *, iters: int = 100,
                      warmup: int = 10, use_graph: bool = True,
                      between: Callable[[], None] | None = None) -> tuple[Timing, Any]:
    """time_cuda for --evict rotate: fns[k] is the row's callable on weight copy k. One CUDA
    graph per copy, warm_up(warmup, R) as in _time_cycled, then `iters` timed replays,
    replay i on graph i % R, events around each replay and only `between` (default
    rotation_spacer) between them; median. Falls back to eager calls cycled the same way when
    a capture fails. Returns (timing, output of the last timed replay)."""
    return _time_cycled(fns, iters=iters, warmup=warmup, between=between or rotation_spacer,
                        use_graph=use_graph)


ROTATE_SPACER_CYCLES = 100_000  # about 50 us at H200 clocks


def rotation_spacer() -> None:
    """The work between two rotated replays: a spin kernel of about 50 us that touches no
    memory (L2 keeps what the last replay left). Without it the replays run back to back and
    the host's launch of the next graph can land between a start event and the graph's first
    kernel (the write eviction's fill gives the host the same head start)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(ROTATE_SPACER_CYCLES)


# ---------------------------------------------------------------------------- ceilings
@dataclass
class Ceilings:
    """Measured in the same run, on the same device. Units: bytes/s and FLOP/s."""
    copy_bw: float
    bf16_flops: float
    fp8_flops: float | None
    notes: list[str] = field(default_factory=list)

    def peak(self, scheme: str) -> float:
        if scheme.startswith("fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops

    def describe(self) -> str:
        fp8 = f"{self.fp8_flops / 1e12:.0f} TFLOP/s" if self.fp8_flops else "n/a"
        return (f"copy {self.copy_bw / 1e12:.3g} TB/s (read+write), "
                f"dense bf16 {self.bf16_flops / 1e12:.0f} TFLOP/s, dense FP8 {fp8}")


def _median_time_s(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    t, _ = time_fn(fn, device, iters=iters, warmup=3, evict=None, use_graph=False)
    return t.median_us * 1e-6


def measure_ceilings(device: torch.device, quick: bool = False) -> Ceilings:
    """Copy bandwidth (dst.copy_(src), bytes read + written), dense bf16 GEMM (torch.matmul)
    and dense FP8 GEMM (torch._scaled_mm, scalar scales), 8192^3 on random data."""
    notes: list[str] = []
    gen = torch.Generator(device=device).manual_seed(1234)
    cuda = device.type == "cuda"
    iters = (10 if quick else 30) if cuda else 3
    nbytes = (1 << 30) if cuda else (16 << 20)
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device, generator=gen)
    dst = torch.empty_like(src)
    t = _median_time_s(lambda: dst.copy_(src), device, iters)
    copy_bw = 2 * nbytes / t

    n = 8192 if cuda else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=gen)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device, generator=gen)
    t = _median_time_s(lambda: torch.matmul(a, b), device, iters)
    bf16_flops = 2 * n**3 / t
    if not cuda:
        notes.append(f"CPU ceilings: {nbytes >> 20} MiB copy, {n}^3 GEMM")

    fp8_flops = None
    if not cuda:
        notes.append("no FP8 ceiling on the CPU: FP8 rows use the bf16 peak")
    else:
        try:
            a8 = a.to(FP8)
            b8 = b.to(FP8)  # [N, K] row-major: b8.t() is the column-major operand _scaled_mm wants
            one = torch.ones((), dtype=torch.float32, device=device)
            t = _median_time_s(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16), device, iters)
            fp8_flops = 2 * n**3 / t
        except Exception as exc:  # noqa: BLE001
            notes.append("FP8 GEMM ceiling not measured (" + short_error(exc, 100)
                         + "): FP8 rows use the bf16 peak")
    if cuda:
        torch.cuda.empty_cache()
    return Ceilings(copy_bw, bf16_flops, fp8_flops, notes)


# ------------------------------------------------------------------------------ floors
def weight_bytes_per_element(scheme: str) -> int:
    return 2 if scheme == "bf16" else 1


def scale_bytes(quant: Any, num_experts: int, experts_touched: int) -> int:
    """Bytes of the scales a layer must read: per-expert weight scales of the touched experts
    plus any static activation scales. 0 for bf16 (quant None)."""
    if quant is None:
        return 0
    total = 0
    for name in ("w1_scale", "w2_scale"):
        t = getattr(quant, name, None)
        if isinstance(t, torch.Tensor):
            if t.dim() >= 1 and t.shape[0] == num_experts and num_experts > 0:
                total += (t.numel() // num_experts) * t.element_size() * experts_touched
            else:
                total += t.numel() * t.element_size()
    for name in ("a1_scale", "a2_scale"):
        t = getattr(quant, name, None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def layer_flops(shape: MoEShape, m: int) -> int:
    """2 * M * topk * 3 * H * I (GEMM1 is 2I x H, GEMM2 is H x I)."""
    return 2 * m * shape.top_k * 3 * shape.hidden_size * shape.intermediate_size


def layer_bytes(shape: MoEShape, m: int, scheme: str, experts_touched: int,
                scales: int = 0, act_in_bytes: int = 2, act_out_bytes: int = 2) -> int:
    """(unique experts touched) * 3*H*I * bytes-per-weight + scales + M*H*(in+out bytes)."""
    w = experts_touched * 3 * shape.hidden_size * shape.intermediate_size
    return (w * weight_bytes_per_element(scheme) + scales
            + m * shape.hidden_size * (act_in_bytes + act_out_bytes))


def gemm_only_bytes(shape: MoEShape, m: int, scheme: str, experts_touched: int,
                    scales: int = 0) -> int:
    """GEMM1 + GEMM2 alone: weights and scales, plus each GEMM's activations read
    (M*topk rows of H, then of I, at the weight element size) and written (bf16)."""
    rows = m * shape.top_k
    a = weight_bytes_per_element(scheme)
    h, i = shape.hidden_size, shape.intermediate_size
    w = experts_touched * 3 * h * i * a + scales
    return w + rows * (h * a + 2 * i * 2) + rows * (i * a + h * 2)


def floor_us(nbytes: float, flops: float, bw: float, peak: float) -> tuple[float, str]:
    """max(bytes/BW, flops/PEAK) in µs, and which term binds ('mem' or 'flop')."""
    tm = nbytes / bw * 1e6
    tf = flops / peak * 1e6
    return (tm, "mem") if tm >= tf else (tf, "flop")


# ----------------------------------------------------------------------------- inputs
def routing(m: int, num_experts: int, top_k: int, device: torch.device, seed: int,
            zipf: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over N(0,1) logits (fixed seed), top-k, renormalized. With zipf = s > 0 the
    logits get log(1/rank^s) added for a random ranking of experts: skewed routing.
    Returns (gating logits f32 [M,E], topk_weights f32 [M,K], topk_ids int32 [M,K])."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(m, num_experts, generator=gen, dtype=torch.float32)
    if zipf > 0:
        rank = torch.randperm(num_experts, generator=gen).to(torch.float32) + 1.0
        logits = logits - zipf * torch.log(rank)[None, :]
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return logits.to(device), w.to(device), ids.to(torch.int32).to(device)


def experts_touched(topk_ids: torch.Tensor, num_experts: int) -> int:
    ids = topk_ids.flatten()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return int(torch.unique(ids).numel())


def make_weights(shape: MoEShape, device: torch.device, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 w1 [E, 2I, H] ~ N(0, 1/H) and w2 [E, H, I] ~ N(0, 1/I): outputs are O(1)."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=device, generator=gen)
    w1.mul_(1.0 / math.sqrt(h))
    w2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=device, generator=gen)
    w2.mul_(1.0 / math.sqrt(i))
    return w1, w2


def make_hidden(m: int, hidden_size: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(m, hidden_size, dtype=torch.bfloat16, device=device, generator=gen)


def rel_error(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN when either is missing or non-finite)."""
    if out is None or ref is None or out.shape != ref.shape:
        return float("nan")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    denom = r.norm().item()
    if denom == 0.0:
        return float("nan")
    return (o - r).norm().item() / denom


# -------------------------------------------------------------- torch._grouped_mm helpers
def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Graph-safe grouping of the M*topk slots by expert (no host sync): returns
    (order [M*K] int64 slot indices sorted by expert, token of each sorted slot,
    offs [E] int32 cumulative end row of each expert)."""
    flat = topk_ids.flatten().to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.clamp(0, num_experts - 1),
                        torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, order // topk_ids.shape[1], offs


def grouped_mm_available(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def grouped_mm_layer(x, w1, w2, topk_weights, topk_ids):
    """bf16 MoE layer on torch._grouped_mm (graph-safe): the PyTorch grouped-GEMM pipeline."""
    m, k = topk_ids.shape
    e, two_i, _ = w1.shape
    order, tok, offs = sort_by_expert(topk_ids, e)
    a = x.index_select(0, tok)
    h1 = torch._grouped_mm(a, w1.transpose(1, 2), offs=offs)
    act = torch.nn.functional.silu(h1[:, : two_i // 2]) * h1[:, two_i // 2:]
    h2 = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    h2 = h2.float() * topk_weights.flatten().index_select(0, order)[:, None]
    out = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, h2)
    return out.to(x.dtype)


def loop_layer(x, w1, w2, topk_weights, topk_ids, dtype=None):
    """Per-expert loop (host syncs: not graph-capturable). dtype=torch.float32 gives an fp32
    reference; None computes in the weights' dtype with fp32 accumulation of the sum."""
    dt = dtype or w1.dtype
    m, k = topk_ids.shape
    e = w1.shape[0]
    i = w1.shape[1] // 2
    out = torch.zeros(m, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten().to(torch.int64)
    wflat = topk_weights.flatten().float()
    for ex in range(e):
        slots = (flat == ex).nonzero().flatten()
        if slots.numel() == 0:
            continue
        tok = slots // k
        a = x.index_select(0, tok).to(dt)
        h = a @ w1[ex].to(dt).t()
        h = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        y = (h @ w2[ex].to(dt).t()).float() * wflat[slots][:, None]
        out.index_add_(0, tok, y)
    return out if dtype == torch.float32 else out.to(x.dtype)


class HarnessLib:
    """Stand-in for hopper_moe used by --selftest: checks the harness itself (timing, floors,
    tables, plots) without the library. bf16 only. Backends: 'torch' (per-expert loop, eager
    because it syncs), 'grouped_mm' (torch._grouped_mm, graph-safe), 'reference' (fp32)."""

    __version__ = "harness-selftest"

    @staticmethod
    def available_backends(device: torch.device) -> list[str]:
        names = ["torch"]
        if grouped_mm_available(device):
            names.append("grouped_mm")
        return names

    @staticmethod
    def fused_experts(x, w1, w2, topk_weights, topk_ids, *, quant=None, backend="torch"):
        if quant is not None:
            raise NotImplementedError("selftest: bf16 only")
        if backend == "torch":
            return loop_layer(x, w1, w2, topk_weights, topk_ids)
        if backend == "grouped_mm":
            return grouped_mm_layer(x, w1, w2, topk_weights, topk_ids)
        if backend == "reference":
            return loop_layer(x, w1, w2, topk_weights, topk_ids, dtype=torch.float32)
        raise ValueError(f"selftest: unknown backend {backend!r}")

    @staticmethod
    def fused_experts_ref(x, w1, w2, topk_weights, topk_ids, *, quant=None):
        return loop_layer(x.float(), w1, w2, topk_weights, topk_ids, dtype=torch.float32)


# ------------------------------------------------------------------------------ output
def fmt(v: Any, spec: str = ".1f", none: str = "—") -> str:
    if v is None:
        return none
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def fmt_err(err: float | None) -> str:
    if err is None:
        return "—"
    if math.isnan(err):
        return "nan"
    return f"{err:.1e}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


_NUMERIC = re.compile(r"^([-+]?[\d.]+(e[-+]?\d+)?( \(\d+%\))?( !)?|—|nan)$")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned plain-text table for the terminal: numbers right-aligned, text left-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for n, r in enumerate(cells):
        out.append(" | ".join(c.rjust(w) if (n and _NUMERIC.match(c)) else c.ljust(w)
                              for c, w in zip(r, widths)).rstrip())
        if n == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


def env_header_md(title: str, env: dict[str, Any], ceilings: Ceilings | None,
                  extra: Sequence[str] = ()) -> str:
    lines = [f"# {title}", "", "```", env.get("command", ""), "```", ""]
    keys = ["date", "gpu", "sm_count", "capability", "gpu_memory_gib", "l2_mib", "cpu",
            "torch", "cuda_runtime", "triton", "hopper_moe", "git", "host"]
    for k in keys:
        if k in env:
            lines.append(f"- {k}: {env[k]}")
    if ceilings is not None:
        lines.append(f"- ceilings (measured in this run): {ceilings.describe()}")
        for n in ceilings.notes:
            lines.append(f"- note: {n}")
    for x in extra:
        lines.append(f"- {x}")
    return "\n".join(lines) + "\n"


def write_results(out_dir: str, stem: str, markdown: str, payload: dict[str, Any]
                  ) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    md_path = os.path.join(out_dir, stem + ".md")
    js_path = os.path.join(out_dir, stem + ".json")
    with open(md_path, "w") as f:
        f.write(markdown)
    with open(js_path, "w") as f:
        json.dump(_sanitize(payload), f, indent=1, default=_json_default)
    return md_path, js_path


def _sanitize(o: Any) -> Any:
    """NaN/inf -> None so the file is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_sanitize(v) for v in o]
    if hasattr(o, "__dataclass_fields__"):
        return _sanitize(asdict(o))
    return o


def _json_default(o: Any) -> Any:
    return str(o)


def show_path(path: str) -> str:
    """Relative to the working directory when inside it, else absolute."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def no_gpu_banner() -> str:
    return ("NO GPU FOUND: torch.cuda.is_available() is False. Ran the CPU path only; "
            "these CPU numbers are not benchmark results.")
