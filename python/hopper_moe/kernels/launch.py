"""Launching a compiled Triton kernel with less host work per call than ``kernel[grid](...)``.

``JITFunction.run`` binds every argument, derives the specialization of each, builds the cache
key from them, looks the compiled kernel up and only then launches: for the MoE GEMM's ~50
arguments that is a large part of an eager layer's host time at decode. Here the compiled
kernel is remembered under a key the caller already has at hand: the kernel, the device,
num_warps / num_stages, the dtypes of the pointer arguments, and ``static``, the values of
every non-pointer argument except the ones the kernel does not specialize on
(``do_not_specialize``: the token-dependent integers). A key seen before launches that
compiled kernel through its own launcher directly. A new key, a pointer that is not 16-byte
aligned, launch hooks set (profilers), or a Triton whose compiled kernels lack the launcher
this relies on go through ``kernel[grid](...)`` as usual, which also compiles; the compiled
kernel it returns is remembered.

The key is stricter than Triton's own (integer values rather than their divisibility, all
pointers aligned), so a remembered kernel is always the one Triton would pick.
"""
from __future__ import annotations

import functools
import operator
from typing import Sequence

import torch
import triton

from .. import settings

__all__ = ["launch", "stats"]

_COMPILED: dict[tuple, object] = {}
_DIRECT = [0]  # launches that went straight to a remembered kernel
_DTYPE = operator.attrgetter("dtype")
_PTR = operator.methodcaller("data_ptr")
_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hook_set(hook) -> bool:
    """Is a launch hook installed? Triton >= 3.5 keeps them in a HookChain (never None; set
    when it holds calls), older ones as a callable or None."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _hooks_set() -> bool:
    if _KNOBS is None:
        return True  # a Triton without knobs: always its own launch path
    return _hook_set(_KNOBS.launch_enter_hook) or _hook_set(_KNOBS.launch_exit_hook)


def stats() -> tuple[int, int]:
    """(compiled kernels remembered, direct launches so far): tests and benchmarks."""
    return len(_COMPILED), _DIRECT[0]


def launch(kernel, grid: Sequence[int], ptrs: tuple, scalars: tuple, static: tuple,
           num_warps: int, num_stages: int, compile_only: bool = False) -> None:
    """``kernel[grid](*ptrs, *scalars, num_warps=..., num_stages=...)``: ptrs are the kernel's
    leading pointer parameters (tensors), scalars every parameter after them (constexprs
    included) in order, static the scalars the compiled kernel depends on. compile_only:
    Triton's ``kernel.warmup`` instead (compile, launch nothing)."""
    args = ptrs + scalars
    if compile_only:
        if not settings.TRITON_INTERPRET:  # the interpreter compiles nothing
            kernel.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages)
        return
    if settings.TRITON_INTERPRET or not ptrs[0].is_cuda:
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages)
        return
    device = torch.cuda.current_device()  # where JITFunction.run launches too
    key = (kernel, device, num_warps, num_stages, tuple(map(_DTYPE, ptrs)), static)
    compiled = _COMPILED.get(key)
    aligned = not functools.reduce(operator.or_, map(_PTR, ptrs)) & 15
    if compiled is None or not aligned or _hooks_set():
        compiled = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages)
        if aligned and all(hasattr(compiled, a) for a in ("run", "function",
                                                           "packed_metadata")):
            _COMPILED[key] = compiled
        return
    # The compiled kernel's launcher, called as JITFunction.run calls it (no hooks: no launch
    # metadata).
    _DIRECT[0] += 1
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args)
