"""Backend choice for ``fused_experts(backend="auto")``: measured tables, read by pure functions.

Where the choice comes from, first match wins:

1. A **measured table** for the current GPU: ``oracle,device_name=<GPU>.json``, in
   ``$HOPPER_MOE_CONFIG_DIR`` (the user's folder, read once at import into
   ``hopper_moe.settings.CONFIG_DIR``) or else shipped in ``hopper_moe/configs/``. It holds the
   median whole-layer time of every backend per (layer shape, quant scheme, token count), as
   written by ``python -m hopper_moe.oracle --measure`` (``hopper_moe.oracle_measure``). For a
   call, the entries of its scheme are narrowed to the measured shape nearest to the layer's
   (E, topk, H, I) (the same shape when it was measured; else the smallest sum of
   |log(ratio)| over the four sizes), then to the smallest measured token count >= M (the
   largest when M is beyond them all); its backends in increasing time are the preference
   order.
2. The **static rules** below (``BACKEND_TABLE``), for a GPU, scheme or device without a
   measured table: on CUDA the Triton backend (it runs every scheme), then torch; on the CPU
   torch (Triton runs there only in its interpreter and sm90 on readable CPU definitions:
   both are for tests).

A preferred backend is taken only if it is available in this build and supports the call
(``supported``: e.g. sm90 has no block FP8 and needs 16-byte rows). On CUDA the torch backend is
never taken while a GPU backend supports the call: it is the portable baseline, 1.2x-300x
slower there. When nothing preferred is left, FALLBACK_ORDER decides.

``explain_backend`` (re-exported by hopper_moe) says what ``auto`` picks for a layer and why.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from . import settings

__all__ = ["BACKEND_TABLE", "Choice", "FALLBACK_ORDER", "GPU_BACKENDS", "LayerShape",
           "choose", "choose_backend", "load_measured", "measured_file_name"]

Row = tuple[Optional[int], tuple[str, ...]]
# (num_experts E, topk, hidden H, intermediate I): what a layer's time depends on besides M.
LayerShape = tuple[int, int, int, int]

_TORCH: tuple[Row, ...] = ((None, ("torch",)),)
_TRITON: tuple[Row, ...] = ((None, ("triton", "torch")),)

BACKEND_TABLE: Mapping[tuple[str, str], tuple[Row, ...]] = {
    ("cuda", "bf16"): _TRITON,
    ("cuda", "fp8_tensor"): _TRITON,
    ("cuda", "fp8_channel"): _TRITON,
    ("cuda", "fp8_block"): _TRITON,
    ("cpu", "bf16"): _TORCH,
    ("cpu", "fp8_tensor"): _TORCH,
    ("cpu", "fp8_channel"): _TORCH,
    ("cpu", "fp8_block"): _TORCH,
}

# Used when neither a measured nor a static row names a backend that can run the call.
FALLBACK_ORDER: tuple[str, ...] = ("triton", "torch", "reference")
# Backends that run GPU kernels of their own; on CUDA, torch comes after all of them.
GPU_BACKENDS: tuple[str, ...] = ("sm90", "triton")
_SHIPPED = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` runs and why (``str()`` gives one readable paragraph)."""
    backend: str
    source: str          # "measured" or "static"
    reason: str

    def __str__(self) -> str:
        return f"{self.backend} ({self.source}): {self.reason}"


def measured_file_name(device_name: str) -> str:
    return f"oracle,device_name={device_name.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=None)
def load_measured(device_name: str) -> Optional[dict]:
    """The measured table of this GPU as {scheme: {shape: [(m, {backend: us}), ...]}} plus
    its file under key "_file"; None when there is none. The user's folder wins."""
    name = measured_file_name(device_name)
    for folder in (settings.CONFIG_DIR, _SHIPPED):
        path = Path(folder) / name if folder else None
        if path is not None and path.is_file():
            with open(path) as f:
                return _index(json.load(f), str(path))
    return None


def _index(data: dict, path: str) -> dict:
    table: dict = {"_file": path}
    for e in data.get("entries", []):
        s = e["shape"]
        shape = (int(s["E"]), int(s["topk"]), int(s["H"]), int(s["I"]))
        times = {b: float(us) for b, us in e["us"].items() if us is not None}
        if times:
            table.setdefault(e["scheme"], {}).setdefault(shape, []).append((int(e["m"]), times))
    for by_shape in table.values():
        if isinstance(by_shape, dict):
            for rows in by_shape.values():
                rows.sort(key=lambda r: r[0])
    return table


def _shape_distance(a: LayerShape, b: LayerShape) -> float:
    return sum(abs(math.log(x / y)) for x, y in zip(a, b))


def measured_order(table: Mapping, scheme: str, shape: LayerShape,
                   num_tokens: int) -> Optional[tuple[tuple[str, ...], str]]:
    """(backends fastest first, how the row was found) from an indexed measured table, or
    None when it has no entry for the scheme. Pure."""
    by_shape = table.get(scheme)
    if not by_shape:
        return None
    near = min(by_shape, key=lambda s: (_shape_distance(s, shape), s))
    rows = by_shape[near]
    m, times = next(((m, t) for m, t in rows if m >= num_tokens), rows[-1])
    order = tuple(sorted(times, key=times.get))
    timing = ", ".join(f"{b} {times[b]:.1f} us" for b in order)
    which = "this shape" if near == shape else (
        f"nearest measured shape E={near[0]} topk={near[1]} H={near[2]} I={near[3]}")
    return order, f"{which}, M = {m} ({timing})"


def _static_order(table: Mapping, device_type: str, scheme: str, num_tokens: int
                  ) -> tuple[str, ...]:
    for max_tokens, order in table.get((device_type, scheme), ()):
        if max_tokens is None or num_tokens <= max_tokens:
            return tuple(order)
    return ()


def choose(device_type: str, scheme: str, num_tokens: int, supported: Sequence[str],
           shape: Optional[LayerShape] = None, measured: Optional[Mapping] = None,
           table: Mapping[tuple[str, str], Sequence[Row]] = BACKEND_TABLE) -> Choice:
    """The backend for this device type, scheme ("bf16" when unquantized), token count and
    layer shape, among ``supported`` (the backends available that can run this call).

    Pure: reads only its arguments. Raises RuntimeError when ``supported`` is empty."""
    if not supported:
        raise RuntimeError(f"no fused_experts backend can run this call on {device_type!r} "
                           f"with quant scheme {scheme!r}")
    found = measured_order(measured, scheme, shape, num_tokens) \
        if measured is not None and shape is not None else None
    if found is not None:
        prefs, why = found
        source = "measured"
        why = f"fastest supported backend in {measured.get('_file', 'the table')} at {why}"
    else:
        prefs = _static_order(table, device_type, scheme, num_tokens)
        source = "static"
        why = (f"no measured table for this GPU and scheme {scheme!r}; static rule for "
               f"{device_type} {scheme}: {' > '.join(prefs) or 'none'}")
    gpu_ok = device_type == "cuda" and any(b in supported for b in GPU_BACKENDS)
    skipped = []
    for name in tuple(prefs) + FALLBACK_ORDER + tuple(supported):
        if name not in supported:
            if name in prefs and name not in skipped:
                skipped.append(name)
            continue
        if name == "torch" and gpu_ok:
            continue
        note = f"; skipped (not available or not supporting this call): " \
               f"{', '.join(skipped)}" if skipped else ""
        return Choice(name, source, why + note)
    raise AssertionError("unreachable: supported is not empty")


def choose_backend(
    device: Union[str, torch.device],
    quant_scheme: str,
    num_tokens: int,
    available: Iterable[str],
    table: Mapping[tuple[str, str], Sequence[Row]] = BACKEND_TABLE,
    shape: Optional[LayerShape] = None,
    measured: Optional[Mapping] = None,
) -> str:
    """Name of the backend ``choose`` picks (every available backend taken as supporting the
    call). Pure."""
    device_type = torch.device(device).type if not isinstance(device, str) else (
        device.split(":")[0])
    return choose(device_type, quant_scheme, num_tokens, tuple(available), shape, measured,
                  table).backend


if __name__ == "__main__":  # python -m hopper_moe.oracle --measure
    from hopper_moe.oracle_measure import main

    raise SystemExit(main())
