"""The scheme-dependent steps every fused_experts backend shares: prepare and the GEMM2 input.

A backend runs the layer as vLLM's modular kernels do:

    prepare   (quantize the input rows, gather them into expert order)
    experts   (GEMM1 with SiLU*mul, the quantization of GEMM2's input, GEMM2)
    finalize  (the weighted sum over the top-k slots)

The gathers, GEMMs and sums are each backend's own; what depends only on the quantization
scheme is here, once, so that every backend quantizes by the same rules (hopper_moe.quant's
docstring states them; hopper_moe.reference is held to them):

- ``router_weighted_input``: the input rows times their routing weight
  (apply_router_weight_on_input).
- ``quantize_activations``: FP8 quantization of GEMM1's input, and of GEMM2's where a
  backend quantizes it in a step of its own. One dispatch over the scheme (block: per token
  per ``block_k`` group; per token; per tensor, static or dynamic) with two implementations
  of the same rules: hopper_moe's quantization ops (the kernel backends) and plain tensor
  ops (``native=True``: the torch backend, which torch.compile must trace without custom
  ops).
- ``quantize_written_rows``: the same rules for GEMM2's input in the kernel backends, over the
  rows GEMM1 wrote only (rows of slots that do not count are never written, so never read).
- ``gemm2_input``: how GEMM2's input, the SiLU*mul output, is quantized; it decides whether
  GEMM1's epilogue writes that input itself (unquantized, or a static per-tensor scale) or
  folds its amax into a dynamic per-tensor scale (``gemm1_epilogue_scale``).
- ``weight_scale_3d`` / ``gemm_weight_scales``: the shapes of the weight scales (per tensor
  ``[E]``, per output channel ``[E, N]`` or ``[E, N, 1]``, block ``[E, N/bn, K/bk]``).
- ``dynamic_scale_floor``: a scale buffer started at the floor of dynamic scales
  (``quant.FP8_MIN_SCALE``, the one definition of that floor).
- ``local_expert_map``: expert_map with entries past the local experts made non-local (-1),
  for kernels that index the local weights with a mapped id.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from . import ops
from .quant import (FP8_MAX, FP8_MIN_SCALE, GROUP_EPS, GROUP_INV_MAX, QuantConfig,
                    abs_ignoring_nan)

__all__ = [
    "DYNAMIC_TENSOR",
    "PER_GROUP",
    "PER_TOKEN",
    "STATIC_TENSOR",
    "UNQUANTIZED",
    "dynamic_scale_floor",
    "gemm1_epilogue_scale",
    "gemm1_writes_gemm2_input",
    "gemm2_input",
    "gemm_weight_scales",
    "local_expert_map",
    "quantize_activations",
    "quantize_written_rows",
    "router_weighted_input",
    "weight_scale_3d",
]


# ----------------------------------------------------------------------------- prepare
def router_weighted_input(hidden_states: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
    """fp32 ``hidden_states [M, H] * topk_weights [M, 1]`` (apply_router_weight_on_input,
    where topk == 1): the weight is applied before GEMM1 instead of in the final sum."""
    return hidden_states.float() * topk_weights.float()


class _KernelQuant:
    """hopper_moe's quantization ops: scale ``[R, C/g]`` per group, ``[R, 1]`` per token,
    ``[1]`` per tensor."""

    @staticmethod
    def per_group(x: torch.Tensor, group: int):
        return ops.per_token_group_quant_fp8(x, group)

    @staticmethod
    def per_token(x: torch.Tensor):
        return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)

    @staticmethod
    def per_tensor(x: torch.Tensor, static_scale: Optional[torch.Tensor]):
        return ops.scaled_fp8_quant(x, static_scale)


class _NativeQuant:
    """The same rules in tensor ops on fp32 ``x``: scale ``[R, C/g]`` per group, ``[R, 1]``
    per token, ``[]`` per tensor."""

    @staticmethod
    def per_group(x: torch.Tensor, group: int):
        rows, cols = x.shape
        xg = x.reshape(rows, cols // group, group)
        scale = abs_ignoring_nan(xg).amax(dim=2, keepdim=True).clamp_min(GROUP_EPS) * \
            GROUP_INV_MAX
        q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.reshape(rows, cols), scale.reshape(rows, cols // group)

    @staticmethod
    def per_token(x: torch.Tensor):
        scale = (abs_ignoring_nan(x).amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(
            FP8_MIN_SCALE)
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

    @staticmethod
    def per_tensor(x: torch.Tensor, static_scale: Optional[torch.Tensor]):
        if static_scale is not None:
            scale = static_scale.float().reshape(())
        else:  # over all of x: callers zero the rows that must not count
            scale = (abs_ignoring_nan(x).amax() / FP8_MAX).clamp_min(FP8_MIN_SCALE)
        # Per tensor multiplies by the reciprocal, as the per-tensor quantization ops do.
        return (x * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_activations(x: torch.Tensor, quant: QuantConfig,
                         static_scale: Optional[torch.Tensor] = None, *,
                         native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [R, C]`` -> (fp8 e4m3 ``[R, C]``, scale) by the scheme of ``quant``:
    block_shape: one dynamic scale per row per ``block_shape[1]`` columns; per_act_token_quant:
    one dynamic scale per row; otherwise one scale for the tensor, ``static_scale`` when given,
    else dynamic. native: tensor ops on fp32 ``x`` (traceable; per-tensor scale ``[]``)
    instead of hopper_moe's ops (per-tensor scale ``[1]``)."""
    impl = _NativeQuant if native else _KernelQuant
    if quant.block_shape is not None:
        return impl.per_group(x, int(quant.block_shape[1]))
    if quant.per_act_token_quant:
        return impl.per_token(x)
    return impl.per_tensor(x, static_scale)


# ----------------------------------------------------------------------------- GEMM2's input
UNQUANTIZED = "unquantized"        # GEMM1 writes it in the layer's 16-bit dtype
STATIC_TENSOR = "static_tensor"    # static a2_scale: GEMM1's epilogue writes FP8 with it
DYNAMIC_TENSOR = "dynamic_tensor"  # one dynamic scale over the counted slots' rows
PER_TOKEN = "per_token"            # one dynamic scale per slot row
PER_GROUP = "per_group"            # one dynamic scale per slot row per block_k columns


def gemm2_input(quant: Optional[QuantConfig]) -> str:
    """How GEMM2's input (the SiLU*mul output ``[S, I]``) is quantized: one of UNQUANTIZED,
    STATIC_TENSOR, DYNAMIC_TENSOR, PER_TOKEN, PER_GROUP."""
    if quant is None:
        return UNQUANTIZED
    if quant.block_shape is not None:
        return PER_GROUP
    if quant.per_act_token_quant:
        return PER_TOKEN
    return STATIC_TENSOR if quant.a2_scale is not None else DYNAMIC_TENSOR


def gemm1_writes_gemm2_input(quant: Optional[QuantConfig]) -> bool:
    """Whether GEMM1's epilogue can write GEMM2's input itself: unquantized, or quantized with
    a scale known before GEMM1 runs (a static per-tensor a2_scale). Otherwise a quantization
    step runs between the GEMMs."""
    return gemm2_input(quant) in (UNQUANTIZED, STATIC_TENSOR)


def quantize_written_rows(act: torch.Tensor, quant: QuantConfig,
                          static_scale: Optional[torch.Tensor], **rows
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM2's input from GEMM1's 16-bit SiLU*mul output ``act [S, I]`` where a quantization
    step runs between the GEMMs (gemm1_writes_gemm2_input is False): (fp8 ``[S, I]``, scale)
    as quantize_activations(act, quant, static_scale) gives them, but only the rows GEMM1
    wrote are read and written (``rows``: ops.fp8_quant_rows' slot_ids / expert_map /
    num_experts, or row_end). Dynamic per tensor: ``static_scale`` is the scale GEMM1's
    epilogue completed (gemm1_epilogue_scale)."""
    kind = gemm2_input(quant)
    if kind == DYNAMIC_TENSOR:
        return ops.fp8_quant_rows(act, "static_tensor", static_scale, **rows)
    if kind == PER_TOKEN:
        return ops.fp8_quant_rows(act, "per_token", **rows)
    if kind == PER_GROUP:
        return ops.fp8_quant_rows(act, "per_group", group_size=int(quant.block_shape[1]), **rows)
    raise RuntimeError(f"quantize_written_rows: GEMM1 writes GEMM2's input itself ({kind})")


def dynamic_scale_floor(device) -> torch.Tensor:
    """``[1]`` f32 holding the smallest scale a dynamic per-tensor quantization produces: a
    kernel that maxes ``amax / 448`` into it leaves the dynamic scale there."""
    return torch.full((1,), FP8_MIN_SCALE, dtype=torch.float32, device=device)


def gemm1_epilogue_scale(quant: Optional[QuantConfig], device) -> Optional[torch.Tensor]:
    """The ``[1]`` f32 scale GEMM1's SiLU*mul epilogue takes for GEMM2's input: with a static
    per-tensor a2_scale that scale (the epilogue quantizes with it); with a dynamic per-tensor
    one a new dynamic_scale_floor buffer (the epilogue maxes the amax of the rows it writes
    into it, which makes it the dynamic scale of exactly the counted rows, and a static
    quantization with it follows); None otherwise."""
    kind = gemm2_input(quant)
    if kind == STATIC_TENSOR:
        return quant.a2_scale.float().reshape(1).contiguous()
    if kind == DYNAMIC_TENSOR:
        return dynamic_scale_floor(device)
    return None


# ----------------------------------------------------------------------------- weight scales
def weight_scale_3d(scale: torch.Tensor, w: torch.Tensor, quant: QuantConfig) -> torch.Tensor:
    """The scale of weights ``w [E, N, K]`` as a 3-D view that broadcasts over w's blocks:
    ``[E, 1, 1]`` per tensor, ``[E, N, 1]`` per output channel, ``[E, ceil(N/bn),
    ceil(K/bk)]`` block-wise (as given)."""
    if quant.block_shape is not None:
        return scale
    e, n = w.shape[0], w.shape[1]
    return scale.reshape(e, n, 1) if quant.per_out_ch_quant else scale.reshape(e, 1, 1)


def gemm_weight_scales(scale: torch.Tensor, w: torch.Tensor,
                       quant: QuantConfig) -> torch.Tensor:
    """The weight-scale operand of hopper_moe's grouped GEMM ops: ``[E]`` per tensor or
    ``[E, N]`` per output channel, f32, contiguous."""
    e, n = w.shape[0], w.shape[1]
    shape = (e, n) if quant.per_out_ch_quant else (e,)
    return scale.float().reshape(shape).contiguous()


# expert_map -> (its version counter, num_local, the local map): a layer passes the same map
# on every call, and the map costs four launches to make. Keyed weakly by the tensor object, so
# an entry dies with its map; the version counter catches in-place changes.
_LOCAL_MAPS = WeakTensorKeyDictionary()


def local_expert_map(expert_map: torch.Tensor, num_local: int) -> torch.Tensor:
    """expert_map with every entry outside [0, num_local) set to -1 (a non-local expert), as
    int32 (what the kernels and ops take; int64 maps are accepted by the API), and padded with
    -1 to num_local entries when shorter (ids past the map count for nothing; the ops that take
    a map count experts by its length and need every local id below it): kernels that index
    the local weights with a mapped id need no bound.
    Made once per map (and again after an in-place change of it); under torch.compile, a CUDA
    graph capture or for an inference-mode tensor it is computed in place of the cache."""
    # An inference tensor has no version counter: an in-place change could not be seen, so
    # its map is computed on every call.
    cacheable = not torch.compiler.is_compiling() and not expert_map.is_inference() and not (
        expert_map.is_cuda and torch.cuda.is_current_stream_capturing())
    if cacheable:
        hit = _LOCAL_MAPS.get(expert_map)
        if hit is not None and hit[0] == expert_map._version and hit[1] == num_local:
            return hit[2]
    inside = (expert_map >= 0) & (expert_map < num_local)
    local = torch.where(inside, expert_map, torch.full_like(expert_map, -1)).to(torch.int32)
    if local.shape[0] < num_local:
        local = torch.cat([local, local.new_full((num_local - local.shape[0],), -1)])
    if cacheable:
        _LOCAL_MAPS[expert_map] = (expert_map._version, num_local, local)
    return local
