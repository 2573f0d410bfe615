"""pytest plugin that runs vLLM 0.33.0's kernel tests, unchanged, against hopper_moe.

Loaded by tools/vllm_kernel_tests.sh with ``-p hopper_moe_vllm_shim`` (this directory on
PYTHONPATH). It is imported before pytest loads any conftest of vLLM's test tree, so every
redirection below is in place before a vLLM test module is imported. What it does:

1. Ops. ``torch.ops._moe_C`` and ``torch.ops._C`` are replaced by namespaces that hand out
   ``torch.ops.hopper_moe.<op>`` for every op hopper_moe registers (same schema, same
   arguments) and fall back to vLLM's own namespace for any other name. vLLM's Python
   wrappers (``vllm._custom_ops``) and layers thus run unchanged on top of hopper_moe's ops.
2. Layer. vLLM's Triton ``fused_experts`` (the function the MoE tests check against their
   torch references) is replaced by an adapter that calls ``hopper_moe.fused_experts`` with
   the same routing, activation, expert map and FP8 quantization
   (``hopper_moe.vllm_plugin.hopper_quant_config``). Anything hopper_moe does not run raises.
   vLLM's modular-kernel ``TritonExperts`` is replaced by ``HopperMoeExperts`` (the experts
   hopper_moe's vLLM plugin puts in its place).
3. Device (``HOPPER_MOE_VLLM_DEVICE=cpu``, the default without a GPU). vLLM's tests hard-code
   ``"cuda"`` and skip themselves on a non-CUDA platform. The shim installs a vLLM platform
   that reports CUDA SM 9.0 and a torch function mode that maps every ``cuda`` device a
   tensor is made on or moved to onto the CPU, plus no-op stand-ins for the torch.cuda
   calls the tests make (synchronize, seeds, streams, events, memory queries).
   With ``HOPPER_MOE_VLLM_DEVICE=cuda`` (a GPU machine) tensors stay on the GPU: vLLM is
   imported on its CPU platform (so none of vLLM's compiled CUDA extensions is needed) and the
   same CUDA SM 9.0 platform is swapped in, backed by the real device.
4. Skips. Tests listed in skips.py (features hopper_moe does not claim) are marked skipped,
   each with the reason from the table.
5. Time budget (``HOPPER_MOE_VLLM_DEADLINE``, a Unix time, set by the script's ``--seconds``):
   a test that would start after it is not run but reported as skipped with
   ``BUDGET_REASON``, so a run on a machine with a time limit still ends with its results
   file and summary; the script then fails the run as incomplete.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_HOPPER_MOE_SHIM", "1")
_DEVICE = os.environ.get("HOPPER_MOE_VLLM_DEVICE", "cpu")
if _DEVICE == "cpu":
    # Triton kernels (vLLM's references and hopper_moe's Triton backend) run in Triton's
    # interpreter; must be set before Triton kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import hopper_moe  # noqa: E402,F401  (registers torch.ops.hopper_moe)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import skips as _skips  # noqa: E402

# --------------------------------------------------------------------------------- 1. ops
HOPPER_OPS = frozenset(schema.name.split("::", 1)[1] for schema in torch._C._jit_get_all_schemas()
                      if schema.name.startswith("hopper_moe::"))
# Ops whose name hopper_moe registers but that are hopper_moe's own (not vLLM's): never mapped.
_OWN_OPS = frozenset({"moe_grouped_gemm", "moe_grouped_gemm_silu_mul", "moe_grouped_gemm_chain"})
REDIRECTED: dict[str, int] = {}  # "<ns>.<op>" -> number of lookups, for the summary


_COLLECTING = [False]


def _missing_op(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"torch.ops.{name}: not provided by hopper_moe")

    missing.__name__ = name
    return missing


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    _COLLECTING[0] = True
    try:
        yield
    finally:
        _COLLECTING[0] = False


class _RedirectNamespace:
    """Stands in for torch.ops._moe_C / torch.ops._C: hopper_moe's op where it has one."""

    def __init__(self, name: str, real):
        self._name = name
        self._real = real

    def __getattr__(self, op: str):
        if op in HOPPER_OPS and op not in _OWN_OPS:
            key = f"{self._name}.{op}"
            REDIRECTED[key] = REDIRECTED.get(key, 0) + 1
            return getattr(torch.ops.hopper_moe, op)
        if "supported" in op or "supports" in op:
            # Capability queries of kernels vLLM has and hopper_moe does not (asked at import
            # time by vLLM's modules): "not supported", so vLLM picks another path.
            return lambda *args, **kwargs: False
        try:
            return getattr(self._real, op)
        except AttributeError:
            if not _COLLECTING[0]:
                raise
            # A test module names a vLLM op hopper_moe lacks while it is imported (e.g. in
            # its parametrize lists): a stand-in that raises when called, so that the module's
            # other tests are collected; its own tests are in the skip table.
            return _missing_op(f"{self._name}.{op}")


    def __repr__(self):
        return f"<torch.ops.{self._name} redirected to torch.ops.hopper_moe>"


if _DEVICE == "cuda":
    # vLLM's CUDA platform loads vLLM's compiled CUDA extensions (its ops, flash attention), which
    # a Python-only vLLM does not have and the tests here do not need (the ops under test are
    # hopper_moe's): vLLM is imported on its CPU platform, and the platform the tests see is
    # swapped in below, as in the CPU run.
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"

# vllm._custom_ops registers fake kernels for vLLM's own op names at import (only where they
# exist): imported before the namespaces are swapped.
import vllm._custom_ops  # noqa: E402,F401

for _ns in ("_moe_C", "_C"):
    setattr(torch.ops, _ns, _RedirectNamespace(_ns, getattr(torch.ops, _ns)))


# ------------------------------------------------------------------------------ 3. device
def _map_device(dev):
    """cuda (str, torch.device, int) -> cpu; anything else unchanged."""
    if isinstance(dev, torch.device):
        return torch.device("cpu") if dev.type == "cuda" else dev
    if isinstance(dev, str):
        return "cpu" if dev.split(":")[0] == "cuda" else dev
    return dev


_PREIMPORT = (
    "vllm._custom_ops",
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.fused_moe.fused_moe",
    "vllm.model_executor.layers.activation",
    "vllm.model_executor.layers.attention",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.utils.fp8_utils",
    "vllm.v1.worker.workspace",
    "vllm.distributed",
)

if _DEVICE == "cpu":
    from torch.overrides import TorchFunctionMode

    _TO_FUNCS = {torch.Tensor.to}
    _CUDA_FUNCS = {torch.Tensor.cuda}
    _TOPK_FUNCS = {torch.topk, torch.Tensor.topk}

    def _topk_lowest_index_first(input, k, dim=-1, largest=True, sorted=True):
        """torch.topk with exact ties taken in index order (lowest first).

        torch.topk's order among equal values is unspecified on both devices (the CPU's
        follows its selection algorithm). The tests' references compare ids exactly and rely on
        inputs without deciding ties: that holds for the data the tests draw from the CUDA
        generator, not always for what the CPU generator draws from the same seed (bf16 logits
        of test_fused_topk). Index order is the one vLLM's kernels (and hopper_moe's) use, so
        ties the CPU data adds are resolved as the kernels resolve them."""
        order = torch.sort(input, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k).contiguous(),
                                        order.indices.narrow(dim, 0, k).contiguous()))

    class _CudaToCpu(TorchFunctionMode):
        """Maps device="cuda" arguments of torch functions and Tensor.to/.cuda to the CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in _TOPK_FUNCS and "out" not in kwargs:
                return _topk_lowest_index_first(*args, **kwargs)
            if func in _CUDA_FUNCS:
                kwargs.pop("device", None)
                kwargs.pop("non_blocking", None)
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = _map_device(kwargs["device"])
            if func in _TO_FUNCS and len(args) > 1:
                args = (args[0], _map_device(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    _MODE = _CudaToCpu()
    _MODE.__enter__()  # stays on for the whole session

    _real_set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: _real_set_default_device(
        None if _map_device(device) == "cpu" or _map_device(device) == torch.device("cpu")
        else device)

    class _NullCtx:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def synchronize(self):
            pass

        def wait_stream(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def elapsed_time(self, *a, **k):
            return 0.0

        def query(self):
            return True

    _cuda = torch.cuda
    for _name, _value in {
        "synchronize": lambda *a, **k: None,
        "manual_seed": lambda *a, **k: None,
        "manual_seed_all": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
        "device_count": lambda: 1,  # the tests' device lists: one "cuda:0"
        "is_available": lambda: False,  # torch itself (dynamo, RNG state) stays off CUDA
        "current_device": lambda: 0,
        "set_device": lambda *a, **k: None,
        "get_device_capability": lambda *a, **k: (9, 0),
        "get_device_name": lambda *a, **k: "NVIDIA H200 (hopper_moe CPU shim)",
        "max_memory_allocated": lambda *a, **k: 0,
        "memory_allocated": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "Stream": _NullCtx,
        "Event": _NullCtx,
        "stream": _NullCtx,
        "current_stream": lambda *a, **k: _NullCtx(),
        "default_stream": lambda *a, **k: _NullCtx(),
    }.items():
        setattr(_cuda, _name, _value)


# vLLM's modules, imported while vLLM still sees the platform it detected: imported with
# the CUDA platform below they would load CUDA-only extensions (flash attention, ...).
import importlib

for _mod in _PREIMPORT:
    importlib.import_module(_mod)

from vllm.platforms import interface as _pi


class HopperMoeShimPlatform(_pi.Platform):
    """What vLLM's tests see: a CUDA SM 9.0 platform. In the CPU run tensors live on the CPU;
    in the CUDA run on the GPU (vLLM detected its CPU platform at import, so that none of its
    compiled CUDA extensions is loaded; the ops under test are hopper_moe's)."""

    _enum = _pi.PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"
    dispatch_key = "CPU" if _DEVICE == "cpu" else "CUDA"
    ray_device_key = ""
    dist_backend = "gloo"

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return _pi.DeviceCapability(major=9, minor=0)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        if _DEVICE == "cuda":
            return torch.cuda.get_device_name(device_id)
        return "NVIDIA H200 (hopper_moe CPU shim)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 141 * (1 << 30)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return _DEVICE == "cuda"

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(torch.cuda.memory_allocated(device)) if _DEVICE == "cuda" else 0.0

    @classmethod
    def set_device(cls, device) -> None:
        if _DEVICE == "cuda":
            torch.cuda.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)
        if _DEVICE == "cuda":
            torch.cuda.manual_seed_all(seed)

    @classmethod
    def is_fp8_fnuz(cls) -> bool:
        return False

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        return torch.float8_e4m3fn

    @classmethod
    def supports_fp8(cls) -> bool:
        return True

import sys

import vllm.platforms as _platforms

detected = _platforms._current_platform
shim = HopperMoeShimPlatform()
_platforms._current_platform = shim
# Modules imported above bound `current_platform` by name (vllm._custom_ops,
# grouped_topk's dispatch, ...): point them at the shim's platform too.
for _name, _module in list(sys.modules.items()):
    if (_name.startswith("vllm.") and detected is not None
            and getattr(_module, "current_platform", None) is detected):
        _module.current_platform = shim


# ------------------------------------------------------------------------------- 2. layer
def _adapt_fused_experts():
    from vllm.model_executor.layers.fused_moe import fused_moe as _fm

    from hopper_moe.vllm_plugin import hopper_quant_config

    original = _fm.fused_experts

    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=None,
                      apply_router_weight_on_input=False, global_num_experts=-1,
                      expert_map=None, quant_config=None):
        act = "silu" if activation is None else getattr(activation, "value", activation)
        quant = None if quant_config is None else hopper_quant_config(quant_config)
        return hopper_moe.fused_experts(
            hidden_states, w1, w2, topk_weights, topk_ids, activation=act,
            apply_router_weight_on_input=apply_router_weight_on_input,
            global_num_experts=global_num_experts, expert_map=expert_map, quant=quant)

    fused_experts.__wrapped__ = original
    fused_experts.__doc__ = "hopper_moe.fused_experts behind vLLM's fused_experts signature"
    _fm.fused_experts = fused_experts
    # Re-exports of the same function object.
    import vllm.model_executor.layers.fused_moe as _pkg
    for mod in (_pkg,):
        if getattr(mod, "fused_experts", None) is original:
            mod.fused_experts = fused_experts


_adapt_fused_experts()


def _adapt_triton_experts():
    """vLLM's modular-kernel TritonExperts -> hopper_moe's HopperMoeExperts (the experts the
    hopper_moe vLLM plugin installs in TritonExperts' place), for the tests that build a
    modular kernel from TritonExperts (tests/kernels/moe/utils.py modular_triton_fused_moe)."""
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    from hopper_moe import vllm_plugin

    experts = vllm_plugin.HopperMoeExperts  # made now, while TritonExperts is vLLM's
    experts.__hopper_moe_replaces__ = triton_moe.TritonExperts
    triton_moe.TritonExperts = experts


_adapt_triton_experts()


# ---------------------------------------------------------------------------- 5. fixtures
# vLLM's tests/conftest.py (models, servers, HF fixtures: heavy imports) is not taken; these
# are the fixtures of it that the selected kernel tests request.
@pytest.fixture
def default_vllm_config():
    """A default VllmConfig as the current config (for CustomOps outside an engine)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture
def workspace_init():
    """vLLM's workspace manager on the test device, reset afterwards."""
    from vllm.v1.worker.workspace import init_workspace_manager, reset_workspace_manager

    init_workspace_manager(torch.device("cuda", 0) if _DEVICE == "cuda" else torch.device("cpu"))
    yield
    reset_workspace_manager()


@pytest.fixture(autouse=True)
def _hopper_moe_dynamo_reset():
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------- 4. skips
def pytest_collection_modifyitems(config, items):
    for item in items:
        nodeid = item.nodeid
        if "tests/kernels/" in nodeid:  # relative to the sdist root, whatever pytest's rootdir
            nodeid = "tests/kernels/" + nodeid.split("tests/kernels/", 1)[1]
        reason = _skips.reason_for(nodeid, _DEVICE,
                                   gpu_sized=os.environ.get("HOPPER_MOE_VLLM_ALL") == "1")
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"hopper_moe: {reason}"))


# ------------------------------------------------------------------------- 5. time budget
BUDGET_REASON = "hopper_moe: not run: the time budget (--seconds) ran out"
_DEADLINE = float(os.environ.get("HOPPER_MOE_VLLM_DEADLINE") or "inf")


def pytest_runtest_setup(item):
    if time.time() > _DEADLINE:
        pytest.skip(BUDGET_REASON)


def pytest_report_header(config):
    return [f"hopper_moe shim: device={_DEVICE}, hopper_moe {hopper_moe.__version__} "
            f"from {os.path.dirname(hopper_moe.__file__)}, ops redirected: "
            f"{', '.join(sorted(HOPPER_OPS - _OWN_OPS))}"]
