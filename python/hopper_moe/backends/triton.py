"""The "triton" backend of fused_experts: align -> (quant) -> GEMM1 with SiLU*mul (+ quant)
-> GEMM2 (* weight) -> sum, with one Triton grouped GEMM (hopper_moe.kernels.moe_gemm,
swap-AB for small token blocks).

``run`` / ``fused_experts_triton`` is what ``hopper_moe.fused_experts(..., backend="triton")``
runs. Arguments are validated by the caller (hopper_moe.api); this module only plans and
launches. Configs come from ``kernels.moe_gemm_configs.get_config`` (finite M buckets, so a
new token count never means a new compiled kernel). The scheme-dependent steps (activation
quantization, how GEMM2's input is quantized, weight-scale shapes, the dynamic scale's floor)
are hopper_moe.prepare's.

Triton itself is imported on the backend's first launch, not with hopper_moe.
"""
from __future__ import annotations

import importlib.util

import torch

from .. import ops, prepare, settings
from ..kernels.moe_gemm_configs import MIN_BLOCK_K, block_k_for_group, get_config

__all__ = ["Routing", "fused_experts_triton", "invoke_moe_gemm", "is_available", "precision",
           "run", "supports", "unsupported_reason"]

_QUANT_NONE, _QUANT_TENSOR, _QUANT_CHANNEL, _QUANT_BLOCK = 0, 1, 2, 3
_ROUND_CODES = {torch.bfloat16: 1, torch.float16: 2}  # the kernel's ACT_ROUND

# Looked up once: fused_experts asks on every call, also while torch.compile traces it, and
# Dynamo does not trace importlib (it breaks the graph there).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def is_available(device_type: str) -> bool:
    """Compiled kernels on CUDA; on the CPU only inside Triton's interpreter (tests)."""
    if not _HAS_TRITON:
        return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and settings.TRITON_INTERPRET


def unsupported_reason(quant) -> str | None:
    """Why the kernel cannot run a layer of this quantization (None: it can): block-wise
    scales whose group of columns holds no K tile of at least MIN_BLOCK_K columns (the kernel
    applies one scale per K tile)."""
    if quant is None or quant.block_shape is None:
        return None
    group_k = int(quant.block_shape[1])
    if block_k_for_group(128, group_k) < MIN_BLOCK_K:
        return (f"block_shape[1] (block_k) = {group_k} must be a multiple of {MIN_BLOCK_K} "
                f"(the kernel's K tile lies inside one scale group)")
    return None


def supports(device: torch.device, dtype: torch.dtype, w1: torch.Tensor, w2: torch.Tensor,
             quant) -> bool:
    """Whether fused_experts(backend='triton') runs this layer (for the oracle)."""
    return unsupported_reason(quant) is None


_MODULES: dict[str, object] = {}


def _moe_gemm():
    """hopper_moe.kernels.moe_gemm (its kernel is looked up there on every launch, so that a
    replaced kernel is the one launched); importing it imports Triton, on the first launch."""
    module = _MODULES.get("moe_gemm")
    if module is None:
        from ..kernels import moe_gemm as module

        _MODULES["moe_gemm"] = module
    return module


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _act_scale_strides(scale: torch.Tensor, quant) -> tuple[int, int]:
    """(stride over rows, over K groups) of an activation scale from
    prepare.quantize_activations: [R, K/g] per group, [R, 1] per token, [1] per tensor."""
    if quant.block_shape is not None:
        return scale.stride(0), scale.stride(1)
    if quant.per_act_token_quant:
        return scale.stride(0), 0
    return 0, 0


def _quant_mode(quant) -> int:
    if quant is None:
        return _QUANT_NONE
    if quant.block_shape is not None:
        return _QUANT_BLOCK
    if quant.per_act_token_quant or quant.per_out_ch_quant:
        return _QUANT_CHANNEL
    return _QUANT_TENSOR


def _weight_scale_strides(scale: torch.Tensor, w: torch.Tensor, quant):
    """(stride over experts, over N groups/channels, over K groups) of the scale of w: 0
    over a dimension it is constant along (prepare.weight_scale_3d's view)."""
    s = prepare.weight_scale_3d(scale, w, quant)
    block = quant.block_shape is not None
    return (s.stride(0), s.stride(1) if block or quant.per_out_ch_quant else 0,
            s.stride(2) if block else 0)


class Routing:
    """Which slots each GEMM program takes. Aligned: the moe_align_block_size layout (blocks of
    BLOCK_M slots of one expert). One slot per block (tiny batches, no alignment launch): block
    m is slot m, its expert read from topk_ids and expert_map inside the kernel."""

    def __init__(self, topk_ids, expert_map, num_experts: int, block_m: int, aligned: bool):
        self.topk_ids = topk_ids
        self.expert_map = expert_map
        self.num_experts = num_experts
        self.aligned = aligned
        if aligned:
            self.sorted_ids, self.expert_ids, self.ntp = ops.moe_align_block_size_buffers(
                topk_ids, num_experts, block_m)
            ops.moe_align_block_size(topk_ids, num_experts, block_m, self.sorted_ids,
                                     self.expert_ids, self.ntp, expert_map)
        else:
            self.sorted_ids = self.expert_ids = self.ntp = topk_ids

    def num_blocks(self, block_m: int) -> int:
        if self.aligned:
            return _cdiv(self.sorted_ids.numel(), block_m)
        return self.topk_ids.numel()


def invoke_moe_gemm(a, b, c, a_scale, stride_as, b_scale, topk_weights, routing: Routing,
                    top_k: int, num_slots: int, quant, mul_routed_weight: bool,
                    config: dict, fuse_silu: bool = False,
                    out_scale: torch.Tensor | None = None, amax_out: bool = False,
                    round_dtype: torch.dtype | None = None,
                    compile_only: bool = False) -> None:
    """C[slot] = A[slot // top_k] . B[expert]^T for every slot the routing places.

    fuse_silu (GEMM1): C[slot] = silu(gate) * up of that product, [slots, N / 2]; an FP8 C is
    quantized with the static scale out_scale; amax_out: C stays bf16 and out_scale (set to
    the dynamic scale's floor by the caller) receives max(out_scale, amax(C) / 448).
    round_dtype (fuse_silu; bf16 or fp16): gate, up, silu(gate) and the product are rounded
    to it as vLLM's unfused pipeline stores them (GEMM1 output, silu_and_mul); None: fp32.
    compile_only: compile the kernel these arguments need (Triton's warmup), launch nothing."""
    n, k = b.shape[1], b.shape[2]
    mode = _quant_mode(quant)
    grid = (routing.num_blocks(config["BLOCK_M"]) * _cdiv(n, config["BLOCK_N"]),)
    dummy = c  # stands in for absent pointers (never read)
    if mode == _QUANT_NONE:
        bse = bsn = bsk = 0
        b_scale = dummy
        a_scale = dummy
    else:
        bse, bsn, bsk = _weight_scale_strides(b_scale, b, quant)
    group_n, group_k = (quant.block_shape if mode == _QUANT_BLOCK else (1, 1))
    ptrs = (
        a, b, c, a_scale, b_scale, topk_weights if mul_routed_weight else dummy,
        out_scale if out_scale is not None else dummy,
        routing.sorted_ids, routing.expert_ids, routing.ntp,
        routing.topk_ids, routing.expert_map if routing.expert_map is not None else dummy)
    # Every other parameter in the kernel's order; the compiled kernel depends on all of them
    # but num_slots and num_sorted (do_not_specialize: they follow the token count).
    static = (
        n, k, routing.num_experts, b.shape[0],
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        stride_as[0], stride_as[1],
        bse, bsn, bsk,
        # The constexprs.
        top_k, mode,
        bool(quant is not None and quant.per_act_token_quant),
        bool(quant is not None and quant.per_out_ch_quant),
        group_n, group_k, mul_routed_weight,
        config["SWAP_AB"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"],
        config["GROUP_M"],
        not routing.aligned, routing.expert_map is not None,
        k % config["BLOCK_K"] == 0, n % config["BLOCK_N"] == 0,
        fuse_silu, fuse_silu and c.dtype == ops.FP8_DTYPE, amax_out,
        _ROUND_CODES.get(round_dtype, 0) if fuse_silu else 0,
        bool(config.get("FP8_FAST_ACC", False)) and mode in (_QUANT_TENSOR, _QUANT_CHANNEL),
        settings.TRITON_INTERPRET,
    )
    scalars = static[:2] + (num_slots, routing.sorted_ids.numel()) + static[2:]
    _launcher().launch(_moe_gemm().moe_gemm_kernel, grid, ptrs, scalars, static,
                       config["num_warps"], config["num_stages"], compile_only)


def _launcher():
    """hopper_moe.kernels.launch, imported with Triton on the first launch."""
    module = _MODULES.get("launch")
    if module is None:
        from ..kernels import launch as module

        _MODULES["launch"] = module
    return module


def precision(quant, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Storage precision of this layer for hidden states of `dtype`, as
    `reference.fused_experts_ref` keywords: vLLM's unfused pipeline's. GEMM1's epilogue rounds
    its output, silu(gate) and the SiLU*mul product to `dtype` as that pipeline stores them
    (also before a static-scale FP8 quantization in the same epilogue); GEMM2's output is
    stored in `dtype` before the top-k sum (fp32 storage rounds nothing)."""
    store = None if dtype == torch.float32 else dtype
    return dict(intermediate_dtype=store, silu_dtype=store)


_IDENTITY_MAPS: dict[tuple, torch.Tensor] = {}


def _identity_map(num_experts: int, device: torch.device) -> torch.Tensor:
    """arange(num_experts) int32 on device, made once (never written: moe_sum only reads it).
    Under torch.compile or a graph capture it is made in place of the cache."""
    key = (num_experts, device.type, device.index)
    ident = _IDENTITY_MAPS.get(key)
    if ident is None:
        ident = torch.arange(num_experts, dtype=torch.int32, device=device)
        if not torch.compiler.is_compiling() and not (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _IDENTITY_MAPS[key] = ident
    return ident


def fused_experts_triton(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         apply_router_weight_on_input: bool = False,
                         global_num_experts: int = -1,
                         expert_map: torch.Tensor | None = None,
                         quant=None, stage_done=None, out=None,
                         compile_only: bool = False) -> torch.Tensor:
    """[M, H] -> [M, H] through the experts chosen by topk_ids, with Triton GEMMs.

    stage_done: called with each stage's name once its launches are enqueued ("align",
    "quant1", "gemm1", "quant2", "gemm2", "sum"; benchmarks/bench_stages.py records an event
    there). out: [M, H] of hidden_states' dtype with unit last stride (checked by the
    caller), written by the final sum instead of a new tensor. compile_only: every step but the
    GEMMs runs, and the GEMMs' kernels are compiled instead of launched (hopper_moe.warmup;
    the output is then meaningless)."""
    mark = stage_done if stage_done is not None else (lambda name: None)
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    # Without expert_map every physical expert of w1 counts (vLLM's rule; fused shared experts
    # are ids in [global_num_experts, E)).
    num_experts = w1.shape[0] if global_num_experts == -1 or expert_map is None \
        else global_num_experts
    inter2 = w1.shape[1]
    out_dtype = hidden_states.dtype
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=hidden_states.device)
    if num_tokens == 0:
        return out
    num_slots = num_tokens * top_k
    mode = _quant_mode(quant)
    scheme = "bf16" if mode == _QUANT_NONE else quant.scheme

    reason = unsupported_reason(quant)
    if reason is not None:
        raise RuntimeError(f"fused_experts(backend='triton'): {reason}")
    cfg = get_config(num_tokens, top_k, num_experts, inter2 // 2, scheme,
                     group_k=None if mode != _QUANT_BLOCK else int(quant.block_shape[1]))
    # The kernels index the weights with the mapped id: an entry outside [0, E_local) is a
    # non-local expert (-1), as in the other backends, never a row of w1 / w2 past its end.
    if expert_map is not None:
        expert_map = prepare.local_expert_map(expert_map, w1.shape[0])
        num_experts = expert_map.shape[0]  # the global count, or E when the map is shorter
    # The kernels read topk_weights with a flat slot index.
    topk_weights = topk_weights.contiguous()
    routing = Routing(topk_ids.contiguous(), expert_map, num_experts, cfg["BLOCK_M"],
                      aligned=not cfg.get("ONE_SLOT_PER_BLOCK", False))
    mark("align")

    x = hidden_states
    if apply_router_weight_on_input:
        x = prepare.router_weighted_input(x, topk_weights).to(out_dtype)

    if mode == _QUANT_NONE:
        a1, a1_s, a1_st = x, None, (0, 0)
    else:
        a1, a1_s = prepare.quantize_activations(x, quant, quant.a1_scale)
        a1_st = _act_scale_strides(a1_s, quant)
    mark("quant1")
    # GEMM1 applies SiLU*mul in its epilogue: act [slots, I] is its only output, GEMM2's input
    # itself where prepare.gemm1_writes_gemm2_input (FP8 with a static a2 scale). With a
    # dynamic per-tensor scale the epilogue maxes amax / 448 into the scale's floor instead,
    # which makes it the dynamic scale. Rows of slots that are never placed (ids outside
    # [0, num_experts)) stay unwritten; GEMM2 never reads them, a dynamic per-tensor scale
    # is the amax of the written rows only, and its quantization pass skips the others.
    kind = prepare.gemm2_input(quant)
    act_scale = prepare.gemm1_epilogue_scale(quant, x.device)
    act_fp8 = kind == prepare.STATIC_TENSOR
    act = torch.empty((num_slots, inter2 // 2), dtype=ops.FP8_DTYPE if act_fp8 else out_dtype,
                      device=x.device)
    invoke_moe_gemm(a1, w1, act, a1_s, a1_st, None if mode == _QUANT_NONE else quant.w1_scale,
                    topk_weights, routing, top_k, num_slots, quant, False, cfg, fuse_silu=True,
                    out_scale=act_scale, amax_out=kind == prepare.DYNAMIC_TENSOR,
                    round_dtype=out_dtype, compile_only=compile_only)
    mark("gemm1")
    if prepare.gemm1_writes_gemm2_input(quant):
        a2, a2_s, a2_st = act, act_scale, (0, 0)
    else:
        # Only the rows GEMM1 wrote are quantized (GEMM2 skips the same slots).
        a2, a2_s = prepare.quantize_written_rows(
            act, quant, act_scale, slot_ids=routing.topk_ids, num_experts=num_experts,
            expert_map=None if expert_map is None else expert_map.to(torch.int32))
        a2_st = _act_scale_strides(a2_s, quant)
    mark("quant2")
    cache2 = torch.empty((num_slots, hidden), dtype=out_dtype, device=x.device)
    invoke_moe_gemm(a2, w2, cache2, a2_s, a2_st, None if mode == _QUANT_NONE else quant.w2_scale,
                    topk_weights, routing, 1, num_slots, quant,
                    not apply_router_weight_on_input, cfg, compile_only=compile_only)
    mark("gemm2")
    # Slots with an id outside [0, num_experts) were never placed, so their rows of cache2 are
    # unwritten; an identity map makes moe_sum skip them as it skips non-local experts.
    sum_map = expert_map if expert_map is not None else _identity_map(num_experts, x.device)
    ops.moe_sum(cache2.view(num_tokens, top_k, hidden), out, topk_ids, sum_map)
    mark("sum")
    return out


def run(*args, **kwargs) -> torch.Tensor:
    return fused_experts_triton(*args, **kwargs)
