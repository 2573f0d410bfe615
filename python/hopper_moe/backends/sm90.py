"""The "sm90" backend of fused_experts (also named "cute"): the layer around hopper_moe's
SM90 grouped GEMM, one call of the op ``torch.ops.hopper_moe.fused_experts_sm90``
(csrc/layer/fused_experts_sm90.cpp: argument checks, buffers and launches in C++):

    moe_permute's sort (rows in expert order, expert offsets; no row copied) ->
    (FP8 quant of x) -> GEMM1 reading x's rows through the sort's permutation (on CUDA its
    producer warp gathers them), with SiLU*mul (+ static FP8 quant, or the dynamic per-tensor
    scale's amax) in its epilogue -> (FP8 quant with that scale, or per token) ->
    GEMM2 (moe_grouped_gemm) -> moe_unpermute (weighted sum over k)

Both GEMMs are the hand-written SM90 wgmma kernel (csrc/include/hopper_moe/gemm) on CUDA and
their readable definitions on the CPU, so the composition is tested in CI. On CUDA the GEMMs
and moe_unpermute are programmatic dependent launches: each starts while the kernel before it
drains, the GEMMs streaming their first weight tiles before their input is complete. Where
GEMM1 writes GEMM2's input itself (bf16, static a2 scale) the two are one call
(moe_grouped_gemm_chain: two dependent launches).
Schemes: bf16 (fp16/fp32 inputs run in bf16), FP8 e4m3 per-tensor (static or dynamic
activation scales) and per-token activations x per-channel weights. Block-wise [128,128] FP8
is not in the kernel yet: ``backend="triton"`` runs it.

Precision model (what tests compare against): GEMM outputs in bf16, the SiLU*mul of those
bf16 values in fp32, rounded once to bf16 (or quantized directly with a static per-tensor a2
scale), the weighted sum over k in fp32 rounded once to bf16 (then to the input's dtype). No
host synchronization: the slot order and the expert row offsets stay on the device, so a
layer can be captured in a CUDA graph.

Not yet fused: the activation quantization, the sort and the final sum are separate
launches (hopper_moe's ops, called from the C++ op). The scheme rules (how GEMM2's input is
quantized, weight-scale shapes, the dynamic scale's floor) are hopper_moe.prepare's, which
the C++ op follows; ``make_gemm_only`` (GEMM-only benchmarks) still prepares its operands here
in Python with them.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops, prepare

_GEMM = torch.ops.hopper_moe.moe_grouped_gemm.default
_GEMM1 = torch.ops.hopper_moe.moe_grouped_gemm_silu_mul.default
_CHAIN = torch.ops.hopper_moe.moe_grouped_gemm_chain.default
_LAYER = torch.ops.hopper_moe.fused_experts_sm90.default


def _fail(msg: str) -> None:
    raise RuntimeError(f"fused_experts(backend='sm90'): {msg}")


def is_available(device_type: str) -> bool:
    """On CUDA: a CUDA build and an SM90 GPU (the kernel is sm_90a code). On the CPU the
    GEMM's CPU definition runs (tests, small layers)."""
    if device_type == "cpu":
        return True
    if device_type != "cuda":
        return False
    global _CUDA_SM90
    if _CUDA_SM90 is None:  # once per process, outside any torch.compile trace after that
        from .. import built_with_cuda

        _CUDA_SM90 = built_with_cuda() and torch.cuda.is_available() and any(
            torch.cuda.get_device_capability(i) == (9, 0)
            for i in range(torch.cuda.device_count()))
    return _CUDA_SM90


# The most local experts the op takes (heuristics::kMaxExperts in csrc/, checked there; a test
# holds the two equal).
MAX_EXPERTS = 1024

# Whether any GPU of this process can run the kernel; _check_supported then asks about the
# tensors' own device (_SM90_DEVICES), so a machine with other GPUs too gets a clear error
# for those.
_CUDA_SM90: Optional[bool] = None
_SM90_DEVICES: dict = {}


def _device_is_sm90(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM90_DEVICES:
        _SM90_DEVICES[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _SM90_DEVICES[index]


def unsupported_reason(device: torch.device, w1: torch.Tensor, w2: torch.Tensor,
                       quant) -> Optional[str]:
    """Why this backend cannot run a layer with these weights on `device` (None: it can)."""
    if quant is not None and quant.block_shape is not None:
        return "block-wise FP8 (quant.block_shape) is not supported yet; use backend='triton'"
    if w1.shape[0] > MAX_EXPERTS:
        return (f"w1.size(0) (num_experts) = {w1.shape[0]} must be at most {MAX_EXPERTS} (the "
                f"GEMM's per-expert tile table)")
    # The bulk tensor copies read rows of 16 bytes' multiples: H (GEMM1's K) and I (GEMM2's K).
    elem = 1 if quant is not None else 2
    hidden, inter = w1.shape[2], w2.shape[2]
    for name, k in (("hidden size H (w1.size(2))", hidden),
                    ("intermediate size I (w2.size(2))", inter)):
        if (k * elem) % 16:
            return (f"{name} = {k} must be a multiple of {16 // elem} for "
                    f"{'FP8' if quant is not None else 'bf16'} operands")
    for name, w in (("w1", w1), ("w2", w2)):
        # Read as they are by bulk tensor copies (the op's check, csrc/checks/layer.cpp). While
        # torch.compile traces there is no address to look at (the op checks it when it runs).
        if w.dtype in (torch.bfloat16, torch.float8_e4m3fn) and \
                not torch.compiler.is_compiling() and w.is_contiguous() and w.numel() > 0 and \
                w.data_ptr() % 16:
            return f"{name} must start on a 16-byte boundary (a view at an element offset)"
    if device.type == "cuda" and not (is_available("cuda") and _device_is_sm90(device)):
        return (f"needs an SM90 GPU (H100/H200) and a CUDA build of hopper_moe; {device} is "
                f"not one")
    return None


def supports(device: torch.device, dtype: torch.dtype, w1: torch.Tensor, w2: torch.Tensor,
             quant) -> bool:
    """Whether fused_experts(backend='sm90') runs this layer (for the oracle)."""
    return unsupported_reason(device, w1, w2, quant) is None


def _check_supported(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     quant) -> None:
    reason = unsupported_reason(hidden_states.device, w1, w2, quant)
    if reason is not None:
        _fail(reason)


def _permuted_gemm1_operands(hidden_states, w1, topk_weights, topk_ids,
                             apply_router_weight_on_input, global_num_experts, expert_map,
                             quant):
    """x (quantized first: each token once) gathered into expert order by moe_permute, and
    GEMM1's other operands: (a1 [S, H], its scale, expert offsets int64 [E + 1],
    inv_permuted_idx, w1 in the GEMM's dtype, w1's scale). Slots that do not count (ids out
    of range, non-local experts) sort after offsets[E], where no GEMM reads or writes."""
    x = hidden_states
    if apply_router_weight_on_input:
        x = prepare.router_weighted_input(x, topk_weights)
    if quant is None:
        xq, x_scale, w1g, w1_scale = x.to(torch.bfloat16), None, w1.to(torch.bfloat16), None
    else:
        xq, x_scale = prepare.quantize_activations(x, quant, quant.a1_scale)
        w1g, w1_scale = w1, prepare.gemm_weight_scales(quant.w1_scale, w1, quant)
    if expert_map is not None and expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    # A per-token scale [M, 1] comes back permuted with the rows ([S, 1]).
    a1, a1_scale, offsets, inv_idx, _ = ops.moe_permute(
        xq, x_scale, topk_ids, global_num_experts, w1.shape[0], expert_map)
    return a1, a1_scale, offsets, inv_idx, w1g.contiguous(), w1_scale


def _gemm2_weights(w2, quant):
    """GEMM2's weights in the GEMM's dtype and their scale (None with bf16)."""
    if quant is None:
        return w2.to(torch.bfloat16).contiguous(), None
    return w2.contiguous(), prepare.gemm_weight_scales(quant.w2_scale, w2, quant)


def _gemm1_output(a1, w1g, quant):
    """GEMM1's output [S, I]: GEMM2's input itself where GEMM1 writes it (bf16, or e4m3 with a
    static a2 scale: prepare.gemm1_writes_gemm2_input), else the bf16 SiLU*mul output that
    GEMM2's input is quantized from."""
    fp8 = quant is not None and prepare.gemm1_writes_gemm2_input(quant)
    return torch.empty((a1.shape[0], w1g.shape[1] // 2),
                       dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=a1.device)


def _gemm1_then_quant(h, a1, a1_scale, w1g, w1_scale, offsets, quant, offsets_ready,
                      a2_scale):
    """GEMM1 with SiLU*mul into bf16 h [S, I], then GEMM2's input quantized from h: (a2, its
    scale). Per token: each row's scale. Dynamic per tensor: a2_scale (from
    prepare.gemm1_epilogue_scale) is the buffer GEMM1's epilogue folds the amax of the rows it
    writes into (started at the floor of dynamic_scaled_fp8_quant, so the scale is the same),
    then one static quantization with it. Rows past offsets[E] (slots that do not count) are
    not written and never read."""
    _GEMM1(h, a1, w1g, offsets, a1_scale, w1_scale, None, offsets_ready, a2_scale)
    # Only the rows before offsets[E] (those GEMM1 wrote) are read and quantized.
    return prepare.quantize_written_rows(h, quant, a2_scale, row_end=offsets[-1:])


def fused_experts_sm90(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       apply_router_weight_on_input: bool, global_num_experts: int,
                       expert_map, quant, out=None) -> torch.Tensor:
    """The layer as one call of ``torch.ops.hopper_moe.fused_experts_sm90``, which checks
    every argument itself (a RuntimeError naming the argument and the rule, on both devices)
    and runs every step in C++. Arguments as ``hopper_moe.fused_experts``; ``quant`` a
    QuantConfig or None, ``out`` an optional ``[M, H]`` result tensor. Returns out."""
    if quant is not None and quant.block_shape is not None:
        _fail("block-wise FP8 (quant.block_shape) is not supported yet; use backend='triton'")
    if hidden_states.is_cuda and not is_available("cuda"):
        _fail(f"needs an SM90 GPU (H100/H200) and a CUDA build of hopper_moe; "
              f"{hidden_states.device} is not one")
    if out is None:
        out = hidden_states.new_empty(hidden_states.shape)
    if quant is None:
        _LAYER(out, hidden_states, w1, w2, topk_weights, topk_ids,
               bool(apply_router_weight_on_input), global_num_experts, expert_map, None, None,
               None, None, False, False)
    else:
        _LAYER(out, hidden_states, w1, w2, topk_weights, topk_ids,
               bool(apply_router_weight_on_input), global_num_experts, expert_map, quant.w1_scale,
               quant.w2_scale, quant.a1_scale, quant.a2_scale, bool(quant.per_act_token_quant),
               bool(quant.per_out_ch_quant))
    return out


def run_steps(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              apply_router_weight_on_input: bool = False, global_num_experts: int = -1,
              expert_map=None, quant=None) -> torch.Tensor:
    """The layer of ``fused_experts_sm90`` composed from hopper_moe's ops in Python, one call
    per step (how this backend ran before the op existed): the op's readable specification.
    Here GEMM1 reads moe_permute's permuted copy of x, where the op's GEMM1 gathers the same
    rows itself. Tests hold the op to it bit for bit; benchmarks/bench_host.py and
    bench_moe.py time it beside the op (backend name ``sm90_steps``). Arguments as
    fused_experts', assumed valid; M > 0."""
    num_global = w1.shape[0] if expert_map is None else (
        expert_map.shape[0] if global_num_experts == -1 else global_num_experts)
    if quant is not None:
        quant = quant.resolve(w1)
    a2_scale = prepare.gemm1_epilogue_scale(quant, hidden_states.device)
    a1, a1_scale, offsets, inv_idx, w1g, w1_scale = _permuted_gemm1_operands(
        hidden_states, w1, topk_weights, topk_ids, apply_router_weight_on_input, num_global,
        expert_map, quant)
    w2g, w2_scale = _gemm2_weights(w2, quant)
    y = torch.empty((a1.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=a1.device)
    h = _gemm1_output(a1, w1g, quant)
    if prepare.gemm1_writes_gemm2_input(quant):
        _CHAIN(y, h, a1, w1g, w2g, offsets, a1_scale, w1_scale, a2_scale, w2_scale, True)
    else:
        a2, a2q_scale = _gemm1_then_quant(h, a1, a1_scale, w1g, w1_scale, offsets, quant, True,
                                          a2_scale)
        _GEMM(y, a2, w2g, offsets, a2q_scale, w2_scale, True)
    weights = torch.ones_like(topk_weights, dtype=torch.float32) \
        if apply_router_weight_on_input else topk_weights.float().contiguous()
    summed = torch.empty((hidden_states.shape[0], w2.shape[1]), dtype=torch.bfloat16,
                         device=a1.device)
    ops.moe_unpermute(summed, y, weights, inv_idx, offsets)
    return summed.to(hidden_states.dtype)


def run(*args, **kwargs) -> torch.Tensor:
    return fused_experts_sm90(*args, **kwargs)


def make_gemm_only(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, quant=None):
    """A zero-argument callable that runs this backend's two GEMM launches only (GEMM1 with
    its fused SiLU*mul epilogue, GEMM2), on operands prepared here once (slots permuted,
    activations quantized), for GEMM-only benchmarks. Returns (a2, y), the two outputs."""
    _check_supported(hidden_states, w1, w2, quant)
    a1, a1_scale, offsets, _, w1g, w1_scale = _permuted_gemm1_operands(
        hidden_states, w1, topk_weights, topk_ids, False, w1.shape[0], None, quant)
    y = torch.empty((a1.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=a1.device)
    a2_scale = prepare.gemm1_epilogue_scale(quant, a1.device)
    w2g, w2_scale = _gemm2_weights(w2, quant)
    h = _gemm1_output(a1, w1g, quant)
    if prepare.gemm1_writes_gemm2_input(quant):  # GEMM1 writes GEMM2's input itself: one call

        def chain():
            _CHAIN(y, h, a1, w1g, w2g, offsets, a1_scale, w1_scale, a2_scale, w2_scale, True)
            return h, y
        return chain
    # Dynamic scales: GEMM2 reads the quantization of a first pass; the timed GEMM1 writes bf16
    # (dynamic per tensor: folding its amax into a scale buffer of its own, as in the layer).
    a2, a2q_scale = _gemm1_then_quant(h, a1, a1_scale, w1g, w1_scale, offsets, quant, True,
                                      a2_scale)
    amax = prepare.gemm1_epilogue_scale(quant, a1.device)

    def gemms():
        _GEMM1(h, a1, w1g, offsets, a1_scale, w1_scale, None, True, amax)
        _GEMM(y, a2, w2g, offsets, a2q_scale, w2_scale, True)
        return h, y
    return gemms
