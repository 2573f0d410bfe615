"""The MoE layer API: ``fused_topk``, ``fused_experts``, ``fused_moe`` (vLLM's signatures).

Notation: M tokens, H hidden size, E local experts (w1.shape[0]), I intermediate size per
expert, topk experts per token, S = M * topk (token, k) slots.

Backends of ``fused_experts``:

- ``"reference"``: ``hopper_moe.reference.fused_experts_ref`` (fp32, loop over experts).
- ``"torch"``: PyTorch-native. Slots are sorted by local expert with tensor ops (no host
  sync), the rows gathered, GEMM1 / GEMM2 run as grouped GEMMs (``torch._grouped_mm``, or
  ``torch._scaled_grouped_mm`` for per-tensor / per-channel FP8 on SM90/SM100), SiLU * mul and
  FP8 requantization in between, then the slots are gathered back and reduced over k in fp32
  (deterministic: no atomics).
  Precision: on CUDA the grouped GEMMs take bf16 (or exact fp8) operands and return bf16, so
  the GEMM outputs and the SiLU*mul output are kept in bf16 (as in vLLM's unfused Triton
  pipeline); block FP8 (no PyTorch kernel for it) and sizes the FP8 kernel cannot take run on
  bf16-dequantized operands. On CPU everything is fp32. ``torch_backend_precision`` states
  this as arguments of the reference. Under torch.compile fp32 GEMMs (CPU) use the per-expert
  masked loop, because torch._grouped_mm's fake kernel accepts bf16 only.
- ``"auto"``: ``oracle.choose_backend`` over ``available_backends(device)``.
- ``"triton"`` / ``"cute"``: register themselves with ``register_backend`` once built; until
  then asking for them raises RuntimeError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import oracle
from .quant import FP8_MAX, FP8_MIN_SCALE, GROUP_EPS, QuantConfig
from .reference.layer import fused_experts_ref

__all__ = [
    "available_backends",
    "torch_backend_precision",
    "fused_experts",
    "fused_moe",
    "fused_topk",
    "register_backend",
]

_HIDDEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_WEIGHT_DTYPES = _HIDDEN_DTYPES + (torch.float8_e4m3fn,)
_ID_DTYPES = (torch.int32, torch.int64)
_INDICES_TYPES = (torch.int32, torch.int64, torch.uint32)
_BACKEND_NAMES = ("auto", "torch", "reference", "triton", "cute")
# CUTLASS grouped GEMMs behind torch._grouped_mm / _scaled_grouped_mm take < 1024 groups.
_MAX_GROUPS = 1023


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


# ----------------------------------------------------------------------------- routing
def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_type: Optional[torch.dtype] = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of ``gating_output [M, E]`` (f32/f16/bf16 logits).

    hidden_states ``[M, H]`` is only checked for its token count. Returns
    ``(topk_weights [M, topk] f32, topk_ids [M, topk] int32 (or indices_type),
    token_expert_indices [M, topk] int32 = k * M + t)``. Weights are the softmax (or sigmoid)
    scores of the chosen experts, renormalized to sum to 1 per token when ``renormalize``.
    Runs ``torch.ops.hopper_moe.topk_softmax`` / ``topk_sigmoid``.
    """
    if not isinstance(gating_output, torch.Tensor) or gating_output.dim() != 2:
        _fail("gating_output must be a 2-D tensor (num_tokens, num_experts)")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 1:
        _fail("hidden_states must be a tensor whose first dim is num_tokens")
    if hidden_states.shape[0] != gating_output.shape[0]:
        _fail(f"hidden_states and gating_output must have the same number of tokens, got "
              f"{hidden_states.shape[0]} and {gating_output.shape[0]}")
    if gating_output.dtype not in _HIDDEN_DTYPES:
        _fail(f"gating_output must be float32, float16 or bfloat16, got {gating_output.dtype}")
    num_experts = gating_output.shape[1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        _fail(f"topk must be an int in [1, num_experts = {num_experts}], got {topk!r}")
    if scoring_func not in ("softmax", "sigmoid"):
        _fail(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    if indices_type is not None and indices_type not in _INDICES_TYPES:
        _fail(f"indices_type must be None, torch.int32, torch.int64 or torch.uint32, got "
              f"{indices_type}")
    num_tokens = gating_output.shape[0]
    device = gating_output.device
    topk_weights = torch.empty(num_tokens, topk, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, topk, dtype=indices_type or torch.int32, device=device)
    token_expert_indices = torch.empty(num_tokens, topk, dtype=torch.int32, device=device)
    if scoring_func == "softmax":
        torch.ops.hopper_moe.topk_softmax(topk_weights, topk_ids, token_expert_indices,
                                          gating_output, renormalize, None, None)
    else:
        torch.ops.hopper_moe.topk_sigmoid(topk_weights, topk_ids, token_expert_indices,
                                          gating_output, renormalize, None, 1.0, None)
    return topk_weights, topk_ids, token_expert_indices


# ----------------------------------------------------------------------------- validation
def _check_tensor(name: str, t, dim: int, device: Optional[torch.device] = None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        _fail(f"{name} must be {dim}-D, got {t.dim()}-D with shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} must be on the same device as hidden_states ({device}), got {t.device}")


def _validate_experts_args(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                           apply_router_weight_on_input, global_num_experts, expert_map,
                           quant, backend) -> int:
    """Checks every argument of fused_experts; returns the resolved global_num_experts."""
    if backend not in _BACKEND_NAMES:
        _fail(f"backend must be one of {_BACKEND_NAMES}, got {backend!r}")
    if activation != "silu":
        _fail(f"activation must be 'silu' (the only activation implemented), got {activation!r}")
    _check_tensor("hidden_states", hidden_states, 2)
    device = hidden_states.device
    _check_tensor("w1", w1, 3, device)
    _check_tensor("w2", w2, 3, device)
    _check_tensor("topk_weights", topk_weights, 2, device)
    _check_tensor("topk_ids", topk_ids, 2, device)
    if hidden_states.dtype not in _HIDDEN_DTYPES:
        _fail(f"hidden_states must be float32, float16 or bfloat16, got {hidden_states.dtype}")
    if hidden_states.stride(-1) != 1:
        _fail("hidden_states must have last-dim stride 1")
    num_tokens, hidden_size = hidden_states.shape
    num_experts, n1, k1 = w1.shape
    if num_experts < 1:
        _fail("w1 must have at least one expert")
    if k1 != hidden_size or n1 % 2 != 0 or n1 == 0:
        _fail(f"w1 must have shape (num_experts, 2*intermediate_size, hidden_size) with "
              f"hidden_size = {hidden_size}, got {tuple(w1.shape)}")
    intermediate_size = n1 // 2
    if tuple(w2.shape) != (num_experts, hidden_size, intermediate_size):
        _fail(f"w2 must have shape (num_experts, hidden_size, intermediate_size) = "
              f"{(num_experts, hidden_size, intermediate_size)}, got {tuple(w2.shape)}")
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype not in _WEIGHT_DTYPES:
            _fail(f"{name} must be float32, float16, bfloat16 or float8_e4m3fn, got {w.dtype}")
        if w.stride(-1) != 1:
            _fail(f"{name} must be K-contiguous (last-dim stride 1)")
    if w1.dtype != w2.dtype:
        _fail(f"w1 and w2 must have the same dtype, got {w1.dtype} and {w2.dtype}")
    if quant is None:
        if w1.dtype != hidden_states.dtype:
            _fail(f"w1 must have the dtype of hidden_states ({hidden_states.dtype}) when quant "
                  f"is None, got {w1.dtype}")
    else:
        if not isinstance(quant, QuantConfig):
            _fail(f"quant must be None or a hopper_moe.QuantConfig, got {type(quant).__name__}")
        quant.validate(w1, w2)
    if tuple(topk_ids.shape) != tuple(topk_weights.shape):
        _fail(f"topk_ids and topk_weights must have the same shape (num_tokens, topk), got "
              f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.shape[0] != num_tokens:
        _fail(f"topk_ids must have shape (num_tokens, topk) with num_tokens = {num_tokens}, got "
              f"{tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    if topk < 1:
        _fail("topk_ids must have at least one column (topk >= 1)")
    if topk_ids.dtype not in _ID_DTYPES:
        _fail(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype not in _HIDDEN_DTYPES:
        _fail(f"topk_weights must be float32, float16 or bfloat16, got {topk_weights.dtype}")
    if apply_router_weight_on_input and topk != 1:
        _fail(f"apply_router_weight_on_input requires topk == 1, got topk = {topk}")
    if isinstance(global_num_experts, bool) or not isinstance(global_num_experts, int):
        _fail(f"global_num_experts must be an int, got {global_num_experts!r}")
    if expert_map is not None:
        _check_tensor("expert_map", expert_map, 1, device)
        if expert_map.dtype not in _ID_DTYPES:
            _fail(f"expert_map must be int32 or int64, got {expert_map.dtype}")
        if global_num_experts == -1:
            global_num_experts = expert_map.shape[0]
        if expert_map.shape[0] != global_num_experts:
            _fail(f"expert_map must have global_num_experts = {global_num_experts} entries, got "
                  f"{expert_map.shape[0]}")
    else:
        if global_num_experts == -1:
            global_num_experts = num_experts
        if global_num_experts != num_experts:
            _fail(f"global_num_experts must be -1 or num_experts = {num_experts} when "
                  f"expert_map is None, got {global_num_experts}")
    if global_num_experts < 1:
        _fail(f"global_num_experts must be >= 1, got {global_num_experts}")
    return global_num_experts


# ----------------------------------------------------------------------------- torch backend
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


@torch.compiler.assume_constant_result
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


def _quantize_rows(x: torch.Tensor, quant: QuantConfig,
                   static_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x [R, C]`` -> (q fp8 [R, C], scale): per-token [R, 1], per-group [R, C/g],
    per-tensor [] (static_scale, or dynamic over all of x: callers zero rows that must not
    count). Same rules as hopper_moe.quant's docstring."""
    rows, cols = x.shape
    if quant.per_act_token_quant:
        scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
        q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale
    if quant.block_shape is not None:
        group = quant.block_shape[1]
        xg = x.reshape(rows, cols // group, group)
        scale = xg.abs().amax(dim=2, keepdim=True).clamp_min(GROUP_EPS) / FP8_MAX
        q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(rows, cols), scale.reshape(rows, cols // group)
    if static_scale is not None:
        scale = static_scale.float().reshape(())
    else:
        scale = (x.abs().amax() / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    # Per-tensor quantization multiplies by the reciprocal, as the per-tensor ops do.
    q = (x * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


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
    e, n, k = w.shape
    if quant.block_shape is not None:
        bn, bk = quant.block_shape  # block scales gathered by index (see _dequantize_rows)
        rows = torch.arange(n, device=w.device) // bn
        cols = torch.arange(k, device=w.device) // bk
        return (w.float() * scale.index_select(1, rows).index_select(2, cols)).to(dtype)
    if quant.per_out_ch_quant:
        return (w.float() * scale.reshape(e, n, 1)).to(dtype)
    return (w.float() * scale.reshape(e, 1, 1)).to(dtype)


def _row_scales(scale: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-tensor [] or per-row [R, 1] activation scale -> contiguous [R] (scale_a operand)."""
    return scale.reshape(-1).expand(num_rows).contiguous() if scale.dim() == 0 else (
        scale.reshape(num_rows).contiguous())


def _weight_col_scales(scale: torch.Tensor, w: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """Per-expert [E] or per-channel [E, N(, 1)] weight scale -> contiguous [E, N]."""
    e, n = w.shape[0], w.shape[1]
    if quant.per_out_ch_quant:
        return scale.reshape(e, n).contiguous()
    return scale.reshape(e, 1).expand(e, n).contiguous()


@dataclass(frozen=True)
class _TorchPlan:
    """How the torch backend runs one call (fixed by dtypes, device and shapes only).

    compute_dtype: operand dtype of the unquantized / dequantized grouped GEMMs.
    scaled: FP8 GEMMs run on torch._scaled_grouped_mm (exact fp8 operands, bf16 output).
    intermediate_dtype: dtype the GEMM outputs and the SiLU*mul output are kept in (None: fp32).
    dequant_dtype: dtype of dequantized GEMM operands (None: fp32, or no dequantization).
    """

    compute_dtype: torch.dtype
    scaled: bool
    intermediate_dtype: Optional[torch.dtype]
    dequant_dtype: Optional[torch.dtype]


def _torch_plan(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                quant: Optional[QuantConfig]) -> _TorchPlan:
    compute = _compute_dtype(hidden_states.dtype, hidden_states.device)
    scaled = (quant is not None and _scaled_grouped_mm_usable(w1, quant)
              and _scaled_grouped_mm_usable(w2, quant))
    low = None if compute == torch.float32 else compute
    return _TorchPlan(compute_dtype=compute, scaled=scaled,
                      intermediate_dtype=torch.bfloat16 if scaled else low,
                      dequant_dtype=None if quant is None or scaled else low)


def torch_backend_precision(hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                            quant: Optional[QuantConfig] = None) -> dict:
    """The precision model of ``backend="torch"`` for these operands, as keyword arguments of
    ``reference.fused_experts_ref`` (``intermediate_dtype``, ``dequant_dtype``): bf16 on CUDA
    (grouped GEMMs output bf16), all None (pure fp32) on CPU. Tests compare the torch backend
    with the reference of its own precision at OPS.md's tolerances."""
    plan = _torch_plan(hidden_states, w1, w2, quant)
    return {"intermediate_dtype": plan.intermediate_dtype, "dequant_dtype": plan.dequant_dtype}


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
    w_deq = _dequantize_weight(w, w_scale, quant, plan.compute_dtype)
    return _grouped_gemm(a_deq, w_deq, offs, sorted_key)


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


def _torch_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids,
                         apply_router_weight_on_input, global_num_experts, expert_map, quant):
    """The "torch" backend (see the module docstring). Shapes static in M; no host sync on
    the grouped-GEMM paths."""
    num_experts, intermediate_size = w1.shape[0], w2.shape[2]
    topk = topk_ids.shape[1]
    plan = _torch_plan(hidden_states, w1, w2, quant)

    order, sorted_key, sorted_valid, offs = sort_slots_by_expert(
        topk_ids, num_experts, global_num_experts, expert_map)
    token_of_slot = order // topk

    x = hidden_states.float() if quant is not None else hidden_states
    if apply_router_weight_on_input:
        x = hidden_states.float() * topk_weights.float()  # [M, 1]: topk == 1

    # GEMM1: [S, H] x [E, 2I, H] -> [S, 2I]
    if quant is None:
        a1, a1_scale = x.to(plan.compute_dtype)[token_of_slot], None
    else:
        q, s = _quantize_rows(x, quant, quant.a1_scale)
        a1 = q[token_of_slot]
        a1_scale = s if s.dim() == 0 else s[token_of_slot]
    h = _expert_gemm(a1, a1_scale, w1, None if quant is None else quant.w1_scale, quant, plan,
                     offs, sorted_key)

    # SiLU(gate) * up in fp32, kept in the plan's intermediate dtype (unquantized: the compute
    # dtype, the same rounding). Rows past offs[-1] are unspecified: GEMM2 never reads them and
    # its rows there are masked below; before an FP8 requantization they become exact zeros
    # so they stay out of a dynamic per-tensor amax.
    inter = F.silu(h[:, :intermediate_size].float()) * h[:, intermediate_size:].float()

    # GEMM2: [S, I] x [E, H, I] -> [S, H]
    if quant is None:
        a2, a2_scale = inter.to(plan.compute_dtype), None
    else:
        if plan.intermediate_dtype is not None:
            inter = inter.to(plan.intermediate_dtype).float()
        inter = torch.where(sorted_valid, inter, 0.0)
        a2, a2_scale = _quantize_rows(inter, quant, quant.a2_scale)
    y = _expert_gemm(a2, a2_scale, w2, None if quant is None else quant.w2_scale, quant, plan,
                     offs, sorted_key)

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


def _reference_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids,
                             apply_router_weight_on_input, global_num_experts, expert_map,
                             quant):
    return fused_experts_ref(hidden_states, w1, w2, topk_weights, topk_ids, "silu",
                             apply_router_weight_on_input, global_num_experts, expert_map,
                             quant)


# ----------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class _Backend:
    run: Callable[..., torch.Tensor]
    is_available: Callable[[str], bool]


_BACKENDS: dict[str, _Backend] = {
    "torch": _Backend(_torch_fused_experts, lambda device_type: True),
    "reference": _Backend(_reference_fused_experts, lambda device_type: True),
}


def make_gemm_only(backend: str, hidden_states: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   quant: Optional[QuantConfig] = None) -> Callable[[], object]:
    """For GEMM-only benchmarks: a zero-argument callable running GEMM1 + GEMM2 of `backend`
    on operands prepared once. Backends without one raise NotImplementedError."""
    if backend == "cute":
        from . import cute

        return cute.make_gemm_only(hidden_states, w1, w2, topk_weights, topk_ids, quant)
    raise NotImplementedError(f"no GEMM-only entry for backend {backend!r}")


def register_backend(name: str, run: Callable[..., torch.Tensor],
                     is_available: Callable[[str], bool]) -> None:
    """Makes ``backend=name`` runnable. ``run(hidden_states, w1, w2, topk_weights, topk_ids,
    apply_router_weight_on_input, global_num_experts, expert_map, quant)`` gets validated
    arguments with M > 0 and global_num_experts resolved; ``is_available(device_type)``."""
    if name not in _BACKEND_NAMES or name == "auto":
        _fail(f"backend name must be one of {_BACKEND_NAMES[1:]}, got {name!r}")
    _BACKENDS[name] = _Backend(run, is_available)


def available_backends(device) -> list[str]:
    """Names of the fused_experts backends that can run on ``device`` in this build."""
    device_type = device if isinstance(device, str) else device.type
    device_type = device_type.split(":")[0]
    return [name for name, b in _BACKENDS.items() if b.is_available(device_type)]


# ----------------------------------------------------------------------------- layer API
def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: Optional[torch.Tensor] = None,
    *,
    quant: Optional[QuantConfig] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The experts of an MoE layer: ``out[t] = sum_k w[t,k] * expert_{id[t,k]}(x_t)``.

    Args:
        hidden_states: ``[M, H]`` float32 / float16 / bfloat16, last-dim stride 1.
        w1: ``[E, 2I, H]`` gate rows then up rows, K-contiguous; hidden_states' dtype, or
            float8_e4m3fn with ``quant``.
        w2: ``[E, H, I]``, K-contiguous, the dtype of w1.
        topk_weights: ``[M, topk]`` f32 (f16/bf16 accepted) routing weights.
        topk_ids: ``[M, topk]`` int32/int64 global expert ids. A slot counts only if
            0 <= id < global_num_experts and (with expert_map) expert_map[id] is a local
            expert in [0, E); other slots contribute zero.
        activation: "silu" (SiLU(gate) * up).
        apply_router_weight_on_input: multiply the input row by its weight before GEMM1
            instead of the output (requires topk == 1).
        global_num_experts: number of global experts (-1: expert_map's length, else E).
        expert_map: ``[global_num_experts]`` int32/int64, global id -> local id or -1.
        quant: FP8 scheme and scales (``hopper_moe.QuantConfig``); None = unquantized.
        backend: "auto", "torch", "reference", "triton" or "cute" (module docstring).

    Returns:
        ``[M, H]`` in hidden_states' dtype, accumulated over k in fp32.

    Raises:
        RuntimeError naming the argument and the rule for any invalid argument, or when the
        requested backend is not available in this build.
    """
    global_num_experts = _validate_experts_args(
        hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
        global_num_experts, expert_map, quant, backend)
    device_type = hidden_states.device.type
    if backend == "auto":
        scheme = "bf16" if quant is None else quant.scheme
        backend = oracle.choose_backend(device_type, scheme, hidden_states.shape[0],
                                        available_backends(device_type))
    elif backend not in _BACKENDS or not _BACKENDS[backend].is_available(device_type):
        _fail(f"backend {backend!r} is not available in this build for device "
              f"{device_type!r} (available: {available_backends(device_type)})")
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, hidden_states.shape[1]))
    return _BACKENDS[backend].run(hidden_states, w1, w2, topk_weights, topk_ids,
                                  apply_router_weight_on_input, global_num_experts, expert_map,
                                  quant)


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: Optional[torch.Tensor] = None,
    *,
    quant: Optional[QuantConfig] = None,
    backend: str = "auto",
    scoring_func: str = "softmax",
) -> torch.Tensor:
    """Routing + experts: ``fused_topk(hidden_states, gating_output [M, E_global], topk,
    renormalize, scoring_func=scoring_func)`` then ``fused_experts`` with the rest of the
    arguments. Returns ``[M, H]`` in hidden_states' dtype."""
    topk_weights, topk_ids, _ = fused_topk(hidden_states, gating_output, topk, renormalize,
                                           scoring_func=scoring_func)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         apply_router_weight_on_input, global_num_experts, expert_map,
                         quant=quant, backend=backend)
