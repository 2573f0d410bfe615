"""The backends of ``hopper_moe.fused_experts``, one module each.

Every backend module has ``is_available(device_type) -> bool`` and ``run(hidden_states, w1,
w2, topk_weights, topk_ids, apply_router_weight_on_input, global_num_experts, expert_map,
quant)``, which gets arguments validated by ``hopper_moe.api`` (M > 0, global_num_experts
resolved); a backend with a GEMM-only entry for benchmarks also has ``make_gemm_only``.

- ``reference``: the fp32 definition (``hopper_moe.reference``).
- ``torch``: PyTorch-native (torch._grouped_mm), the baseline every kernel must beat.
- ``triton``: one Triton grouped GEMM (``hopper_moe.kernels.moe_gemm``) with SiLU*mul and
  the GEMM2-input quantization in GEMM1's epilogue; Triton is imported on its first run.
- ``sm90``: the layer around hopper_moe's SM90 (Hopper wgmma) grouped GEMM ops; ``"cute"``
  is accepted as another name for it.

The scheme-dependent steps they share (activation quantization, GEMM2-input scheme, weight
scale shapes, FP8 scale floor) are in ``hopper_moe.prepare``.
"""
