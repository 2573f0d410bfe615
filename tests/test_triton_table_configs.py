"""Every distinct config of the shipped tuned tables (hopper_moe/configs/E=*.json) runs the
Triton layer correctly.

On a machine without a GPU, get_config never reads the tables (it returns the default
heuristic), so the tuned tiles (128 x 256, GROUP_M 16, BLOCK_K 256, SWAP_AB at BLOCK_M 16,
ONE_SLOT_PER_BLOCK, FP8_FAST_ACC, ...) would otherwise never run in the CPU suite. Here each
distinct config is forced into the backend (merged into the default as get_config merges a
table entry) and run once on a small layer of its table's scheme against the reference:
H and I no multiples of the tiles (block FP8: multiples of its 128-column groups), an expert
map with a non-local expert, an id of -1 and one of E, partial token blocks, and the output
and both GEMMs' outputs pre-filled with NaN. FP8 tables (dtype=fp8_w8a8) serve per-tensor and
per-channel layers; their configs run as both, the per-tensor one alternating between dynamic
and static activation scales.

In the interpreter num_warps / num_stages do not matter, so configs that differ only there run
once; on a GPU every distinct config compiles and runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA, poison, seeded
from test_fused_moe import check_close

from hopper_moe import reference
from hopper_moe.quant import make_quant_config
import hopper_moe.backends.triton as triton_backend
from hopper_moe.kernels import moe_gemm_configs as triton_configs

DEVICE = "cuda" if HAS_CUDA else "cpu"
TABLES = sorted(Path(triton_configs._SHIPPED).glob("E=*.json"))
# The keys that change what the interpreter runs (num_warps / num_stages only matter compiled).
KERNEL_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SWAP_AB", "ONE_SLOT_PER_BLOCK",
               "FP8_FAST_ACC")


def _table_scheme(name: str) -> str:
    if "block_shape=" in name:
        return "fp8_block"
    return "fp8" if "dtype=fp8_w8a8" in name else "bf16"


def _distinct_configs() -> list[tuple[str, dict]]:
    seen: dict[tuple, tuple[str, dict]] = {}
    for path in TABLES:
        scheme = _table_scheme(path.name)
        for cfg in json.loads(path.read_text()).values():
            keys = sorted(cfg) if HAS_CUDA else KERNEL_KEYS
            seen.setdefault((scheme,) + tuple(str(cfg.get(k)) for k in keys), (scheme, cfg))
    return list(seen.values())


def _cases():
    cases, fp8_turn = [], 0
    for table_scheme, cfg in _distinct_configs():
        if table_scheme == "fp8":
            per_tensor = ("fp8_tensor", "fp8_tensor_static")[fp8_turn % 2]
            fp8_turn += 1
            schemes = (per_tensor, "fp8_channel")
        else:
            schemes = (table_scheme,)
        tag = (f"M{cfg['BLOCK_M']}N{cfg['BLOCK_N']}K{cfg['BLOCK_K']}G{cfg['GROUP_M']}"
               f"{'-swap' if cfg.get('SWAP_AB') else ''}"
               f"{'-oneslot' if cfg.get('ONE_SLOT_PER_BLOCK') else ''}"
               f"{'-fastacc' if cfg.get('FP8_FAST_ACC') else ''}")
        if HAS_CUDA:
            tag += f"-w{cfg.get('num_warps')}s{cfg.get('num_stages')}"
        for scheme in schemes:
            cases.append(pytest.param(scheme, cfg, id=f"{scheme}-{tag}"))
    return cases


# H, I per scheme: no multiple of any table's BLOCK_N / BLOCK_K (block FP8: of 128).
SHAPES = {"bf16": (200, 72), "fp8": (208, 80), "fp8_block": (384, 128)}
EXPERT_MAP = [1, -1, 0, 3, -1, 2]  # 6 global experts, 4 local, two non-local


def _layer(scheme: str, seed: int):
    M, topk = 9, 2
    H, I = SHAPES["fp8" if scheme.startswith("fp8_") and scheme != "fp8_block" else scheme]
    emap = torch.tensor(EXPERT_MAP, dtype=torch.int32)
    E = int((emap >= 0).sum())
    g = seeded(seed)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / (2 * I ** 0.5)).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(M, emap.numel(), generator=g), -1),
                              topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    ids[0, 1] = -1  # no expert
    ids[3, 0] = emap.numel()  # == global E: no expert
    quant = None
    if scheme != "bf16":
        base = "fp8_tensor" if scheme == "fp8_tensor_static" else scheme
        w1, w2, quant = make_quant_config(w1, w2, base, static_act=scheme == "fp8_tensor_static",
                                          a_sample=x)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    if quant is not None:
        quant = type(quant)(**{f: (to(v) if isinstance(v, torch.Tensor) else v)
                               for f, v in quant.__dict__.items()})
    return to(x), to(w1), to(w2), to(weights), to(ids), quant, to(emap)


def test_tables_are_read_and_consistent():
    """Each shipped table parses, its name round-trips through config_file_name, and its
    entries hold what the backend needs (FP8_FAST_ACC only where the kernel honours it)."""
    assert TABLES
    for path in TABLES:
        fields = dict(part.split("=", 1) for part in path.stem.split(",")[:2])
        scheme = {"fp8": "fp8_tensor"}.get(_table_scheme(path.name), _table_scheme(path.name))
        assert triton_configs.config_file_name(int(fields["E"]), int(fields["N"]), scheme,
                                               "NVIDIA H200") == path.name
        table = json.loads(path.read_text())
        assert table and all(int(m) > 0 for m in table), path.name
        for m, cfg in table.items():
            what = f"{path.name}[{m}]"
            for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
                assert cfg[k] >= 16 and cfg[k] & (cfg[k] - 1) == 0, what
            assert cfg["GROUP_M"] >= 1, what
            if scheme == "fp8_block":
                assert 128 % cfg["BLOCK_K"] == 0, what
            if scheme != "fp8_tensor":
                assert not cfg.get("FP8_FAST_ACC", False), what


@pytest.mark.parametrize("scheme,cfg", _cases())
def test_shipped_config_matches_reference(scheme, cfg, monkeypatch):
    def forced(num_tokens, top_k, num_experts, intermediate, scheme_, group_k=None):
        # what moe_gemm_configs._config / get_config make of a table entry
        out = dict(triton_configs.default_config(num_tokens, top_k, num_experts, scheme_), **cfg)
        if "SWAP_AB" not in cfg:
            out["SWAP_AB"] = out["BLOCK_M"] < 64
        if group_k is not None:
            out["BLOCK_K"] = triton_configs.block_k_for_group(out["BLOCK_K"], group_k)
        return out

    monkeypatch.setattr(triton_backend, "get_config", forced)
    invoke = triton_backend.invoke_moe_gemm

    def poisoned(a, b, c, *args, **kwargs):
        # GEMM1's act and GEMM2's per-slot output start as NaN too: a row that one kernel
        # leaves unwritten and the next step reads shows in the result.
        poison(c)
        return invoke(a, b, c, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "invoke_moe_gemm", poisoned)
    x, w1, w2, w, ids, quant, emap = _layer(scheme, seed=31)
    out = torch.full_like(x, float("nan"))
    got = triton_backend.fused_experts_triton(x, w1, w2, w, ids, global_num_experts=emap.numel(),
                                              expert_map=emap, quant=quant, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = reference.fused_experts_ref(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(),
                                      global_num_experts=emap.numel(), expert_map=emap.cpu(),
                                      quant=None if quant is None else type(quant)(**{
                                          f: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                          for f, v in quant.__dict__.items()}),
                                      **triton_backend.precision(quant))
    check_close(out, ref, scheme, f"{scheme} {cfg}", requant_steps=out.is_cuda)
