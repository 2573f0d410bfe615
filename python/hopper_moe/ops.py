"""Python wrappers of the hopper_moe ops, with the names and signatures of `vllm._custom_ops`.

In-place wrappers forward to `torch.ops.hopper_moe.<op>`; allocating wrappers (the ones vLLM
users call as `ops.scaled_fp8_quant(x)`, `ops.shuffle_rows(x, map)`, ...) allocate outputs and
return them. Shapes and dtypes follow docs/OPS.md. No Python loops, and no host syncs
except one when moe_permute's cached slot indices grow (_slot_indices).
"""
from __future__ import annotations

import threading

import torch

_ops = torch.ops.hopper_moe
FP8_DTYPE = torch.float8_e4m3fn


def _fail(op: str, msg: str) -> None:
    raise RuntimeError(f"hopper_moe::{op}: {msg}")


def _require_dim(op: str, name: str, t, dim: int, at_least: bool = False) -> None:
    """What an allocating wrapper reads of a tensor's shape before the op's own checks run:
    a tensor of `dim` dimensions (at least `dim` with at_least)."""
    if not isinstance(t, torch.Tensor) or (t.dim() < dim if at_least else t.dim() != dim):
        got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(op, f"{name} must be a {'>= ' if at_least else ''}{dim}-D tensor, got {got}")


def _require_int(op: str, name: str, v, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        _fail(op, f"{name} must be an int >= {low}, got {v!r}")


# ----------------------------------------------------------------------------- routing
def topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 token_expert_indices: torch.Tensor, gating_output: torch.Tensor,
                 renormalize: bool = False, e_score_correction_bias: torch.Tensor | None = None,
                 is_padding: torch.Tensor | None = None) -> None:
    """Softmax top-k routing. gating_output [T,E]; writes topk_weights [T,K] f32,
    topk_ids [T,K] int32/int64, token_expert_indices [T,K] int32 (= k*T + t)."""
    _ops.topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize,
                      e_score_correction_bias, is_padding)


def topk_sigmoid(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 token_expert_indices: torch.Tensor, gating_output: torch.Tensor,
                 renormalize: bool = False, e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0,
                 is_padding: torch.Tensor | None = None) -> None:
    """Sigmoid top-k routing; same outputs as topk_softmax."""
    _ops.topk_sigmoid(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize,
                      e_score_correction_bias, routed_scaling_factor, is_padding)


def grouped_topk(scores: torch.Tensor, num_expert_group: int, topk_group: int, topk: int,
                 renormalize: bool, routed_scaling_factor: float, bias: torch.Tensor,
                 scoring_func: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped routing. Returns (weights f32 [T,topk], ids int32 [T,topk]).
    scoring_func: 0 = scores used as given, 1 = sigmoid."""
    return _ops.grouped_topk(scores, num_expert_group, topk_group, topk, renormalize,
                             routed_scaling_factor, bias, scoring_func)


# ----------------------------------------------------------------- permutation/reduction
def moe_align_block_size_buffers(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """Allocate (sorted_token_ids, experts_ids, num_tokens_post_pad) with vLLM's static upper
    bounds (no host sync): padded length numel + E*(block_size-1), capped at numel*block_size
    when there are fewer slots than experts."""
    if block_size <= 0:
        raise RuntimeError(f"hopper_moe::moe_align_block_size: block_size must be > 0, "
                           f"got {block_size}")
    _require_int("moe_align_block_size", "num_experts", num_experts, 1)
    if not isinstance(topk_ids, torch.Tensor):
        _fail("moe_align_block_size", f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    numel = topk_ids.numel()
    max_padded = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        max_padded = min(numel * block_size, max_padded)
    dev = topk_ids.device
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=dev)
    max_blocks = (max_padded + block_size - 1) // block_size
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=dev)
    num_tokens_post_pad = torch.empty((1,), dtype=torch.int32, device=dev)
    return sorted_ids, expert_ids, num_tokens_post_pad


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                         sorted_token_ids: torch.Tensor, experts_ids: torch.Tensor,
                         num_tokens_post_pad: torch.Tensor,
                         expert_map: torch.Tensor | None = None,
                         scatter_idx: torch.Tensor | None = None) -> None:
    """Sort the flat (token, k) slots by expert into block_size-padded segments."""
    _ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                              num_tokens_post_pad, expert_map, scatter_idx)


def moe_permute(hidden_states: torch.Tensor, a1q_scale: torch.Tensor | None,
                topk_ids: torch.Tensor, n_expert: int, n_local_expert: int = -1,
                expert_map: torch.Tensor | None = None,
                permuted_hidden_states: torch.Tensor | None = None):
    """Group the rows of hidden_states [T,H] by expert. Returns (permuted_hidden_states
    [T*K,H], a1q_scale permuted when per-token, expert_first_token_offset int64 [E_local+1],
    inv_permuted_idx int32 [T*K], permuted_idx int32 [T*K])."""
    _require_dim("moe_permute", "hidden_states", hidden_states, 2)
    _require_dim("moe_permute", "topk_ids", topk_ids, 2)
    n_token, n_hidden = hidden_states.shape
    topk = topk_ids.size(1)
    rows = n_token * topk
    _require_int("moe_permute", "n_expert", n_expert, 1)
    if n_local_expert == -1:
        n_local_expert = n_expert
    _require_int("moe_permute", "n_local_expert (or -1)", n_local_expert, 1)
    dev = hidden_states.device
    if permuted_hidden_states is None:
        permuted_hidden_states = torch.empty((rows, n_hidden), dtype=hidden_states.dtype,
                                             device=dev)
    token_expert_indices = _slot_indices(rows, dev).view(n_token, topk)
    expert_first_token_offset = torch.empty(n_local_expert + 1, dtype=torch.int64, device=dev)
    permuted_idx = torch.empty((rows,), dtype=torch.int32, device=dev)  # the op writes each entry
    inv_permuted_idx = torch.empty((n_token, topk), dtype=torch.int32, device=dev)
    if topk_ids.dtype != torch.int32:
        # An id that int32 cannot hold is no expert: -1 (skipped), never its low 32 bits.
        topk_ids = torch.where((topk_ids >= torch.iinfo(torch.int32).min)
                               & (topk_ids <= torch.iinfo(torch.int32).max),
                               topk_ids, -1).to(torch.int32)
    _ops.moe_permute(hidden_states, topk_ids, token_expert_indices, expert_map,
                     n_expert, n_local_expert, topk, permuted_hidden_states,
                     expert_first_token_offset, inv_permuted_idx, permuted_idx)
    if a1q_scale is not None and a1q_scale.dim() > 1 and rows > 0:
        a1q_scale = a1q_scale[permuted_idx.clamp(max=rows - 1) // topk]
    return (permuted_hidden_states, a1q_scale, expert_first_token_offset,
            inv_permuted_idx.flatten(), permuted_idx)


# arange(n) int32 per CUDA device, grown by doubling; every tensor ever made stays referenced
# here, since CUDA graphs captured earlier may read views of it.
_SLOT_INDICES: dict[int, list[torch.Tensor]] = {}
_SLOT_INDICES_LOCK = threading.Lock()


def _slot_indices(rows: int, dev: torch.device) -> torch.Tensor:
    """arange(rows) int32 on dev. On CUDA, a view of a cached arange, so that a layer does not
    launch one per call; the cache grows only outside graph capture and torch.compile (which
    get a plain arange), and its fill is synchronized once, when it grows, so that any stream
    may read it."""
    if dev.type != "cuda" or torch.compiler.is_compiling():
        return torch.arange(rows, dtype=torch.int32, device=dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    held = _SLOT_INDICES.setdefault(index, [])
    if held and held[-1].numel() >= rows:
        return held[-1][:rows]
    if torch.cuda.is_current_stream_capturing():
        return torch.arange(rows, dtype=torch.int32, device=dev)
    with _SLOT_INDICES_LOCK:  # one thread grows it; others see it only once it is filled
        if not held or held[-1].numel() < rows:
            capacity = max(4096, 1 << max(rows - 1, 0).bit_length())
            grown = torch.arange(capacity, dtype=torch.int32, device=dev)
            torch.cuda.current_stream(dev).synchronize()
            held.append(grown)
        return held[-1][:rows]


def moe_unpermute(out: torch.Tensor, permuted_hidden_states: torch.Tensor,
                  topk_weights: torch.Tensor, inv_permuted_idx: torch.Tensor,
                  expert_first_token_offset: torch.Tensor | None = None) -> None:
    """out[t] = sum_k topk_weights[t,k] * permuted_hidden_states[inv_permuted_idx[t,k]]."""
    _require_dim("moe_unpermute", "topk_weights", topk_weights, 2)
    if not isinstance(inv_permuted_idx, torch.Tensor) or \
            inv_permuted_idx.numel() != topk_weights.numel():
        _fail("moe_unpermute", f"inv_permuted_idx must hold num_tokens * topk = "
                               f"{topk_weights.numel()} entries ([T*K] or [T, K]), got "
                               f"{getattr(inv_permuted_idx, 'shape', inv_permuted_idx)}")
    topk = topk_weights.size(1)
    _ops.moe_unpermute(permuted_hidden_states, topk_weights,
                       inv_permuted_idx.view(topk_weights.shape), expert_first_token_offset,
                       topk, out)


def shuffle_rows(input_tensor: torch.Tensor, dst2src_map: torch.Tensor) -> torch.Tensor:
    """Returns out with out[i] = input_tensor[dst2src_map[i]]."""
    _require_dim("shuffle_rows", "input_tensor", input_tensor, 2)
    _require_dim("shuffle_rows", "dst2src_map", dst2src_map, 1)
    output_tensor = torch.empty((dst2src_map.size(0), input_tensor.size(1)),
                                dtype=input_tensor.dtype, device=input_tensor.device)
    _ops.shuffle_rows(input_tensor, dst2src_map, output_tensor)
    return output_tensor


def moe_sum(input: torch.Tensor, output: torch.Tensor, topk_ids: torch.Tensor | None = None,
            expert_map: torch.Tensor | None = None) -> None:
    """output[t] = sum_k input[t,k] (fp32 accumulation), skipping non-local slots."""
    _ops.moe_sum(input, output, topk_ids, expert_map)


# ------------------------------------------------------------------ activation and quant
def silu_and_mul(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """out[..., d] = silu(x[..., :d]) * x[..., d:]; allocates out when None."""
    if out is None:
        _require_dim("silu_and_mul", "input", x, 1, at_least=True)
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    _ops.silu_and_mul(out, x)
    return out


def silu_and_mul_quant(out: torch.Tensor | None, x: torch.Tensor,
                       scale: torch.Tensor) -> torch.Tensor:
    """FP8 (static scale) of silu(x[..., :d]) * x[..., d:]; allocates out when None."""
    if out is None:
        _require_dim("silu_and_mul_quant", "input", x, 1, at_least=True)
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=FP8_DTYPE, device=x.device)
    _ops.silu_and_mul_quant(out, x, scale)
    return out


def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                     num_token_padding: int | None = None,
                     scale_ub: torch.Tensor | None = None,
                     use_per_token_if_dynamic: bool = False,
                     output: torch.Tensor | None = None,
                     group_shape: tuple[int, int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D input to FP8 e4m3. With `scale`: static; else dynamic per tensor (scale
    [1]) or per token (scale [rows,1]) with use_per_token_if_dynamic. num_token_padding pads
    the output rows (padding rows are zero, their per-token scales one). Returns (out, scale)."""
    if input.dim() != 2:
        raise RuntimeError(f"scaled_fp8_quant: input must be 2-D (got {input.dim()}-D)")
    rows, cols = input.shape
    padded = max(num_token_padding or 0, rows)
    if output is None:
        output = torch.empty((padded, cols), dtype=FP8_DTYPE, device=input.device)
    out = output[:rows] if padded != rows else output
    if scale is None:
        if use_per_token_if_dynamic:
            scale = torch.empty((padded, 1), dtype=torch.float32, device=input.device)
            _ops.dynamic_per_token_scaled_fp8_quant(out, input, scale[:rows], scale_ub)
            if padded != rows:
                scale[rows:].fill_(1.0)
        else:
            scale = torch.empty((1,), dtype=torch.float32, device=input.device)
            _ops.dynamic_scaled_fp8_quant(out, input, scale)
    else:
        _ops.static_scaled_fp8_quant(out, input, scale,
                                     list(group_shape) if group_shape is not None else None)
    if padded != rows:
        output[rows:].view(torch.uint8).zero_()
    return output, scale


def fp8_quant_rows(input: torch.Tensor, kind: str, scale: torch.Tensor | None = None, *,
                   group_size: int = 0, slot_ids: torch.Tensor | None = None,
                   expert_map: torch.Tensor | None = None, num_experts: int = 0,
                   row_end: torch.Tensor | None = None,
                   output: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 quantization of the rows of a layer's intermediate ``input [R, K]`` that GEMM1
    wrote; the other rows of the result (and of a new scale) stay unwritten, and those of
    ``input`` are never read. kind: "static_tensor" (``scale`` [1] given), "per_token" (a new
    scale [R, 1]) or "per_group" (a new scale [R, K / group_size]), with the formulas of
    static_scaled_fp8_quant, dynamic_per_token_scaled_fp8_quant and per_token_group_fp8_quant.
    The rows that count, exactly one of: ``slot_ids`` (one id per row, row r is slot r; it
    counts when ``0 <= id < num_experts`` and, with ``expert_map`` [num_experts] int32,
    ``expert_map[id] >= 0``) or ``row_end`` (int64, one element: rows before it count, the
    expert offsets' last entry for rows sorted by expert). Returns (result, scale)."""
    if input.dim() != 2:
        raise RuntimeError(f"fp8_quant_rows: input must be 2-D (got {input.dim()}-D)")
    rows, cols = input.shape
    if output is None:
        output = torch.empty((rows, cols), dtype=FP8_DTYPE, device=input.device)
    if scale is None and kind in ("per_token", "per_group"):
        width = 1 if kind == "per_token" else cols // group_size if group_size > 0 else 0
        scale = torch.empty((rows, width), dtype=torch.float32, device=input.device)
    if scale is None:
        raise RuntimeError('fp8_quant_rows: kind "static_tensor" needs scale')
    _ops.fp8_quant_rows(output, input, scale, kind, group_size, slot_ids, expert_map,
                        num_experts, row_end)
    return output, scale


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float = 1e-10,
                              dtype: torch.dtype | None = None,
                              column_major_scales: bool = False,
                              out_q: torch.Tensor | None = None,
                              use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, group of `group_size` columns) dynamic FP8 quantization.
    Returns (x_q like x in fp8, x_s f32 [..., K/group_size], column-major when asked)."""
    dtype = dtype or FP8_DTYPE
    _require_dim("per_token_group_fp8_quant", "input", x, 1, at_least=True)
    finfo = torch.finfo(dtype)
    if group_size <= 0:
        raise RuntimeError(f"per_token_group_quant_fp8: group_size must be > 0 (got {group_size})")
    if x.shape[-1] % group_size != 0:
        raise RuntimeError(f"per_token_group_quant_fp8: x.shape[-1] ({x.shape[-1]}) must be "
                           f"divisible by group_size ({group_size})")
    if out_q is None:
        out_q = torch.empty(x.shape, dtype=dtype, device=x.device)
    groups = x.shape[-1] // group_size
    if column_major_scales:
        # Group index outermost in memory: [M, G] with strides (1, M) for a 2-D x.
        x_s = torch.empty((groups,) + x.shape[:-1], dtype=torch.float32,
                          device=x.device).movedim(0, -1)
    else:
        x_s = torch.empty(x.shape[:-1] + (groups,), dtype=torch.float32, device=x.device)
    _ops.per_token_group_fp8_quant(x, out_q, x_s, group_size, eps, finfo.min, finfo.max,
                                   use_ue8m0, column_major_scales, False)
    return out_q, x_s


# -------------------------------------------------------------------- grouped-GEMM metadata
def get_cutlass_moe_mm_data(topk_ids: torch.Tensor, expert_offsets: torch.Tensor,
                            problem_sizes1: torch.Tensor, problem_sizes2: torch.Tensor,
                            input_permutation: torch.Tensor, output_permutation: torch.Tensor,
                            num_experts: int, n: int, k: int,
                            blockscale_offsets: torch.Tensor | None = None,
                            is_gated: bool = True) -> None:
    """Per-expert problem sizes and the slot permutations of the grouped GEMMs; problem sizes
    are swapped (N, M, K) when topk_ids.numel() <= 64."""
    _ops.get_cutlass_moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2,
                                 input_permutation, output_permutation, num_experts, n, k,
                                 blockscale_offsets, is_gated)


def get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
        expert_first_token_offset: torch.Tensor, problem_sizes1: torch.Tensor,
        problem_sizes2: torch.Tensor, n: int, k: int, swap_ab: bool) -> None:
    """Problem sizes of both grouped GEMMs from expert_first_token_offset [E+1]."""
    _ops.get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
        expert_first_token_offset, problem_sizes1, problem_sizes2, n, k, swap_ab)


def cutlass_group_gemm_supported(cuda_device_capability: int) -> bool:
    """Whether cutlass_moe_mm can run on a GPU of this capability (major*10 + minor)."""
    return _ops.cutlass_group_gemm_supported(cuda_device_capability)


# ------------------------------------------------------------------------- grouped GEMM
def cutlass_moe_mm(out_tensors: torch.Tensor, a_tensors: torch.Tensor, b_tensors: torch.Tensor,
                   a_scales: torch.Tensor, b_scales: torch.Tensor, expert_offsets: torch.Tensor,
                   problem_sizes: torch.Tensor, a_strides: torch.Tensor, b_strides: torch.Tensor,
                   c_strides: torch.Tensor, per_act_token: bool, per_out_ch: bool) -> None:
    """FP8 grouped GEMM with vLLM's arguments: for each expert e, out_tensors rows
    [expert_offsets[e], expert_offsets[e+1]) (the last group ends after its problem size's
    row count, read swapped when M_tot <= 64) = a_scale * b_scale * a_tensors . b_tensors[e]^T.
    a e4m3 [M_tot, K], b e4m3 [E, N, K], out bf16 or fp16 [M_tot, N]. Runs the SM90 kernel of
    moe_grouped_gemm on CUDA."""
    _ops.cutlass_moe_mm(out_tensors, a_tensors, b_tensors, a_scales, b_scales, expert_offsets,
                        problem_sizes, a_strides, b_strides, c_strides, per_act_token,
                        per_out_ch)


def moe_grouped_gemm(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor,
                     a_scales: torch.Tensor | None = None, b_scales: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, offsets_ready: bool = False,
                     config: str | None = None) -> torch.Tensor:
    """out[r] = sa(r) * sb(e) * a[r] . b[e]^T for offsets[e] <= r < offsets[e+1].

    a [M, K] bf16 or fp8 e4m3 (rows grouped by expert), b [E, N, K] (a's dtype),
    expert_offsets int64 [E + 1]; fp8 needs a_scales f32 ([1] or [M]) and b_scales f32
    ([E] or [E, N]). Returns out [M, N] (rows outside every expert are not written): bf16,
    or the given out's dtype, bf16 or fp16 (the fp32 sums rounded once to it).
    On CUDA it runs the SM90 kernel (H100/H200 only; other GPUs get a RuntimeError).
    offsets_ready=True promises that the kernel launched just before on the stream does not
    write expert_offsets: the GEMM then reads them, and starts streaming weights, while that
    kernel finishes (programmatic dependent launch).
    config forces parts of the CUDA launch for tests and measurements: None or "" for the
    heuristic's choice, else comma-separated key=value pairs: mapping=swap_ab|standard,
    pair=0|1 (the swap-AB warpgroup pair), k_splits=1..8, pdl=0|1. Validated on every device
    (a RuntimeError names the bad pair); it never changes the result beyond rounding."""
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    _ops.moe_grouped_gemm(out, a, b, expert_offsets, a_scales, b_scales, offsets_ready,
                          config or "")
    return out


def moe_grouped_gemm_silu_mul(a: torch.Tensor, b: torch.Tensor, expert_offsets: torch.Tensor,
                              a_scales: torch.Tensor | None = None,
                              b_scales: torch.Tensor | None = None,
                              out_scale: torch.Tensor | None = None,
                              out: torch.Tensor | None = None,
                              offsets_ready: bool = False,
                              amax_scale: torch.Tensor | None = None,
                              config: str | None = None) -> torch.Tensor:
    """GEMM1 of an MoE layer with SiLU*mul in its epilogue: with h = moe_grouped_gemm(a, b, ...)
    (bf16, b = [gate (I rows); up (I rows)] per expert), out[r, j] = silu(h[r, j]) * h[r, I + j]
    in fp32, rounded once to bf16, or quantized to e4m3 as clamp(v * (1 / out_scale)) when
    out_scale (f32 [1], static per tensor) is given. Returns out [M, I]; rows outside every
    expert are not written. offsets_ready as in moe_grouped_gemm. amax_scale (f32 [1], bf16
    out only; a non-negative start value, e.g. the floor 1 / (448 * 512)) is updated to
    max(amax_scale, amax |out| / 448) over the rows written: the dynamic per-tensor FP8 scale
    of out, for static_scaled_fp8_quant to apply. config as in moe_grouped_gemm."""
    if out is None:
        dtype = torch.float8_e4m3fn if out_scale is not None else torch.bfloat16
        out = torch.empty((a.shape[0], b.shape[1] // 2), dtype=dtype, device=a.device)
    _ops.moe_grouped_gemm_silu_mul(out, a, b, expert_offsets, a_scales, b_scales, out_scale,
                                   offsets_ready, amax_scale, config or "")
    return out


def moe_grouped_gemm_chain(a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                           expert_offsets: torch.Tensor, a_scales: torch.Tensor | None = None,
                           w1_scales: torch.Tensor | None = None,
                           h_scale: torch.Tensor | None = None,
                           w2_scales: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, h: torch.Tensor | None = None,
                           offsets_ready: bool = False,
                           config: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 and GEMM2 of an MoE layer's experts in one call:
    h = moe_grouped_gemm_silu_mul(a, w1, expert_offsets, a_scales, w1_scales, h_scale) and
    out = moe_grouped_gemm(h, w2, expert_offsets, h_scale, w2_scales), with the same results.

    a [M, K], w1 [E, 2I, K] and w2 [E, N, I] of one dtype: bf16 without scales, or fp8 e4m3
    with a_scales / w1_scales (GEMM1's, as in moe_grouped_gemm), h_scale f32 [1] (the static
    per-tensor scale h is quantized with, GEMM2's a scale) and w2_scales ([E] or [E, N]).
    Returns (out [M, N] bf16, h [M, I] bf16 or e4m3); rows outside every expert are not
    written. On CUDA these are two launches, GEMM2 a dependent launch of GEMM1. offsets_ready
    as in moe_grouped_gemm (for the kernel before GEMM1); config as in moe_grouped_gemm, for
    both GEMMs."""
    if h is None:
        dtype = torch.float8_e4m3fn if h_scale is not None else torch.bfloat16
        h = torch.empty((a.shape[0], w1.shape[1] // 2), dtype=dtype, device=a.device)
    if out is None:
        out = torch.empty((a.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=a.device)
    _ops.moe_grouped_gemm_chain(out, h, a, w1, w2, expert_offsets, a_scales, w1_scales, h_scale,
                                w2_scales, offsets_ready, config or "")
    return out, h
