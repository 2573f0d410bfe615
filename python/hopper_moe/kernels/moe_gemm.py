"""Grouped expert GEMM over aligned token blocks (Triton).

One program computes a BLOCK_M x BLOCK_N tile of C for one block of `sorted_token_ids`
(the `moe_align_block_size` layout: every block holds slots of a single expert):

    C[slot, n] = scale * sum_k A[slot // a_rows_per_token... , k] * B[e, n, k]   (* routed weight)

Operand roles
  A  [rows, K]   activations (bf16/fp16, or fp8 e4m3 with scales); row of slot s is s // TOP_K
                 for GEMM1 (A is per token) and s for GEMM2 (A is per slot: pass TOP_K = 1).
  B  [E, N, K]   expert weights, K contiguous.
  C  [slots, N]  output rows in slot order (slot = t * top_k + k).

Swap-AB: when a block holds few token rows, the MMA's 64-row side would be mostly idle. With
SWAP_AB the program computes the transposed tile, C^T = B_tile . A_tile^T, so the weight tile
(BLOCK_N rows) takes the wide side and the tokens (BLOCK_M) become the narrow N side; the
epilogue stores through a transposed index. The result is the same function; it is a mapping
choice made per launch from the config.

Scales (QUANT): 0 none; 1 per-tensor activation x per-expert weight; 2 per-token activation
(a_scale [rows]) x per-channel weight (b_scale [E, N]); either side may be per-tensor in mode 2
(PER_ACT_TOKEN / PER_OUT_CH); 3 block-wise: a_scale [rows, K/GROUP_K], b_scale
[E, N/GROUP_N, K/GROUP_K], applied inside the K loop, one per K tile (BLOCK_K divides
GROUP_K: moe_gemm_configs.get_config fits it).

Fused SiLU*mul (FUSE_SILU, GEMM1 only): B is w1 [E, 2I, K] (gate rows, then up rows) and the
program computes BLOCK_N pre-activation columns as BLOCK_N / 2 (gate, up) pairs: column 2j of
the tile is gate row n0 + j, column 2j + 1 up row I + n0 + j. The epilogue splits the pairs,
stores silu(gate) * up as C [slots, I] (BLOCK_N / 2 columns) and never writes the [slots, 2I]
GEMM1 output: per slot and bf16 that is 8I bytes less HBM traffic (4I written and read back,
and the SiLU*mul pass's own 2I written, against the 2I this C takes) and one launch fewer. OUT_FP8 quantizes the result with a static scale (out_scale, as
x * (1 / s)); AMAX_OUT atomically maxes amax / 448 of the stored values into out_scale, which
the caller initialized to the dynamic scale's floor: out_scale then is the dynamic per-tensor
scale of C, so the quantization of C needs no amax pass of its own. ACT_ROUND (1 bf16, 2 fp16,
0 none) rounds as vLLM's unfused pipeline stores: gate and up (GEMM1's output), silu(gate),
and the product, each to the layer's 16-bit dtype; an FP8 requantization would otherwise turn
those sub-ulp differences into whole fp8 steps against vLLM's results.

FP8_FAST_ACC (per-tensor and per-channel FP8 only; a config's "FP8_FAST_ACC": true): the whole
K loop accumulates in the tensor core, as the serving engine's kernel does, instead of adding
each K tile's product to fp32 registers of its own. That saves the second accumulator tile
(128 x 256 tiles at 8 warps spill without it: tools/triton_sass.py) at the cost of the tensor
core's FP8 accumulation precision. Tables set it only where hopper_moe.tune's accuracy check
accepts it (the shipped H200 ones: qwen3_30b-sized FP8 per-tensor prefill rows).

INTERPRETER is set only under TRITON_INTERPRET=1. The CPU interpreter (Triton 3.8) computes a
bf16 tl.dot wrongly and converts fp32 to bf16 by truncation, so there the operands are widened
to fp32 first and the output is rounded to nearest-even by hand; compiled kernels skip both.

ONE_SLOT_PER_BLOCK: for batches with no more slots than experts, the alignment step is skipped
and each program takes one slot (its expert read from topk_ids / expert_map); it saves a
launch where almost every aligned block would hold a single row anyway.

No recompilation across token counts: every integer whose value follows the number of tokens
(`num_slots`, `num_sorted`) is in do_not_specialize, and the launch grid is not part of the
compiled kernel's key; shapes (N, K, strides, and EVEN_K / EVEN_N: K and N multiples of the
tile, which drop the loads' K and N masks) follow the model, not the batch.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import round_to_e4m3

FP8_MAX = tl.constexpr(448.0)

# Integer arguments whose values vary with the token count: never specialized.
TOKEN_DEPENDENT_ARGS = ["num_slots", "num_sorted"]


@triton.jit(do_not_specialize=TOKEN_DEPENDENT_ARGS)
def moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr,
    a_scale_ptr, b_scale_ptr, topk_weights_ptr, out_scale_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    topk_ids_ptr, expert_map_ptr,
    N, K,
    num_slots, num_sorted, num_experts, num_local_experts,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    stride_asm, stride_ask,
    stride_bse, stride_bsn, stride_bsk,
    TOP_K: tl.constexpr,
    QUANT: tl.constexpr,
    PER_ACT_TOKEN: tl.constexpr,
    PER_OUT_CH: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ONE_SLOT_PER_BLOCK: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    OUT_FP8: tl.constexpr,
    AMAX_OUT: tl.constexpr,
    ACT_ROUND: tl.constexpr,
    FP8_FAST_ACC: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    # Grouped ordering of (m, n) tiles so that consecutive programs share weight tiles in L2.
    pid = tl.program_id(0)
    if ONE_SLOT_PER_BLOCK:
        num_pid_m = num_slots
    else:
        num_pid_m = tl.cdiv(num_sorted, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % (GROUP_M * num_pid_n)) % group_size_m)
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size_m

    if ONE_SLOT_PER_BLOCK:
        # Tiny batches skip the alignment: block m is slot m alone (row 0 of the tile), its
        # expert read straight from topk_ids (and expert_map); an id that does not count
        # gives the expert -1, whose rows are written as zeros below.
        slots = (pid_m + tl.zeros((BLOCK_M,), dtype=tl.int32)).to(tl.int64)
        row_ok = tl.arange(0, BLOCK_M) == 0
        gid = tl.load(topk_ids_ptr + pid_m).to(tl.int64)
        valid = (gid >= 0) & (gid < num_experts)
        if HAS_EXPERT_MAP:
            local = tl.load(expert_map_ptr + gid, mask=valid, other=-1).to(tl.int64)
        else:
            local = gid
        expert = tl.where(valid & (local >= 0) & (local < num_local_experts), local, -1)
    else:
        num_padded = tl.load(num_tokens_post_padded_ptr)
        if pid_m * BLOCK_M >= num_padded:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_token_ids_ptr + offs_m, mask=offs_m < num_sorted,
                        other=num_slots).to(tl.int64)
        row_ok = slots < num_slots
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if FUSE_SILU:
        # Tile column j is weight row (j % 2) * I + n0 + j // 2: (gate, up) pairs, so the
        # epilogue's split is a split of adjacent accumulator columns.
        half_n = N // 2
        pair = tl.arange(0, BLOCK_N) // 2
        side = tl.arange(0, BLOCK_N) % 2
        out_col = (pid_n * (BLOCK_N // 2) + pair).to(tl.int64)
        offs_n = out_col + side * half_n
        col_ok = out_col < half_n
        offs_o = (pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)).to(tl.int64)
        o_ptrs = c_ptr + slots[:, None] * stride_cm + offs_o[None, :] * stride_cn
        o_mask = row_ok[:, None] & (offs_o[None, :] < half_n)
    else:
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = offs_n < N
        if SWAP_AB:
            c_ptrs = c_ptr + slots[None, :] * stride_cm + offs_n[:, None] * stride_cn
            c_mask = row_ok[None, :] & col_ok[:, None]
        else:
            c_ptrs = c_ptr + slots[:, None] * stride_cm + offs_n[None, :] * stride_cn
            c_mask = row_ok[:, None] & col_ok[None, :]

    if expert < 0:
        # Not a local expert: its slots contribute zero (and leave an amax as it is).
        if FUSE_SILU:
            tl.store(o_ptrs, tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=c_ptr.dtype.element_ty),
                     mask=o_mask)
        elif SWAP_AB:
            tl.store(c_ptrs, tl.zeros((BLOCK_N, BLOCK_M), dtype=c_ptr.dtype.element_ty),
                     mask=c_mask)
        else:
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                     mask=c_mask)
        return

    a_rows = slots // TOP_K
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    if SWAP_AB:
        # a_t: (BLOCK_K, BLOCK_M), b: (BLOCK_N, BLOCK_K); acc: (BLOCK_N, BLOCK_M)
        a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak
        b_ptrs = b_base + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        # a: (BLOCK_M, BLOCK_K), b_t: (BLOCK_K, BLOCK_N); acc: (BLOCK_M, BLOCK_N)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    if QUANT == 3:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
        bs_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn

    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        # Masks only where the shape needs them: EVEN_K / EVEN_N (K, N multiples of the
        # tile) drop the K and N predicates, so the weight tile loads unmasked.
        k_left = K - kb * BLOCK_K
        if SWAP_AB:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[None, :], other=0.0)
                if EVEN_N:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                if EVEN_N:
                    b = tl.load(b_ptrs)
                else:
                    b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if INTERPRETER:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if QUANT == 0 or (FP8_FAST_ACC and QUANT != 3):
            # bf16/fp16, or FP8 with fast accumulation (per-tensor / per-channel scales):
            # accumulate in the MMA itself.
            if SWAP_AB:
                acc = tl.dot(b, a, acc)
            else:
                acc = tl.dot(a, b, acc)
        else:
            # FP8: each K tile's product is added to the fp32 registers (the tensor core's FP8
            # accumulator keeps fewer mantissa bits; `tl.dot(a, b, acc)` would accumulate the
            # whole K loop there). The cost is a second accumulator tile: 128 x 256 FP8 tiles
            # with 8 warps need 255 registers and spill; 64/128 x 128 tiles do not.
            if SWAP_AB:
                part = tl.dot(b, a)
            else:
                part = tl.dot(a, b)
        if QUANT == 3:
            kg = (kb * BLOCK_K) // GROUP_K
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_ok, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk, mask=col_ok, other=0.0)
            if SWAP_AB:
                acc += part * b_s[:, None] * a_s[None, :]
            else:
                acc += part * a_s[:, None] * b_s[None, :]
        elif QUANT != 0 and not FP8_FAST_ACC:
            acc += part
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if QUANT == 1:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr + expert * stride_bse))
    elif QUANT == 2:
        if PER_ACT_TOKEN:
            a_s = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)
        else:
            a_s = tl.load(a_scale_ptr + a_rows * 0)
        if PER_OUT_CH:
            b_s = tl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn, mask=col_ok,
                          other=0.0)
        else:
            b_s = tl.load(b_scale_ptr + expert * stride_bse + offs_n * 0)
        if SWAP_AB:
            acc = acc * b_s[:, None] * a_s[None, :]
        else:
            acc = acc * a_s[:, None] * b_s[None, :]

    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0)
        if SWAP_AB:
            acc = acc * w[None, :]
        else:
            acc = acc * w[:, None]

    if FUSE_SILU:
        if SWAP_AB:
            acc = tl.trans(acc)  # (BLOCK_M, BLOCK_N): tokens by rows again
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        if ACT_ROUND == 0:
            act = gate / (1.0 + tl.exp(-gate)) * up
        else:
            # vLLM's unfused order: GEMM1's output stored in the layer's 16-bit dtype, then
            # silu_and_mul: silu rounded to that dtype, times up, rounded again.
            gate = _round_to(gate, ACT_ROUND, INTERPRETER)
            up = _round_to(up, ACT_ROUND, INTERPRETER)
            silu = _round_to(gate / (1.0 + tl.exp(-gate)), ACT_ROUND, INTERPRETER)
            act = _round_to(silu * up, ACT_ROUND, INTERPRETER)
        if OUT_FP8:
            inv_scale = tl.math.div_rn(1.0, tl.load(out_scale_ptr))
            q = tl.minimum(tl.maximum(act * inv_scale, -FP8_MAX), FP8_MAX)
            if INTERPRETER:  # the interpreter's fp8 conversion does not round to nearest
                q = round_to_e4m3(q)
            tl.store(o_ptrs, q.to(c_ptr.dtype.element_ty), mask=o_mask)
        else:
            if INTERPRETER:
                act = _round_to_bf16(act, c_ptr.dtype.element_ty)
            stored = act.to(c_ptr.dtype.element_ty)
            tl.store(o_ptrs, stored, mask=o_mask)
            if AMAX_OUT:
                amax = tl.max(tl.max(tl.where(o_mask, tl.abs(stored.to(tl.float32)), 0.0), 1), 0)
                tl.atomic_max(out_scale_ptr, tl.math.div_rn(amax, FP8_MAX))
    else:
        if INTERPRETER:
            acc = _round_to_bf16(acc, c_ptr.dtype.element_ty)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _round_to(v, code: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 v rounded to nearest even in bf16 (code 1) or fp16 (code 2), back in fp32."""
    if code == 1:
        if INTERPRETER:
            v = _round_to_bf16(v, tl.bfloat16)
        else:
            v = v.to(tl.bfloat16).to(tl.float32)
    else:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _round_to_bf16(v, dtype: tl.constexpr):
    """The interpreter converts fp32 to bf16 by truncation: round to nearest even by hand (a
    no-op for other output dtypes)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v
