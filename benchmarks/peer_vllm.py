"""The peer: the serving engine's Triton MoE pipeline (vLLM 0.33.0's ``fused_moe_kernel``), run
as the engine runs it, for measuring hopper_moe against it in the same run (docs/BENCHMARK.md).

Nothing of the engine is stored in this repository. ``extract`` takes the kernel's source and the
engine's tuned config tables out of a vLLM distribution the user points to and writes them to a
folder outside the tree (default ``~/.cache/hopper_moe/peer_vllm``, or ``HOPPER_MOE_PEER_DIR``);
a machine without a registry gets that folder carried along. ``VllmTritonPipeline`` loads the
kernel from there and runs the engine's layer around it, step for step as its
``fused_experts_impl`` does, with hopper_moe's vLLM-compatible ops as the glue:

    input quantization (scaled_fp8_quant / per_token_group_quant_fp8)
    -> expert assignment: moe_align_block_size, or for few slots per expert
       (tokens * top_k * 4 <= experts, no expert_map) the kernel's naive one-block-per-slot mode
    -> GEMM1 (fused_moe_kernel) -> silu_and_mul -> quantization of GEMM2's input
    -> GEMM2 (fused_moe_kernel, routed weight applied) -> moe_sum

The alignment runs inside the timed call, as in the engine. Configs: the engine's tuned table
for this GPU, expert count, intermediate size, dtype and block shape (nearest token count), else
its default rule (the numbers of vLLM 0.33.0's get_default_config for CUDA). ``config_for``
says which one a row used.

    python benchmarks/peer_vllm.py extract SOURCE [--dest DIR]

SOURCE: a vllm-0.33.0 wheel (.whl), a tarball of its Python sources (.tar.gz / .tar.xz, e.g.
the one tools/vllm_offline_bundle.sh packs), or a folder that holds ``vllm/``.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import sys
import tarfile
import zipfile
from typing import Optional

import torch

KERNEL_PATH = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_PREFIX = "vllm/model_executor/layers/fused_moe/configs/"
KERNEL_NAME = "fused_moe_kernel"
MODULE_FILE = "fused_moe_kernel.py"


def default_dir() -> str:
    return os.environ.get("HOPPER_MOE_PEER_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hopper_moe", "peer_vllm")


# ------------------------------------------------------------------------------ extract
def _read_members(source: str) -> tuple[str, dict[str, bytes]]:
    """(the kernel file's text, {config file name: bytes}) from a wheel, a tarball or a folder."""
    configs: dict[str, bytes] = {}
    kernel: Optional[bytes] = None

    def take(name: str, read) -> None:
        nonlocal kernel
        # Members may sit under a top folder (vllm-0.33.0/vllm/...): match on the tail.
        idx = name.find("vllm/model_executor/")
        if idx < 0:
            return
        rel = name[idx:]
        if rel == KERNEL_PATH:
            kernel = read()
        elif rel.startswith(CONFIG_PREFIX) and rel.endswith(".json") and "/" not in \
                rel[len(CONFIG_PREFIX):]:
            configs[rel[len(CONFIG_PREFIX):]] = read()

    if os.path.isdir(source):
        path = os.path.join(source, KERNEL_PATH)
        if os.path.isfile(path):
            take(KERNEL_PATH, lambda: open(path, "rb").read())
        cfg_dir = os.path.join(source, CONFIG_PREFIX)
        if os.path.isdir(cfg_dir):
            for name in sorted(os.listdir(cfg_dir)):
                path = os.path.join(cfg_dir, name)
                take(CONFIG_PREFIX + name, lambda p=path: open(p, "rb").read())
    elif zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as zf:
            for name in zf.namelist():
                take(name, lambda n=name: zf.read(n))
    elif tarfile.is_tarfile(source):
        with tarfile.open(source) as tf:
            for member in tf:
                if member.isfile():
                    take(member.name, lambda m=member: tf.extractfile(m).read())
    else:
        raise RuntimeError(f"peer_vllm: {source!r} is not a wheel, a tarball or a folder")
    if kernel is None:
        raise RuntimeError(f"peer_vllm: {source!r} has no {KERNEL_PATH}")
    return kernel.decode(), configs


def _is_triton_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list)


def kernel_source(text: str) -> str:
    """The ``fused_moe_kernel`` Triton function of the engine's module and the Triton
    functions it calls, as a module of their own (imports: triton and triton.language)."""
    tree = ast.parse(text)
    lines = text.splitlines()
    jit = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_triton_jit(n)}
    if KERNEL_NAME not in jit:
        raise RuntimeError(f"peer_vllm: no @triton.jit {KERNEL_NAME} in {KERNEL_PATH}")
    wanted, todo = [], [KERNEL_NAME]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.append(name)
        todo += [n.id for n in ast.walk(jit[name]) if isinstance(n, ast.Name) and n.id in jit]
    parts = []
    for name in sorted(wanted, key=lambda n: jit[n].lineno):
        node = jit[name]
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        parts.append("\n".join(lines[start:node.end_lineno]))
    return ("# Extracted at benchmark time by benchmarks/peer_vllm.py from the serving engine's\n"
            f"# {KERNEL_PATH}; not part of hopper_moe.\n"
            "import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(parts) + "\n")


def extract(source: str, dest: Optional[str] = None) -> str:
    """Write the kernel module and the config tables of ``source`` to ``dest``; returns dest."""
    dest = dest or default_dir()
    text, configs = _read_members(source)
    os.makedirs(os.path.join(dest, "configs"), exist_ok=True)
    with open(os.path.join(dest, MODULE_FILE), "w") as f:
        f.write(kernel_source(text))
    for name, data in configs.items():
        with open(os.path.join(dest, "configs", name), "wb") as f:
            f.write(data)
    with open(os.path.join(dest, "SOURCE.txt"), "w") as f:
        f.write(f"{os.path.abspath(source)}\n{len(configs)} config tables\n")
    return dest


# ------------------------------------------------------------------------------ configs
def device_file_name(device: torch.device) -> str:
    """The engine's device part of a config file name (H200 family -> NVIDIA_H200)."""
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def config_file_name(num_experts: int, n: int, dtype: Optional[str],
                     block_shape: Optional[list[int]], device_name: str) -> str:
    sel = f",dtype={dtype}" if dtype else ""
    if block_shape and all(block_shape):
        sel += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return f"E={num_experts},N={n},device_name={device_name}{sel}.json"


def default_config(m: int, num_experts: int, dtype: Optional[str],
                   block_shape: Optional[list[int]]) -> dict:
    """The engine's default tiles on CUDA when no tuned table exists (vLLM 0.33.0's numbers)."""
    if dtype == "fp8_w8a8" and block_shape is not None:
        small = m <= 8 and block_shape[0] % 64 == 0
        return {"BLOCK_SIZE_M": 16 if m <= 64 else 64,
                "BLOCK_SIZE_N": 64 if small else block_shape[0],
                "BLOCK_SIZE_K": block_shape[1], "GROUP_SIZE_M": 1 if m <= 16 else 32,
                "num_warps": 4, "num_stages": (4 if m <= 4 else 3) if small else 3}
    block_m = 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if m <= 64 else 128,
            "BLOCK_SIZE_K": 128 if dtype == "fp8_w8a8" or m <= 64 else 64,
            "GROUP_SIZE_M": 16 if m // max(num_experts, 1) > 128 else 1,
            "num_warps": 4 if m <= 128 else 8, "num_stages": 4 if m <= 32 else 3}


# ------------------------------------------------------------------------------ the layer
def _quant_kind(quant) -> tuple[Optional[str], Optional[list[int]], bool]:
    """(the engine's dtype selector, block shape, per-token activations) of a QuantConfig."""
    if quant is None:
        return None, None, False
    if quant.block_shape is None and quant.per_out_ch_quant and not quant.per_act_token_quant:
        raise RuntimeError("peer_vllm: the engine's kernel takes per-channel weight scales "
                           "only with per-token activation scales (per_channel_quant)")
    block = [int(b) for b in quant.block_shape] if quant.block_shape is not None else None
    return "fp8_w8a8", block, bool(quant.per_act_token_quant)


# How a peer row picks its tiles. "engine": the engine's own choice (tuned table, else its
# default rule). "default": the default rule even where a tuned table exists. "swap": the
# engine's choice with the FP8 swap-AB decision flipped. docs/BENCHMARK.md's peer table is the
# best of the three per row (bench_moe.py --backends peer,peer_default,peer_swap).
VARIANTS = ("engine", "default", "swap")


def _engine_swaps(cfg: dict, quant, device: torch.device) -> bool:
    """The engine's enable_swap_ab: FP8 on SM90 with narrow token tiles runs swapped."""
    return bool(quant is not None and device.type == "cuda"
                and torch.cuda.get_device_capability(device) == (9, 0)
                and cfg["BLOCK_SIZE_M"] < 64 and cfg["BLOCK_SIZE_N"] >= 64)


_KERNELS: dict = {}  # module file -> its kernel: one JIT function per file, shared by variants


def _load_kernel(path: str):
    if path not in _KERNELS:
        spec = importlib.util.spec_from_file_location(
            f"hopper_moe_peer_vllm_kernel_{len(_KERNELS)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _KERNELS[path] = getattr(module, KERNEL_NAME)
    return _KERNELS[path]


class VllmTritonPipeline:
    """The engine's Triton MoE layer (see the module docstring) on an extracted kernel;
    ``variant`` (VARIANTS) says how its tiles are chosen."""

    def __init__(self, folder: Optional[str] = None, variant: str = "engine"):
        if variant not in VARIANTS:
            raise RuntimeError(f"peer_vllm: variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        self.folder = folder or default_dir()
        path = os.path.join(self.folder, MODULE_FILE)
        if not os.path.isfile(path):
            raise RuntimeError(f"peer_vllm: no extracted kernel in {self.folder} (run "
                               "python benchmarks/peer_vllm.py extract SOURCE)")
        self.kernel = _load_kernel(os.path.realpath(path))
        self._tables: dict[str, Optional[dict]] = {}

    def config_for(self, m: int, w1: torch.Tensor, w2: torch.Tensor, quant
                   ) -> tuple[dict, str]:
        """(the tiles, where they come from) for m tokens, as the engine picks them (variant
        "default": its default rule; "swap": the key SWAP_AB holds the flipped decision)."""
        dtype, block, _ = _quant_kind(quant)
        if self.variant == "default":
            return default_config(m, w2.shape[0], dtype, block), "default rule"
        cfg, how = self._engine_config(m, w1, w2, quant)
        if self.variant == "swap" and quant is not None:  # the kernel swaps FP8 operands only
            cfg["SWAP_AB"] = not _engine_swaps(cfg, quant, w1.device)
            how += f", swap-AB {'on' if cfg['SWAP_AB'] else 'off'} (flipped)"
        elif self.variant == "swap":
            how += " (16-bit: no swap-AB in the kernel; the engine's choice)"
        return cfg, how

    def _engine_config(self, m: int, w1: torch.Tensor, w2: torch.Tensor, quant
                       ) -> tuple[dict, str]:
        dtype, block, _ = _quant_kind(quant)
        name = config_file_name(w2.shape[0], w2.shape[2], dtype, block,
                                device_file_name(w1.device))
        if name not in self._tables:
            path = os.path.join(self.folder, "configs", name)
            table = None
            if os.path.isfile(path):
                with open(path) as f:
                    raw = json.load(f)
                raw.pop("triton_version", None)
                table = {int(k): v for k, v in raw.items()}
            self._tables[name] = table
        table = self._tables[name]
        if table:
            return dict(table[min(table, key=lambda k: abs(k - m))]), "tuned " + name
        return default_config(m, w2.shape[0], dtype, block), "default (no " + name + ")"

    @staticmethod
    def _quantize(a: torch.Tensor, scale: Optional[torch.Tensor], quant):
        from hopper_moe import ops
        dtype, block, per_token = _quant_kind(quant)
        if dtype is None:
            return a, None
        if block is not None:
            return ops.per_token_group_quant_fp8(a, block[1])
        return ops.scaled_fp8_quant(a, scale, use_per_token_if_dynamic=per_token)

    def _gemm(self, a, b, c, a_scale, b_scale, topk_weights, sorted_ids, expert_ids,
              num_post_pad, mul_routed_weight: bool, top_k: int, config: dict, quant) -> None:
        import triton
        import triton.language as tl
        dtype, block, per_token = _quant_kind(quant)
        fp8 = dtype is not None
        cfg = dict(config)
        block_k = cfg.pop("BLOCK_SIZE_K")
        if block is not None:
            block_k = min(block_k, block[0], block[1])
        cfg.pop("SPLIT_K", None)  # the launch passes SPLIT_K=1 itself, as the engine does
        swap = cfg.pop("SWAP_AB") if "SWAP_AB" in cfg else _engine_swaps(cfg, quant, a.device)
        m = a.shape[0]
        num_tokens = m * top_k
        if sorted_ids is not None:
            em = sorted_ids.shape[0]
            if m < cfg["BLOCK_SIZE_M"]:
                em = min(em, m * top_k * cfg["BLOCK_SIZE_M"])
        else:
            em = num_tokens * cfg["BLOCK_SIZE_M"]
        grid = (triton.cdiv(em, cfg["BLOCK_SIZE_M"]) * triton.cdiv(b.shape[1],
                                                                   cfg["BLOCK_SIZE_N"]),)
        if a_scale is not None and a_scale.ndim == 0:
            a_scale = a_scale.reshape(1)
        compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                   torch.float32: tl.float32}[c.dtype]
        self.kernel[grid](
            a, b, c, None, a_scale, b_scale, topk_weights, sorted_ids, expert_ids, num_post_pad,
            b.shape[1], b.shape[2], em, num_tokens,
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
            c.stride(1), c.stride(2),
            a_scale.stride(0) if a_scale is not None and a_scale.ndim == 2 else 0,
            a_scale.stride(1) if a_scale is not None and a_scale.ndim == 2 else 0,
            b_scale.stride(0) if b_scale is not None else 0,
            b_scale.stride(2) if b_scale is not None and b_scale.ndim == 3 else 0,
            b_scale.stride(1) if b_scale is not None and b_scale.ndim >= 2
            and b_scale.shape[1] > 1 else 0,
            0, 0,
            0 if block is None else block[0], 0 if block is None else block[1],
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute,
            use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False,
            per_channel_quant=per_token, naive_block_assignment=sorted_ids is None,
            HAS_BIAS=False, BLOCK_SIZE_K=block_k, SWAP_AB=swap, SPLIT_K=1, **cfg)

    def __call__(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, quant=None) -> torch.Tensor:
        """out [M, H] = the layer (SiLU(gate)*up experts, routed weights in GEMM2), as the
        engine's fused_experts_impl computes it (no expert_map, weights applied after GEMM2)."""
        from hopper_moe import ops
        m, top_k = topk_ids.shape
        e, n, _ = w1.shape
        hidden = w2.shape[1]
        config, _ = self.config_for(m, w1, w2, quant)
        cache13 = torch.empty(m * top_k * max(n, hidden), dtype=x.dtype, device=x.device)
        cache1 = cache13[:m * top_k * n].view(m, top_k, n)
        cache3 = cache13[:m * top_k * hidden].view(m, top_k, hidden)
        cache2 = torch.empty((m * top_k, n // 2), dtype=x.dtype, device=x.device)
        out = torch.empty_like(x)
        xq, x_scale = self._quantize(x, quant.a1_scale if quant is not None else None, quant)
        block_m = config["BLOCK_SIZE_M"]
        if m * top_k * 4 <= e:  # the engine's naive assignment: one block per slot
            sorted_ids, expert_ids = None, topk_ids.view(-1)
            num_post_pad = torch.full((1,), topk_ids.numel() * block_m, dtype=torch.int32,
                                      device=x.device)
        else:
            sorted_ids, expert_ids, num_post_pad = ops.moe_align_block_size_buffers(
                topk_ids, e, block_m)
            ops.moe_align_block_size(topk_ids, e, block_m, sorted_ids, expert_ids, num_post_pad)
        w1_scale = quant.w1_scale if quant is not None else None
        w2_scale = quant.w2_scale if quant is not None else None
        self._gemm(xq, w1, cache1, x_scale, w1_scale, topk_weights, sorted_ids, expert_ids,
                   num_post_pad, False, top_k, config, quant)
        ops.silu_and_mul(cache2, cache1.view(-1, n))
        hq, h_scale = self._quantize(cache2, quant.a2_scale if quant is not None else None,
                                     quant)
        self._gemm(hq, w2, cache3, h_scale, w2_scale, topk_weights, sorted_ids, expert_ids,
                   num_post_pad, True, 1, config, quant)
        ops.moe_sum(cache3, out)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="take the kernel and its configs out of SOURCE")
    ex.add_argument("source")
    ex.add_argument("--dest", default=None, help=f"folder (default {default_dir()})")
    args = p.parse_args(argv)
    dest = extract(args.source, args.dest)
    with open(os.path.join(dest, "SOURCE.txt")) as f:
        print(f"peer_vllm: kernel and {f.read().splitlines()[1]} in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
