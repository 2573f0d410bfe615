"""Tile configs of the Triton MoE GEMM, chosen from a finite set of token-count buckets.

A config is a dict: BLOCK_M/N/K, GROUP_M, SWAP_AB, num_warps, num_stages and optionally
ONE_SLOT_PER_BLOCK (skip the alignment; tiny batches) and FP8_FAST_ACC (per-tensor /
per-channel FP8: accumulate the K loop in the tensor core; see kernels/moe_gemm.py; set only
where the tuner's accuracy check accepted it). Lookup order:
  1. a JSON file named as vLLM names its tuned files,
     `E={E},N={I},device_name={dev}[,dtype=fp8_w8a8][,block_shape=[bn,bk]].json`, keyed by M
     (nearest key wins), in $HOPPER_MOE_CONFIG_DIR (user files win; read once, at import,
     into hopper_moe.settings.CONFIG_DIR) or hopper_moe/configs/;
  2. the default heuristic below.
Either way the number of distinct configs, hence compiled kernels, is bounded.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from .. import settings

M_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
_SHIPPED = Path(__file__).resolve().parent.parent / "configs"


def config_file_name(num_experts: int, intermediate: int, scheme: str,
                     device_name: str | None = None) -> str:
    dev = (device_name or _device_name()).replace(" ", "_")
    name = f"E={num_experts},N={intermediate},device_name={dev}"
    if scheme != "bf16":
        name += ",dtype=fp8_w8a8"
    if scheme == "fp8_block":
        name += ",block_shape=[128,128]"
    return name + ".json"


_DEVICE_NAMES: dict[int, str] = {}


def _device_name() -> str:
    """The current GPU's name ("cpu" without one); asked of the driver once per device."""
    if not _has_cuda():
        return "cpu"
    index = torch.cuda.current_device()
    name = _DEVICE_NAMES.get(index)
    if name is None:
        name = _DEVICE_NAMES[index] = torch.cuda.get_device_name(index)
    return name


@functools.lru_cache(maxsize=None)
def _load(file_name: str) -> dict[int, dict] | None:
    for folder in (settings.CONFIG_DIR, _SHIPPED):
        if folder and (Path(folder) / file_name).is_file():
            with open(Path(folder) / file_name) as f:
                return {int(m): cfg for m, cfg in json.load(f).items()}
    return None


def bucket(num_tokens: int) -> int:
    """The nearest bucket at or above num_tokens (the largest one beyond it)."""
    for m in M_BUCKETS:
        if num_tokens <= m:
            return m
    return M_BUCKETS[-1]


def one_slot_pays(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether to skip the alignment and give each program one (token, expert) slot.

    A program per slot reads its expert's weights once per slot, so an expert picked by two
    tokens is streamed twice. One token never picks an expert twice: M = 1 costs nothing
    extra. Otherwise S slots over E experts repeat about S / (2E) of the weight bytes; at
    S <= E / 8 that is <= 6%, less than the alignment launch it saves on small layers; at
    S <= E it would be up to half of the weight bytes again, more than that launch costs."""
    slots = num_tokens * top_k
    return num_tokens <= 1 or 8 * slots <= num_experts


def expected_max_rows(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Rows the fullest expert is expected to get under uniform routing: mean + 2.5 sqrt(mean)
    (exceeded by ~0.6% of experts). A token block smaller than that splits the busiest experts
    over two blocks, which streams their weights twice."""
    mean = num_tokens * top_k / max(num_experts, 1)
    return mean + 2.5 * math.sqrt(mean)


def default_config(num_tokens: int, top_k: int, num_experts: int, scheme: str) -> dict:
    """Heuristic tiles for Hopper. Few rows per expert: swap-AB with a 16..64-row token side
    sized to the fullest expert and a wide weight tile; many rows: the standard mapping with
    128 x 256 tiles (bf16) or 64/128 x 128 (FP8)."""
    m = bucket(num_tokens)
    rows = expected_max_rows(m, top_k, num_experts)
    one_slot = one_slot_pays(num_tokens, top_k, num_experts)
    fp8 = scheme != "bf16"
    block_k = 128 if fp8 else 64
    if rows <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k * (2 if not fp8 else 1), GROUP_M=1,
                   SWAP_AB=True, num_warps=4, num_stages=4)
    elif rows <= 64:
        cfg = dict(BLOCK_M=32 if rows <= 32 else 64, BLOCK_N=128, BLOCK_K=block_k,
                   GROUP_M=1, SWAP_AB=True, num_warps=4, num_stages=4)
    elif not fp8:
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=block_k, GROUP_M=8, SWAP_AB=False,
                   num_warps=8, num_stages=3)  # 3 x 48 KiB of tiles in shared memory
    else:  # FP8 tiles of 128 x 256 ran about 2x slower than these on the H200
        cfg = dict(BLOCK_M=64 if m <= 1024 else 128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8,
                   SWAP_AB=False, num_warps=8 if m > 1024 else 4, num_stages=3)
    if scheme == "fp8_block":
        cfg["BLOCK_K"] = 128
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 128)
    if one_slot:
        cfg.update(BLOCK_M=16, SWAP_AB=True, GROUP_M=1, ONE_SLOT_PER_BLOCK=True)
    return cfg


# (file, num_tokens) -> (the table it was found in, its nearest key): the nearest-key search
# once per token count and table.
_NEAREST: dict[tuple[str, int], tuple[dict, int]] = {}


# The smallest K tile tl.dot takes.
MIN_BLOCK_K = 16


def block_k_for_group(block_k: int, group_k: int) -> int:
    """The K tile for block-wise scales of `group_k` columns: the kernel applies one scale per
    K tile, so a tile must lie inside one group: the largest power of two that divides group_k,
    at most block_k (below MIN_BLOCK_K: no tile fits; the backend rejects such groups)."""
    return min(block_k, group_k & -group_k)


def get_config(num_tokens: int, top_k: int, num_experts: int, intermediate: int,
               scheme: str, group_k: int | None = None) -> dict:
    """Config of both GEMMs of a layer (w1 [E, 2*intermediate, H], w2 [E, H, intermediate])
    for this token count; they share BLOCK_M because they share one alignment. group_k: the
    columns of a block-wise scale group (BLOCK_K is fitted to it: block_k_for_group). A new
    dict on every call (callers may change it)."""
    cfg = _config(num_tokens, top_k, num_experts, intermediate, scheme)
    if group_k is not None:
        cfg["BLOCK_K"] = block_k_for_group(cfg["BLOCK_K"], group_k)
    return cfg


def _config(num_tokens: int, top_k: int, num_experts: int, intermediate: int,
            scheme: str) -> dict:
    default = default_config(num_tokens, top_k, num_experts, scheme)
    if not _has_cuda():
        return default
    name = config_file_name(num_experts, intermediate, scheme)
    table = _load(name)
    if not table:
        return default
    hit = _NEAREST.get((name, num_tokens))
    if hit is not None and hit[0] is table:
        key = hit[1]
    else:
        key = min(table, key=lambda m: abs(m - num_tokens))
        _NEAREST[(name, num_tokens)] = (table, key)
    cfg = dict(default, **table[key])
    if "SWAP_AB" not in table[key]:
        cfg["SWAP_AB"] = cfg["BLOCK_M"] < 64
    return cfg


@functools.lru_cache(maxsize=None)
def _has_cuda() -> bool:
    """Asked once: torch.cuda.is_available() reads the environment on every call."""
    return torch.cuda.is_available()
