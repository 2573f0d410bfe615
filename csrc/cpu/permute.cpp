// SCAFFOLD: replaced by the permute implementation.
#include "ops.h"

namespace hopper_moe::cpu {

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size, at::Tensor& sorted_token_ids, at::Tensor& experts_ids, at::Tensor& num_tokens_post_pad, const OptTensor& maybe_expert_map, const OptTensor& scatter_idx) { TORCH_CHECK(false, "hopper_moe::moe_align_block_size: not built yet"); }

void moe_permute(const at::Tensor& input, const at::Tensor& topk_ids, const at::Tensor& token_expert_indices, const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert, int64_t topk, at::Tensor& permuted_input, at::Tensor& expert_first_token_offset, at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx) { TORCH_CHECK(false, "hopper_moe::moe_permute: not built yet"); }

void moe_unpermute(const at::Tensor& permuted_hidden_states, const at::Tensor& topk_weights, const at::Tensor& inv_permuted_idx, const OptTensor& expert_first_token_offset, int64_t topk, at::Tensor& hidden_states) { TORCH_CHECK(false, "hopper_moe::moe_unpermute: not built yet"); }

void shuffle_rows(const at::Tensor& input_tensor, const at::Tensor& dst2src_map, at::Tensor& output_tensor) { TORCH_CHECK(false, "hopper_moe::shuffle_rows: not built yet"); }

}
