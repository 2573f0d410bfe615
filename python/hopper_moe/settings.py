"""Every environment variable the Python package reads, read once, when hopper_moe is imported.

No other module reads the environment: a per-call read would make a layer's behaviour depend
on when it runs, costs a dictionary lookup on every launch and cannot be traced by
torch.compile. Set the variables before ``import hopper_moe``; code (tests among it) that must
change one later sets the constant here instead (``monkeypatch.setattr(settings, ...)``), and
every user reads it as ``settings.NAME`` at call time, so the change is seen.

- ``TRITON_INTERPRET`` (bool): ``TRITON_INTERPRET=1``, Triton's CPU interpreter. Triton
  kernels then also run on CPU tensors (the Triton backend of fused_experts counts as available
  on the CPU, and the kernels take the interpreter's rounding workarounds).
- ``CONFIG_DIR`` (str or None): ``HOPPER_MOE_CONFIG_DIR``, a folder of tuned tile configs of
  the Triton MoE GEMM and of measured backend tables (``oracle,device_name=<GPU>.json``,
  written by ``python -m hopper_moe.oracle --measure``); its files win over the shipped ones
  (hopper_moe/configs/).
- ``ENABLE_VLLM_PLUGIN`` (bool): ``HOPPER_MOE=1``, the switch of the vLLM plugin
  (``hopper_moe.vllm_plugin.register``, which vLLM calls in each of its processes): off, the
  plugin registers nothing. Not a ``VLLM_``-prefixed name: vLLM warns about unknown ones.
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["CONFIG_DIR", "ENABLE_VLLM_PLUGIN", "TRITON_INTERPRET"]

TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
CONFIG_DIR: Optional[str] = os.environ.get("HOPPER_MOE_CONFIG_DIR") or None
ENABLE_VLLM_PLUGIN: bool = os.environ.get("HOPPER_MOE", "0") == "1"
