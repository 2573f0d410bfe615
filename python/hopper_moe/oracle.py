"""Backend choice for ``fused_experts(backend="auto")``: a table read by one pure function.

The table maps (device type, quant scheme) to rows ``(max_num_tokens, preferences)`` in
increasing max_num_tokens order (None = no upper bound). The first row whose bound covers the
token count gives the preference order; the first preferred backend that is available wins.
Rows change only with a benchmark table (benchmarks/results/) that shows the new choice is
not slower.

Current rows, from benchmarks/results/h200_moe.md (H200, mixtral and qwen3_30b, bf16 and FP8
per-tensor, M = 1..4096; fp8_channel from h200_moe_v1.md):
- CUDA bf16, fp8_tensor, fp8_channel: "triton" at every M: 1.19-4.71x faster than "torch"
  and faster than "cute" at every M of that run (cute's layer is 3-6% behind it for mixtral
  bf16 M = 2..64, 11% at M = 1, and further behind from M = 256 on, where cute has no
  standard mapping yet: benchmarks/NOTES.md, v11).
- CUDA fp8_block: "torch" (the Triton block-FP8 layer is not benchmarked yet; cute has no
  block FP8).
- CPU rows keep "torch".
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

__all__ = ["BACKEND_TABLE", "FALLBACK_ORDER", "choose_backend"]

Row = tuple[Optional[int], tuple[str, ...]]

_ALL_TOKENS: tuple[Row, ...] = ((None, ("torch",)),)
_TRITON: tuple[Row, ...] = ((None, ("triton", "torch")),)

BACKEND_TABLE: Mapping[tuple[str, str], tuple[Row, ...]] = {
    ("cuda", "bf16"): _TRITON,
    ("cuda", "fp8_tensor"): _TRITON,
    ("cuda", "fp8_channel"): _TRITON,
    ("cuda", "fp8_block"): _ALL_TOKENS,
    ("cpu", "bf16"): _ALL_TOKENS,
    ("cpu", "fp8_tensor"): _ALL_TOKENS,
    ("cpu", "fp8_channel"): _ALL_TOKENS,
    ("cpu", "fp8_block"): _ALL_TOKENS,
}

# Used when the table has no row for the device/scheme, or none of a row's backends is there.
FALLBACK_ORDER: tuple[str, ...] = ("torch", "reference")


def choose_backend(
    device: Union[str, torch.device],
    quant_scheme: str,
    num_tokens: int,
    available: Iterable[str],
    table: Mapping[tuple[str, str], Sequence[Row]] = BACKEND_TABLE,
) -> str:
    """Name of the backend to run for this device, scheme ("bf16" when unquantized) and M.

    Pure: reads only its arguments. Raises RuntimeError when no listed backend is available.
    """
    device_type = torch.device(device).type if not isinstance(device, str) else (
        device.split(":")[0])
    avail = tuple(available)
    prefs: Sequence[str] = ()
    for max_tokens, order in table.get((device_type, quant_scheme), ()):
        if max_tokens is None or num_tokens <= max_tokens:
            prefs = order
            break
    for name in tuple(prefs) + FALLBACK_ORDER:
        if name in avail:
            return name
    raise RuntimeError(f"no fused_experts backend available for device {device_type!r} and "
                       f"quant scheme {quant_scheme!r}; available: {list(avail)}")
