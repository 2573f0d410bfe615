"""A CUTLASS 3.x ptr-array grouped GEMM as a GEMM-only peer (docs/BENCHMARK.md's CUTLASS row):
GEMM1 + GEMM2 of the layer with tokens as the M operand, built from the same CUTLASS headers
as hopper_moe, for measuring only. Sources: benchmarks/peer_cutlass/ (one file per variant);
compiled on first use with torch.utils.cpp_extension into a folder outside the tree
(``~/.cache/hopper_moe/peer_cutlass``, or ``HOPPER_MOE_PEER_CUTLASS_DIR``).

    python benchmarks/peer_cutlass.py build        # compile (no GPU needed), print the variants

It builds with PyTorch's extension builder, which needs CUDA_HOME where nvcc's folder has no
lib/ of its own (e.g. CUDA_HOME=/usr/local/cuda when nvcc is a link in /usr/local/bin).

Variants (bench_moe.py backends ``cutlass_coop`` / ``cutlass_pingpong`` with ``--gemm-only``):
FP8 e4m3 cooperative 256x128x128 (fast accumulation, and ``cutlass_coop_promoted`` with
CUTLASS's fp32 promotion), FP8 ping-pong 128x128x128 (fast accumulation), bf16 cooperative
256x128x64 and ping-pong 128x128x64; ``cutlass_engine``: the FP8 kernels vLLM's cutlass_moe_mm
runs on SM90 for more than 64 rows, chosen per GEMM by its rule (ping-pong, fast accumulation:
64x128x256 with a 1x8 cluster for N >= 8192, else 128x128x128 with 1x8 for K >= 8192, else
64x256x128 with 1x2). bf16 outputs, alpha = 1 (the FP8 scales are not applied:
a GEMM-only timing). Operands are prepared once per row (rows sorted by expert, one group per
expert with rows); the timed call launches the two grouped GEMMs only.
"""
from __future__ import annotations

import functools
import os
import sys
import weakref
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "peer_cutlass"
BACKENDS = {"cutlass_coop": "coop", "cutlass_coop_promoted": "coop_promoted",
            "cutlass_pingpong": "pingpong", "cutlass_engine": "engine"}
# cutlass_engine: the FP8 kernels vLLM's cutlass_moe_mm runs on SM90, chosen per GEMM by its
# rule for more than 64 rows (its swap-AB kernels for fewer rows are not built here).
ENGINE_MIN_ROWS = 65
ENGINE_LARGE = 8192
# Which schemes a backend's variant runs (the FP8 variants take per-tensor or per-channel
# FP8 operands; the scales are not applied).
FP8_SCHEMES = ("fp8_tensor", "fp8_channel")


def build_dir() -> Path:
    return Path(os.environ.get("HOPPER_MOE_PEER_CUTLASS_DIR") or
                Path.home() / ".cache" / "hopper_moe" / "peer_cutlass")


def engine_variant(rows: int, n: int, k: int) -> str | None:
    """The variant vLLM's cutlass_moe_mm picks for a GEMM of `rows` rows (all experts'), N and
    K on SM90, or None for 64 rows or fewer (its swap-AB kernels, not built here)."""
    if rows < ENGINE_MIN_ROWS:
        return None
    if n >= ENGINE_LARGE:
        return "fp8_engine_n8192"
    if k >= ENGINE_LARGE:
        return "fp8_engine_k8192"
    return "fp8_engine_default"


def variant_for(backend: str, scheme: str) -> str | None:
    """The compiled variant that backend runs for scheme, or None where it has none
    (cutlass_engine: its default; gemm_pair chooses per GEMM with engine_variant)."""
    kind = BACKENDS.get(backend)
    if kind is None:
        return None
    if kind == "engine":
        return "fp8_engine_default" if scheme in FP8_SCHEMES else None
    if scheme == "bf16":
        return None if kind == "coop_promoted" else "bf16_" + kind
    if scheme in FP8_SCHEMES:
        return "fp8_" + kind
    return None


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False):
    """The compiled module (compiles on first use; a later process reuses the build)."""
    from torch.utils.cpp_extension import load as load_ext
    sys.path.insert(0, str(HERE.parent / "third_party"))
    from find_cutlass import cutlass_include_dirs, nvidia_include_dirs
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in SOURCES.glob("*.cu"))
    flags = ["-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
             "--expt-extended-lambda", "-gencode=arch=compute_90a,code=sm_90a",
             "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    return load_ext(name="hopper_moe_peer_cutlass", sources=sources,
                    extra_include_paths=[str(SOURCES)] + cutlass_include_dirs()
                    + nvidia_include_dirs(),
                    extra_cuda_cflags=flags, build_directory=str(out), verbose=verbose)


def expert_rows(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(token index of each slot in expert order, rows per expert) for in-range ids: the torch
    backend's grouping (hopper_moe.backends.torch.sort_slots_by_expert), with the counts on the
    host for the plans."""
    from hopper_moe.backends.torch import sort_slots_by_expert
    order, _, _, offs = sort_slots_by_expert(topk_ids, num_experts, num_experts, None)
    ends = [0] + [int(v) for v in offs.tolist()]
    return order[: ends[-1]] // topk_ids.shape[1], [b - a for a, b in zip(ends, ends[1:])]


def check_groups(a: torch.Tensor, w: torch.Tensor, d: torch.Tensor, counts: list[int],
                 variant: str) -> None:
    """The first and the last expert with rows against an fp32 matmul: a peer that computes
    something else would time something else."""
    starts = [sum(counts[:e]) for e in range(len(counts))]
    used = [e for e, c in enumerate(counts) if c > 0]
    for e in {used[0], used[-1]}:
        rows = slice(starts[e], starts[e] + counts[e])
        ref = a[rows].float() @ w[e].float().t()
        err = ((d[rows].float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err <= 2e-2:
            raise RuntimeError(f"peer_cutlass {variant}: expert {e} off by {err:.2e} "
                               "(relative) against an fp32 matmul")


def gemm_pair(backend: str, scheme: str, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_ids: torch.Tensor) -> Callable[[], object]:
    """A zero-argument callable running GEMM1 ([rows, H] x w1^T) and GEMM2 ([rows, I] x w2^T)
    of the peer's variant on operands made here (w1 [E, 2I, H], w2 [E, H, I] in the scheme's
    dtype: bf16, or float8_e4m3fn for FP8)."""
    variant = variant_for(backend, scheme)
    if variant is None:
        raise NotImplementedError(f"{backend} has no {scheme} variant")
    num_experts, two_i, hidden = w1.shape
    tok, counts = expert_rows(topk_ids, num_experts)
    if sum(counts) == 0:
        raise NotImplementedError("no routed rows")
    variant1 = variant2 = variant
    if BACKENDS[backend] == "engine":
        variant1 = engine_variant(sum(counts), two_i, hidden)
        variant2 = engine_variant(sum(counts), hidden, two_i // 2)
        if variant1 is None or variant2 is None:
            raise NotImplementedError(f"{backend}: the engine's kernels for {sum(counts)} rows "
                                      f"(<= {ENGINE_MIN_ROWS - 1}: swap-AB) are not built")
    mod = load()
    dtype = w1.dtype
    gen = torch.Generator(device=x.device).manual_seed(12)
    a1 = x.index_select(0, tok).float().clamp(-448, 448).to(dtype).contiguous()
    a2 = (torch.randn(a1.shape[0], two_i // 2, device=x.device, generator=gen) * 0.5).to(dtype)
    d1 = torch.empty(a1.shape[0], two_i, dtype=torch.bfloat16, device=x.device)
    d2 = torch.empty(a1.shape[0], hidden, dtype=torch.bfloat16, device=x.device)
    w1, w2 = w1.contiguous(), w2.contiguous()  # the plans hold their addresses: keep them
    h1 = mod.prepare(variant1, a1, w1, d1, counts)
    h2 = mod.prepare(variant2, a2, w2, d2, counts)
    keep = (a1, a2, d1, d2, w1, w2)
    mod.run(h1)
    mod.run(h2)
    check_groups(a1, w1, d1, counts, variant1)
    check_groups(a2, w2, d2, counts, variant2)

    def run():
        mod.run(h1)
        mod.run(h2)
        return keep[2], keep[3]
    run.variant = variant1 if variant1 == variant2 else \
        f"{variant1} + {variant2}"  # type: ignore[attr-defined]
    for handle in (h1, h2):  # the plans (device arrays, workspace) go with the callable
        weakref.finalize(run, mod.release, handle)
    return run


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print(__doc__)
        return 2
    mod = load(verbose="-v" in args)
    print("peer_cutlass: built in", build_dir(), "; variants:", ", ".join(mod.variants()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
