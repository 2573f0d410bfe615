// SCAFFOLD: replaced by the routing implementation.
#include "ops.h"

namespace hopper_moe::cpu {

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices, at::Tensor& token_expert_indices, const at::Tensor& gating_output, bool renormalize, const OptTensor& bias, const OptTensor& is_padding) { TORCH_CHECK(false, "hopper_moe::topk_softmax: not built yet"); }

void topk_sigmoid(at::Tensor& topk_weights, at::Tensor& topk_indices, at::Tensor& token_expert_indices, const at::Tensor& gating_output, bool renormalize, const OptTensor& bias, double routed_scaling_factor, const OptTensor& is_padding) { TORCH_CHECK(false, "hopper_moe::topk_sigmoid: not built yet"); }

std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, int64_t n_group, int64_t topk_group, int64_t topk, bool renormalize, double routed_scaling_factor, const at::Tensor& bias, int64_t scoring_func) { TORCH_CHECK(false, "hopper_moe::grouped_topk: not built yet"); }

}
