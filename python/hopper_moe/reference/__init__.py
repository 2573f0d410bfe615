"""fp32 PyTorch references of every hopper_moe op and of the whole MoE layer.

Plain, readable definitions: the tests and benchmarks hold every kernel to these. Each op's
reference takes the op's inputs and returns its outputs (no in-place arguments).
"""
from .activation import *  # noqa: F401,F403
from .gemm_data import *  # noqa: F401,F403
from .grouped_gemm import *  # noqa: F401,F403
from .layer import *  # noqa: F401,F403
from .permute import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403
from .reduce import *  # noqa: F401,F403
from .rope_quant import *  # noqa: F401,F403
from .routing import *  # noqa: F401,F403
