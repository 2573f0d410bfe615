"""The bandwidth control of a GEMM-only row: one kernel that reads the weights the row's two
GEMMs stream (every touched expert's w1 and w2 slice, on the weight copy the replay uses) and
nothing else, timed exactly as the GEMMs are (bench_moe.py --gemm-only --backends cute,read).

Its time is what a pure stream of those bytes costs under the same method: graph launch,
first-byte latency and drain included. A GEMM pair cannot stream the same bytes faster than a
kernel that only reads them, so `read`'s % of floor bounds what the GEMMs can reach at a
row's size.

The kernel: the slices are cut into chunks of BLOCK * STEPS words; program p reads chunk p as int32
words, STEPS loads of BLOCK words each, all issued before their XOR is folded, and stores the
chunk's XOR (so no load can be dropped; `expected_xor` recomputes it on the host for tests).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

BLOCK = 1024  # int32 words per load step of one program (4 KB; 4 warps: 2 x 16 B per thread)
STEPS = 16    # load steps per program: a chunk is 64 KB
NUM_WARPS = 4

_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_chunks(a_ptr, b_ptr, a_chunks, a_start, a_end, b_start, b_end, out_ptr,
                    BLOCK: tl.constexpr, STEPS: tl.constexpr):
        # chunk p < a_chunks reads words a_start[p] .. a_end[p] of a, the rest b's
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        if pid < a_chunks:
            start = tl.load(a_start + pid)
            end = tl.load(a_end + pid)
            for s in tl.static_range(STEPS):
                idx = start + s * BLOCK + offs
                acc ^= tl.load(a_ptr + idx, mask=idx < end, other=0)
        else:
            q = pid - a_chunks
            start = tl.load(b_start + q)
            end = tl.load(b_end + q)
            for s in tl.static_range(STEPS):
                idx = start + s * BLOCK + offs
                acc ^= tl.load(b_ptr + idx, mask=idx < end, other=0)
        tl.store(out_ptr + pid, tl.xor_sum(acc, 0))

    return read_chunks


def kernel():
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    return _kernel


def words(w: torch.Tensor) -> torch.Tensor:
    """A contiguous weight tensor's bytes as flat int32 words."""
    if not w.is_contiguous():
        raise RuntimeError("read control: the weights must be contiguous")
    flat = w.reshape(-1).view(torch.uint8)
    if flat.numel() % 4 or flat.data_ptr() % 16:
        raise RuntimeError("read control: the weights' bytes must be a 16-byte aligned "
                           "multiple of 4")
    return flat.view(torch.int32)


def chunk_table(experts: Sequence[int], expert_words: int) -> tuple[list[int], list[int]]:
    """(start, end) word offsets of the BLOCK * STEPS word chunks covering each expert's slice of
    `expert_words` words, in expert order; the last chunk of a slice ends with it."""
    starts, ends = [], []
    for e in experts:
        lo, hi = e * expert_words, (e + 1) * expert_words
        for s in range(lo, hi, BLOCK * STEPS):
            starts.append(s)
            ends.append(min(s + BLOCK * STEPS, hi))
    return starts, ends


def touched_experts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    ids = topk_ids.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return sorted(set(ids.tolist()))


def make_weight_read(w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
                     ) -> Callable[[], torch.Tensor]:
    """A zero-argument callable (one kernel launch, graph-capturable) that reads the slices
    of w1 and w2 ([E, ...], contiguous) of the experts in topk_ids; returns the per-chunk
    XORs."""
    e = w1.shape[0]
    if w2.shape[0] != e:
        raise RuntimeError(f"read control: w1 and w2 have {e} and {w2.shape[0]} experts")
    experts = touched_experts(topk_ids, e)
    a, b = words(w1), words(w2)
    return _make_read(a, chunk_table(experts, a.numel() // e), b,
                      chunk_table(experts, b.numel() // e))


def make_buffer_read(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The same kernel over every byte of one contiguous buffer."""
    a = words(buf)
    return _make_read(a, chunk_table([0], a.numel()), a, ([], []))


def _make_read(a: torch.Tensor, a_tab: tuple[list[int], list[int]], b: torch.Tensor,
               b_tab: tuple[list[int], list[int]]) -> Callable[[], torch.Tensor]:
    dev = a.device

    def table(v: list[int]) -> torch.Tensor:
        return torch.tensor(v or [0], dtype=torch.int64, device=dev)
    tabs = [table(a_tab[0]), table(a_tab[1]), table(b_tab[0]), table(b_tab[1])]
    n_a, n = len(a_tab[0]), len(a_tab[0]) + len(b_tab[0])
    out = torch.empty(max(n, 1), dtype=torch.int32, device=dev)
    k = kernel()

    def run() -> torch.Tensor:
        if n:
            k[(n,)](a, b, n_a, tabs[0], tabs[1], tabs[2], tabs[3], out, BLOCK=BLOCK,
                    STEPS=STEPS, num_warps=NUM_WARPS)
        return out
    return run


def expected_xor(w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The per-chunk XORs make_weight_read's kernel must return, computed with torch."""
    import numpy as np
    e = w1.shape[0]
    experts = touched_experts(topk_ids, e)
    res: list[int] = []
    for w in (w1, w2):
        x = words(w).cpu().numpy()
        for s, t in zip(*chunk_table(experts, x.size // e)):
            res.append(int(np.bitwise_xor.reduce(x[s:t])))
    return torch.tensor(res, dtype=torch.int32)


def describe() -> str:
    return (f"read = one Triton kernel reading only the touched experts' w1 and w2 bytes "
            f"({BLOCK * STEPS * 4 // 1024} KB per program, {STEPS} loads in flight), timed as the "
            f"GEMM rows: the pure-stream control (not a GEMM; never the row's best)")


def gemm_only_read(x: Any, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor):
    """bench_moe.py's GEMM-only hook for backend 'read': (callable, label)."""
    del x
    return make_weight_read(w1, w2, topk_ids), "read control (Triton weight read)"
