"""hopper_moe as a vLLM plugin: ``HopperMoeExperts``, experts of vLLM's modular MoE kernel
(``FusedMoEExpertsModular``) that run ``hopper_moe.fused_experts``.

vLLM calls ``register`` in each of its processes (entry point ``vllm.general_plugins`` in
pyproject.toml). With ``HOPPER_MOE=1`` (``settings.ENABLE_VLLM_PLUGIN``) it installs two hooks:

- Unquantized layers: ``HopperMoeUnquantizedFusedMoEMethod`` is registered in place of vLLM's
  ``UnquantizedFusedMoEMethod`` (``CustomOp.register_oot``). It keeps vLLM's backend choice and
  swaps ``TritonExperts`` for ``HopperMoeExperts`` where vLLM chose its Triton backend.
- FP8 layers (per-tensor, per-channel x per-token, block [128, 128]): ``HopperMoeExperts`` is
  put ahead of ``TritonExperts`` in the Triton slot of vLLM's FP8 backend selection, by
  wrapping ``vllm.model_executor.layers.fused_moe.oracle.fp8.backend_to_kernel_cls``. That is
  a vLLM-internal function, not an API: the hook is tested with vLLM 0.33.0 only.

Either way vLLM's ``is_supported_config`` still decides per layer: a layer HopperMoeExperts
does not cover (expert bias, SwiGLU limit / alpha / beta, LoRA, an activation other than SiLU,
all2all or DP dispatch, another quantization scheme or dtype) keeps vLLM's ``TritonExperts``.

vLLM is imported on first use only: by ``register`` with the switch on, or by reading
``HopperMoeExperts`` / ``HopperMoeUnquantizedFusedMoEMethod`` (module attributes made on
demand, as their base classes are vLLM's). The module imports without vLLM installed.
"""
from __future__ import annotations

import functools
import importlib
import logging
from types import SimpleNamespace
from typing import Any, Optional

import torch

import hopper_moe

from . import settings
from .quant import QuantConfig

__all__ = [
    "HopperMoeExperts",
    "HopperMoeUnquantizedFusedMoEMethod",
    "experts_by_layer",
    "hopper_quant_config",
    "register",
]

# A child of vLLM's "vllm" logger, the one vLLM gives a handler: INFO lines of a logger with
# another name would not be printed.
_LOG = logging.getLogger("vllm.hopper_moe")
_LOGGED: set[str] = set()

_FP8_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.fp8"
_CLASS_NAMES = ("HopperMoeExperts", "HopperMoeUnquantizedFusedMoEMethod")
_BLOCK = 128  # the block FP8 layout hopper_moe is tuned for: [128, 128] weights, 1 x 128 acts
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# FusedMoEQuantConfig fields hopper_moe has no use for: set, they would be silently ignored.
_UNSUPPORTED_QUANT_FIELDS = ("w1_bias", "w2_bias", "w1_zp", "w2_zp", "a1_gscale", "a2_gscale",
                             "g1_alphas", "g2_alphas", "gemm1_alpha", "gemm1_beta",
                             "gemm1_clamp_limit")
# FusedMoEConfig fields that change the activation or add a bias.
_UNSUPPORTED_LAYER_FIELDS = ("swiglu_limit", "swiglu_alpha", "swiglu_beta",
                             "activation_situ_beta", "activation_situ_linear_beta")


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


def _log_once(message: str) -> None:
    """INFO `message` the first time it comes (one line per layer configuration, not per layer)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        _LOG.info(message)


# ----------------------------------------------------------------------------- vLLM, lazily
@functools.lru_cache(maxsize=None)
def _vllm() -> SimpleNamespace:
    """The vLLM modules and names this module uses, imported on first use."""
    mk = importlib.import_module("vllm.model_executor.layers.fused_moe.modular_kernel")
    return SimpleNamespace(
        mk=mk,
        platforms=importlib.import_module("vllm.platforms"),
        quant_utils=importlib.import_module(
            "vllm.model_executor.layers.quantization.utils.quant_utils"),
        MoEActivation=importlib.import_module(
            "vllm.model_executor.layers.fused_moe.activation").MoEActivation,
        TopKWeightAndReduceNoOP=importlib.import_module(
            "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce"
        ).TopKWeightAndReduceNoOP,
        TritonExperts=importlib.import_module(
            "vllm.model_executor.layers.fused_moe.experts.triton_moe").TritonExperts,
        unquantized_oracle=importlib.import_module(
            "vllm.model_executor.layers.fused_moe.oracle.unquantized"),
        UnquantizedFusedMoEMethod=importlib.import_module(
            "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
        ).UnquantizedFusedMoEMethod,
    )


@functools.lru_cache(maxsize=None)
def _supported_quant_keys() -> frozenset:
    """The (weight, activation) QuantKey pairs of vLLM that hopper_moe runs."""
    q = _vllm().quant_utils
    return frozenset({
        (None, None),  # unquantized
        (q.kFp8StaticTensorSym, q.kFp8StaticTensorSym),  # per-tensor, static activations
        (q.kFp8StaticTensorSym, q.kFp8DynamicTensorSym),  # per-tensor, dynamic activations
        (q.kFp8StaticTensorSym, q.kFp8DynamicTokenSym),  # per-tensor weights, per-token acts
        (q.kFp8StaticChannelSym, q.kFp8DynamicTokenSym),  # per-channel x per-token
        (q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym),  # block [128, 128] x 1 x 128 groups
    })


# ----------------------------------------------------------------------------- quant config
def hopper_quant_config(quant_config: Any) -> Optional[QuantConfig]:
    """``hopper_moe.QuantConfig`` of vLLM's ``FusedMoEQuantConfig`` (None: unquantized).

    The scales are vLLM's tensors (no copy), so a weight reload that updates them in place is
    seen. Raises RuntimeError naming the field for what hopper_moe does not run: a quantized
    dtype other than float8_e4m3fn, biases, zero points, global scales, alphas, a SwiGLU clamp.
    """
    for name in _UNSUPPORTED_QUANT_FIELDS:
        if getattr(quant_config, name) is not None:
            _fail(f"quant_config.{name} must be None for HopperMoeExperts (hopper_moe runs "
                  "SiLU(gate) * up without biases, zero points, global scales or clamps)")
    if quant_config.quant_dtype is None and quant_config.weight_quant_dtype is None:
        return None
    for name in ("quant_dtype", "weight_quant_dtype"):
        if getattr(quant_config, name) != torch.float8_e4m3fn:
            _fail(f"quant_config.{name} must be None or torch.float8_e4m3fn for "
                  f"HopperMoeExperts, got {getattr(quant_config, name)}")
    block = quant_config.block_shape
    per_channel = quant_config.per_out_ch_quant
    w1_scale, w2_scale = quant_config.w1_scale, quant_config.w2_scale
    if block is None and not per_channel:
        w1_scale, w2_scale = _per_expert(w1_scale), _per_expert(w2_scale)
    return QuantConfig(
        w1_scale=w1_scale, w2_scale=w2_scale,
        a1_scale=quant_config.a1_scale, a2_scale=quant_config.a2_scale,
        per_act_token_quant=quant_config.per_act_token_quant, per_out_ch_quant=per_channel,
        block_shape=None if block is None else [int(b) for b in block])


def _per_expert(scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A per-tensor weight scale as hopper_moe takes it, ``[E]`` (vLLM may keep ``[E, 1]``).
    Any other shape is passed on for QuantConfig.validate to reject by name."""
    if isinstance(scale, torch.Tensor) and scale.dim() > 1 and scale.numel() == scale.shape[0]:
        return scale.reshape(-1)
    return scale


def _check_activation_config(config: Any) -> None:
    """vLLM's ApplyMoEActivationConfig must be plain SiLU(gate) * up (no clamp, alpha, beta)."""
    for name, plain in (("clamp_limit", None), ("alpha", 1.0), ("beta", 0.0),
                        ("activation_situ_beta", None), ("activation_situ_linear_beta", None)):
        if getattr(config, name) != plain:
            _fail(f"activation_config.{name} must be {plain} for HopperMoeExperts (plain "
                  f"SiLU(gate) * up), got {getattr(config, name)}")


# ----------------------------------------------------------------------------- layer support
def _unsupported_layer_reason(moe_config: Any, weight_key: Any) -> Optional[str]:
    """Why HopperMoeExperts cannot run this layer (vLLM's phrasing), or None."""
    if moe_config.has_bias:
        return "kernel does not support expert bias"
    for name in _UNSUPPORTED_LAYER_FIELDS:
        if getattr(moe_config, name) is not None:
            return f"kernel does not support {name} = {getattr(moe_config, name)}"
    if moe_config.in_dtype not in _ACT_DTYPES:
        return f"kernel does not support activation dtype {moe_config.in_dtype}"
    if weight_key == _vllm().quant_utils.kFp8Static128BlockSym:
        sizes = (("hidden size", moe_config.hidden_dim),
                 ("intermediate size per partition", moe_config.intermediate_size_per_partition))
        for what, size in sizes:
            if size % _BLOCK:
                return f"kernel does not support block FP8 with {what} {size} (not a multiple " \
                       f"of {_BLOCK})"
    return None


def _describe_layer(moe_config: Any, quant: Optional[QuantConfig]) -> str:
    """The layer configuration in the INFO line that says HopperMoeExperts runs it."""
    scheme = "bf16" if quant is None else quant.scheme
    if quant is not None and quant.scheme == "fp8_tensor":
        scheme += " (static activation scales)" if quant.a1_scale is not None else " (dynamic)"
    return (f"{scheme}, {moe_config.in_dtype}, {moe_config.num_local_experts} local of "
            f"{moe_config.num_experts} experts, top-{moe_config.experts_per_token}, hidden "
            f"{moe_config.hidden_dim}, intermediate {moe_config.intermediate_size_per_partition}")


# ----------------------------------------------------------------------------- the experts
class _HopperMoeExperts:
    """vLLM modular-kernel experts (``FusedMoEExpertsModular``) running
    ``hopper_moe.fused_experts``.

    Standard activation format ([M, H] tokens); CUDA SM90, or the CPU (tests); SiLU(gate) * up
    only; no all2all, DP or context-parallel dispatch (an expert_map is fine); quant schemes in
    ``_supported_quant_keys``. Takes unquantized inputs (hopper_moe quantizes the activations
    itself), needs no workspaces and applies the router weights and the top-k reduction
    itself (``TopKWeightAndReduceNoOP``). Compiles what the layer can reach
    (``hopper_moe.warmup``) once: when vLLM hands over the loaded layer
    (``process_weights_after_loading``), or else on its first ``apply`` (vLLM's profiling run).
    """

    def __init__(self, moe_config: Any, quant_config: Any, max_num_tokens: Optional[int] = None,
                 num_dispatchers: Optional[int] = None):
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self.hopper_quant = hopper_quant_config(quant_config)
        _check_activation_config(self.activation_config)
        self._warm = False
        _log_once("hopper_moe: HopperMoeExperts runs MoE layers with "
                  + _describe_layer(moe_config, self.hopper_quant))

    # --- what vLLM's backend selection asks (is_supported_config and its parts)
    @staticmethod
    def activation_format() -> Any:
        return _vllm().mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def is_supported_config(cls: Any, moe_config: Any, weight_key: Any, activation_key: Any,
                            activation_format: Any) -> tuple[bool, Optional[str]]:
        """vLLM's checks (device, activation, quant scheme, parallel config, LoRA, ...), then
        hopper_moe's own: no bias, no SwiGLU limit/alpha/beta, a float activation dtype, and
        for block FP8 hidden and intermediate sizes that are multiples of 128."""
        supported, reason = _vllm().mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format)
        if supported:
            reason = _unsupported_layer_reason(moe_config, weight_key)
            supported = reason is None
        if not supported:
            _log_once(f"hopper_moe: HopperMoeExperts not used for a layer: {reason} "
                      "(vLLM takes its next candidate)")
        return supported, reason

    @staticmethod
    def _supports_current_device() -> bool:
        platform = _vllm().platforms.current_platform
        return platform.is_cpu() or (platform.is_cuda() and platform.is_device_capability(90))

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return (weight_key, activation_key) in _supported_quant_keys()

    @staticmethod
    def _supports_activation(activation: Any) -> bool:
        return activation == _vllm().MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: Any) -> bool:
        p = moe_parallel_config
        return not (p.use_all2all_kernels or p.use_passthrough_all2all or p.dp_size > 1
                    or p.pcp_size > 1 or p.is_sequence_parallel)

    # --- what the modular kernel asks
    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int,
                         local_num_experts: int, expert_tokens_meta: Any,
                         activation: Any) -> tuple[tuple[int, ...], tuple[int, ...],
                                                   tuple[int, ...]]:
        """No workspaces (hopper_moe allocates its own); the output is the reduced [M, K]."""
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> Any:
        return _vllm().TopKWeightAndReduceNoOP()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Warms the layer up with its final weights (vLLM calls this for unquantized layers
        once the weights are in their runtime format)."""
        self._warm_up(layer.w13_weight, layer.w2_weight, layer.expert_map,
                      self.moe_config.in_dtype)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: Any, global_num_experts: int, expert_map: Optional[torch.Tensor],
              a1q_scale: Optional[torch.Tensor], a2_scale: Optional[torch.Tensor],
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        """Writes the weighted, reduced layer output ``[M, H]`` into ``output``.

        With apply_router_weight_on_input, vLLM's prepare step has already multiplied each
        input row by its weight (top-1), so the experts' outputs are summed unweighted.
        a2_scale is vLLM's quant_config.a2_scale, already in self.hopper_quant.
        """
        if self.post_gemm2_hook is not None:
            _fail("HopperMoeExperts reduces over top-k inside hopper_moe.fused_experts: a "
                  "post_gemm2_hook (which needs the unreduced GEMM2 rows) is not supported")
        if a1q_scale is not None:
            _fail("a1q_scale must be None: HopperMoeExperts takes unquantized inputs "
                  "(expects_unquantized_inputs) and quantizes them itself")
        if activation != _vllm().MoEActivation.SILU:
            _fail(f"activation must be MoEActivation.SILU for HopperMoeExperts, got {activation}")
        if not self._warm:
            self._warm_up(w1, w2, expert_map, hidden_states.dtype)
        if apply_router_weight_on_input:
            topk_weights = torch.ones_like(topk_weights)
        hopper_moe.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, "silu", False,
                                 global_num_experts, expert_map, quant=self.hopper_quant,
                                 out=output)

    def _warm_up(self, w1: torch.Tensor, w2: torch.Tensor, expert_map: Optional[torch.Tensor],
                 dtype: torch.dtype) -> None:
        """hopper_moe.warmup for this layer up to vLLM's max_num_batched_tokens, once. Skipped
        inside a CUDA graph capture (warmup synchronizes the device, which a capture forbids)."""
        if w1.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        cfg = self.moe_config
        hopper_moe.warmup(w1, w2, cfg.experts_per_token, cfg.max_num_tokens, dtype=dtype,
                          quant=self.hopper_quant,
                          global_num_experts=-1 if expert_map is None else expert_map.numel(),
                          expert_map=expert_map)
        self._warm = True


# ----------------------------------------------------------------------------- unquantized
class _HopperMoeUnquantizedFusedMoEMethod:
    """vLLM's ``UnquantizedFusedMoEMethod`` with ``HopperMoeExperts`` in place of
    ``TritonExperts`` where vLLM chose its Triton backend and HopperMoeExperts supports the
    layer; every other choice of vLLM is kept."""

    def __init__(self, moe: Any):
        super().__init__(moe)
        self.experts_cls = _unquantized_experts_cls(self.unquantized_backend, self.experts_cls,
                                                    moe)


def _unquantized_experts_cls(backend: Any, experts_cls: Any, moe_config: Any) -> Any:
    """HopperMoeExperts when vLLM picked (TRITON, TritonExperts) and it supports the layer."""
    v = _vllm()
    if backend != v.unquantized_oracle.UnquantizedMoeBackend.TRITON or \
            experts_cls is not v.TritonExperts:
        return experts_cls
    ours = _classes().HopperMoeExperts
    supported, _ = ours.is_supported_config(ours, moe_config, None, None,
                                            v.mk.FusedMoEActivationFormat.Standard)
    return ours if supported else experts_cls


# ----------------------------------------------------------------------------- classes
@functools.lru_cache(maxsize=None)
def _classes() -> SimpleNamespace:
    """The two classes, made once with vLLM's bases (which need vLLM imported)."""
    v = _vllm()

    class HopperMoeExperts(_HopperMoeExperts, v.mk.FusedMoEExpertsModular):
        __doc__ = _HopperMoeExperts.__doc__
        __qualname__ = "HopperMoeExperts"

    class HopperMoeUnquantizedFusedMoEMethod(_HopperMoeUnquantizedFusedMoEMethod,
                                             v.UnquantizedFusedMoEMethod):
        __doc__ = _HopperMoeUnquantizedFusedMoEMethod.__doc__
        __qualname__ = "HopperMoeUnquantizedFusedMoEMethod"

    return SimpleNamespace(HopperMoeExperts=HopperMoeExperts,
                           HopperMoeUnquantizedFusedMoEMethod=HopperMoeUnquantizedFusedMoEMethod)


def __getattr__(name: str) -> Any:
    if name in _CLASS_NAMES:
        return getattr(_classes(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- registration
def register() -> None:
    """vLLM's general-plugin entry point. Does nothing unless ``HOPPER_MOE=1``; then installs
    the unquantized and the FP8 hook (module docstring) and logs one line saying which.
    Idempotent: a hook already in place is not installed again (vLLM calls this in every
    process, and may call it more than once)."""
    if not settings.ENABLE_VLLM_PLUGIN:
        return
    hooks = (("unquantized layers on vLLM's Triton backend", _hook_unquantized),
             ("FP8 layers, ahead of TritonExperts in the Triton slot of vLLM's FP8 backend "
              "selection", _hook_fp8))
    installed = [what for what, hook in hooks if hook()]
    if installed:
        _LOG.info("hopper_moe %s: HopperMoeExperts registered for %s", hopper_moe.__version__,
                  "; for ".join(installed))


def _hook_unquantized() -> bool:
    """Registers HopperMoeUnquantizedFusedMoEMethod for UnquantizedFusedMoEMethod (vLLM's
    CustomOp out-of-tree registry); False if it already is, or another plugin's class is."""
    registry = importlib.import_module("vllm.model_executor.custom_op").op_registry_oot
    base = _vllm().UnquantizedFusedMoEMethod
    ours = _classes().HopperMoeUnquantizedFusedMoEMethod
    present = registry.get(base.__name__)
    if present is ours:
        return False
    if present is not None:
        _LOG.warning("hopper_moe: %s already replaces %s; unquantized MoE layers are left to "
                     "it", present.__qualname__, base.__name__)
        return False
    base.register_oot(ours)
    return True


def _hook_fp8() -> bool:
    """Wraps vLLM's FP8 ``backend_to_kernel_cls`` so that the TRITON backend lists
    HopperMoeExperts before vLLM's classes; False if already wrapped."""
    oracle = importlib.import_module(_FP8_ORACLE)
    if hasattr(oracle.backend_to_kernel_cls, "hopper_moe_original"):
        return False
    oracle.backend_to_kernel_cls = _hopper_first_in_slot(oracle.backend_to_kernel_cls,
                                                        oracle.Fp8MoeBackend.TRITON)
    return True


def _hopper_first_in_slot(original: Any, slot: Any) -> Any:
    """``original(backend)`` with HopperMoeExperts first in the list of ``slot``."""

    @functools.wraps(original)
    def backend_to_kernel_cls(backend):
        classes = original(backend)
        if backend != slot:
            return classes
        return [_classes().HopperMoeExperts, *classes]

    backend_to_kernel_cls.hopper_moe_original = original
    return backend_to_kernel_cls


# ----------------------------------------------------------------------------- inspection
def experts_by_layer(model: torch.nn.Module) -> dict[str, str]:
    """``{module name: experts class name}`` for every MoE layer of a loaded vLLM model whose
    quant method built a modular kernel. In a worker: ``llm.apply_model(experts_by_layer)``."""
    found = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            found[name] = type(kernel.fused_experts).__name__
    return found
