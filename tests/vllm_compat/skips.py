"""The table of vLLM 0.33.0 kernel tests the harness does not run against hopper_moe, and why.

Only features hopper_moe does not claim are skipped (docs/OPS.md lists what it claims): FP4
(NVFP4, MXFP4), int4/int8/WNA16, Marlin and the other vendor kernels, activations other than
SiLU(gate) * up, vLLM's workspace manager and scratch buffers, vLLM-internal Python plumbing
(Triton launcher details, layer oracles), and ops hopper_moe does not register.

SELECTED   upstream test files the harness runs (each tests an op or the layer hopper_moe claims).
NOT_RUN    every other file of tests/kernels/{moe,quantization,core} and tests/kernels/*.py,
           by glob, with the reason it is not taken (the harness reports any file that matches
           neither, so a new upstream file cannot be dropped silently).
SKIPS      tests inside SELECTED files that are skipped: (node id glob, reason). A glob matches
           the node id relative to the extracted sdist, e.g.
           ``tests/kernels/moe/test_moe.py::test_fused_moe_wn16[...]``.
CPU_SKIPS  tests skipped in the CPU run only (where tensors live; a reference the interpreter breaks).
CPU_GPU_SIZED  the GPU-sized cases the CPU run leaves out for time (the GPU run and --all take them).
"""
from __future__ import annotations

import fnmatch

SELECTED = {
    "tests/kernels/moe/test_fused_topk.py": "topk_softmax, topk_sigmoid (fused_topk, fused_topk_bias)",
    "tests/kernels/moe/test_grouped_topk.py": "grouped_topk",
    "tests/kernels/moe/test_moe_align_block_size.py": "moe_align_block_size",
    "tests/kernels/moe/test_moe_permute_unpermute.py": "moe_permute, moe_unpermute",
    "tests/kernels/test_shuffle_rows.py": "shuffle_rows",
    "tests/kernels/moe/test_moe.py": "fused_experts (bf16/fp16/fp32), moe_sum, moe_align_block_size opcheck",
    "tests/kernels/moe/test_triton_moe_ptpc_fp8.py": "fused_experts FP8 per-token x per-channel",
    "tests/kernels/moe/test_block_fp8.py": "fused_experts FP8 block [128,128], per_token_group_fp8_quant",
    "tests/kernels/moe/test_cutlass_moe.py": "cutlass_moe_mm, get_cutlass_moe_mm_data, shuffle_rows (FP8 CUTLASS MoE path)",
    "tests/kernels/core/test_activation.py": "silu_and_mul",
    "tests/kernels/test_fused_quant_activation.py": "silu_and_mul, silu_and_mul_quant",
    "tests/kernels/quantization/test_fp8_quant.py": "static/dynamic/per-token scaled_fp8_quant",
    "tests/kernels/quantization/test_fp8_quant_group.py": "static_scaled_fp8_quant group_shape (QuantFP8)",
    "tests/kernels/quantization/test_per_token_group_quant.py": "per_token_group_fp8_quant",
    "tests/kernels/quantization/test_block_fp8.py": "per_token_group_quant_fp8 (the first test)",
}

# Reasons, by category (the summary counts by these keys).
FP4 = "FP4 (NVFP4 / MXFP4): hopper_moe has no FP4 ops"
INT = "int4 / int8 / WNA16 / W4A8 quantization: hopper_moe runs bf16/fp16/fp32 and FP8 e4m3 only"
MARLIN = "Marlin / Humming / Machete kernels: not part of hopper_moe"
ACT = "activation other than SiLU(gate)*up (GELU, SwiGLU-OAI, clamp/limit, ReLU2, ...): not claimed"
WORKSPACE = "vLLM's workspace manager / scratch buffers: vLLM-internal Python, not an op"
VENDOR = "vendor or backend kernels hopper_moe does not provide (DeepGEMM, FlashInfer, TRT-LLM, AITER/ROCm, CuteDSL, b12x, XPU, CPU-backend ops, Triton OAI kernels)"
DIST = "multi-GPU / all2all / DP / EP dispatch (DeepEP, MoRI, NIXL, pplx): not part of hopper_moe"
INTERNAL = "vLLM-internal Python (layer oracles, config, weight loading, Triton launcher details), no hopper_moe op involved"
NOT_AN_OP = "op hopper_moe does not register"
BLOCK_MM = "dense (non-MoE) block FP8 GEMM (w8a8_block_fp8_matmul and its backends): not a hopper_moe op"

NOT_RUN = [
    # moe/
    ("tests/kernels/moe/*nvfp4*", FP4), ("tests/kernels/moe/*mxfp4*", FP4),
    ("tests/kernels/moe/*fp4*", FP4), ("tests/kernels/moe/test_ocp_mx_moe.py", FP4),
    ("tests/kernels/moe/*int4*", INT), ("tests/kernels/moe/*int8*", INT),
    ("tests/kernels/moe/*mxint4*", INT),
    ("tests/kernels/moe/*marlin*", MARLIN),
    ("tests/kernels/moe/*deepgemm*", VENDOR), ("tests/kernels/moe/*deep_gemm*", VENDOR),
    ("tests/kernels/moe/*flashinfer*", VENDOR), ("tests/kernels/moe/*trtllm*", VENDOR),
    ("tests/kernels/moe/*rocm*", VENDOR), ("tests/kernels/moe/*aiter*", VENDOR),
    ("tests/kernels/moe/*cutedsl*", VENDOR), ("tests/kernels/moe/*b12x*", VENDOR),
    ("tests/kernels/moe/*flydsl*", VENDOR), ("tests/kernels/moe/*zen_cpu*", VENDOR),
    ("tests/kernels/moe/test_cpu_*", VENDOR), ("tests/kernels/moe/*gpt_oss*", VENDOR),
    ("tests/kernels/moe/*oai_triton*", VENDOR), ("tests/kernels/moe/*muse_spark*", VENDOR),
    ("tests/kernels/moe/test_gemma4router.py", VENDOR),
    ("tests/kernels/moe/test_topk_softplus_sqrt.py", NOT_AN_OP),
    ("tests/kernels/moe/test_situ_mul_fp8_quant.py", ACT),
    ("tests/kernels/moe/test_triton_moe_no_act_mul.py", ACT),
    ("tests/kernels/moe/test_silu_mul_fp8_quant_deep_gemm.py", VENDOR),
    ("tests/kernels/moe/test_silu_mul_per_token_group_quant_fp8_colmajor.py", NOT_AN_OP),
    ("tests/kernels/moe/*deepep*", DIST), ("tests/kernels/moe/*mori*", DIST),
    ("tests/kernels/moe/*naive_dp*", DIST), ("tests/kernels/moe/*moonep*", DIST),
    ("tests/kernels/moe/test_batched_moe.py", DIST),
    ("tests/kernels/moe/test_modular_kernel_combinations.py", DIST),
    ("tests/kernels/moe/test_profile_modular_kernel.py", DIST),
    ("tests/kernels/moe/parallel_utils.py", DIST),
    ("tests/kernels/moe/test_count_expert_num_tokens.py", NOT_AN_OP),
    ("tests/kernels/moe/test_fused_globalize_align_block_size.py", NOT_AN_OP),
    ("tests/kernels/moe/test_moe_fused_mul_sum.py", NOT_AN_OP),
    ("tests/kernels/moe/test_zero_expert_moe.py", NOT_AN_OP),
    ("tests/kernels/moe/test_routing.py", INTERNAL),
    ("tests/kernels/moe/test_routing_simulator.py", INTERNAL),
    ("tests/kernels/moe/test_routed_experts_capture_monolithic.py", INTERNAL),
    ("tests/kernels/moe/test_expert_substitution.py", INTERNAL),
    ("tests/kernels/moe/test_fp8_tp_loading.py", INTERNAL),
    ("tests/kernels/moe/test_moe_kernel_oracle.py", INTERNAL),
    ("tests/kernels/moe/test_moe_layer.py", INTERNAL),
    ("tests/kernels/moe/test_moe_weight_loading_padded.py", INTERNAL),
    ("tests/kernels/moe/test_mxfp8_aiter_backend_selection.py", VENDOR),
    ("tests/kernels/moe/test_unquantized_backend_selection.py", INTERNAL),
    ("tests/kernels/moe/test_shared_fused_moe_routed_transform.py", INTERNAL),
    ("tests/kernels/moe/test_batched_deepgemm.py", VENDOR),
    ("tests/kernels/moe/modular_kernel_tools/*", DIST),
    ("tests/kernels/moe/__init__.py", "package file"), ("tests/kernels/moe/conftest.py", "support file"),
    ("tests/kernels/moe/utils.py", "support file"),
    # quantization/
    ("tests/kernels/quantization/*fp4*", FP4), ("tests/kernels/quantization/*mxfp*", FP4),
    ("tests/kernels/quantization/*nvfp4*", FP4),
    ("tests/kernels/quantization/*int8*", INT), ("tests/kernels/quantization/*int4*", INT),
    ("tests/kernels/quantization/*w4a*", INT), ("tests/kernels/quantization/*awq*", INT),
    ("tests/kernels/quantization/*gptq*", INT), ("tests/kernels/quantization/*da8w4*", INT),
    ("tests/kernels/quantization/*marlin*", MARLIN), ("tests/kernels/quantization/*machete*", MARLIN),
    ("tests/kernels/quantization/*rocm*", VENDOR), ("tests/kernels/quantization/*aiter*", VENDOR),
    ("tests/kernels/quantization/*rdna*", VENDOR), ("tests/kernels/quantization/*flashinfer*", VENDOR),
    ("tests/kernels/quantization/*hadacore*", VENDOR), ("tests/kernels/quantization/test_cpu_*", VENDOR),
    ("tests/kernels/quantization/test_cutlass_scaled_mm.py", BLOCK_MM),
    ("tests/kernels/quantization/test_triton_scaled_mm.py", BLOCK_MM),
    ("tests/kernels/quantization/test_scaled_mm_kernel_selection.py", INTERNAL),
    ("tests/kernels/quantization/test_fp8_min_max_helper.py", INTERNAL),
    ("tests/kernels/quantization/test_quant_op_schema.py", NOT_AN_OP),
    ("tests/kernels/quantization/test_quantized_embedding.py", NOT_AN_OP),
    ("tests/kernels/quantization/nvfp4_utils.py", "support file"),
    # core/ : everything but test_activation.py is norms, rotary, embeddings, attention helpers
    ("tests/kernels/core/*", NOT_AN_OP),
    # tests/kernels/*.py and the other subdirectories
    ("tests/kernels/__init__.py", "package file"), ("tests/kernels/conftest.py", "support file"),
    ("tests/kernels/utils.py", "support file"), ("tests/kernels/quant_utils.py", "support file"),
    ("tests/kernels/allclose_default.py", "support file"),
    ("tests/kernels/*/*", NOT_AN_OP),  # attention, mamba, fla, helion, ... directories
    ("tests/kernels/*", NOT_AN_OP),  # top-level files other than the SELECTED ones
]

SKIPS = [
    # moe/test_moe.py
    ("tests/kernels/moe/test_moe.py::test_fused_moe_wn16*", INT),
    ("tests/kernels/moe/test_moe.py::test_*marlin*", MARLIN),
    ("tests/kernels/moe/test_moe.py::test_humming*", MARLIN),
    ("tests/kernels/moe/test_moe.py::test_batched_moe_align_block_size_opcheck*", NOT_AN_OP),
    ("tests/kernels/moe/test_moe.py::test_unquantized_bf16_flashinfer_trtllm_backend*", VENDOR),
    ("tests/kernels/moe/test_moe.py::test_triton_moe_launcher_passes_scalar_scale_as_pointer*", INTERNAL),
    ("tests/kernels/moe/test_moe.py::test_host_resident_weights_take_sorted_path*", INTERNAL),
    ("tests/kernels/moe/test_moe.py::test_naive_block_assignment_moe*", INTERNAL),
    ("tests/kernels/moe/test_moe.py::test_fused_shared_expert_alignment*", WORKSPACE),
    # moe/test_moe_permute_unpermute.py
    ("tests/kernels/moe/test_moe_permute_unpermute.py::test_moe_permute_*scratch*", WORKSPACE),
    ("tests/kernels/moe/test_moe_permute_unpermute.py::test_moe_permute_reuses_scratch_buffers*", WORKSPACE),
    # moe/test_moe_align_block_size.py
    ("tests/kernels/moe/test_moe_align_block_size.py::test_batched_moe_align_block_size*", NOT_AN_OP),
    # moe/test_grouped_topk.py
    ("tests/kernels/moe/test_grouped_topk.py::test_kimi_grouped_topk*", INTERNAL),
    # moe/test_block_fp8.py
    ("tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_deep_gemm_fused_moe*", VENDOR),
    ("tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_clamp_skips_fused_silu_quant*", ACT),
    # moe/test_cutlass_moe.py
    ("tests/kernels/moe/test_cutlass_moe.py::test_*fp4*", FP4),
    ("tests/kernels/moe/test_cutlass_moe.py::test_nvfp4*", FP4),
    ("tests/kernels/moe/test_cutlass_moe.py::test_cutlass_mxfp4*", FP4),
    ("tests/kernels/moe/test_cutlass_moe.py::test_cutlass_moe_activation_metadata*", INTERNAL),
    ("tests/kernels/moe/test_cutlass_moe.py::test_cutlass_moe_forwards_shared_activation*", INTERNAL),
    ("tests/kernels/moe/test_cutlass_moe.py::test_remap_topk_ids_to_local*", INTERNAL),
    # core/test_activation.py: only SiLU(gate)*up is claimed
    ("tests/kernels/core/test_activation.py::test_masked_moe_activation*", ACT),
    ("tests/kernels/core/test_activation.py::test_moe_silu_clamp*", ACT),
    ("tests/kernels/core/test_activation.py::test_swiglu_limit*", ACT),
    ("tests/kernels/core/test_activation.py::test_silu_and_mul_with_clamp*", ACT),
    ("tests/kernels/core/test_activation.py::test_activation*", ACT),
    ("tests/kernels/core/test_activation.py::test_humming*", MARLIN),
    # test_fused_quant_activation.py: the per-block variant calls silu_and_mul_per_block_quant
    ("tests/kernels/test_fused_quant_activation.py::test_maybe_fused_act_quant_fp8_dynamic_block*", NOT_AN_OP),
    # quantization/test_per_token_group_quant.py
    ("tests/kernels/quantization/test_per_token_group_quant.py::test_per_token_group_quant_int8*", INT),
    ("tests/kernels/quantization/test_per_token_group_quant.py::test_per_token_group_quant_fp8_packed*", NOT_AN_OP),
    # quantization/test_block_fp8.py: only the per_token_group_quant_fp8 test is about hopper_moe
    ("tests/kernels/quantization/test_block_fp8.py::test_w8a8_block_fp8_*", BLOCK_MM),
]

# Skipped in the CPU run only (--device cpu), where the shim keeps the tests' "cuda" tensors on
# the CPU and Triton runs in its interpreter; they run on the GPU. Only tests that check where a
# tensor lives, or whose reference computes differently on the CPU (the interpreter, torch's
# CPU division), belong here.
ON_CPU = "asserts that a result is a CUDA tensor: the CPU run keeps tensors on the CPU (runs on the GPU)"
INTERPRETER_FP8 = ("the reference is vLLM's Triton kernel, whose cast to FP8 in Triton's CPU "
                   "interpreter loses the carry when rounding crosses a power of two (-126.9 "
                   "gives -64, not -128); runs on the GPU")
CPU_TIE = ("the reference computes amax / 448.0 on the CPU, where torch divides exactly; on "
           "CUDA torch multiplies by the fp32 reciprocal, which is what vLLM's kernels (its CUDA "
           "op and its Triton fallback) and hopper_moe compute on every device. The two scales "
           "can differ by one ulp, and an element at an e4m3 rounding tie then lands on the "
           "neighbouring code (subnormal codes are more than the test's 15% apart). 2050-token "
           "cases only (the 7-token ones run); runs on the GPU")
CPU_SKIPS = [
    ("tests/kernels/test_shuffle_rows.py::test_shuffle_rows_device_consistency", ON_CPU),
    ("tests/kernels/quantization/test_block_fp8.py::test_per_token_group_quant_fp8[2050-*",
     CPU_TIE),
    ("tests/kernels/quantization/test_per_token_group_quant.py::test_per_token_group_quant_fp8[*",
     INTERPRETER_FP8),
]

# GPU-sized cases, not run on the CPU for time unless the run asks for them (--all): their
# fp32 torch references take minutes to tens of minutes each on a CPU. They test nothing the
# smaller cases of the same tests do not, except size, and they run on the GPU.
GPU_SIZED = "GPU-sized case (minutes of CPU time per case); runs on the GPU and with --all"
CPU_SLOW_FILE = ("file of about 30 minutes of CPU time on 2 cores (an fp32 reference per case); "
                 "runs on the GPU and with --all")
CPU_GPU_SIZED = [
    # test_fused_moe's (32768, 2048, 511) and (40000, 1024, 1024) shapes; the 2^31+ element test
    ("tests/kernels/moe/test_moe.py::*32768*", GPU_SIZED),
    ("tests/kernels/moe/test_moe.py::*40000*", GPU_SIZED),
    ("tests/kernels/moe/test_moe.py::test_fused_moe_int64_overflow*", GPU_SIZED),
    # block FP8 with M = 2048 and 8192 tokens (ids: seed-dtype-block-topk-E-M-N-K; no N, K,
    # E or topk value is 2048 or 8192)
    ("tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_fused_moe[*-2048-*", GPU_SIZED),
    ("tests/kernels/moe/test_block_fp8.py::test_w8a8_block_fp8_fused_moe[*-8192-*", GPU_SIZED),
    # The CUTLASS MoE file (its 32768 / 65536-token cases included): with a build that has the
    # CUDA kernels, its cutlass_group_gemm_supported(90) query answers True and the whole file
    # runs on the CPU, about 30 minutes on 2 cores (a CPU-only build answers False and the file
    # skips itself)
    ("tests/kernels/moe/test_cutlass_moe.py::*", CPU_SLOW_FILE),
]

# test_act_and_mul is parametrized over activations; only the SiLU ones are hopper_moe's.
_ACT_AND_MUL = "tests/kernels/core/test_activation.py::test_act_and_mul["


def reason_for(nodeid: str, device: str = "cuda", gpu_sized: bool = False) -> str | None:
    """The skip reason of an upstream test node id in a run on `device` ("cpu" or "cuda"), or
    None when it runs. gpu_sized: the CPU run takes the GPU-sized cases too (--all)."""
    if device == "cpu":
        for pattern, reason in CPU_SKIPS + ([] if gpu_sized else CPU_GPU_SIZED):
            if fnmatch.fnmatchcase(nodeid, pattern):
                return reason
    if nodeid.startswith(_ACT_AND_MUL):
        params = nodeid[len(_ACT_AND_MUL):]
        if not params.startswith("silu_and_mul-") and "-silu_and_mul-" not in params \
                and "SiluAndMul" not in params and "silu_and_mul]" not in params:
            return ACT
    for pattern, reason in SKIPS:
        if fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None


def not_run_reason(path: str) -> str | None:
    """Why an upstream file (path relative to the sdist root) is not run; None if SELECTED."""
    if path in SELECTED:
        return None
    for pattern, reason in NOT_RUN:
        if fnmatch.fnmatchcase(path, pattern):
            return reason
    return "unclassified (new upstream file?)"
