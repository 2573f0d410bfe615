"""benchmarks/peer_vllm.py: the engine's Triton pipeline as a measuring peer.

Extraction and config choice run on a synthetic distribution (no vLLM needed). The layer's
numbers need the engine's real kernel: they run when a vLLM 0.33.0 source is at hand
(HOPPER_MOE_PEER_SOURCE, or the sdist tools/vllm_kernel_tests.sh downloads), in Triton's CPU
interpreter on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import peer_vllm  # noqa: E402

FAKE_MODULE = '''
import functools
import triton
import triton.language as tl

LIMIT = 3


@triton.jit
def helper(x):
    return x + 1


@triton.jit
def unrelated(x):
    return x


def host_side(a):
    return a


@triton.jit
def fused_moe_kernel(out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, helper(offs))
'''
CFG_NAME = "E=8,N=128,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
CFG = {"triton_version": "3.6.0", "1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64,
                                        "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1},
       "64": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8}}


def _fake_tree(root) -> str:
    base = root / "vllm-0.33.0"
    mod = base / peer_vllm.KERNEL_PATH
    mod.parent.mkdir(parents=True)
    mod.write_text(FAKE_MODULE)
    (mod.parent / "configs").mkdir()
    (mod.parent / "configs" / CFG_NAME).write_text(json.dumps(CFG))
    (mod.parent / "configs" / "README").write_text("not a table")
    return str(base)


def _pack(tree: str, kind: str, dest) -> str:
    if kind == "folder":
        return tree
    top = os.path.dirname(tree)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tree) for f in fs]
    if kind == "wheel":
        path = str(dest / "vllm-0.33.0-py3-none-any.whl")
        with zipfile.ZipFile(path, "w") as zf:
            for f in files:  # a wheel has vllm/ at its top
                zf.write(f, os.path.relpath(f, tree))
        return path
    path = str(dest / "vllm-0.33.0.tar.gz")
    with tarfile.open(path, "w:gz") as tf:
        for f in files:  # an sdist has a vllm-0.33.0/ folder on top
            tf.add(f, os.path.relpath(f, top))
    return path


@pytest.mark.parametrize("kind", ["folder", "wheel", "tarball"])
def test_extract_takes_the_kernel_its_triton_helpers_and_the_tables(tmp_path, kind):
    src = _pack(_fake_tree(tmp_path / "src"), kind, tmp_path)
    dest = peer_vllm.extract(src, str(tmp_path / "out"))
    text = open(os.path.join(dest, peer_vllm.MODULE_FILE)).read()
    assert "def fused_moe_kernel(" in text and "def helper(" in text
    assert "unrelated" not in text and "host_side" not in text
    # each with its decorator, in source order
    assert "@triton.jit\ndef fused_moe_kernel(" in text and "@triton.jit\ndef helper(" in text
    assert text.index("def helper(") < text.index("def fused_moe_kernel(")
    assert os.listdir(os.path.join(dest, "configs")) == [CFG_NAME]


def test_extract_refuses_a_source_without_the_kernel(tmp_path):
    (tmp_path / "vllm").mkdir()
    with pytest.raises(RuntimeError, match="has no vllm/model_executor"):
        peer_vllm.extract(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="not a wheel, a tarball or a folder"):
        bogus = tmp_path / "x.bin"
        bogus.write_bytes(b"\0" * 10)
        peer_vllm.extract(str(bogus), str(tmp_path / "out"))


def test_config_file_names_are_the_engines():
    name = peer_vllm.config_file_name(256, 512, "fp8_w8a8", [128, 128], "NVIDIA_H200")
    assert name == "E=256,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
    assert peer_vllm.config_file_name(8, 7168, None, None, "NVIDIA_H100_80GB_HBM3") == \
        "E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3.json"


def test_default_config_is_the_engines_rule():
    # bf16, few tokens: 16-row tiles, 4 stages; many tokens: 128-row tiles, 8 warps
    small = peer_vllm.default_config(8, 64, None, None)
    assert (small["BLOCK_SIZE_M"], small["BLOCK_SIZE_N"], small["BLOCK_SIZE_K"],
            small["num_stages"]) == (16, 64, 128, 4)
    big = peer_vllm.default_config(4096, 8, None, None)
    assert (big["BLOCK_SIZE_M"], big["BLOCK_SIZE_N"], big["BLOCK_SIZE_K"], big["GROUP_SIZE_M"],
            big["num_warps"]) == (128, 128, 64, 16, 8)
    block = peer_vllm.default_config(4, 256, "fp8_w8a8", [128, 128])
    assert (block["BLOCK_SIZE_N"], block["BLOCK_SIZE_K"], block["num_stages"]) == (64, 128, 4)


class _Quant:
    def __init__(self, block_shape=None, per_act_token_quant=False, per_out_ch_quant=False):
        self.block_shape = block_shape
        self.per_act_token_quant = per_act_token_quant
        self.per_out_ch_quant = per_out_ch_quant


def test_per_channel_weights_need_per_token_activations():
    with pytest.raises(RuntimeError, match="per-channel weight scales only with per-token"):
        peer_vllm._quant_kind(_Quant(per_out_ch_quant=True))
    assert peer_vllm._quant_kind(_Quant(per_act_token_quant=True, per_out_ch_quant=True)) == \
        ("fp8_w8a8", None, True)
    # per-token activations with per-tensor weights: the kernel broadcasts the weight scale
    assert peer_vllm._quant_kind(_Quant(per_act_token_quant=True)) == ("fp8_w8a8", None, True)


def test_config_for_takes_the_nearest_tuned_row_else_the_default(tmp_path, monkeypatch):
    dest = peer_vllm.extract(_fake_tree(tmp_path / "src"), str(tmp_path / "out"))
    peer = peer_vllm.VllmTritonPipeline(dest)
    w1, w2 = torch.empty(8, 256, 64), torch.empty(8, 64, 128)
    monkeypatch.setattr(peer_vllm, "device_file_name", lambda device: "NVIDIA_H200")
    cfg, how = peer.config_for(40, w1, w2, _Quant())
    assert cfg["BLOCK_SIZE_M"] == 64 and how == "tuned " + CFG_NAME
    cfg, how = peer.config_for(20, w1, w2, _Quant())
    assert cfg["BLOCK_SIZE_M"] == 16
    cfg, how = peer.config_for(20, w1, w2, None)  # bf16: no table in the fake tree
    assert how.startswith("default") and cfg == peer_vllm.default_config(20, 8, None, None)


def test_variants_choose_the_default_rule_or_flip_swap_ab(tmp_path, monkeypatch):
    dest = peer_vllm.extract(_fake_tree(tmp_path / "src"), str(tmp_path / "out"))
    monkeypatch.setattr(peer_vllm, "device_file_name", lambda device: "NVIDIA_H200")
    w1, w2 = torch.empty(8, 256, 64), torch.empty(8, 64, 128)
    cfg, how = peer_vllm.VllmTritonPipeline(dest, "default").config_for(40, w1, w2, _Quant())
    assert how == "default rule" and cfg == peer_vllm.default_config(40, 8, "fp8_w8a8", None)
    # tuned M = 64 row: 64-row tiles, which the engine does not swap; the variant does (on the
    # CPU the engine never swaps, so the flip is always "on")
    cfg, how = peer_vllm.VllmTritonPipeline(dest, "swap").config_for(40, w1, w2, _Quant())
    assert cfg["SWAP_AB"] is True and "flipped" in how
    cfg, how = peer_vllm.VllmTritonPipeline(dest, "swap").config_for(40, w1, w2, None)
    assert "SWAP_AB" not in cfg and "16-bit" in how
    with pytest.raises(RuntimeError, match="variant must be one of"):
        peer_vllm.VllmTritonPipeline(dest, "best")


def test_pipeline_without_an_extracted_kernel_says_how_to_get_one(tmp_path):
    with pytest.raises(RuntimeError, match="peer_vllm.py extract"):
        peer_vllm.VllmTritonPipeline(str(tmp_path))


def _real_source():
    named = os.environ.get("HOPPER_MOE_PEER_SOURCE")
    if named:  # named on purpose (CI names the sdist): missing is a failure, not a skip
        assert os.path.exists(named), f"HOPPER_MOE_PEER_SOURCE={named} does not exist"
        return named
    path = os.path.join(ROOT, "build", "vllm-kernel-tests", "vllm-0.33.0.tar.gz")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def real_peer(tmp_path_factory):
    src = _real_source()
    if src is None:
        pytest.skip("no vLLM 0.33.0 source (HOPPER_MOE_PEER_SOURCE, or the sdist "
                    "tools/vllm_kernel_tests.sh downloads into build/vllm-kernel-tests)")
    return peer_vllm.VllmTritonPipeline(peer_vllm.extract(src, str(tmp_path_factory.mktemp("p"))))


def _layer(dtype, m, e=8, k=2, hidden=256, inter=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w1 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    tw, ti = torch.topk(torch.softmax(torch.randn(m, e, generator=g), -1), k)
    return x, w1, w2, tw, ti.to(torch.int32)


# bf16 is left to the GPU: Triton's CPU interpreter computes a bf16 tl.dot wrongly (see
# hopper_moe/kernels/moe_gemm.py, INTERPRETER); fp16 and fp32 take the same path.
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_real_pipeline_matches_the_reference(real_peer, dtype, m):
    import hopper_moe
    # m = 1 over 16 experts: the naive one-block-per-slot assignment (1 x 2 x 4 <= 16);
    # the others go through moe_align_block_size.
    x, w1, w2, tw, ti = _layer(dtype, m, e=16 if m == 1 else 8)
    out = real_peer(x, w1, w2, tw, ti)
    ref = hopper_moe.fused_experts(x, w1, w2, tw, ti, backend="reference")
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", ["engine", "swap"])
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_real_pipeline_fp8_matches_the_reference(real_peer, scheme, variant):
    import hopper_moe
    from hopper_moe.quant import make_quant_config
    x, w1, w2, tw, ti = _layer(torch.float16, 6)
    w1q, w2q, quant = make_quant_config(w1, w2, "fp8_" + scheme)
    peer = real_peer if variant == "engine" else \
        peer_vllm.VllmTritonPipeline(real_peer.folder, variant)
    out = peer(x, w1q, w2q, tw, ti, quant)
    ref = hopper_moe.fused_experts(x, w1q, w2q, tw, ti, quant=quant, backend="reference")
    # FP8 activations: a few e4m3 steps of the inputs of each GEMM
    torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=6e-2)


def test_extract_command_line(tmp_path):
    src = _fake_tree(tmp_path / "src")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peer_vllm.py"),
                        "extract", src, "--dest", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 config tables" in r.stdout


def _row(backend, us, m=1):
    return {"shape": "mixtral", "dtype": "bf16", "M": m, "backend": backend, "us": us,
            "floor_us": 100.0, "pct_floor": 100.0 * 100.0 / us, "rel_err": 1e-3}


def test_bench_table_best_is_hopper_moes_and_compared_with_the_peer():
    import bench_moe
    rows = [_row("torch", 400.0), _row("triton", 200.0), _row("peer", 180.0),
            _row("peer_default", 150.0), _row("peer_swap", 300.0)]
    headers, lines = bench_moe.compact_table(
        rows, ["torch", "triton", "peer", "peer_default", "peer_swap"])
    cells = dict(zip(headers, lines[0]))
    assert cells["best"] == "triton"  # a peer row is never hopper_moe's best
    # against the fastest peer row
    assert cells["best × peer"] == "0.75" and cells["best × torch"] == "2.00"
    headers, _ = bench_moe.compact_table(rows[:2], ["torch", "triton"])
    assert "best × peer" not in headers


def test_auto_check_ignores_the_peer(tmp_path):
    path = tmp_path / "r.json"
    rows = [_row("triton", 200.0), _row("peer", 100.0), _row("peer_default", 90.0),
            _row("peer_swap", 95.0), dict(_row("auto", 202.0), how="auto: triton")]
    path.write_text(json.dumps({"rows": rows}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "auto_check.py"), str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "| mixtral | bf16 | 1 | triton | 200.0 | triton | 202.0 | 1.010 | yes |" in r.stdout


def test_triton_sass_compiles_the_peer_kernel_for_sm90(real_peer):
    # ptxas for sm_90a without a GPU: the engine's kernel at a small bf16 tile uses wgmma
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "triton_sass.py"), "--peer",
                        real_peer.folder, "--scheme", "bf16", "--block", "64,128,64",
                        "--warps", "4", "--stages", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "peer (the engine's fused_moe_kernel)" in r.stdout
    assert "MMA: HGMMA.64x128x16.F32.BF16" in r.stdout and "local memory: none" in r.stdout
