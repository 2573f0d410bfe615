"""The vLLM plugin, hopper_moe.vllm_plugin, against vLLM 0.33 on the CPU.

Without vLLM (the main .venv) only the first group runs: the entry point is declared, the module
imports without vLLM, and register() stays inert (imports nothing) with the switch off. Every
other test needs vLLM and skips, saying so; tools/vllm_check.sh builds an environment with
vLLM 0.33.0 and runs them all:

- contract: is_supported_config for every (weight, activation) QuantKey pair vLLM's FP8 methods
  build, and for the layer features HopperMoeExperts leaves to vLLM's TritonExperts (LoRA, bias,
  SwiGLU limit, other activations, all2all / DP); the overridden methods' signatures equal
  vLLM's (an upgrade that changes them fails here);
- selection: vLLM's own FP8 and unquantized backend selection after register(), switch on/off;
- numerics: vLLM's FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), HopperMoeExperts(...))
  against hopper_moe.reference.fused_experts_ref for bf16 and every FP8 scheme, with an
  expert_map and with apply_router_weight_on_input; and vLLM's own UnquantizedFusedMoEMethod and
  Fp8MoEMethod, weights loaded and processed, then applied;
- warmup: hopper_moe.warmup (recorded, not run) once per layer, at weight loading or first apply.

vLLM's backend selection is run as on an SM90 GPU where it matters (fixture `sm90`: vLLM's
platform object answers is_cuda, device capability 9.0, ...); kernels always run on the CPU.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import hopper_moe
from hopper_moe import QuantConfig, settings
from hopper_moe import vllm_plugin as plugin
from hopper_moe.backends import torch as torch_backend
from hopper_moe.quant import make_quant_config, quantize_weights_fp8
from hopper_moe.reference.layer import fused_experts_ref

from conftest import seeded

ROOT = Path(__file__).resolve().parent.parent
FP8_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.fp8"

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform: set before import
try:
    import vllm  # noqa: F401
    VLLM_MISSING = None
except ImportError as exc:
    VLLM_MISSING = (f"vLLM is not installed here ({exc}); tools/vllm_check.sh builds an "
                    "environment with vLLM 0.33.0 and runs these tests")
needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")


def _run_python(code: str, **env_overrides: str) -> str:
    """stdout of `code` in a fresh interpreter (settings are read once, at import)."""
    env = {k: v for k, v in os.environ.items() if k != "HOPPER_MOE"}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip().splitlines()[-1]


# =============================================================================== without vLLM
def test_entry_point_is_declared():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    value = project["entry-points"]["vllm.general_plugins"]["hopper_moe"]
    assert value == "hopper_moe.vllm_plugin:register"
    module, _, name = value.partition(":")
    assert callable(getattr(importlib.import_module(module), name))


_VLLM_MODULES = "sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))"


def test_switch_off_register_imports_nothing():
    """The entry point loads and runs without touching vLLM unless HOPPER_MOE is exactly 1."""
    code = ("import sys, hopper_moe.vllm_plugin as p; p.register(); "
            f"print(p.settings.ENABLE_VLLM_PLUGIN, {_VLLM_MODULES})")
    assert _run_python(code, HOPPER_MOE="true") == "False []"


def test_switch_is_HOPPER_MOE_1():
    code = "from hopper_moe import settings; print(settings.ENABLE_VLLM_PLUGIN)"
    assert _run_python(code, HOPPER_MOE="1") == "True"


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        plugin.Nope  # noqa: B018


# =============================================================================== vLLM helpers
def _v(name: str):
    return importlib.import_module(name)


def _mk():
    return _v("vllm.model_executor.layers.fused_moe.modular_kernel")


def _qu():
    return _v("vllm.model_executor.layers.quantization.utils.quant_utils")


def _cfg_mod():
    return _v("vllm.model_executor.layers.fused_moe.config")


def _silu():
    return _v("vllm.model_executor.layers.fused_moe.activation").MoEActivation.SILU


def _triton_experts():
    return _v("vllm.model_executor.layers.fused_moe.experts.triton_moe").TritonExperts


def moe_config(e=8, topk=2, h=256, i=128, num_local=None, dtype=torch.bfloat16, ep=False,
               **fields):
    """vLLM's FusedMoEConfig of a layer (no parallelism; `ep`: an EP rank without DP)."""
    cfg = _cfg_mod()
    parallel = cfg.FusedMoEParallelConfig.make_no_parallel()
    if ep:
        parallel = dataclasses.replace(parallel, ep_size=2, use_ep=True)
    fields.setdefault("activation", _silu())
    return cfg.FusedMoEConfig(
        num_experts=e, experts_per_token=topk, hidden_dim=h, intermediate_size=i,
        num_local_experts=e if num_local is None else num_local, num_logical_experts=e,
        device="cpu", routing_method=cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=parallel, in_dtype=dtype, max_num_tokens=96, **fields)


def is_supported(experts_cls, cfg, weight_key=None, activation_key=None):
    return experts_cls.is_supported_config(experts_cls, cfg, weight_key, activation_key,
                                           _mk().FusedMoEActivationFormat.Standard)


@pytest.fixture(autouse=True)
def vllm_config():
    """vLLM's default VllmConfig as the current one (vLLM's CustomOps read it when built)."""
    if VLLM_MISSING is not None:
        yield
        return
    config = _v("vllm.config")
    with config.set_current_vllm_config(config.VllmConfig()):
        yield


@pytest.fixture
def hooks(monkeypatch):
    """register() with the switch on; vLLM's process-wide registry and FP8 oracle are restored
    after the test, and the plugin's log-once memory starts empty."""
    custom_op = _v("vllm.model_executor.custom_op")
    oracle = _v(FP8_ORACLE)
    monkeypatch.setattr(custom_op, "op_registry_oot", dict(custom_op.op_registry_oot))
    monkeypatch.setattr(oracle, "backend_to_kernel_cls", oracle.backend_to_kernel_cls)
    monkeypatch.setattr(plugin, "_LOGGED", set())
    monkeypatch.setattr(settings, "ENABLE_VLLM_PLUGIN", True)
    plugin.register()
    return monkeypatch


@pytest.fixture
def warmups(monkeypatch):
    """hopper_moe.warmup recorded instead of run: one dict of its arguments per call."""
    calls = []

    def record(w1, w2, top_k, max_num_tokens, **kwargs):
        calls.append(dict(w1=w1, w2=w2, top_k=top_k, max_num_tokens=max_num_tokens, **kwargs))

    monkeypatch.setattr(hopper_moe, "warmup", record)
    return calls


@pytest.fixture
def sm90(monkeypatch):
    """A context manager: inside it vLLM's platform answers like a CUDA SM90 GPU."""
    platforms = _v("vllm.platforms")
    interface = _v("vllm.platforms.interface")
    platform = platforms.current_platform
    answers = dict(
        is_cuda=lambda: True, is_cuda_alike=lambda: True, is_cpu=lambda: False,
        is_rocm=lambda: False, is_xpu=lambda: False, supports_fp8=lambda: True,
        get_device_capability=lambda device_id=0: interface.DeviceCapability(9, 0),
        is_device_capability=lambda cap, device_id=0: cap in (90, (9, 0)),
        is_device_capability_family=lambda cap, device_id=0: cap == 90,
        has_device_capability=lambda cap, device_id=0: (
            (cap if isinstance(cap, int) else cap[0] * 10 + cap[1]) <= 90),
        device_name="NVIDIA H200 (emulated)",
    )

    class _Sm90:
        def __enter__(self):
            self._ctx = monkeypatch.context()
            patch = self._ctx.__enter__()
            for name, value in answers.items():
                patch.setattr(platform, name, value, raising=False)
            return platform

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

    return _Sm90()


# =============================================================================== contract
# Every (weight, activation) pair vLLM 0.33's FP8 MoE methods pass to select_fp8_moe_backend,
# with the method(s) that build it, and whether HopperMoeExperts runs it.
def _fp8_key_pairs():
    q = _qu()
    refined = q.create_fp8_quant_key(static=True, group_shape=q.GroupShape(64, 64))
    return [
        ("block 128x128 (Fp8MoEMethod, CT block, online block)",
         q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym, True),
        ("per-tensor, static acts (Fp8MoEMethod static, ModelOpt FP8, CT tensor static)",
         q.kFp8StaticTensorSym, q.kFp8StaticTensorSym, True),
        ("per-tensor, dynamic acts (Fp8MoEMethod dynamic, online fp8)",
         q.kFp8StaticTensorSym, q.kFp8DynamicTensorSym, True),
        ("per-tensor weights, per-token acts (Fp8MoEMethod with VLLM_BATCH_INVARIANT)",
         q.kFp8StaticTensorSym, q.kFp8DynamicTokenSym, True),
        ("per-channel x per-token (CT channel, online PTPC)",
         q.kFp8StaticChannelSym, q.kFp8DynamicTokenSym, True),
        ("block refined to 64x64 for TP (Fp8MoEMethod)", refined, q.kFp8Dynamic128Sym, False),
        ("per-tensor weights, 1x128 dynamic acts (CT tensor, dynamic input)",
         q.kFp8StaticTensorSym, q.kFp8Dynamic128Sym, False),
        ("block with UE8M0 scales", q.kFp8Static128BlockE8M0Sym, q.kFp8Dynamic128Sym, False),
        ("per-channel weights, static per-tensor acts",
         q.kFp8StaticChannelSym, q.kFp8StaticTensorSym, False),
        ("int8 per-channel x per-token", q.kInt8StaticChannelSym, q.kInt8DynamicTokenSym, False),
        ("mxfp8", q.kMxfp8Static, q.kMxfp8Dynamic, False),
    ]


@needs_vllm
def test_quant_scheme_support_for_every_key_pair_vllm_builds():
    experts = plugin.HopperMoeExperts
    cfg = moe_config()
    for what, weight_key, act_key, want in _fp8_key_pairs():
        assert experts._supports_quant_scheme(weight_key, act_key) is want, what
        supported, reason = is_supported(experts, cfg, weight_key, act_key)
        assert supported is want, (what, reason)
        if not want:
            assert "quantization scheme" in reason, (what, reason)
    assert is_supported(experts, cfg) == (True, None)  # unquantized


UNSUPPORTED = ("LoRA", "expert bias", "SwiGLU limit", "SwiGLU alpha", "GELU", "SwiGLU-OAI",
               "non-gated SiLU", "DeepEP all2all", "DP without EP")


def _unsupported_layers():
    """{what: (FusedMoEConfig fields, a part of the reason HopperMoeExperts must give)}."""
    mk_cfg = _cfg_mod()
    act = _v("vllm.model_executor.layers.fused_moe.activation").MoEActivation
    all2all = dataclasses.replace(mk_cfg.FusedMoEParallelConfig.make_no_parallel(), dp_size=2,
                                  ep_size=2, use_ep=True, all2all_backend="deepep_low_latency")
    naive_dp = dataclasses.replace(mk_cfg.FusedMoEParallelConfig.make_no_parallel(), dp_size=2)
    return {
        "LoRA": (dict(is_lora_enabled=True), "LoRA"),
        "expert bias": (dict(has_bias=True), "expert bias"),
        "SwiGLU limit": (dict(swiglu_limit=7.0), "swiglu_limit"),
        "SwiGLU alpha": (dict(swiglu_alpha=1.702), "swiglu_alpha"),
        "GELU": (dict(activation=act.GELU), "GELU"),
        "SwiGLU-OAI": (dict(activation=act.SWIGLUOAI), "SWIGLUOAI"),
        "non-gated SiLU": (dict(activation=act.SILU_NO_MUL), "act_and_mul"),
        "DeepEP all2all": (dict(moe_parallel_config=all2all), "parallel config"),
        "DP without EP": (dict(moe_parallel_config=naive_dp), "parallel config"),
    }


@needs_vllm
def test_unsupported_list_is_complete():
    assert tuple(_unsupported_layers()) == UNSUPPORTED


@needs_vllm
@pytest.mark.parametrize("what", UNSUPPORTED)
def test_unsupported_layers_are_refused_and_go_to_vllms_triton_experts(what, hooks, sm90):
    """Each refused layer: HopperMoeExperts says why; vLLM's FP8 selection (moe_backend
    "triton", as on an SM90 GPU) then returns vLLM's own TritonExperts, for bf16 the
    unquantized method keeps it."""
    fields, reason_part = _unsupported_layers()[what]
    q = _qu()
    oracle = _v(FP8_ORACLE)
    parallel = fields.pop("moe_parallel_config", None)
    with sm90:  # vLLM refuses non-gated layers on its CPU platform
        cfg = moe_config(moe_backend="triton", **fields)
        if parallel is not None:
            cfg.moe_parallel_config = parallel
        supported, reason = is_supported(plugin.HopperMoeExperts, cfg,
                                         q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym)
        assert not supported and reason_part in reason, (what, reason)
        if parallel is not None:
            return  # vLLM selects batched or all-gather variants there, never this slot
        for keys in ((q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym),
                     (q.kFp8StaticTensorSym, q.kFp8DynamicTensorSym)):
            backend, cls = oracle.select_fp8_moe_backend(cfg, *keys)
            assert (backend, cls) == (oracle.Fp8MoeBackend.TRITON, _triton_experts()), what
        method = _unquantized_base()(moe_config(**fields))
        assert type(method) is _unquantized_method()
        assert method.experts_cls is _triton_experts(), what


@needs_vllm
@pytest.mark.parametrize("h, i, want", [(256, 128, True), (256, 96, False), (192, 128, False)])
def test_block_fp8_needs_whole_128_groups(h, i, want):
    q = _qu()
    supported, reason = is_supported(plugin.HopperMoeExperts, moe_config(h=h, i=i),
                                     q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym)
    assert supported is want, reason
    assert is_supported(plugin.HopperMoeExperts, moe_config(h=h, i=i))[0]  # bf16: any size


@needs_vllm
def test_supported_devices(sm90):
    experts = plugin.HopperMoeExperts
    assert experts._supports_current_device()  # the CPU platform (tests)
    with sm90 as platform:
        assert experts._supports_current_device()
        platform.is_device_capability = lambda cap, device_id=0: cap in (100, (10, 0))
        assert not experts._supports_current_device()  # Blackwell: not SM90


@needs_vllm
def test_expert_map_parallel_config_is_supported():
    assert is_supported(plugin.HopperMoeExperts, moe_config(num_local=4, ep=True))[0]


# The methods HopperMoeExperts overrides, and the one helper it adds.
OVERRIDDEN = ("__init__", "activation_format", "is_supported_config", "_supports_current_device",
              "_supports_no_act_and_mul", "_supports_quant_scheme", "_supports_activation",
              "_supports_parallel_config", "expects_unquantized_inputs", "workspace_shapes",
              "finalize_weight_and_reduce_impl", "process_weights_after_loading", "apply")
HELPERS = ("_warm_up",)


def _kind(cls, name):
    attr = inspect.getattr_static(cls, name)
    return type(attr).__name__ if isinstance(attr, (staticmethod, classmethod, property)) \
        else "function"


def _params(cls, name):
    attr = inspect.getattr_static(cls, name)
    func = attr.fget if isinstance(attr, property) else getattr(cls, name)
    sig = inspect.signature(func, follow_wrapped=False)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@needs_vllm
def test_overridden_signatures_equal_vllms():
    ours = plugin.HopperMoeExperts
    base = _mk().FusedMoEExpertsModular
    mixin_names = {n for n in vars(plugin._HopperMoeExperts) if not n.startswith("__")
                   or n == "__init__"}
    assert mixin_names == set(OVERRIDDEN) | set(HELPERS)
    for name in OVERRIDDEN:
        assert hasattr(base, name), f"vLLM's {base.__name__} no longer has {name}"
        assert _kind(ours, name) == _kind(base, name), name
        assert _params(ours, name) == _params(base, name), name
    assert not ours.__abstractmethods__
    method, vllm_method = _unquantized_method(), _unquantized_base()
    assert _params(method, "__init__") == _params(vllm_method, "__init__")


@needs_vllm
def test_fp8_hook_keeps_the_signature_of_vllms_function(hooks):
    oracle = _v(FP8_ORACLE)
    wrapped = oracle.backend_to_kernel_cls
    original = wrapped.hopper_moe_original
    assert original is not wrapped
    assert _params_of(wrapped) == _params_of(original)
    assert wrapped(oracle.Fp8MoeBackend.DEEPGEMM) == original(oracle.Fp8MoeBackend.DEEPGEMM)


def _params_of(func):
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(func, follow_wrapped=False).parameters.values()]


def _unquantized_base():
    return _v("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
              ).UnquantizedFusedMoEMethod


def _unquantized_method():
    return plugin.HopperMoeUnquantizedFusedMoEMethod


@needs_vllm
def test_experts_refuse_quant_configs_they_would_silently_ignore():
    cfg = _cfg_mod()
    w_scale = torch.ones(8)
    bias = cfg.fp8_w8a8_moe_quant_config(w1_scale=w_scale, w2_scale=w_scale,
                                         w1_bias=torch.zeros(8, 256))
    with pytest.raises(RuntimeError, match="quant_config.w1_bias must be None"):
        plugin.HopperMoeExperts(moe_config(), bias)
    clamp = cfg.FusedMoEQuantConfig.make(gemm1_clamp_limit=7.0)
    with pytest.raises(RuntimeError, match="gemm1_clamp_limit must be None"):
        plugin.HopperMoeExperts(moe_config(), clamp)
    with pytest.raises(RuntimeError, match="activation_config.clamp_limit must be None"):
        plugin.HopperMoeExperts(moe_config(swiglu_limit=7.0), cfg.FusedMoEQuantConfig.make())


# =============================================================================== selection
def _selection_keys():
    q = _qu()
    return {"block": (q.kFp8Static128BlockSym, q.kFp8Dynamic128Sym),
            "tensor_static": (q.kFp8StaticTensorSym, q.kFp8StaticTensorSym),
            "tensor_dynamic": (q.kFp8StaticTensorSym, q.kFp8DynamicTensorSym),
            "tensor_token": (q.kFp8StaticTensorSym, q.kFp8DynamicTokenSym),
            "channel_token": (q.kFp8StaticChannelSym, q.kFp8DynamicTokenSym)}


@needs_vllm
@pytest.mark.parametrize("keys", ["block", "tensor_static", "tensor_dynamic", "tensor_token",
                                  "channel_token"])
def test_fp8_selection_returns_hopper_moe_experts(keys, hooks, sm90):
    oracle = _v(FP8_ORACLE)
    with sm90:
        got = oracle.select_fp8_moe_backend(moe_config(moe_backend="triton"),
                                            *_selection_keys()[keys])
    assert got == (oracle.Fp8MoeBackend.TRITON, plugin.HopperMoeExperts)


@needs_vllm
def test_fp8_block_auto_selection_on_sm90_returns_hopper_moe_experts(hooks, sm90):
    """vLLM's "auto" order puts its Triton backend first for block FP8 on SM90 (TP)."""
    oracle = _v(FP8_ORACLE)
    with sm90:
        got = oracle.select_fp8_moe_backend(moe_config(), *_selection_keys()["block"])
    assert got == (oracle.Fp8MoeBackend.TRITON, plugin.HopperMoeExperts)


@needs_vllm
def test_fp8_selection_on_the_cpu_platform(hooks):
    """On vLLM's CPU platform (tests) the Triton slot works too: TritonExperts cannot run there."""
    oracle = _v(FP8_ORACLE)
    got = oracle.select_fp8_moe_backend(moe_config(moe_backend="triton"),
                                        *_selection_keys()["block"])
    assert got == (oracle.Fp8MoeBackend.TRITON, plugin.HopperMoeExperts)


@needs_vllm
def test_unquantized_method_becomes_the_plugins_subclass(hooks, sm90):
    with sm90:
        method = _unquantized_base()(moe_config())
    assert type(method) is _unquantized_method()
    assert method.unquantized_backend.name == "TRITON"
    assert method.experts_cls is plugin.HopperMoeExperts


@needs_vllm
def test_unquantized_method_keeps_vllms_other_backends(hooks):
    """On the CPU platform vLLM picks its CPU backend: the plugin's subclass leaves it."""
    method = _unquantized_base()(moe_config())
    assert type(method) is _unquantized_method()
    assert method.unquantized_backend.name == "CPU"
    assert method.experts_cls is not plugin.HopperMoeExperts


@needs_vllm
def test_switch_off_changes_nothing(monkeypatch, sm90):
    custom_op = _v("vllm.model_executor.custom_op")
    oracle = _v(FP8_ORACLE)
    monkeypatch.setattr(custom_op, "op_registry_oot", dict(custom_op.op_registry_oot))
    monkeypatch.setattr(oracle, "backend_to_kernel_cls", oracle.backend_to_kernel_cls)
    monkeypatch.setattr(settings, "ENABLE_VLLM_PLUGIN", False)
    registry_before = dict(custom_op.op_registry_oot)
    function_before = oracle.backend_to_kernel_cls
    plugin.register()
    assert custom_op.op_registry_oot == registry_before
    assert oracle.backend_to_kernel_cls is function_before
    with sm90:
        for keys in _selection_keys().values():
            got = oracle.select_fp8_moe_backend(moe_config(moe_backend="triton"), *keys)
            assert got == (oracle.Fp8MoeBackend.TRITON, _triton_experts())
        method = _unquantized_base()(moe_config())
    assert type(method) is _unquantized_base()
    assert method.experts_cls is _triton_experts()


@needs_vllm
def test_register_is_idempotent_and_logs_one_line(hooks, caplog):
    """`hooks` registered once already; registering again changes nothing and logs nothing."""
    oracle = _v(FP8_ORACLE)
    custom_op = _v("vllm.model_executor.custom_op")
    hooks.setattr(oracle, "backend_to_kernel_cls", oracle.backend_to_kernel_cls.hopper_moe_original)
    hooks.setattr(custom_op, "op_registry_oot",
                  {k: v for k, v in custom_op.op_registry_oot.items()
                   if k != "UnquantizedFusedMoEMethod"})
    with caplog.at_level(logging.INFO, logger="vllm.hopper_moe"):
        for _ in range(3):
            plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.hopper_moe"]
    assert len(lines) == 1, lines
    assert "HopperMoeExperts registered for unquantized layers" in lines[0]
    assert "FP8 layers" in lines[0]
    assert oracle.backend_to_kernel_cls(oracle.Fp8MoeBackend.TRITON) == [
        plugin.HopperMoeExperts, _triton_experts()]
    assert custom_op.op_registry_oot["UnquantizedFusedMoEMethod"] is _unquantized_method()


@needs_vllm
def test_another_plugins_unquantized_method_is_left_alone(hooks, caplog):
    custom_op = _v("vllm.model_executor.custom_op")
    other = type("OtherUnquantizedFusedMoEMethod", (_unquantized_base(),), {})
    hooks.setitem(custom_op.op_registry_oot, "UnquantizedFusedMoEMethod", other)
    with caplog.at_level(logging.WARNING, logger="vllm.hopper_moe"):
        plugin.register()
    assert custom_op.op_registry_oot["UnquantizedFusedMoEMethod"] is other
    assert any("already replaces" in r.getMessage() for r in caplog.records)


@needs_vllm
def test_vllm_loads_the_entry_point():
    """vLLM's own plugin loader finds the installed entry point and, with HOPPER_MOE=1 only,
    the FP8 hook is in place."""
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(p.value == "hopper_moe.vllm_plugin:register" for p in points):
        pytest.skip("hopper_moe is not installed as a distribution here (its entry points are "
                    "invisible); tools/vllm_check.sh installs it")
    code = ("import importlib, vllm.plugins as p; p.load_general_plugins(); "
            f"o = importlib.import_module('{FP8_ORACLE}'); "
            "print(hasattr(o.backend_to_kernel_cls, 'hopper_moe_original'))")
    assert _run_python(code, HOPPER_MOE="1", VLLM_TARGET_DEVICE="cpu") == "True"
    assert _run_python(code, VLLM_TARGET_DEVICE="cpu") == "False"


# =============================================================================== numerics
# OPS.md tolerances of the whole layer against the fp32 reference (tests/test_fused_moe.py).
TOL = {"bf16": (2e-2, 0.0), "fp8_tensor": (5.5e-2, 1e-2), "fp8_channel": (5.5e-2, 1e-2),
       "fp8_block": (0.035, 0.035)}
SCHEMES = ["bf16", "fp8_tensor_static", "fp8_tensor_dynamic", "fp8_tensor_token", "fp8_channel",
           "fp8_block"]
VARIANTS = ["top2", "expert_map", "router_weight_on_input"]


@dataclasses.dataclass
class Layer:
    x: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    quant: Optional[QuantConfig]  # the test's own description, for the reference
    vllm_quant: object  # vLLM's FusedMoEQuantConfig of the same scales
    cfg: object  # vLLM's FusedMoEConfig
    expert_map: Optional[torch.Tensor]
    global_num_experts: int
    on_input: bool


def _hopper_quant(w1, w2, scheme, x):
    """fp8 weights and the test's QuantConfig for `scheme`."""
    if scheme == "fp8_tensor_token":  # per-tensor weights, per-token activations
        w1q, s1 = quantize_weights_fp8(w1)
        w2q, s2 = quantize_weights_fp8(w2)
        return w1q, w2q, QuantConfig(w1_scale=s1, w2_scale=s2, per_act_token_quant=True)
    base = scheme.replace("_static", "").replace("_dynamic", "")
    return make_quant_config(w1, w2, base, static_act=scheme.endswith("_static"),
                             a_sample=x.float())


def _vllm_quant(q: Optional[QuantConfig]):
    """vLLM's FusedMoEQuantConfig of the same scales, shaped as vLLM's FP8 methods keep them
    (a static activation scale is the 0-d max over experts)."""
    cfg = _cfg_mod()
    if q is None:
        return cfg.FusedMoEQuantConfig.make()

    def scalar(s):
        return None if s is None else s.reshape(())

    return cfg.fp8_w8a8_moe_quant_config(
        w1_scale=q.w1_scale, w2_scale=q.w2_scale, a1_scale=scalar(q.a1_scale),
        a2_scale=scalar(q.a2_scale), per_act_token_quant=q.per_act_token_quant,
        per_out_ch_quant=q.per_out_ch_quant,
        block_shape=None if q.block_shape is None else list(q.block_shape))


def make_layer(scheme, variant, m=37, e=8, h=256, i=128, seed=0) -> Layer:
    """Unit-scale random layer (x ~ N(0,1), w1 ~ N(0,1/H), w2 ~ N(0,1/I)), softmax routing."""
    g = seeded(seed)
    topk = 1 if variant == "router_weight_on_input" else 2
    num_local = 5 if variant == "expert_map" else e
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    w1 = torch.randn(num_local, 2 * i, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(num_local, h, i, generator=g) / math.sqrt(i)
    weights, ids = torch.softmax(torch.randn(m, e, generator=g), -1).topk(topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if variant == "router_weight_on_input":
        weights = torch.rand(m, 1, generator=g) * 0.5 + 0.5
    expert_map, global_num_experts = None, e
    if num_local != e:
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[torch.randperm(e, generator=g)[:num_local]] = torch.arange(
            num_local, dtype=torch.int32)
    if scheme == "bf16":
        w1, w2, q = w1.to(torch.bfloat16), w2.to(torch.bfloat16), None
    else:
        w1, w2, q = _hopper_quant(w1, w2, scheme, x)
    cfg = moe_config(e=e, topk=topk, h=h, i=i, num_local=num_local, ep=expert_map is not None)
    return Layer(x, w1, w2, weights.float(), ids.to(torch.int32), q, _vllm_quant(q), cfg,
                 expert_map, global_num_experts, variant == "router_weight_on_input")


def reference(layer: Layer, ran_on_cpu: bool = True) -> torch.Tensor:
    """fp32 reference. With apply_router_weight_on_input vLLM's prepare step multiplies each
    input row by its (top-1) weight in the input dtype before the experts; the reference takes
    that product as its input and weighs the outputs by 1. ran_on_cpu: the output compared
    came from hopper_moe on the CPU (its torch backend), so the reference rounds where that
    backend does (``backends.torch.precision``: an FP8 layer with 16-bit activations rounds
    its intermediates to the activation dtype, as vLLM's pipeline does)."""
    x, weights = layer.x, layer.weights
    if layer.on_input:
        x, weights = x * weights.to(x.dtype), torch.ones_like(weights)
    precision = torch_backend.precision(layer.x, layer.w1, layer.w2, layer.quant) \
        if ran_on_cpu else {}
    return fused_experts_ref(x, layer.w1, layer.w2, weights, layer.ids,
                             global_num_experts=layer.global_num_experts,
                             expert_map=layer.expert_map, quant=layer.quant, **precision)


def tolerance(scheme):
    """(atol, rtol) of a SCHEMES entry."""
    return TOL[scheme.replace("_static", "").replace("_dynamic", "").replace(
        "fp8_tensor_token", "fp8_channel")]


def check_close(out, ref, scheme):
    atol, rtol = tolerance(scheme)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert out.abs().max() > 0
    ratio = out.float().pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()
    assert 0.9 < ratio < 1.1, ratio


def vllm_kernel(layer: Layer):
    """vLLM's modular kernel with its no-DP/EP prepare-finalize and HopperMoeExperts."""
    no_dp_ep = _v("vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep")
    experts = plugin.HopperMoeExperts(layer.cfg, layer.vllm_quant)
    return _mk().FusedMoEKernel(no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular(), experts)


def run_kernel(kernel, layer: Layer) -> torch.Tensor:
    return kernel.apply(layer.x, layer.w1, layer.w2, layer.weights, layer.ids,
                        activation=_silu(), global_num_experts=layer.global_num_experts,
                        expert_map=layer.expert_map,
                        apply_router_weight_on_input=layer.on_input)


@needs_vllm
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_moe_kernel_matches_the_reference(scheme, variant, warmups):
    layer = make_layer(scheme, variant)
    key = {"bf16": (None, None), "fp8_tensor_static": "tensor_static",
           "fp8_tensor_dynamic": "tensor_dynamic", "fp8_tensor_token": "tensor_token",
           "fp8_channel": "channel_token", "fp8_block": "block"}[scheme]
    keys = key if isinstance(key, tuple) else _selection_keys()[key]
    assert is_supported(plugin.HopperMoeExperts, layer.cfg, *keys) == (True, None)
    out = run_kernel(vllm_kernel(layer), layer)
    check_close(out, reference(layer), scheme)


def layer_to(layer: Layer, device: str) -> Layer:
    """The same layer with every tensor (scales included) on `device`."""
    def move(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    q = layer.quant
    if q is not None:
        q = dataclasses.replace(q, w1_scale=move(q.w1_scale), w2_scale=move(q.w2_scale),
                                a1_scale=move(q.a1_scale), a2_scale=move(q.a2_scale))
    return dataclasses.replace(layer, x=move(layer.x), w1=move(layer.w1), w2=move(layer.w2),
                               weights=move(layer.weights), ids=move(layer.ids), quant=q,
                               vllm_quant=_vllm_quant(q), expert_map=move(layer.expert_map))


@needs_vllm
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_moe_kernel_on_the_gpu_matches_the_reference(scheme, variant, warmups):
    """vLLM's modular kernel with HopperMoeExperts on CUDA tensors: hopper_moe's GPU kernels
    (the backend `auto` picks) under vLLM's prepare/finalize; the reference runs on the CPU.
    vLLM's platform stays its CPU one (its compiled CUDA ops are not needed: the experts are
    hopper_moe's)."""
    layer = make_layer(scheme, variant)
    on_gpu = layer_to(layer, "cuda")
    out = run_kernel(vllm_kernel(on_gpu), on_gpu)
    assert out.is_cuda
    out, ref = out.cpu(), reference(layer, ran_on_cpu=False)
    if scheme == "bf16":
        check_close(out, ref, scheme)
        return
    # FP8 on another device than the reference: a GEMM1 output one bf16 rounding away can
    # requantize an intermediate element to the neighbouring FP8 code; the project's rule for
    # that (tests/test_fused_moe.py: a few elements up to REQUANT_SLACK x the tolerance, at
    # most REQUANT_MAX_FRACTION of them), the norm ratio as strict as on the CPU.
    from test_fused_moe import REQUANT_MAX_FRACTION, REQUANT_SLACK

    atol, rtol = tolerance(scheme)
    diff, tol = (out.float() - ref.float()).abs(), atol + rtol * ref.float().abs()
    assert (diff / tol).max().item() <= REQUANT_SLACK, (diff / tol).max().item()
    assert int((diff > tol).sum()) <= max(2, REQUANT_MAX_FRACTION * ref.numel())
    ratio = out.float().pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()
    assert 0.9 < ratio < 1.1, ratio


@needs_vllm
def test_router_weight_is_applied_exactly_once(warmups):
    """The check above can fail: weighing the output again (or not scaling the input) moves
    the result far outside the tolerance."""
    layer = make_layer("bf16", "router_weight_on_input")
    out = run_kernel(vllm_kernel(layer), layer)
    twice = fused_experts_ref(layer.x * layer.weights.to(layer.x.dtype), layer.w1, layer.w2,
                              layer.weights, layer.ids)
    never = fused_experts_ref(layer.x, layer.w1, layer.w2, torch.ones_like(layer.weights),
                              layer.ids)
    for wrong in (twice, never):
        with pytest.raises(AssertionError):
            check_close(out, wrong, "bf16")


@needs_vllm
def test_output_is_written_into_vllms_buffer(warmups, monkeypatch):
    """apply() writes the reduced result into the `output` vLLM passes (no copy back)."""
    layer = make_layer("fp8_block", "top2")
    experts = plugin.HopperMoeExperts(layer.cfg, layer.vllm_quant)
    output = torch.full((layer.x.shape[0], layer.x.shape[1]), float("nan"), dtype=torch.bfloat16)
    got = experts.apply(output, layer.x, layer.w1, layer.w2, layer.weights, layer.ids, _silu(),
                        layer.global_num_experts, None, None, None, torch.empty(0),
                        torch.empty(0), None, False)
    assert got is None
    check_close(output, reference(layer), "fp8_block")


@needs_vllm
def test_apply_refuses_a_quantized_input(warmups):
    layer = make_layer("fp8_block", "top2")
    experts = plugin.HopperMoeExperts(layer.cfg, layer.vllm_quant)
    output = torch.empty_like(layer.x)
    with pytest.raises(RuntimeError, match="a1q_scale must be None"):
        experts.apply(output, layer.x, layer.w1, layer.w2, layer.weights, layer.ids, _silu(),
                      layer.global_num_experts, None, torch.ones(1), None, torch.empty(0),
                      torch.empty(0), None, False)


@needs_vllm
def test_experts_contract_values(warmups):
    layer = make_layer("fp8_channel", "top2")
    experts = plugin.HopperMoeExperts(layer.cfg, layer.vllm_quant)
    assert experts.expects_unquantized_inputs
    assert experts.workspace_shapes(37, 256, 256, 2, 8, 8, None, _silu()) == ((0,), (0,),
                                                                                (37, 256))
    noop = _v("vllm.model_executor.layers.fused_moe.topk_weight_and_reduce"
              ).TopKWeightAndReduceNoOP
    assert isinstance(experts.finalize_weight_and_reduce_impl(), noop)
    assert experts.activation_format() == _mk().FusedMoEActivationFormat.Standard
    q = experts.hopper_quant
    assert (q.scheme, q.per_act_token_quant, q.per_out_ch_quant) == ("fp8_channel", True, True)
    assert q.w1_scale is layer.quant.w1_scale  # vLLM's tensors, not copies


# =============================================================================== warmup
@needs_vllm
def test_first_apply_warms_up_once(warmups):
    layer = make_layer("fp8_block", "expert_map")
    kernel = vllm_kernel(layer)
    run_kernel(kernel, layer)
    run_kernel(kernel, layer)
    assert len(warmups) == 1
    call = warmups[0]
    assert call["w1"] is layer.w1 and call["w2"] is layer.w2
    assert (call["top_k"], call["max_num_tokens"], call["dtype"]) == (2, 96, torch.bfloat16)
    assert call["quant"] is kernel.fused_experts.hopper_quant
    assert call["expert_map"] is layer.expert_map and call["global_num_experts"] == 8


class _RoutedExpertsStandIn(torch.nn.Module):
    """What vLLM's MoE methods read from vLLM's RoutedExperts (which needs a whole engine)."""

    def __init__(self, cfg, expert_map=None):
        super().__init__()
        self.moe_config = cfg
        self.activation = cfg.activation
        self.apply_router_weight_on_input = False
        self.global_num_experts = cfg.num_experts
        self.expert_map = expert_map
        self.top_k = cfg.experts_per_token

    def _expert_routing_tables(self):
        return None


@needs_vllm
def test_unquantized_method_end_to_end(hooks, sm90, warmups):
    """vLLM's UnquantizedFusedMoEMethod (selected as on SM90): weights created, loaded and
    processed (the warmup happens here, once), then applied on the CPU."""
    layer_data = make_layer("bf16", "expert_map")
    with sm90:
        method = _unquantized_base()(layer_data.cfg)
    assert method.experts_cls is plugin.HopperMoeExperts
    module = _RoutedExpertsStandIn(layer_data.cfg, layer_data.expert_map)
    module.quant_method = method
    method.create_weights(module, num_experts=5, hidden_size=256,
                          intermediate_size_per_partition=128, params_dtype=torch.bfloat16)
    module.w13_weight.data.copy_(layer_data.w1)
    module.w2_weight.data.copy_(layer_data.w2)
    method.process_weights_after_loading(module)
    assert len(warmups) == 1 and warmups[0]["w1"] is module.w13_weight
    assert warmups[0]["max_num_tokens"] == 96 and warmups[0]["quant"] is None
    out = method.apply(module, layer_data.x, layer_data.weights, layer_data.ids, None, None)
    check_close(out, reference(layer_data), "bf16")
    assert len(warmups) == 1
    model = torch.nn.ModuleDict({"moe": module})
    assert plugin.experts_by_layer(model) == {"moe": "HopperMoeExperts"}


@needs_vllm
def test_fp8_block_method_end_to_end(hooks, warmups):
    """vLLM's Fp8MoEMethod (block [128, 128], --moe-backend triton) on vLLM's CPU platform:
    selection, weights created, loaded and processed, then applied. vLLM's FP8 methods do not
    hand the loaded layer to the experts, so the warmup comes with the first apply."""
    fp8 = _v("vllm.model_executor.layers.quantization.fp8")
    # A single process without torch.distributed: tensor parallelism of 1.
    hooks.setattr(_v("vllm.distributed"), "get_tensor_model_parallel_world_size", lambda: 1)
    layer_data = make_layer("fp8_block", "top2")
    cfg = dataclasses.replace(layer_data.cfg, moe_backend="triton")
    module = _RoutedExpertsStandIn(cfg)
    method = fp8.Fp8MoEMethod(fp8.Fp8Config(weight_block_size=[128, 128]), module)
    assert method.experts_cls is plugin.HopperMoeExperts
    module.quant_method = method
    method.create_weights(module, num_experts=8, hidden_size=256,
                          intermediate_size_per_partition=128, params_dtype=torch.bfloat16)
    q = layer_data.quant
    for name, value in (("w13_weight", layer_data.w1), ("w2_weight", layer_data.w2),
                        ("w13_weight_scale_inv", q.w1_scale), ("w2_weight_scale_inv", q.w2_scale)):
        getattr(module, name).data.copy_(value)
    method.process_weights_after_loading(module)
    assert type(method.moe_kernel.fused_experts) is plugin.HopperMoeExperts
    assert warmups == []
    out = method.apply(module, layer_data.x, layer_data.weights, layer_data.ids, None, None)
    check_close(out, reference(layer_data), "fp8_block")
    assert len(warmups) == 1 and warmups[0]["quant"].scheme == "fp8_block"
    method.apply(module, layer_data.x, layer_data.weights, layer_data.ids, None, None)
    assert len(warmups) == 1
