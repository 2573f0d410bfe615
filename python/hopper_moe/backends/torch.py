"""The "torch" backend of fused_experts: the MoE layer in PyTorch-native ops.

Slots (token, k) are sorted by local expert with tensor ops (no host sync), the rows gathered,
GEMM1 / GEMM2 run as grouped GEMMs (``torch._grouped_mm``, or ``torch._scaled_grouped_mm``
for per-tensor / per-channel FP8 on SM90/SM100), SiLU * mul and FP8 requantization in
between, then the slots are gathered back and reduced over k in fp32 (deterministic: no
atomics). The activation quantization and the weight-scale shapes are hopper_moe.prepare's,
in its tensor-op implementation (``native=True``), so that torch.compile traces the layer.

Precision: on CUDA the grouped GEMMs take bf16 (or exact fp8) operands and return bf16, so the
GEMM outputs and the SiLU*mul output are kept in bf16 (as in vLLM's unfused Triton pipeline);
block FP8 (no PyTorch kernel for it) and sizes the FP8 kernel cannot take run on
bf16-dequantized operands. On CPU the GEMMs are fp32; an FP8 layer with fp16/bf16 activations
then stores the GEMM outputs and SiLU*mul in the activation dtype, with silu(gate) rounded
before the multiply, as vLLM's pipeline does: the FP8 requantization of the intermediate sees
vLLM's values, not values one rounding apart that land in another FP8 bucket. Everything else
on CPU is fp32. ``precision`` states this as arguments of the reference. Under torch.compile fp32 GEMMs (CPU) use the per-expert masked loop,
because torch._grouped_mm's fake kernel accepts bf16 only.

This backend has no GEMM-only entry (``make_gemm_only``): benchmarks time its grouped GEMMs
with their own torch._grouped_mm pair.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import prepare
from ..quant import QuantConfig

__all__ = ["combine_sorted_slots", "is_available", "precision", "run", "sort_slots_by_expert"]

# CUTLASS grouped GEMMs behind torch._grouped_mm / _scaled_grouped_mm take < 1024 groups.
_MAX_GROUPS = 1023


def is_available(device_type: str) -> bool:
    """Runs wherever PyTorch does."""
    return True


def _probe_cpu_grouped_mm() -> frozenset:
    """dtypes in which this torch runs torch._grouped_mm (2D x 3D with offsets) on CPU."""
    ok = set()
    if not hasattr(torch, "_grouped_mm"):
        return frozenset()
    for dtype in (torch.float32, torch.bfloat16):
        try:
            a = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
            b = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4) / 8  # [E, N, K]
            offs = torch.tensor([1, 3], dtype=torch.int32)
            out = torch._grouped_mm(a.to(dtype), b.to(dtype).transpose(1, 2), offs=offs)
            want = torch.cat([a[:1] @ b[0].t(), a[1:] @ b[1].t()])
            if torch.equal(out.float(), want):
                ok.add(dtype)
        except Exception:  # noqa: BLE001  (any failure means: not usable)
            pass
    return frozenset(ok)


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_HAS_SCALED_GROUPED_MM = hasattr(torch, "_scaled_grouped_mm")
_CPU_GROUPED_MM_DTYPES = _probe_cpu_grouped_mm()
_FORCE_LOOP_GEMM = False  # tests set this to exercise the per-expert loop fallback


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo at import time
    (about 2 s of `import hopper_moe`): that decorator only marks the function, and Dynamo
    reads the mark when it traces a call. Once torch._dynamo is loaded the public decorator
    is used; tests/test_compile.py compiles the layer that calls the marked function."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _cuda_capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def _compute_dtype(hidden_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """dtype of the grouped GEMM operands: bf16 on CUDA (the native _grouped_mm kernel; fp16
    inputs are run in bf16), fp32 on CUDA for fp32 inputs and always fp32 on CPU."""
    if device.type == "cuda" and hidden_dtype != torch.float32:
        return torch.bfloat16
    return torch.float32


def _aligned_16(w: torch.Tensor, k: int) -> bool:
    """w [E, N, K] (K-contiguous) can be the column-major B operand of a grouped GEMM: K and
    the row stride are 16-byte multiples and (eager only: torch.compile cannot read a storage
    offset while tracing, and weights are whole allocations there) the start is 16-byte
    aligned."""
    size = w.element_size()
    if (k * size) % 16 != 0 or (w.stride(1) * size) % 16 != 0 or w.stride(1) < k:
        return False
    return torch.compiler.is_compiling() or (w.storage_offset() * size) % 16 == 0


def _grouped_mm_usable(a: torch.Tensor, w: torch.Tensor) -> bool:
    """a [S, K] row-major, w [E, N, K] in the same dtype: may torch._grouped_mm run a @ w^T?"""
    if _FORCE_LOOP_GEMM or not _HAS_GROUPED_MM:
        return False
    if a.device.type == "cpu":
        if a.dtype not in _CPU_GROUPED_MM_DTYPES:
            return False
    elif a.device.type == "cuda":
        # bf16 is the native CUTLASS kernel (SM90/SM100; a per-group mm loop elsewhere); other
        # dtypes go to PyTorch's host-synchronizing fallback or are rejected by older releases.
        if a.dtype != torch.bfloat16 or w.shape[0] > _MAX_GROUPS:
            return False
    else:
        return False
    if w.dtype != a.dtype:
        return False
    if a.dtype == torch.float32 and torch.compiler.is_compiling():
        # Eager CPU/CUDA run fp32, but the fake (meta) kernel of torch._grouped_mm accepts
        # bf16 only, so a traced fp32 layer takes the loop fallback.
        return False
    n, k = w.shape[1], w.shape[2]
    return _aligned_16(w, k) and (n * w.element_size()) % 16 == 0


def _scaled_grouped_mm_usable(w: torch.Tensor, quant: QuantConfig) -> bool:
    """May torch._scaled_grouped_mm (rowwise fp8 x fp8 -> bf16, SM90/SM100 only) run with w?"""
    if _FORCE_LOOP_GEMM or not _HAS_SCALED_GROUPED_MM or quant.block_shape is not None:
        return False
    if w.device.type != "cuda" or w.shape[0] > _MAX_GROUPS or torch.version.hip:
        return False
    if _cuda_capability(w.device.index) not in (90, 100):
        return False
    n, k = w.shape[1], w.shape[2]
    return n % 16 == 0 and k % 16 == 0 and _aligned_16(w, k)


def _loop_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
               sorted_key: torch.Tensor) -> torch.Tensor:
    """Fallback of the grouped GEMM: rows offs[e-1]:offs[e] of a times w[e]^T, rows past
    offs[-1] zero. Eager: one matmul per expert on its rows (reads offs on the host). Under
    torch.compile the row ranges are not known while tracing, so every expert multiplies all
    rows and torch.where keeps its own (E times the work, no graph break)."""
    num_slots, num_experts, n = a.shape[0], w.shape[0], w.shape[1]
    out = a.new_zeros(num_slots, n)
    if torch.compiler.is_compiling():
        for e in range(num_experts):
            out = torch.where((sorted_key == e).unsqueeze(1), a @ w[e].t(), out)
        return out
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ w[e].t()
        start = end
    return out


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                  sorted_key: torch.Tensor) -> torch.Tensor:
    """``out[r] = a[r] @ w[e]^T`` for rows r of expert e (offs = int32 end rows, [E]).

    a ``[S, K]`` contiguous, w ``[E, N, K]`` K-contiguous, same dtype; rows past offs[-1] are
    unspecified (callers mask them)."""
    if _grouped_mm_usable(a, w):
        return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    return _loop_gemm(a, w, offs, sorted_key)


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, quant: QuantConfig,
                     dtype: torch.dtype) -> torch.Tensor:
    if quant.block_shape is not None:
        # Each column's group scale gathered by index: no size relation between q and scale
        # for torch.compile's symbolic shapes to solve (Inductor on CUDA failed on one).
        group = quant.block_shape[1]
        cols = torch.arange(q.shape[1], device=q.device) // group
        return (q.float() * scale.index_select(1, cols)).to(dtype)
    return (q.float() * scale).to(dtype)


def _dequantize_weight(w: torch.Tensor, scale: torch.Tensor, quant: QuantConfig,
                       dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``w [E, N, K]`` x its scales -> ``dtype`` (computed in fp32)."""
    if quant.block_shape is not None:
        bn, bk = quant.block_shape  # block scales gathered by index (see _dequantize_rows)
        rows = torch.arange(w.shape[1], device=w.device) // bn
        cols = torch.arange(w.shape[2], device=w.device) // bk
        return (w.float() * scale.index_select(1, rows).index_select(2, cols)).to(dtype)
    return (w.float() * prepare.weight_scale_3d(scale, w, quant)).to(dtype)


def _dequant_loop_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                       quant: QuantConfig, dtype: torch.dtype,
                       offs: torch.Tensor) -> torch.Tensor:
    """_loop_gemm over fp8 weights dequantized expert by expert (the values and the products
    of _dequantize_weight's, for the experts that have rows; reads offs on the host)."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    s3 = prepare.weight_scale_3d(scale, w, quant)
    if quant.block_shape is not None:
        bn, bk = quant.block_shape
        rows = torch.arange(w.shape[1], device=w.device) // bn
        cols = torch.arange(w.shape[2], device=w.device) // bk
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            s = s3[e]
            if quant.block_shape is not None:
                s = s.index_select(0, rows).index_select(1, cols)
            out[start:end] = a[start:end] @ (w[e].float() * s).to(dtype).t()
        start = end
    return out


def _row_scales(scale: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-tensor [] or per-row [R, 1] activation scale -> contiguous [R] (scale_a operand)."""
    return scale.reshape(-1).expand(num_rows).contiguous() if scale.dim() == 0 else (
        scale.reshape(num_rows).contiguous())


def _weight_col_scales(scale: torch.Tensor, w: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """Per-expert [E] or per-channel [E, N(, 1)] weight scale -> contiguous [E, N] (scale_b
    operand)."""
    scale = prepare.gemm_weight_scales(scale, w, quant)
    if scale.dim() == 2:
        return scale
    return scale.reshape(-1, 1).expand(w.shape[0], w.shape[1]).contiguous()


@dataclass(frozen=True)
class _TorchPlan:
    """How the torch backend runs one call (fixed by dtypes, device and shapes only).

    compute_dtype: operand dtype of the unquantized / dequantized grouped GEMMs.
    scaled: FP8 GEMMs run on torch._scaled_grouped_mm (exact fp8 operands, bf16 output).
    intermediate_dtype: dtype the GEMM outputs and the SiLU*mul output are kept in (None: fp32).
    dequant_dtype: dtype of dequantized GEMM operands (None: fp32, or no dequantization).
    silu_dtype: silu(gate) is rounded to this dtype before the multiply by up (None: not).
    """

    compute_dtype: torch.dtype
    scaled: bool
    intermediate_dtype: Optional[torch.dtype]
    dequant_dtype: Optional[torch.dtype]
    silu_dtype: Optional[torch.dtype] = None


def _torch_plan(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                quant: Optional[QuantConfig]) -> _TorchPlan:
    compute = _compute_dtype(hidden_states.dtype, hidden_states.device)
    scaled = (quant is not None and _scaled_grouped_mm_usable(w1, quant)
              and _scaled_grouped_mm_usable(w2, quant))
    low = None if compute == torch.float32 else compute
    if (quant is not None and compute == torch.float32
            and hidden_states.dtype in (torch.float16, torch.bfloat16)):
        # fp32 GEMMs (the CPU) of a 16-bit FP8 layer: vLLM's rounding of the intermediates
        # (module docstring).
        return _TorchPlan(compute_dtype=compute, scaled=False,
                          intermediate_dtype=hidden_states.dtype, dequant_dtype=None,
                          silu_dtype=hidden_states.dtype)
    return _TorchPlan(compute_dtype=compute, scaled=scaled,
                      intermediate_dtype=torch.bfloat16 if scaled else low,
                      dequant_dtype=None if quant is None or scaled else low)


def precision(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              quant: Optional[QuantConfig] = None) -> dict:
    """The precision model of ``backend="torch"`` for these operands, as keyword arguments of
    ``reference.fused_experts_ref`` (``intermediate_dtype``, ``dequant_dtype``): bf16 on CUDA
    (grouped GEMMs output bf16), all None (pure fp32) on CPU. Tests compare the torch backend
    with the reference of its own precision at OPS.md's tolerances."""
    plan = _torch_plan(hidden_states, w1, w2, quant)
    out = {"intermediate_dtype": plan.intermediate_dtype, "dequant_dtype": plan.dequant_dtype}
    if plan.silu_dtype is not None:
        out["silu_dtype"] = plan.silu_dtype
    return out


def _expert_gemm(a: torch.Tensor, a_scale: Optional[torch.Tensor], w: torch.Tensor,
                 w_scale: Optional[torch.Tensor], quant: Optional[QuantConfig], plan: _TorchPlan,
                 offs: torch.Tensor, sorted_key: torch.Tensor) -> torch.Tensor:
    """One grouped GEMM of the layer: sorted rows ``a [S, K]`` (compute dtype, or fp8 with
    ``a_scale``) times each row's expert weight ``w [E, N, K]``; returns ``[S, N]`` (bf16 on
    the scaled path, else the compute dtype)."""
    if quant is None:
        return _grouped_gemm(a, w.to(plan.compute_dtype), offs, sorted_key)
    if plan.scaled:
        return torch._scaled_grouped_mm(
            a, w.transpose(1, 2), _row_scales(a_scale, a.shape[0]),
            _weight_col_scales(w_scale, w, quant), offs=offs, out_dtype=torch.bfloat16)
    a_deq = _dequantize_rows(a, a_scale, quant, plan.compute_dtype)
    if a.device.type == "cpu" and not torch.compiler.is_compiling():
        # Eager CPU: one expert's weights dequantized at a time, only experts with rows (all of
        # them at once is E x N x K fp32 values, several GB for a large layer).
        return _dequant_loop_gemm(a_deq, w, w_scale, quant, plan.compute_dtype, offs)
    w_deq = _dequantize_weight(w, w_scale, quant, plan.compute_dtype)
    return _grouped_gemm(a_deq, w_deq, offs, sorted_key)


def _stored(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """t as fp32 after a store in dtype (None: fp32, no rounding); a no-op for a tensor
    already of that dtype."""
    if dtype is None or t.dtype == dtype:
        return t.float()
    return t.to(dtype).float()


def sort_slots_by_expert(topk_ids: torch.Tensor, num_experts: int, global_num_experts: int,
                         expert_map: Optional[torch.Tensor]):
    """Slots (token, k) in local-expert order, on the device, with no host sync.

    Returns ``(order, sorted_key, sorted_valid, offs)``: ``order`` [S] int64 slot indices
    sorted by local expert (stable); ``sorted_key`` their local expert, ``num_experts`` for
    slots that do not count (id outside [0, global_num_experts) or expert_map -1), which sort
    last; ``sorted_valid`` [S, 1] bool; ``offs`` int32 [E] end row of each expert's rows."""
    num_slots = topk_ids.numel()
    ids = topk_ids.reshape(num_slots).long()
    valid = (ids >= 0) & (ids < global_num_experts)
    local = torch.where(valid, ids, 0)
    if expert_map is not None:
        local = expert_map.long()[local]
    valid = valid & (local >= 0) & (local < num_experts)
    key = torch.where(valid, local, num_experts)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    sorted_valid = (sorted_key < num_experts).unsqueeze(1)
    experts = torch.arange(num_experts, device=topk_ids.device, dtype=sorted_key.dtype)
    offs = torch.searchsorted(sorted_key, experts, right=True).to(torch.int32)
    return order, sorted_key, sorted_valid, offs


def run(hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
        global_num_experts, expert_map, quant):
    """The layer (see the module docstring), arguments as ``hopper_moe.fused_experts`` after
    its validation. Shapes static in M; no host sync on the grouped-GEMM paths."""
    num_experts, intermediate_size = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    plan = _torch_plan(hidden_states, w1, w2, quant)

    order, sorted_key, sorted_valid, offs = sort_slots_by_expert(
        topk_ids, num_experts, global_num_experts, expert_map)
    token_of_slot = order // topk

    x = hidden_states.float() if quant is not None else hidden_states
    if apply_router_weight_on_input:
        x = prepare.router_weighted_input(hidden_states, topk_weights)

    # GEMM1: [S, H] x [E, 2I, H] -> [S, 2I]
    if quant is None:
        a1, a1_scale = x.to(plan.compute_dtype)[token_of_slot], None
    else:
        q, s = prepare.quantize_activations(x, quant, quant.a1_scale, native=True)
        a1 = q[token_of_slot]
        a1_scale = s if s.dim() == 0 else s[token_of_slot]
    h = _expert_gemm(a1, a1_scale, w1, None if quant is None else quant.w1_scale, quant, plan,
                     offs, sorted_key)

    # SiLU(gate) * up in fp32, kept in the plan's intermediate dtype (unquantized: the compute
    # dtype, the same rounding). Rows past offs[-1] are unspecified: GEMM2 never reads them and
    # its rows there are masked below; before an FP8 requantization they become exact zeros
    # so they stay out of a dynamic per-tensor amax.
    h = _stored(h, plan.intermediate_dtype)
    inter = (_stored(F.silu(h[:, :intermediate_size]), plan.silu_dtype)
             * h[:, intermediate_size:].float())

    # GEMM2: [S, I] x [E, H, I] -> [S, H]
    if quant is None:
        a2, a2_scale = inter.to(plan.compute_dtype), None
    else:
        if plan.intermediate_dtype is not None:
            inter = inter.to(plan.intermediate_dtype).float()
        inter = torch.where(sorted_valid, inter, 0.0)
        a2, a2_scale = prepare.quantize_activations(inter, quant, quant.a2_scale,
                                                    native=True)
    y = _expert_gemm(a2, a2_scale, w2, None if quant is None else quant.w2_scale, quant, plan,
                     offs, sorted_key)
    y = _stored(y, plan.intermediate_dtype)

    return combine_sorted_slots(y, order, sorted_valid, topk_weights,
                                apply_router_weight_on_input).to(hidden_states.dtype)


def combine_sorted_slots(y: torch.Tensor, order: torch.Tensor, sorted_valid: torch.Tensor,
                         topk_weights: torch.Tensor,
                         apply_router_weight_on_input: bool) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * y[slot (t, k)]`` in fp32 ([M, H]), for y [S, H] in the
    order of sort_slots_by_expert; rows of slots that do not count are ignored (they may hold
    anything), and with apply_router_weight_on_input the weight is 1 (already applied)."""
    num_tokens, topk = topk_weights.shape
    num_slots = num_tokens * topk
    if apply_router_weight_on_input:
        slot_weight = torch.ones(num_slots, 1, dtype=torch.float32, device=y.device)
    else:
        slot_weight = topk_weights.reshape(num_slots)[order].float().unsqueeze(1)
    y = torch.where(sorted_valid, y.float(), 0.0) * torch.where(sorted_valid, slot_weight, 0.0)
    # Back to (token, k) order, then the fp32 sum over k.
    slots = torch.arange(num_slots, device=y.device, dtype=order.dtype)
    inverse = torch.empty_like(order).scatter_(0, order, slots)
    return y[inverse].reshape(num_tokens, topk, y.shape[1]).sum(dim=1)
