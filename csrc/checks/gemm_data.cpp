// SCAFFOLD: replaced by the gemm_data implementation.
#include "ops.h"

namespace hopper_moe::check {

void get_cutlass_moe_mm_data(const at::Tensor& topk_ids, at::Tensor& expert_offsets, at::Tensor& problem_sizes1, at::Tensor& problem_sizes2, at::Tensor& input_permutation, at::Tensor& output_permutation, int64_t num_experts, int64_t n, int64_t k, const OptTensor& blockscale_offsets, bool is_gated) { TORCH_CHECK(false, "hopper_moe::get_cutlass_moe_mm_data: not built yet"); }

void get_cutlass_moe_mm_problem_sizes_from_expert_offsets(const at::Tensor& expert_first_token_offset, at::Tensor& problem_sizes1, at::Tensor& problem_sizes2, int64_t n, int64_t k, bool swap_ab) { TORCH_CHECK(false, "hopper_moe::get_cutlass_moe_mm_problem_sizes_from_expert_offsets: not built yet"); }

}
