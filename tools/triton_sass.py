"""Compile the Triton MoE GEMM for sm_90a without a GPU and report what ptxas made of it:
registers, spills, shared memory, and the SASS instruction mix of the kernel.

    python tools/triton_sass.py --scheme bf16 --block 128,256,64 --warps 8 --stages 3 \
        [--swap-ab] [--fuse-silu] [--fast-acc] [--n 28672 --k 4096] [--sass out.sass]
    python tools/triton_sass.py --peer [DIR] --scheme fp8_tensor --block 128,256,128 ...

--peer compiles the serving engine's fused_moe_kernel instead (extracted into DIR by
benchmarks/peer_vllm.py; default its folder) at the same tile, for comparing the two kernels
(per-tensor FP8 or bf16; --fuse-silu and the FP8-output options do not apply to it).

The launch's specializations are reproduced: unit strides and 16-divisible sizes are what
Triton sees on the GPU (do_not_specialize arguments excepted), EVEN_K / EVEN_N follow the
shape. Needs ptxas and cuobjdump: the CUDA toolkit's, or those Triton ships.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
# This tool compiles kernels; under TRITON_INTERPRET=1 they would be defined as interpreted
# functions, which cannot be compiled.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hopper_moe.kernels.moe_gemm import TOKEN_DEPENDENT_ARGS, moe_gemm_kernel  # noqa: E402

QUANT = {"bf16": 0, "fp8_tensor": 1, "fp8_channel": 2, "fp8_block": 3}


def _tool(name: str) -> str:
    """The CUDA toolkit's copy, else the one Triton ships (its backend's bin/)."""
    for path in (shutil.which(name),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name),
                 os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)):
        if path and os.path.exists(path):
            return path
    raise SystemExit(f"{name} not found (set CUDA_HOME)")


def signature(args) -> tuple[dict, dict, dict]:
    fp8 = args.scheme != "bf16"
    in_t = "fp8e4nv" if fp8 else "bf16"
    out_t = "fp8e4nv" if args.fp8_out else "bf16"
    ptrs = {"a_ptr": in_t, "b_ptr": in_t, "c_ptr": out_t, "a_scale_ptr": "fp32",
            "b_scale_ptr": "fp32", "topk_weights_ptr": "fp32", "out_scale_ptr": "fp32",
            "sorted_token_ids_ptr": "i32", "expert_ids_ptr": "i32",
            "num_tokens_post_padded_ptr": "i32", "topk_ids_ptr": "i32",
            "expert_map_ptr": "i32"}
    bm, bn, bk = args.block
    n, k = args.n, args.k
    out_n = n // 2 if args.fuse_silu else n
    ints = dict(N=n, K=k, num_slots=8192, num_sorted=9000, num_experts=8, num_local_experts=8,
                stride_am=k, stride_ak=1, stride_be=n * k, stride_bn=k, stride_bk=1,
                stride_cm=out_n, stride_cn=1, stride_asm=0, stride_ask=0,
                stride_bse=1, stride_bsn=0, stride_bsk=0)
    const = dict(TOP_K=2, QUANT=QUANT[args.scheme], PER_ACT_TOKEN=False, PER_OUT_CH=False,
                 GROUP_N=1, GROUP_K=1, MUL_ROUTED_WEIGHT=False, SWAP_AB=args.swap_ab,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, ONE_SLOT_PER_BLOCK=False,
                 HAS_EXPERT_MAP=False, EVEN_K=k % bk == 0, EVEN_N=n % bn == 0,
                 FUSE_SILU=args.fuse_silu, OUT_FP8=args.fp8_out,
                 AMAX_OUT=args.fuse_silu and args.amax,
                 ACT_ROUND=1 if args.fuse_silu else 0,
                 FP8_FAST_ACC=args.fast_acc and args.scheme in ("fp8_tensor", "fp8_channel"),
                 INTERPRETER=False)
    return _specialize(moe_gemm_kernel, ptrs, ints, const, TOKEN_DEPENDENT_ARGS)


def _specialize(fn, ptrs: dict, ints: dict, const: dict, unspecialized=()
                ) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `fn`'s launch as Triton specializes it on the GPU:
    pointers 16-byte aligned, integers equal to 1 made constexprs and multiples of 16 marked
    divisible (except the `unspecialized` ones, do_not_specialize), `const` as given."""
    sig, attrs, const = {}, {}, dict(const)
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = "*" + ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ints:
            v = ints[name]
            if name not in unspecialized and v == 1:
                sig[name] = "constexpr"
                const[name] = 1
                continue
            sig[name] = "i32"
            if name not in unspecialized and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in const:
            sig[name] = "constexpr"
        else:
            raise SystemExit(f"unknown kernel argument {name} of {fn.__name__}")
    return sig, {k: v for k, v in const.items() if sig.get(k) == "constexpr"}, attrs


def peer_signature(fn, args) -> tuple[dict, dict, dict]:
    """The engine kernel's launch (peer_vllm.VllmTritonPipeline._gemm) at this tile."""
    import triton.language as tl
    if args.scheme not in ("bf16", "fp8_tensor"):
        raise SystemExit("--peer: --scheme bf16 or fp8_tensor")
    fp8 = args.scheme != "bf16"
    in_t = "fp8e4nv" if fp8 else "bf16"
    ptrs = {"a_ptr": in_t, "b_ptr": in_t, "c_ptr": "bf16", "a_scale_ptr": "fp32",
            "b_scale_ptr": "fp32", "topk_weights_ptr": "fp32", "sorted_token_ids_ptr": "i32",
            "expert_ids_ptr": "i32", "num_tokens_post_padded_ptr": "i32"}
    bm, bn, bk = args.block
    n, k = args.n, args.k
    ints = dict(N=n, K=k, EM=9000, num_valid_tokens=8192, stride_am=k, stride_ak=1,
                stride_be=n * k, stride_bk=1, stride_bn=k, stride_cm=n, stride_cn=1,
                stride_asm=0, stride_ask=0, stride_bse=1, stride_bsk=0, stride_bsn=0,
                stride_bbe=0, stride_bbn=0)
    const = dict(b_bias_ptr=None, group_n=0, group_k=0, naive_block_assignment=False,
                 BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=16, SPLIT_K=1,
                 MUL_ROUTED_WEIGHT=False, top_k=2, compute_type=tl.bfloat16, use_fp8_w8a8=fp8,
                 use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
                 HAS_BIAS=False, SWAP_AB=args.swap_ab, USE_TD=False)
    return _specialize(fn, ptrs, ints, const)


def _peer_kernel(folder: str | None):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import peer_vllm
    return peer_vllm.VllmTritonPipeline(folder).kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scheme", default="bf16", choices=sorted(QUANT))
    p.add_argument("--block", default="128,256,64",
                   type=lambda s: tuple(int(v) for v in s.split(",")), help="BLOCK_M,N,K")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--swap-ab", action="store_true")
    p.add_argument("--fuse-silu", action="store_true", help="GEMM1 with SiLU*mul epilogue")
    p.add_argument("--fp8-out", action="store_true", help="with --fuse-silu: static FP8 C")
    p.add_argument("--amax", action="store_true", help="with --fuse-silu: dynamic amax out")
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--fast-acc", action="store_true",
                   help="FP8 per-tensor / per-channel: accumulate the K loop in the tensor core "
                        "(a config's FP8_FAST_ACC)")
    p.add_argument("--sass", default=None, help="write the SASS here")
    p.add_argument("--peer", nargs="?", const="", default=None, metavar="DIR",
                   help="compile the engine's fused_moe_kernel (benchmarks/peer_vllm.py) instead")
    args = p.parse_args(argv)

    if args.peer is not None:
        fn = _peer_kernel(args.peer or None)
        sig, const, attrs = peer_signature(fn, args)
    else:
        fn = moe_gemm_kernel
        sig, const, attrs = signature(args)
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=args.warps, num_stages=args.stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        verbose = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o",
                                  str(Path(tmp) / "v.cubin")], capture_output=True, text=True)
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    usage = " ".join(line.split("ptxas info    :")[-1].strip()
                     for line in verbose.stderr.splitlines() if "Used" in line or "spill" in line)
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", sass))
    mma = sorted({m for m in re.findall(r"\b([HQ]GMMA\.\S+)", sass)})
    print(("peer (the engine's fused_moe_kernel) " if args.peer is not None else "") +
          f"config: scheme={args.scheme} block={args.block} warps={args.warps} "
          f"stages={args.stages} swap_ab={args.swap_ab} fuse_silu={args.fuse_silu}")
    print(f"ptxas: {usage}")
    print(f"shared memory (Triton): {kernel.metadata.shared} bytes")
    print(f"SASS: {sum(ops.values())} instructions; MMA: {', '.join(mma) or 'none'}")
    print("top: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    local = [k for k in ops if k in ("LDL", "STL")]
    print("local memory: " + (", ".join(f"{k} {ops[k]}" for k in local) if local else "none"))
    if args.sass:
        Path(args.sass).write_text(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
