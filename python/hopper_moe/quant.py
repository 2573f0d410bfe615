"""FP8 quantization description of an MoE layer (vLLM's names) and helpers to make one.

Notation: E experts, H hidden size, I intermediate size per expert, N output channels of a
weight (2I for w1, H for w2), K its input channels (H for w1, I for w2).

Schemes (``QuantConfig.scheme``):

- ``"fp8_tensor"``: weights e4m3 with one f32 scale per expert (``w*_scale`` ``[E]``);
  activations one scale per tensor: static (``a1_scale`` / ``a2_scale`` ``[1]`` f32) or dynamic
  (computed from the whole activation tensor on every call when the scale is None).
- ``"fp8_channel"``: ``per_out_ch_quant`` -> weights one scale per output channel
  (``[E, N]`` or ``[E, N, 1]``); ``per_act_token_quant`` -> activations one dynamic scale per
  token row. Either flag selects this scheme; the other side stays per-tensor.
- ``"fp8_block"``: ``block_shape = [bn, bk]`` (normally ``[128, 128]``) -> weights one scale per
  ``bn x bk`` block (``[E, ceil(N/bn), ceil(K/bk)]``); activations one dynamic scale per token
  per ``bk``-column group.

Quantization rule everywhere (kernels, reference, PyTorch path): ``q = fp8(clamp(x / scale,
-448, 448))``; a dynamic per-tensor or per-token scale is ``max(amax / 448, 1 / (448 * 512))``;
a per-token-group scale is ``max(amax, 1e-10) * (1 / 448)`` (the fp32 reciprocal, as vLLM on
CUDA: ``GROUP_INV_MAX``).
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "GROUP_EPS",
    "GROUP_INV_MAX",
    "QuantConfig",
    "abs_ignoring_nan",
    "fp32_reciprocal",
    "make_quant_config",
    "quantize_weights_fp8",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# The FP8 scale floors, defined here once for the Python side (hopper_moe.prepare and
# hopper_moe.reference use these); the kernels' own are fp8::kMinScale and the group ops' eps.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # floor of dynamic per-tensor / per-token scales
GROUP_EPS = 1e-10  # floor of a per-token-group amax


def fp32_reciprocal(v: float) -> float:
    """1 / v rounded to fp32, as a Python float (exact in fp32): a per-token-group scale is
    amax times fp32_reciprocal(fp8_max)."""
    return float(torch.tensor(1.0, device="cpu") / torch.tensor(v, dtype=torch.float32,
                                                                 device="cpu"))


GROUP_INV_MAX = fp32_reciprocal(FP8_MAX)


def abs_ignoring_nan(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN as 0: an amax over it skips NaN elements as the quantization
    kernels' C ``fmaxf`` does, so every backend and the references scale alike."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)

_SCHEMES = ("fp8_tensor", "fp8_channel", "fp8_block")


def _fail(msg: str) -> None:
    raise RuntimeError(msg)


@dataclass(frozen=True, eq=False)
class QuantConfig:
    """FP8 (e4m3) quantization of an MoE layer, with vLLM's field names.

    Attributes:
        w1_scale: f32 dequantization scales of w1 ``[E, 2I, H]``: ``[E]`` per-tensor,
            ``[E, 2I]`` / ``[E, 2I, 1]`` per-channel, ``[E, ceil(2I/bn), ceil(H/bk)]`` block.
        w2_scale: same for w2 ``[E, H, I]`` (N = H, K = I).
        a1_scale: static per-tensor scale ``[1]`` f32 of the GEMM1 input; None = dynamic.
        a2_scale: static per-tensor scale ``[1]`` f32 of the GEMM2 input; None = dynamic.
        per_act_token_quant: activations get one dynamic scale per token row.
        per_out_ch_quant: weights have one scale per output channel.
        block_shape: ``[bn, bk]`` block-wise weights; activations then get one dynamic scale
            per token per ``bk`` columns.
        quant_dtype: the quantized dtype; only ``torch.float8_e4m3fn`` is supported.
    """

    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    a1_scale: Optional[torch.Tensor] = None
    a2_scale: Optional[torch.Tensor] = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    block_shape: Optional[Sequence[int]] = None
    quant_dtype: torch.dtype = torch.float8_e4m3fn

    @property
    def scheme(self) -> str:
        """"fp8_block", "fp8_channel" or "fp8_tensor" (see the module docstring)."""
        if self.block_shape is not None:
            return "fp8_block"
        if self.per_act_token_quant or self.per_out_ch_quant:
            return "fp8_channel"
        return "fp8_tensor"

    @property
    def act_group_size(self) -> Optional[int]:
        """Columns per activation scale group (``block_shape[1]``) for block scaling, else None."""
        return None if self.block_shape is None else int(self.block_shape[1])

    def resolve(self, w1: torch.Tensor) -> "QuantConfig":
        """This config with what vLLM infers made explicit: per-token activations with
        per-channel weight scales (``w1_scale`` of shape ``[E, N]`` or ``[E, N, 1]``, N > 1)
        and ``per_out_ch_quant`` unset mean per-channel weights, as vLLM's fused_experts
        reads them. Otherwise self."""
        s = self.w1_scale
        if (self.per_act_token_quant and not self.per_out_ch_quant and self.block_shape is None
                and isinstance(s, torch.Tensor) and isinstance(w1, torch.Tensor)
                and w1.dim() == 3 and w1.shape[1] > 1
                and tuple(s.shape) in ((w1.shape[0], w1.shape[1]),
                                       (w1.shape[0], w1.shape[1], 1))):
            return dataclasses.replace(self, per_out_ch_quant=True)
        return self

    def validate(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Checks this config against w1 ``[E, 2I, H]`` and w2 ``[E, H, I]``.

        Raises RuntimeError naming the field and the rule. Shapes of w1/w2 themselves are
        checked by ``fused_experts``; this checks dtypes, devices and every scale's shape.
        """
        if self.quant_dtype != torch.float8_e4m3fn:
            _fail(f"quant_dtype must be torch.float8_e4m3fn, got {self.quant_dtype}")
        for name, w in (("w1", w1), ("w2", w2)):
            if w.dtype != self.quant_dtype:
                _fail(f"{name} must have dtype {self.quant_dtype} when quant is given, "
                      f"got {w.dtype}")
            if w.dim() != 3:
                _fail(f"{name} must be 3-D (num_experts, N, K), got {w.dim()}-D")
        bs = self.block_shape
        if bs is not None:
            if (not isinstance(bs, (list, tuple)) or len(bs) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                               for b in bs)):
                _fail(f"block_shape must be None or two positive ints [block_n, block_k], got {bs}")
            if self.per_act_token_quant or self.per_out_ch_quant:
                _fail("block_shape cannot be combined with per_act_token_quant or "
                      "per_out_ch_quant")
        num_experts = w1.shape[0]
        for name, scale, w in (("w1_scale", self.w1_scale, w1), ("w2_scale", self.w2_scale, w2)):
            if not isinstance(scale, torch.Tensor):
                _fail(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
            if scale.dtype != torch.float32:
                _fail(f"{name} must have dtype torch.float32, got {scale.dtype}")
            if scale.device != w.device:
                _fail(f"{name} must be on the same device as the weights ({w.device}), "
                      f"got {scale.device}")
            n, k = w.shape[1], w.shape[2]
            shape = tuple(scale.shape)
            if bs is not None:
                want = (num_experts, (n + bs[0] - 1) // bs[0], (k + bs[1] - 1) // bs[1])
                if shape != want:
                    _fail(f"{name} must have shape (num_experts, ceil(N/block_n), "
                          f"ceil(K/block_k)) = {want} for block_shape {list(bs)}, got {shape}")
            elif self.per_out_ch_quant:
                if shape not in ((num_experts, n), (num_experts, n, 1)):
                    _fail(f"{name} must have shape (num_experts, N) = {(num_experts, n)} or "
                          f"(num_experts, N, 1) for per_out_ch_quant, got {shape}")
            elif shape != (num_experts,):
                _fail(f"{name} must have shape (num_experts,) = {(num_experts,)} for "
                      f"per-tensor weights, got {shape}")
        for name, scale in (("a1_scale", self.a1_scale), ("a2_scale", self.a2_scale)):
            if scale is None:
                continue
            if not isinstance(scale, torch.Tensor):
                _fail(f"{name} must be None or a torch.Tensor, got {type(scale).__name__}")
            if scale.numel() != 1 or scale.dim() > 1:
                _fail(f"{name} must be a per-tensor scale of shape (1,) or (), got "
                      f"{tuple(scale.shape)}")
            if scale.dtype != torch.float32:
                _fail(f"{name} must have dtype torch.float32, got {scale.dtype}")
            if scale.device != w1.device:
                _fail(f"{name} must be on the same device as the weights ({w1.device}), "
                      f"got {scale.device}")
            if self.per_act_token_quant or bs is not None:
                _fail(f"{name} must be None with per_act_token_quant or block_shape "
                      "(those activation scales are dynamic)")
        if bs is not None:
            hidden_size, intermediate_size = w1.shape[2], w2.shape[2]
            if hidden_size % bs[1] != 0 or intermediate_size % bs[1] != 0:
                _fail(f"block_shape: hidden_size ({hidden_size}) and intermediate_size "
                      f"({intermediate_size}) must be multiples of block_k ({bs[1]}) so that "
                      "activation groups are whole")


def quantize_weights_fp8(
    w: torch.Tensor,
    per_out_ch: bool = False,
    block_shape: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes expert weights ``w [E, N, K]`` to float8_e4m3fn.

    Returns ``(w_fp8 [E, N, K], scale f32)`` with ``w ~= w_fp8 * scale`` where scale is
    amax / 448 over each expert (``[E]``), each output channel (``[E, N, 1]``, per_out_ch) or
    each ``bn x bk`` block (``[E, ceil(N/bn), ceil(K/bk)]``, block_shape).
    """
    if w.dim() != 3:
        _fail(f"w must be 3-D (num_experts, N, K), got {w.dim()}-D")
    wf = w.float()
    e, n, k = wf.shape
    if block_shape is not None:
        bn, bk = int(block_shape[0]), int(block_shape[1])
        nb, kb = math.ceil(n / bn), math.ceil(k / bk)
        padded = wf.new_zeros(e, nb * bn, kb * bk)
        padded[:, :n, :k] = wf
        amax = padded.view(e, nb, bn, kb, bk).abs().amax(dim=(2, 4))
        scale = amax.clamp_min(1e-12) / FP8_MAX
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :n, :k]
    elif per_out_ch:
        scale = wf.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / FP8_MAX
        full = scale
    else:
        scale = wf.abs().amax(dim=(1, 2)).clamp_min(1e-12) / FP8_MAX
        full = scale.view(e, 1, 1)
    q = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def _intermediate_amax(x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """amax of silu(x @ gate^T) * (x @ up^T) over all experts (calibration of a2_scale)."""
    inter = w1.shape[1] // 2
    h = torch.einsum("mh,enh->emn", x.float(), w1.float())
    act = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
    return act.abs().amax()


def make_quant_config(
    w1: torch.Tensor,
    w2: torch.Tensor,
    scheme: str,
    static_act: bool = False,
    a_sample: Optional[torch.Tensor] = None,
    block_shape: Sequence[int] = (128, 128),
    w_channel_scale_3d: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[QuantConfig]]:
    """Quantizes w1 ``[E, 2I, H]`` and w2 ``[E, H, I]`` for ``scheme``.

    scheme: "bf16" (returns the weights unchanged and None), "fp8_tensor", "fp8_channel"
    (per-channel weights x per-token activations) or "fp8_block" (``block_shape``).
    static_act (fp8_tensor only): static activation scales. a1_scale = amax(a_sample) / 448 and
    a2_scale = amax of the intermediate activation of a_sample over all experts / 448 when
    a_sample ``[M, H]`` is given, else 8 / 448 for both (covers |x| <= 8).
    w_channel_scale_3d: per-channel scales as ``[E, N, 1]`` (True) or ``[E, N]``.
    Returns ``(w1q, w2q, QuantConfig)``.
    """
    if scheme == "bf16":
        return w1, w2, None
    if scheme not in _SCHEMES:
        _fail(f"scheme must be one of {('bf16',) + _SCHEMES}, got {scheme!r}")
    if static_act and scheme != "fp8_tensor":
        _fail("static_act is only defined for scheme 'fp8_tensor'")
    if scheme == "fp8_block":
        bs = [int(block_shape[0]), int(block_shape[1])]
        w1q, w1s = quantize_weights_fp8(w1, block_shape=bs)
        w2q, w2s = quantize_weights_fp8(w2, block_shape=bs)
        return w1q, w2q, QuantConfig(w1_scale=w1s, w2_scale=w2s, block_shape=bs)
    if scheme == "fp8_channel":
        w1q, w1s = quantize_weights_fp8(w1, per_out_ch=True)
        w2q, w2s = quantize_weights_fp8(w2, per_out_ch=True)
        if not w_channel_scale_3d:
            w1s, w2s = w1s.squeeze(-1).contiguous(), w2s.squeeze(-1).contiguous()
        return w1q, w2q, QuantConfig(w1_scale=w1s, w2_scale=w2s, per_act_token_quant=True,
                                     per_out_ch_quant=True)
    w1q, w1s = quantize_weights_fp8(w1)
    w2q, w2s = quantize_weights_fp8(w2)
    a1 = a2 = None
    if static_act:
        dev = w1.device
        if a_sample is not None:
            a1 = (a_sample.float().abs().amax().clamp_min(1e-6) / FP8_MAX).reshape(1)
            a2 = (_intermediate_amax(a_sample, w1).clamp_min(1e-6) / FP8_MAX).reshape(1)
            a1, a2 = a1.to(dev), a2.to(dev)
        else:
            a1 = torch.full((1,), 8.0 / FP8_MAX, dtype=torch.float32, device=dev)
            a2 = torch.full((1,), 8.0 / FP8_MAX, dtype=torch.float32, device=dev)
    return w1q, w2q, QuantConfig(w1_scale=w1s, w2_scale=w2s, a1_scale=a1, a2_scale=a2)
