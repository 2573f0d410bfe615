"""The measured backend oracle: table lookup (shape, scheme, token count), the rules on top
of it (supported backends only, never torch on CUDA while a GPU backend can run), the table
files (user folder over shipped), explain_backend and fused_experts' use of it."""
from __future__ import annotations

import json

import pytest
import torch

import hopper_moe
from hopper_moe import api, oracle, settings

MIXTRAL = (8, 2, 4096, 14336)
QWEN = (128, 8, 2048, 768)


def _table(entries):
    return oracle._index({"entries": entries}, "test.json")


def _entry(shape, scheme, m, **us):
    e, k, h, i = shape
    return dict(shape=dict(E=e, topk=k, H=h, I=i), scheme=scheme, m=m, us=us)


TABLE = _table([
    _entry(MIXTRAL, "bf16", 1, triton=179.0, sm90=204.0, torch=400.0),
    _entry(MIXTRAL, "bf16", 64, triton=700.0, sm90=650.0, torch=900.0),
    _entry(MIXTRAL, "bf16", 4096, triton=5000.0, sm90=6000.0, torch=4000.0),
    _entry(QWEN, "bf16", 1, triton=40.0, sm90=38.0, torch=300.0),
    _entry(QWEN, "fp8_tensor", 1, triton=30.0, sm90=33.0, torch=300.0),
])
ALL = ("sm90", "triton", "torch", "reference")


@pytest.mark.parametrize("m, want", [(1, "triton"), (2, "sm90"), (64, "sm90"),
                                     (65, "triton"), (10 ** 6, "triton")])
def test_measured_row_by_token_count(m, want):
    """The smallest measured M >= the call's (the largest beyond them all); torch, fastest at
    M = 4096 here, is never taken on CUDA while a GPU backend is supported."""
    choice = oracle.choose("cuda", "bf16", m, ALL, MIXTRAL, TABLE)
    assert choice.backend == want and choice.source == "measured"


def test_measured_nearest_shape():
    # An unmeasured shape close to qwen3's takes qwen3's row; exact shapes take their own.
    assert oracle.choose("cuda", "bf16", 1, ALL, (128, 8, 2048, 512), TABLE).backend == "sm90"
    assert oracle.choose("cuda", "bf16", 1, ALL, (8, 2, 4096, 7168), TABLE).backend == "triton"
    choice = oracle.choose("cuda", "bf16", 1, ALL, (128, 8, 2048, 512), TABLE)
    assert "nearest measured shape E=128 topk=8 H=2048 I=768" in choice.reason
    assert "this shape" in oracle.choose("cuda", "bf16", 1, ALL, QWEN, TABLE).reason


def test_measured_skips_unsupported_and_falls_back():
    # sm90 fastest but not supported (e.g. H not a multiple of 8): the next measured one.
    assert oracle.choose("cuda", "bf16", 1, ("triton", "torch"), QWEN, TABLE).backend == "triton"
    # Only torch can run: torch, even on CUDA.
    assert oracle.choose("cuda", "bf16", 1, ("torch",), QWEN, TABLE).backend == "torch"
    # A scheme the table does not hold: the static rule (Triton on CUDA).
    choice = oracle.choose("cuda", "fp8_block", 1, ALL, QWEN, TABLE)
    assert choice.backend == "triton" and choice.source == "static"
    # No table at all (another GPU): static too; on the CPU torch.
    assert oracle.choose("cuda", "bf16", 1, ALL, QWEN, None).backend == "triton"
    assert oracle.choose("cpu", "bf16", 1, ALL, QWEN, TABLE).backend == "sm90"  # measured
    assert oracle.choose("cpu", "bf16", 1, ALL, QWEN, None).backend == "torch"
    with pytest.raises(RuntimeError, match="no fused_experts backend can run"):
        oracle.choose("cuda", "bf16", 1, (), QWEN, TABLE)


def test_choice_explains_itself():
    choice = oracle.choose("cuda", "bf16", 1, ("triton", "torch"), QWEN, TABLE)
    text = str(choice)
    assert text.startswith("triton (measured):")
    assert "test.json" in text and "M = 1" in text and "sm90 38.0 us" in text
    assert "skipped" in text and "sm90" in text.split("skipped")[1]


def test_table_files_user_folder_wins(tmp_path, monkeypatch):
    """load_measured reads oracle,device_name=<GPU>.json from the user's folder before the
    shipped one."""
    name = oracle.measured_file_name("Test GPU 9000")
    assert name == "oracle,device_name=Test_GPU_9000.json"
    (tmp_path / name).write_text(json.dumps({"entries": [
        _entry(QWEN, "bf16", 8, sm90=1.0, triton=2.0)]}))
    monkeypatch.setattr(settings, "CONFIG_DIR", str(tmp_path))
    oracle.load_measured.cache_clear()
    try:
        table = oracle.load_measured("Test GPU 9000")
        assert table["_file"].endswith(name)
        assert table["bf16"][QWEN] == [(8, {"sm90": 1.0, "triton": 2.0})]
        assert oracle.load_measured("Another GPU") is None
    finally:
        oracle.load_measured.cache_clear()


def test_shipped_h200_table_is_complete():
    """The shipped H200 table times every backend that ran, per row, for the shapes and
    schemes of docs/BENCHMARK.md, and every row's fastest GPU backend is a real backend."""
    table = oracle.load_measured("NVIDIA H200")
    assert table is not None, "hopper_moe/configs/oracle,device_name=NVIDIA_H200.json missing"
    for scheme in ("bf16", "fp8_tensor", "fp8_channel"):
        assert MIXTRAL in table[scheme] and QWEN in table[scheme], scheme
    assert (256, 8, 7168, 256) in table["fp8_block"]
    for by_shape in (v for k, v in table.items() if k != "_file"):
        for rows in by_shape.values():
            for m, times in rows:
                assert m >= 1 and {"triton", "torch"} <= set(times)
                assert all(t > 0 for t in times.values())


def test_explain_backend_and_auto_agree():
    """explain_backend names what fused_experts(backend="auto") runs."""
    w1 = torch.randn(4, 64, 32, dtype=torch.bfloat16)
    w2 = torch.randn(4, 32, 32, dtype=torch.bfloat16)
    choice = hopper_moe.explain_backend(3, w1, w2, 2)
    assert choice.backend == "torch" and choice.source == "static"
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    w = torch.full((3, 2), 0.5)
    calls = []
    real = api._BACKENDS["torch"]
    monkey = api._Backend(lambda *a, **k: calls.append(1) or real.run(*a, **k),
                          real.is_available)
    old = api._BACKENDS["torch"]
    api._BACKENDS["torch"] = monkey
    try:
        hopper_moe.fused_experts(x, w1, w2, w, ids)
    finally:
        api._BACKENDS["torch"] = old
    assert calls == [1]


@pytest.mark.parametrize("bad, match", [
    (dict(num_tokens=-1), "num_tokens must be an int >= 0"),
    (dict(num_tokens=True), "num_tokens must be an int >= 0"),
    (dict(top_k=0), "top_k must be an int >= 1"),
    (dict(w1=torch.zeros(2, 2)), "w1 and w2 must be 3-D"),
])
def test_explain_backend_bad_input(bad, match):
    args = dict(num_tokens=1, w1=torch.zeros(2, 8, 4), w2=torch.zeros(2, 4, 4), top_k=1)
    args.update(bad)
    with pytest.raises(RuntimeError, match=match):
        hopper_moe.explain_backend(args["num_tokens"], args["w1"], args["w2"], args["top_k"])


def test_sm90_supports_names_what_it_cannot_run():
    from hopper_moe.backends import sm90
    from hopper_moe.quant import QuantConfig

    cpu = torch.device("cpu")
    w1, w2 = torch.zeros(2, 16, 12), torch.zeros(2, 12, 8)  # H = 12: not a multiple of 8
    assert not sm90.supports(cpu, torch.bfloat16, w1, w2, None)
    assert "hidden size H" in sm90.unsupported_reason(cpu, w1, w2, None)
    w1, w2 = torch.zeros(2, 16, 16), torch.zeros(2, 16, 8)
    assert sm90.supports(cpu, torch.bfloat16, w1, w2, None)
    s = torch.ones(2)
    block = QuantConfig(s, s, block_shape=[128, 128])
    assert "block-wise FP8" in sm90.unsupported_reason(cpu, w1, w2, block)
