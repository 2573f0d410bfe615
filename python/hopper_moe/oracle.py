"""Backend choice for ``fused_experts(backend="auto")``: a table read by one pure function.

The table maps (device type, quant scheme) to rows ``(max_num_tokens, preferences)`` in
increasing max_num_tokens order (None = no upper bound). The first row whose bound covers the
token count gives the preference order; the first preferred backend that is available wins,
else the first available one of FALLBACK_ORDER. Backend names are api's ("sm90", not its
alias "cute"). A row changes only with a whole-layer benchmark table in benchmarks/results/
(benchmarks/bench_moe.py) that shows the new choice is not slower.

What the table says, and the tables it rests on:

- CUDA, bf16 / fp8_tensor / fp8_channel: "triton" at every token count, then "torch". In
  benchmarks/results/h200_moe.md (H200; mixtral and qwen3_30b; bf16 and fp8_tensor;
  M = 1..4096) the Triton layer is the fastest at every M, ahead of "sm90", and 1.2-4.7x
  faster than "torch"; fp8_channel rests on benchmarks/results/h200_moe_v1.md (the same
  shapes, "triton" against "torch" only).
- CUDA, fp8_block: "torch". No table in benchmarks/results/ times the Triton block-FP8
  layer yet, and "sm90" has no block FP8.
- CPU, every scheme: "torch" (Triton runs on the CPU only in its interpreter, and "sm90" on
  the ops' readable CPU definitions: both are for tests).
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
