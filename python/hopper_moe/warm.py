"""``hopper_moe.warmup`` (this module is ``hopper_moe.warm``: the package attribute ``warmup``
is the function): compile and run, before serving, everything a layer can reach.

The Triton GEMM compiles one kernel per tile config, and configs come from a finite set of
token-count buckets (kernels.moe_gemm_configs): without a warm-up, the first call that lands in
a new bucket compiles for 1-3 s. ``warmup`` walks every token count 1..max_num_tokens through
the same choices a call makes (the backend ``auto`` picks, the Triton config), keeps one token
count per distinct (backend, config), compiles the Triton kernels of all of them on a thread
pool (compilation runs in Triton's compiler and ptxas, largely outside the GIL), then runs the
whole layer once at each of those token counts in order, so that every launch path, cache and
the allocator's largest buffers are in place. After it, no token count up to max_num_tokens
compiles anything.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import api
from .quant import QuantConfig

__all__ = ["WarmupReport", "warmup"]


@dataclass
class WarmupReport:
    """What warmup did: the token count run per (backend, config) class, the Triton kernels
    compiled (None where this Triton does not say), and the seconds each phase took."""
    token_counts: dict[str, list[int]] = field(default_factory=dict)
    kernels_compiled: Optional[int] = None
    compile_s: float = 0.0
    run_s: float = 0.0


def _fail(msg: str) -> None:
    raise RuntimeError(f"warmup: {msg}")


def _compiled_variants() -> Optional[int]:
    """Compiled specializations of the Triton MoE GEMM (None: Triton not loaded, or this
    version keeps them elsewhere)."""
    import sys

    module = sys.modules.get("hopper_moe.kernels.moe_gemm")
    if module is None:
        return 0
    try:
        return sum(len(cache[0]) for cache in module.moe_gemm_kernel.device_caches.values())
    except (AttributeError, TypeError, IndexError):
        return None


def _classes(w1, w2, top_k: int, max_num_tokens: int, dtype: torch.dtype, quant,
             global_num_experts: int, backend: str) -> dict[tuple, int]:
    """(backend, kernel class) -> the smallest token count in it, over 1..max_num_tokens.
    global_num_experts: the resolved count with an expert_map, -1 without (the Triton
    backend's expert count is then w1's)."""
    from .kernels.moe_gemm_configs import get_config

    device = w1.device
    scheme = "bf16" if quant is None else quant.scheme
    num_experts = w1.shape[0] if global_num_experts == -1 else global_num_experts
    inter = w2.shape[2]
    reps: dict[tuple, int] = {}
    for m in range(1, max_num_tokens + 1):
        name = backend if backend != "auto" else api._auto_choice(
            device, dtype, m, w1, w2, top_k, quant).backend
        if name == "triton":
            cfg = get_config(m, top_k, num_experts, inter, scheme,
                             group_k=None if quant is None else quant.act_group_size)
            key = (name, tuple(sorted(cfg.items())))
        else:  # no JIT: a run per power-of-two size class sets up launch paths and buffers
            key = (name, max(m - 1, 1).bit_length())
        reps.setdefault(key, m)
    return reps


def warmup(w1: torch.Tensor, w2: torch.Tensor, top_k: int, max_num_tokens: int = 16384, *,
           dtype: torch.dtype = torch.bfloat16, quant: Optional[QuantConfig] = None,
           global_num_experts: int = -1, expert_map: Optional[torch.Tensor] = None,
           apply_router_weight_on_input: bool = False, backend: str = "auto",
           threads: Optional[int] = None) -> WarmupReport:
    """Prepares the layer with experts w1 ``[E, 2I, H]`` / w2 ``[E, H, I]`` (and ``quant``,
    ``expert_map``, ``global_num_experts`` as ``fused_experts`` takes them) for calls of 1 to
    ``max_num_tokens`` tokens of ``dtype`` routed ``top_k`` ways with ``backend``: compiles
    every Triton kernel those calls reach (``threads`` workers, default min(8, CPUs)), then
    runs the layer once per kernel class on random inputs. Synchronizes the device. On the CPU
    it validates the arguments (one call of one token) and reports the classes without running
    them: nothing there is compiled or sized per call. Returns a WarmupReport."""
    if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int) or \
            max_num_tokens < 1:
        _fail(f"max_num_tokens must be an int >= 1, got {max_num_tokens!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        _fail(f"top_k must be an int >= 1, got {top_k!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3:
        _fail("w1 must be a 3-D tensor [E, 2I, H]")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        _fail(f"threads must be None or an int >= 1, got {threads!r}")
    device = w1.device
    hidden = w1.shape[2]
    if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int):
        _fail(f"global_num_experts must be an int, got {global_num_experts!r}")
    # The global expert count as fused_experts resolves it (the range the router's ids come
    # from, and the count the Triton configs are chosen by): with expert_map,
    # global_num_experts or else the map's length; without, w1's experts.
    if isinstance(expert_map, torch.Tensor) and expert_map.dim() == 1:
        num_global = expert_map.shape[0] if global_num_experts == -1 else global_num_experts
        global_num_experts = num_global
    else:
        num_global = w1.shape[0]
    if top_k > num_global:
        _fail(f"top_k = {top_k} must be at most the number of experts ({num_global})")
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Drawn on the CPU, whatever torch's default device is, then moved to the layer's device.
    x = torch.randn(max_num_tokens, hidden, generator=gen, device="cpu") * 0.5
    x = x.to(device=device, dtype=dtype)
    # Distinct experts per token, as a router gives them.
    ids = torch.rand(max_num_tokens, num_global, generator=gen, device="cpu")
    ids = ids.argsort(dim=1)[:, :top_k]
    ids = ids.to(device=device, dtype=torch.int32)
    weights = torch.rand(max_num_tokens, top_k, generator=gen, device="cpu").to(device)

    def call(m: int, name: str, **extra):
        return api.fused_experts(x[:m], w1, w2, weights[:m], ids[:m], "silu",
                                 apply_router_weight_on_input, global_num_experts, expert_map,
                                 quant=quant, backend=name, **extra)

    # Validates every argument once, with fused_experts' own messages.
    call(1, backend)
    reps = _classes(w1, w2, top_k, max_num_tokens, dtype, quant,
                    global_num_experts if expert_map is not None else -1,
                    api._canonical(backend))
    report = WarmupReport()
    for (name, _), m in sorted(reps.items(), key=lambda kv: kv[1]):
        report.token_counts.setdefault(name, []).append(m)
    if device.type == "cpu":
        # Nothing to prepare on the CPU: no kernel is compiled (the torch backend is eager, the
        # Triton interpreter compiles nothing) and no allocator or launch state depends on the
        # size. The classes are reported; running them would only cost time (minutes for a
        # DeepSeek-size layer up to vLLM's batch size).
        return report
    before = _compiled_variants()
    start = time.perf_counter()
    triton_ms = report.token_counts.get("triton", [])
    if triton_ms:
        from .backends import triton as triton_backend

        def compile_one(m: int) -> None:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                triton_backend.fused_experts_triton(
                    x[:m], w1, w2, weights[:m], ids[:m], apply_router_weight_on_input,
                    global_num_experts, expert_map, quant, compile_only=True)

        compile_one(triton_ms[0])  # the JIT's per-device state, made once
        workers = threads or min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for f in [pool.submit(compile_one, m) for m in triton_ms[1:]]:
                f.result()
    report.compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for name, ms in report.token_counts.items():
        for m in ms + [max_num_tokens]:
            call(m, name)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.run_s = time.perf_counter() - start
    after = _compiled_variants()
    if before is not None and after is not None:
        report.kernels_compiled = after - before
    return report

