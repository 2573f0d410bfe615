"""Every op is registered under torch.ops.hopper_moe with exactly the schema of OPS.md
(vLLM's schemas), so a caller can swap torch.ops._moe_C for torch.ops.hopper_moe."""
import pytest
import torch

import hopper_moe

# The schema strings of docs/OPS.md, verbatim.
EXPECTED = [
    "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, Tensor gating_output, bool renormalize, Tensor? bias, Tensor? is_padding) -> ()",
    "topk_sigmoid(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, Tensor gating_output, bool renormalize, Tensor? bias, float routed_scaling_factor, Tensor? is_padding) -> ()",
    "grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, float routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)",
    "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, Tensor(a!)? scatter_idx=None) -> ()",
    "moe_permute(Tensor input, Tensor topk_ids, Tensor token_expert_indices, Tensor? expert_map, int n_expert, int n_local_expert, int topk, Tensor! permuted_input, Tensor! expert_first_token_offset, Tensor! inv_permuted_idx, Tensor! permuted_idx)->()",
    "moe_permute_with_scratch(Tensor input, Tensor topk_ids, Tensor token_expert_indices, Tensor? expert_map, int n_expert, int n_local_expert, int topk, Tensor! permuted_input, Tensor! expert_first_token_offset, Tensor! inv_permuted_idx, Tensor! permuted_idx, Tensor! sort_workspace, Tensor! permuted_experts_id, Tensor! sorted_row_idx, Tensor! topk_ids_for_sort)->()",
    "moe_prepare_scatter(Tensor topk_ids, Tensor token_expert_indices, Tensor? expert_map, int n_expert, int n_local_expert, Tensor! expert_first_token_offset, Tensor! scatter_idx, Tensor! sort_workspace, Tensor! sorted_experts, Tensor! sorted_rows, Tensor! topk_ids_for_sort)->()",
    "moe_permute_unpermute_supported() -> bool",
    "moe_permute_sort_workspace_size(int num_expanded_rows, int n_expert) -> int",
    "moe_unpermute(Tensor permuted_hidden_states, Tensor topk_weights, Tensor inv_permuted_idx, Tensor? expert_first_token_offset, int topk, Tensor! hidden_states)->()",
    "shuffle_rows(Tensor input_tensor, Tensor dst2src_map, Tensor! output_tensor) -> ()",
    "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
    "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, int[]? group_shape=None) -> ()",
    "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, Tensor? scale_ub) -> ()",
    "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()",
    "get_cutlass_moe_mm_data(Tensor topk_ids, Tensor! expert_offsets, Tensor! problem_sizes1, Tensor! problem_sizes2, Tensor! input_permutation, Tensor! output_permutation, int num_experts, int n, int k, Tensor? blockscale_offsets, bool is_gated) -> ()",
    "get_cutlass_moe_mm_problem_sizes_from_expert_offsets(Tensor expert_first_token_offset, Tensor! problem_sizes1, Tensor! problem_sizes2, int n, int k, bool swap_ab) -> ()",
    "cutlass_group_gemm_supported(int cuda_device_capability) -> bool",
]


def _name(schema: str) -> str:
    return schema.split("(", 1)[0]


def test_every_expected_op_is_listed_once():
    names = [_name(s) for s in EXPECTED]
    assert len(names) == len(set(names))
    assert len(names) == 21


# cutlass_moe_mm runs the hand-written grouped GEMM. cutlass_group_gemm_supported answers True
# only for the capabilities below: those where the cutlass_moe_mm entry has passed its GPU
# tests (tests/test_grouped_gemm.py): SM90, on an H200. A build without the CUDA kernels
# supports none.
SUPPORTED_CAPABILITIES: set[int] = {90} if hopper_moe.built_with_cuda() else set()
CUTLASS_MOE_MM = (
"cutlass_moe_mm(Tensor! out_tensors, Tensor a_tensors, Tensor b_tensors, Tensor a_scales, Tensor b_scales, Tensor expert_offsets, Tensor problem_sizes, Tensor a_strides, Tensor b_strides, Tensor c_strides, bool per_act_token, bool per_out_ch) -> ()"
)


# hopper_moe's own ops (not vLLM's): their schemas are pinned here.
OWN = [
    "moe_grouped_gemm(Tensor! out, Tensor a, Tensor b, Tensor expert_offsets, "
    'Tensor? a_scales, Tensor? b_scales, bool offsets_ready=False, str config="") -> ()',
    "moe_grouped_gemm_silu_mul(Tensor! out, Tensor a, Tensor b, Tensor expert_offsets, "
    "Tensor? a_scales, Tensor? b_scales, Tensor? out_scale, bool offsets_ready=False, "
    'Tensor(b!)? amax_scale=None, str config="") -> ()',
    "moe_grouped_gemm_chain(Tensor! out, Tensor! h, Tensor a, Tensor w1, Tensor w2, "
    "Tensor expert_offsets, Tensor? a_scales, Tensor? w1_scales, Tensor? h_scale, "
    'Tensor? w2_scales, bool offsets_ready=False, str config="") -> ()',
    "fp8_quant_rows(Tensor! result, Tensor input, Tensor(a!) scale, str kind, "
    "int group_size, Tensor? slot_ids, Tensor? expert_map, int num_experts, "
    "Tensor? row_end) -> ()",
    "fused_experts_sm90(Tensor! out, Tensor hidden_states, Tensor w1, Tensor w2, "
    "Tensor topk_weights, Tensor topk_ids, bool apply_router_weight_on_input, "
    "int global_num_experts, Tensor? expert_map, Tensor? w1_scale, Tensor? w2_scale, "
    "Tensor? a1_scale, Tensor? a2_scale, bool per_act_token_quant, "
    "bool per_out_ch_quant) -> ()",
]


@pytest.mark.parametrize("schema", OWN, ids=_name)
def test_own_op_schema(schema):
    op = getattr(torch.ops.hopper_moe, _name(schema)).default
    assert str(op._schema) == str(torch._C.parse_schema("hopper_moe::" + schema))


def test_cutlass_moe_mm_schema_and_supported_capabilities():
    expected = torch._C.parse_schema("hopper_moe::" + CUTLASS_MOE_MM)
    assert str(torch.ops.hopper_moe.cutlass_moe_mm.default._schema) == str(expected)
    for capability in (80, 89, 90, 100):
        supported = torch.ops.hopper_moe.cutlass_group_gemm_supported(capability)
        assert supported == (capability in SUPPORTED_CAPABILITIES)


@pytest.mark.parametrize("schema", EXPECTED, ids=_name)
def test_registered_schema_matches(schema):
    op = getattr(torch.ops.hopper_moe, _name(schema)).default
    expected = torch._C.parse_schema("hopper_moe::" + schema)
    assert str(op._schema) == str(expected)


def test_no_unexpected_ops():
    registered = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
                  if s.name.startswith("hopper_moe::")}
    assert registered <= {_name(s) for s in EXPECTED + OWN} | {"cutlass_moe_mm"}
