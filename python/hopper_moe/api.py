"""The MoE layer API: ``fused_topk``, ``fused_experts``, ``fused_moe`` (vLLM's signatures),
the backend registry (``register_backend``, ``available_backends``) and argument validation.

This module is ``hopper_moe.api``, not ``hopper_moe.fused_moe``: the package's attribute
``fused_moe`` is the function (``hopper_moe.fused_moe(x, w1, w2, ...)``, as in vLLM), and a
submodule of that name would be shadowed by it (``import hopper_moe.fused_moe`` would give
the function or the module depending on import order). The package re-exports the public
names; import this module as ``hopper_moe.api`` for the rest (``make_gemm_only``).

Notation: M tokens, H hidden size, E local experts (w1.shape[0]), I intermediate size per
expert, topk experts per token, S = M * topk (token, k) slots.

Backends of ``fused_experts`` (one module each under ``hopper_moe.backends``; the steps they
share are in ``hopper_moe.prepare``):

- ``"reference"``: ``hopper_moe.reference.fused_experts_ref`` (fp32, loop over experts).
- ``"torch"``: PyTorch-native grouped GEMMs (``torch._grouped_mm``), the baseline.
- ``"triton"``: one Triton grouped GEMM with SiLU*mul in GEMM1's epilogue; CUDA, or the CPU
  under TRITON_INTERPRET=1.
- ``"sm90"`` (also accepted as ``"cute"``): the layer around hopper_moe's SM90 grouped GEMM
  ops; an SM90 GPU, or their CPU definitions.
- ``"auto"``: ``oracle.choose`` (measured tables, else static rules) over the available
  backends that support the call; ``explain_backend`` says what it picks and why.

``register_backend`` replaces a backend's entry (tests, experiments).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import oracle
from .backends import reference as _reference_backend
from .backends import sm90 as _sm90_backend
from .backends import torch as _torch_backend
from .backends import triton as _triton_backend
from .quant import QuantConfig

__all__ = [
    "BACKEND_ALIASES",
    "available_backends",
    "explain_backend",
    "fused_experts",
    "fused_moe",
    "fused_topk",
    "make_gemm_only",
    "register_backend",
]

_HIDDEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_WEIGHT_DTYPES = _HIDDEN_DTYPES + (torch.float8_e4m3fn,)
_ID_DTYPES = (torch.int32, torch.int64)
_INDICES_TYPES = (torch.int32, torch.int64, torch.uint32)
_BACKEND_NAMES = ("auto", "torch", "reference", "triton", "sm90")
# Other names accepted wherever a backend name is. "cute": the SM90 backend, after CuTe, the
# CUTLASS layer its kernels are written in (benchmarks and scripts pass this name).
BACKEND_ALIASES = {"cute": "sm90"}
# The names that run the SM90 layer op directly (fused_experts' fast path).
_SM90_NAMES = ("sm90",) + tuple(a for a, b in BACKEND_ALIASES.items() if b == "sm90")


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


def _canonical(name):
    return BACKEND_ALIASES.get(name, name) if isinstance(name, str) else name


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


def _checked_quant(quant, w1, w2, act_dtype: torch.dtype, act_name: str):
    """quant checked against the weights (QuantConfig.resolve + validate; resolved returned),
    or, without it, the weights of the activations' dtype."""
    if quant is None:
        if w1.dtype != act_dtype:
            _fail(f"w1 must have the dtype of {act_name} ({act_dtype}) when quant is None, got "
                  f"{w1.dtype}")
        return None
    if not isinstance(quant, QuantConfig):
        _fail(f"quant must be None or a hopper_moe.QuantConfig, got {type(quant).__name__}")
    quant = quant.resolve(w1)
    quant.validate(w1, w2)
    return quant


def _validate_experts_args(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                           apply_router_weight_on_input, global_num_experts, expert_map,
                           quant, backend) -> int:
    """Checks every argument of fused_experts; returns the resolved global_num_experts and
    quant (QuantConfig.resolve: what vLLM infers from the scales' shapes made explicit)."""
    if _canonical(backend) not in _BACKEND_NAMES:
        _fail(f"backend must be one of {_BACKEND_NAMES} (or an alias in "
              f"{tuple(BACKEND_ALIASES)}), got {backend!r}")
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
    quant = _checked_quant(quant, w1, w2, hidden_states.dtype, "hidden_states")
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
    if global_num_experts != -1 and global_num_experts < 1:
        _fail(f"global_num_experts must be -1 or >= 1, got {global_num_experts}")
    if expert_map is None:
        # As vLLM: without expert_map every physical expert of w1 is computed, whatever
        # global_num_experts says. Fewer routed than physical experts is how engines fuse
        # shared experts (ids in [global_num_experts, E) are the shared ones); a larger
        # global_num_experts leaves ids in [E, global_num_experts) non-local (zero).
        global_num_experts = num_experts
    return global_num_experts, quant


# ----------------------------------------------------------------------------- backends
def _supports_all(device, dtype, w1, w2, quant) -> bool:
    return True


@dataclass(frozen=True)
class _Backend:
    run: Callable[..., torch.Tensor]
    is_available: Callable[[str], bool]
    make_gemm_only: Optional[Callable[..., Callable[[], object]]] = None
    # run(..., out=tensor) writes the result into it (else fused_experts copies it there).
    writes_out: bool = False
    # supports(device, dtype, w1, w2, quant): can it run this layer (asked by "auto" only)?
    supports: Callable[..., bool] = _supports_all


_BACKENDS: dict[str, _Backend] = {
    "torch": _Backend(_torch_backend.run, _torch_backend.is_available),
    "reference": _Backend(_reference_backend.run, _reference_backend.is_available),
    "triton": _Backend(_triton_backend.run, _triton_backend.is_available, writes_out=True,
                       supports=_triton_backend.supports),
    "sm90": _Backend(_sm90_backend.run, _sm90_backend.is_available,
                     _sm90_backend.make_gemm_only, writes_out=True,
                     supports=_sm90_backend.supports),
}


def make_gemm_only(backend: str, hidden_states: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   quant: Optional[QuantConfig] = None) -> Callable[[], object]:
    """For GEMM-only benchmarks: a zero-argument callable running GEMM1 + GEMM2 of `backend`
    on operands prepared once. Backends without one raise NotImplementedError."""
    entry = _BACKENDS.get(_canonical(backend))
    if entry is None or entry.make_gemm_only is None:
        raise NotImplementedError(f"no GEMM-only entry for backend {backend!r}")
    return entry.make_gemm_only(hidden_states, w1, w2, topk_weights, topk_ids, quant)


def register_backend(name: str, run: Callable[..., torch.Tensor],
                     is_available: Callable[[str], bool],
                     make_gemm_only: Optional[Callable[..., Callable[[], object]]] = None,
                     supports: Callable[..., bool] = _supports_all) -> None:
    """Makes ``backend=name`` runnable (an alias names the backend it stands for).
    ``run(hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
    global_num_experts, expert_map, quant)`` gets validated arguments with M > 0 and
    global_num_experts resolved; ``is_available(device_type)``; ``make_gemm_only`` as
    ``hopper_moe.backends.sm90.make_gemm_only``; ``supports(device, dtype, w1, w2, quant)``
    whether it runs that layer (``auto`` asks)."""
    name = _canonical(name)
    if name not in _BACKEND_NAMES or name == "auto":
        _fail(f"backend name must be one of {_BACKEND_NAMES[1:]} (or an alias in "
              f"{tuple(BACKEND_ALIASES)}), got {name!r}")
    _BACKENDS[name] = _Backend(run, is_available, make_gemm_only, supports=supports)
    _AVAILABLE.clear()
    _choice.cache_clear()


def available_backends(device) -> list[str]:
    """Names of the fused_experts backends that can run on ``device`` in this build."""
    device_type = device if isinstance(device, str) else device.type
    device_type = device_type.split(":")[0]
    return [name for name, b in _BACKENDS.items() if b.is_available(device_type)]


# Per device type: available_backends, asked once (availability is fixed for the process;
# register_backend clears it).
_AVAILABLE: dict[str, tuple[str, ...]] = {}
_DEVICE_NAMES: dict[int, str] = {}


def _available(device_type: str) -> tuple[str, ...]:
    names = _AVAILABLE.get(device_type)
    if names is None:
        names = _AVAILABLE[device_type] = tuple(available_backends(device_type))
    return names


def _device_name(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _DEVICE_NAMES.get(index)
    if name is None:
        name = _DEVICE_NAMES[index] = torch.cuda.get_device_name(index)
    return name


# One entry per distinct call signature and token count: warmup() fills it for every token
# count up to its max_num_tokens, so that a first call at a new token count while serving does
# no oracle work (a miss costs tens of µs of Python).
@functools.lru_cache(maxsize=1 << 17)
def _choice(device_type: str, device_name: Optional[str], scheme: str, num_tokens: int,
            supported: tuple[str, ...], shape: oracle.LayerShape) -> oracle.Choice:
    measured = oracle.load_measured(device_name) if device_name is not None else None
    return oracle.choose(device_type, scheme, num_tokens, supported, shape, measured)


def _auto_choice(device: torch.device, dtype: torch.dtype, num_tokens: int, w1, w2,
                 top_k: int, quant) -> oracle.Choice:
    supported = tuple(n for n in _available(device.type)
                      if _BACKENDS[n].supports(device, dtype, w1, w2, quant))
    scheme = "bf16" if quant is None else quant.scheme
    shape = (w1.shape[0], top_k, w1.shape[2], w2.shape[2])
    return _choice(device.type, _device_name(device), scheme, num_tokens, supported, shape)


def explain_backend(num_tokens: int, w1: torch.Tensor, w2: torch.Tensor, top_k: int, *,
                    quant: Optional[QuantConfig] = None,
                    dtype: torch.dtype = torch.bfloat16) -> oracle.Choice:
    """What ``fused_experts(backend="auto")`` runs for ``num_tokens`` tokens of ``dtype``
    routed ``top_k`` ways through experts w1 ``[E, 2I, H]`` / w2 ``[E, H, I]`` (on their
    device), and why: ``choice.backend``, ``choice.source`` ("measured" or "static") and
    ``choice.reason`` (the table row and its times, or the rule); ``print(choice)`` reads as
    one line."""
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3 or \
            not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        _fail("w1 and w2 must be 3-D tensors [E, 2I, H] and [E, H, I]")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        _fail(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        _fail(f"top_k must be an int >= 1, got {top_k!r}")
    if dtype not in _HIDDEN_DTYPES:
        _fail(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    num_experts, n1, hidden_size = w1.shape
    if num_experts < 1 or n1 == 0 or n1 % 2 or \
            tuple(w2.shape) != (num_experts, hidden_size, n1 // 2):
        _fail(f"w1 [E, 2I, H] and w2 [E, H, I] must agree (E >= 1, I >= 1), got "
              f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    quant = _checked_quant(quant, w1, w2, dtype, "the hidden states")
    return _auto_choice(w1.device, dtype, num_tokens, w1, w2, top_k, quant)


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
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The experts of an MoE layer: ``out[t] = sum_k w[t,k] * expert_{id[t,k]}(x_t)``.

    Args:
        hidden_states: ``[M, H]`` float32 / float16 / bfloat16, last-dim stride 1.
        w1: ``[E, 2I, H]`` gate rows then up rows, K-contiguous; hidden_states' dtype, or
            float8_e4m3fn with ``quant``.
        w2: ``[E, H, I]``, K-contiguous, the dtype of w1.
        topk_weights: ``[M, topk]`` f32 (f16/bf16 accepted) routing weights.
        topk_ids: ``[M, topk]`` int32/int64 (uint32 read as int32) global expert ids. A
            slot counts only if (with expert_map) 0 <= id < global_num_experts and
            expert_map[id] is a local expert in [0, E), or (without) 0 <= id < E; other
            slots contribute zero.
        activation: "silu" (SiLU(gate) * up).
        apply_router_weight_on_input: multiply the input row by its weight before GEMM1
            instead of the output (requires topk == 1).
        global_num_experts: number of global experts (-1: expert_map's length, else E).
            Without expert_map it does not change the result (vLLM's rule): all E experts
            of w1 are computed, also when fewer are routed (fused shared experts).
        expert_map: ``[global_num_experts]`` int32/int64, global id -> local id or -1.
        quant: FP8 scheme and scales (``hopper_moe.QuantConfig``); None = unquantized.
        backend: "auto", "torch", "reference", "triton" or "sm90" (alias "cute"; module
            docstring).
        out: optional ``[M, H]`` tensor of hidden_states' dtype and device, last-dim stride
            1, sharing no memory with the other arguments: the result is written into it
            (the "triton" and "sm90" backends write it there directly, the others copy).

    Returns:
        ``[M, H]`` in hidden_states' dtype, accumulated over k in fp32 (``out`` when given).

    Raises:
        RuntimeError naming the argument and the rule for any invalid argument, or when the
        requested backend is not available in this build.
    """
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dtype == torch.uint32:
        # fused_topk(indices_type=torch.uint32)'s ids, read as int32: the same ids, and one
        # past 2^31 - 1 reads as negative, out of range either way (it counts for nothing).
        topk_ids = topk_ids.view(torch.int32)
    if backend in _SM90_NAMES and _sm90_direct(hidden_states, w1, w2, topk_weights, topk_ids,
                                                activation, apply_router_weight_on_input,
                                                global_num_experts, expert_map, quant, out):
        # One op call: torch.ops.hopper_moe.fused_experts_sm90 checks every argument itself
        # (the same rules, a RuntimeError naming the argument) and runs the layer in C++.
        return _sm90_backend.fused_experts_sm90(
            hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
            global_num_experts, expert_map, quant, out)
    global_num_experts, quant = _validate_experts_args(
        hidden_states, w1, w2, topk_weights, topk_ids, activation, apply_router_weight_on_input,
        global_num_experts, expert_map, quant, backend)
    device_type = hidden_states.device.type
    name = _canonical(backend)
    if name == "auto":
        name = _auto_choice(hidden_states.device, hidden_states.dtype, hidden_states.shape[0],
                            w1, w2, topk_ids.shape[1], quant).backend
    elif name not in _BACKENDS or not _BACKENDS[name].is_available(device_type):
        _fail(f"backend {backend!r} is not available in this build for device "
              f"{device_type!r} (available: {available_backends(device_type)})")
    if out is not None:
        _check_out(out, hidden_states, (w1, w2, topk_weights, topk_ids, expert_map, quant))
    if hidden_states.shape[0] == 0:
        return hidden_states.new_empty((0, hidden_states.shape[1])) if out is None else out
    entry = _BACKENDS[name]
    if out is not None and entry.writes_out:
        return entry.run(hidden_states, w1, w2, topk_weights, topk_ids,
                         apply_router_weight_on_input, global_num_experts, expert_map, quant,
                         out=out)
    result = entry.run(hidden_states, w1, w2, topk_weights, topk_ids,
                       apply_router_weight_on_input, global_num_experts, expert_map, quant)
    return result if out is None else out.copy_(result)


def _sm90_direct(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                 apply_router_weight_on_input, global_num_experts, expert_map, quant,
                 out) -> bool:
    """Whether fused_experts(backend="sm90") may hand the call to the SM90 layer op as it is:
    the registered backend is the op's, and every argument is of a type the op's schema takes
    (the op checks the rest). Otherwise the Python validation runs and names what is wrong."""
    entry = _BACKENDS.get("sm90")
    return (entry is not None and entry.run is _sm90_backend.run and activation == "silu"
            and isinstance(hidden_states, torch.Tensor) and isinstance(w1, torch.Tensor)
            and isinstance(w2, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
            and isinstance(topk_ids, torch.Tensor)
            and (expert_map is None or isinstance(expert_map, torch.Tensor))
            and (out is None or isinstance(out, torch.Tensor))
            and type(apply_router_weight_on_input) is bool
            and type(global_num_experts) is int
            and (quant is None or (isinstance(quant, QuantConfig)
                                   and quant.quant_dtype == torch.float8_e4m3fn
                                   and quant.block_shape is None
                                   and isinstance(quant.w1_scale, torch.Tensor)
                                   and isinstance(quant.w2_scale, torch.Tensor)
                                   and (quant.a1_scale is None
                                        or isinstance(quant.a1_scale, torch.Tensor))
                                   and (quant.a2_scale is None
                                        or isinstance(quant.a2_scale, torch.Tensor)))))


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last] byte addresses a tensor's elements can occupy."""
    start = t.data_ptr()
    extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return start, start + (extent + 1) * t.element_size() - 1


def _check_out(out, hidden_states: torch.Tensor, others) -> None:
    """out: [M, H] of hidden_states' dtype and device, unit last stride, no element written
    twice, no memory shared with any input (the kernels read the inputs while writing it)."""
    _check_tensor("out", out, 2, hidden_states.device)
    if tuple(out.shape) != tuple(hidden_states.shape):
        _fail(f"out must have the shape of hidden_states {tuple(hidden_states.shape)}, got "
              f"{tuple(out.shape)}")
    if out.dtype != hidden_states.dtype:
        _fail(f"out must have the dtype of hidden_states ({hidden_states.dtype}), got "
              f"{out.dtype}")
    if out.numel() == 0:
        return
    if out.stride(1) != 1 or (out.shape[0] > 1 and out.stride(0) < out.shape[1]):
        _fail(f"out must have last-dim stride 1 and rows that do not overlap, got strides "
              f"{tuple(out.stride())}")
    lo, hi = _storage_span(out)
    tensors = [hidden_states] + [t for t in others if isinstance(t, torch.Tensor)]
    quant = others[-1]
    if isinstance(quant, QuantConfig):
        tensors += [t for t in (quant.w1_scale, quant.w2_scale, quant.a1_scale,
                                quant.a2_scale) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.numel() and t.device == out.device and \
                t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            t_lo, t_hi = _storage_span(t)
            if t_lo <= hi and lo <= t_hi:
                _fail("out must not share memory with hidden_states, the weights, the "
                      "routing tensors or the scales")


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
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routing + experts: ``fused_topk(hidden_states, gating_output [M, E_global], topk,
    renormalize, scoring_func=scoring_func)`` then ``fused_experts`` with the rest of the
    arguments (``out`` as there). Returns ``[M, H]`` in hidden_states' dtype."""
    # The router scores every global expert: a narrower or wider gating_output would route
    # to experts that do not exist (silently dropped) or never route to some that do.
    # The number of global experts as fused_experts counts them: global_num_experts, else
    # expert_map's length, else w1.size(0).
    if global_num_experts != -1:
        num_global, source = global_num_experts, "global_num_experts"
    elif isinstance(expert_map, torch.Tensor) and expert_map.dim() == 1:
        num_global, source = expert_map.shape[0], "expert_map.size(0)"
    else:
        num_global, source = (w1.shape[0] if isinstance(w1, torch.Tensor) and w1.dim() == 3
                              else None), "w1.size(0)"
    if isinstance(gating_output, torch.Tensor) and gating_output.dim() == 2 and \
            num_global is not None and gating_output.shape[1] != num_global:
        _fail(f"gating_output.size(1) must be the number of experts "
              f"({source} = {num_global}), got {gating_output.shape[1]}")
    topk_weights, topk_ids, _ = fused_topk(hidden_states, gating_output, topk, renormalize,
                                           scoring_func=scoring_func)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         apply_router_weight_on_input, global_num_experts, expert_map,
                         quant=quant, backend=backend, out=out)
