"""Run every CUDA op once on the edge-case shapes, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tools/sanitize_ops.py
    ... python tools/sanitize_ops.py --gemm     (only the grouped GEMM and the cute layer)
    ... python tools/sanitize_ops.py --layer    (only the whole layer: every GPU backend x
                                                 every scheme, edge-case routings)
    ... python tools/sanitize_ops.py --layer --backends triton,sm90   (those backends only)

Every allocation is exact-size (no caching allocator), so an access one element past a buffer
is caught. Shapes: 0, 1 and 3 tokens, a tile +- 1, experts with no tokens, all tokens on one
expert, ids out of range and expert_map -1 entries, NaN/inf router logits; on an SM90 GPU the
grouped GEMM (moe_grouped_gemm, cutlass_moe_mm) with N/K tails and ragged experts, and the cute
layer.
"""
from __future__ import annotations

import sys

import torch

import hopper_moe
from hopper_moe import ops

dev = "cuda"
g = torch.Generator(device=dev)
g.manual_seed(0)


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dtype)


def routing(T, E, K, bad_ids=False, one_expert=False, weird_logits=False):
    logits = randn(T, E, dtype=torch.float32)
    if weird_logits and T >= 3:
        logits[0] = float("nan")
        logits[1, 0] = float("inf")
        logits[2] = 1.0
    w = torch.empty(T, K, dtype=torch.float32, device=dev)
    ids = torch.empty(T, K, dtype=torch.int32, device=dev)
    tei = torch.empty(T, K, dtype=torch.int32, device=dev)
    ops.topk_softmax(w, ids, tei, logits, True)
    if one_expert:
        ids = (torch.arange(K, device=dev, dtype=torch.int32) % E).expand(T, K).contiguous()
    if bad_ids and T > 0:
        ids[0, 0] = -1
        ids[-1, -1] = E + 3
    ops.topk_sigmoid(w.clone(), ids.clone(), tei.clone(), logits, True, None, 2.5)
    if E % 4 == 0 and K <= E // 4 * 2:
        ops.grouped_topk(logits, 4, 2, K, True, 2.5, randn(E, dtype=torch.float32), 1)
    return w, ids


def layer_ops(T, E, K, H, I, expert_map=None, **kw):
    w, ids = routing(T, E, K, **kw)
    x = randn(T, H)
    for bs in (16, 64):
        sorted_ids, expert_ids, ntp = ops.moe_align_block_size_buffers(ids, E, bs)
        ops.moe_align_block_size(ids, E, bs, sorted_ids, expert_ids, ntp, expert_map)
    n_local = E if expert_map is None else int((expert_map >= 0).sum())
    perm, _, offs, inv, pidx = ops.moe_permute(x, None, ids, E, n_local, expert_map)
    # The same sort in the caller's scratch (exact-size buffers), and its routing-only form.
    S = T * K
    scratch = (torch.empty(torch.ops.hopper_moe.moe_permute_sort_workspace_size(S, E),
                           dtype=torch.int8, device=dev),
               *(torch.empty(S, dtype=torch.int32, device=dev) for _ in range(3)))
    tei = torch.arange(S, dtype=torch.int32, device=dev).view(T, K)
    offs2 = torch.empty(n_local + 1, dtype=torch.int64, device=dev)
    inv2 = torch.empty(T, K, dtype=torch.int32, device=dev)
    torch.ops.hopper_moe.moe_permute_with_scratch(
        x, ids, tei, expert_map, E, n_local, K, torch.empty_like(perm), offs2, inv2,
        torch.empty(S, dtype=torch.int32, device=dev), *scratch)
    torch.ops.hopper_moe.moe_prepare_scatter(ids, tei, expert_map, E, n_local, offs2, inv2,
                                             *scratch)
    out = torch.empty(T, H, dtype=x.dtype, device=dev)
    ops.moe_unpermute(out, perm, w, inv, offs)
    ops.shuffle_rows(x, torch.arange(T, device=dev, dtype=torch.int32).flip(0))
    stacked = randn(T, K, H)
    ops.moe_sum(stacked, torch.empty(T, H, dtype=x.dtype, device=dev), ids, expert_map)
    inter = randn(T, 2 * I)
    ops.silu_and_mul(None, inter)
    ops.silu_and_mul_quant(None, inter, torch.tensor([0.05], device=dev))
    ops.scaled_fp8_quant(x)
    ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    ops.scaled_fp8_quant(x, torch.tensor([0.02], device=dev))
    if H % 128 == 0:
        ops.per_token_group_quant_fp8(x, 128)
        ops.per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=True)
    eo = torch.empty(E + 1, dtype=torch.int32, device=dev)
    ps1 = torch.empty(E, 3, dtype=torch.int32, device=dev)
    ps2 = torch.empty(E, 3, dtype=torch.int32, device=dev)
    ip = torch.empty(T * K, dtype=torch.int32, device=dev)
    op = torch.empty(T * K, dtype=torch.int32, device=dev)
    ops.get_cutlass_moe_mm_data(ids, eo, ps1, ps2, ip, op, E, I, H)
    ops.get_cutlass_moe_mm_problem_sizes_from_expert_offsets(offs, ps1[:n_local], ps2[:n_local],
                                                             I, H, T * K <= 64)
    torch.cuda.synchronize()


def gemm_ops(counts, n, k, config=""):
    """moe_grouped_gemm (bf16; FP8 per-token x per-channel) with these rows per expert, then
    cutlass_moe_mm on the same rows, then moe_grouped_gemm_silu_mul (bf16 and e4m3 outputs)
    and a GEMM after it, and the two as moe_grouped_gemm_chain (bf16, FP8): N and K tails,
    empty experts, one expert with every row. config: the launch config of the
    grouped-GEMM ops ("" for the heuristic's; cutlass_moe_mm always runs the heuristic's)."""
    e, m = len(counts), sum(counts)
    offs = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(dev)
    a, b = randn(m, k), randn(e, n, k)
    ops.moe_grouped_gemm(a, b, offs, config=config)
    fp8 = torch.float8_e4m3fn
    aq, bq = a.to(fp8), b.to(fp8)
    sa = torch.rand(m, 1, device=dev, generator=g) + 0.5
    sb = torch.rand(e, n, device=dev, generator=g) + 0.5
    ops.moe_grouped_gemm(aq, bq, offs, sa, sb, config=config)
    sizes = torch.tensor([[c, n, k] if m > 64 else [n, c, k] for c in counts],
                         dtype=torch.int32, device=dev)
    strides = torch.full((e,), k, dtype=torch.int64, device=dev)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    ops.cutlass_moe_mm(out, aq, bq, sa, sb, offs[:-1], sizes, strides, strides,
                       torch.full((e,), n, dtype=torch.int64, device=dev), True, True)
    if n % 2 == 0:  # SiLU*mul in the epilogue: bf16 out, e4m3 out, GEMM2 after it (PDL)
        h = ops.moe_grouped_gemm_silu_mul(a, b, offs, offsets_ready=True,
                                          amax_scale=torch.full((1,), 1e-6, device=dev),
                                          config=config)
        if (n // 2) % 8 == 0:  # GEMM2's K rows of 16-byte multiples
            ops.moe_grouped_gemm(h, randn(e, 64, n // 2), offs, offsets_ready=True,
                                 config=config)
            # The chain: GEMM1 with SiLU*mul, then GEMM2 as a dependent launch.
            ops.moe_grouped_gemm_chain(a, b, randn(e, 72, n // 2), offs, offsets_ready=True,
                                       config=config)
            if (n // 2) % 16 == 0:
                ops.moe_grouped_gemm_chain(aq, bq, randn(e, 72, n // 2).to(fp8), offs, sa, sb,
                                           torch.full((1,), 0.05, device=dev),
                                           torch.rand(e, device=dev, generator=g) + 0.5,
                                           offsets_ready=True, config=config)
        ops.moe_grouped_gemm_silu_mul(aq, bq, offs, sa, sb,
                                      torch.full((1,), 0.05, device=dev), config=config)
    torch.cuda.synchronize()


def whole_layers(backends=("torch", "triton", "sm90")):
    """fused_experts on every GPU backend of `backends` that runs each scheme (torch, triton,
    sm90 where it supports it), with 1 and 3 tokens (ids out of range), an expert_map with -1
    and out-of-local entries, one hot expert and 300 tokens, and many experts with few rows
    each (where the sm90 layer's GEMM1 gathers x's rows itself:
    heuristics::layer_gathers_gemm1_rows); out= given for half of them."""
    from hopper_moe import api
    from hopper_moe.quant import make_quant_config

    schemes = [("bf16", {}), ("fp8_tensor", {}), ("fp8_tensor", dict(static_act=True)),
               ("fp8_channel", {}), ("fp8_block", {})]
    emap = torch.tensor([0, -1, 1, 5, 2, -1, 3, 9], dtype=torch.int32, device=dev)
    cases = [dict(T=1, E=8, K=2), dict(T=3, E=8, K=3, bad=True),
             dict(T=17, E=8, K=2, expert_map=emap), dict(T=300, E=8, K=2, hot=True),
             dict(T=3, E=128, K=4), dict(T=2, E=64, K=8, bad=True)]
    H, I = 256, 384
    for scheme, kw in schemes:
        for c in cases:
            e_local = 4 if "expert_map" in c else c["E"]
            w1 = randn(e_local, 2 * I, H) / 16
            w2 = randn(e_local, H, I) / 16
            w1q, w2q, quant = make_quant_config(w1, w2, scheme, **kw)
            x = randn(c["T"], H)
            w, ids = routing(c["T"], c["E"], c["K"], bad_ids=c.get("bad", False),
                             one_expert=c.get("hot", False))
            for backend in backends:
                if backend not in api.available_backends("cuda") or not \
                        api._BACKENDS[backend].supports(x.device, x.dtype, w1q, w2q, quant):
                    continue
                out = torch.empty_like(x) if backend != "torch" and c["T"] % 2 else None
                hopper_moe.fused_experts(x, w1q, w2q, w, ids, global_num_experts=c["E"],
                                         expert_map=c.get("expert_map"), quant=quant,
                                         backend=backend, out=out)
                torch.cuda.synchronize()
                print("ok layer", backend, scheme, kw or "", {k: v for k, v in c.items()
                                                             if k != "expert_map"},
                      "expert_map" if "expert_map" in c else "", flush=True)


def main():
    args = sys.argv[1:]
    if "--layer" in args:
        if "--backends" in args:
            i = args.index("--backends")
            if i + 1 >= len(args):
                raise SystemExit("--backends needs a comma-separated list, e.g. triton,sm90")
            backends = tuple(b for b in args[i + 1].split(",") if b)
            unknown = set(backends) - {"torch", "triton", "sm90"}
            if unknown:
                raise SystemExit(f"--backends: unknown {sorted(unknown)}; known: torch, "
                                 "triton, sm90")
            whole_layers(backends)
        else:
            whole_layers()
        return
    cases = [
        dict(T=0, E=8, K=2, H=128, I=64),
        dict(T=1, E=8, K=2, H=128, I=64),
        dict(T=3, E=7, K=3, H=136, I=72, bad_ids=True, weird_logits=True),
        dict(T=63, E=64, K=8, H=256, I=128),
        dict(T=65, E=128, K=8, H=128, I=96, one_expert=True),
        dict(T=300, E=256, K=8, H=384, I=40),
        dict(T=17, E=16, K=4, H=128, I=64,
             expert_map=torch.tensor([0, -1, 1, -1, 2, 3, -1, 4, 5, -1, -1, 6, 7, -1, 8, 9],
                                     dtype=torch.int32, device=dev)),
        dict(T=8200, E=32, K=8, H=128, I=64),  # T*K > 65535
    ]
    for c in cases if "--gemm" not in sys.argv[1:] else []:
        layer_ops(**c)
        print("ok", {k: v for k, v in c.items() if k != "expert_map"},
              "expert_map" if "expert_map" in c else "")
    if torch.cuda.get_device_capability() == (9, 0):  # the grouped GEMM is sm_90a code
        for counts, n, k in (([1], 64, 64), ([0, 5, 0, 3], 72, 176), ([0, 0, 70], 200, 144),
                             ([2] * 40, 128, 256), ([10, 30, 0, 24], 128, 128),
                             ([0, 130, 7], 136, 128), ([0, 300], 128, 128),
                             ([1, 0, 1], 520, 8208), ([0, 300, 129], 200, 1040)):
            # token tiles (heuristics/sm90.h): 16, 16, 64, 16, 32, 64, 128 (FP8: 64), and a
            # K split (bf16 4 ways, FP8 2) with N and K tails, the standard mapping
            gemm_ops(counts, n, k)
            print("ok grouped gemm", dict(experts=len(counts), rows=sum(counts), n=n, k=k))
        # Forced K splits of 4 and 8 with several units per CTA and, at 8 ways of 4 k-tiles,
        # empty K ranges.
        for splits in ("4", "8"):
            gemm_ops([3, 0, 5, 2] * 6, 136, 272, config=f"k_splits={splits}")
            print("ok grouped gemm, forced K split", splits)
        # The warpgroup pair forced (swap-AB token tiles 16 and 32), unsplit and split 3 ways,
        # with N and K tails and an odd number of k-tiles per unit.
        for counts, n, k in (([0, 5, 0, 3], 72, 176), ([10, 30, 0, 24], 128, 128),
                             ([3, 0, 5, 2] * 6, 136, 400)):
            gemm_ops(counts, n, k, config="pair=1")
            print("ok grouped gemm, forced pair", dict(experts=len(counts), n=n, k=k))
        gemm_ops([3, 0, 5, 2] * 6, 136, 4112, config="pair=1,k_splits=3")
        print("ok grouped gemm, forced pair, K split 3")
        for T, E, K in ((1, 8, 2), (40, 16, 4)):
            x = randn(T, 256)
            w1, w2 = randn(E, 256, 256) / 16, randn(E, 256, 128) / 16
            ids = torch.randint(0, E, (T, K), device=dev, dtype=torch.int32)
            hopper_moe.fused_experts(x, w1, w2, torch.rand(T, K, device=dev), ids,
                                     backend="cute")
            print("ok cute layer", dict(T=T, E=E, K=K))
    assert hopper_moe.built_with_cuda()


if __name__ == "__main__":
    main()
