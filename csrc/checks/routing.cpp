// Argument checks of the routing ops (topk_softmax, topk_sigmoid, grouped_topk), shared by the
// CPU and CUDA implementations so both devices reject the same calls with the same message.
#include <limits>

#include "hopper_moe/common/checks.h"
#include "ops.h"

namespace hopper_moe::check {
namespace {

// bias is fp32 or the dtype of the logits it is added to.
void check_bias_dtype(const char* op, const at::Tensor& bias, const at::Tensor& logits,
                      const char* logits_name) {
  const auto dtype = logits.scalar_type();
  const bool ok = bias.scalar_type() == at::kFloat || bias.scalar_type() == dtype;
  HM_CHECK(op, ok, "bias must have dtype Float or ", logits_name, "'s dtype ",
           c10::toString(dtype), " (got ", c10::toString(bias.scalar_type()), ")");
}

// Shared by topk_softmax and topk_sigmoid: gating_output [T, E] f32/f16/bf16 with a unit-stride
// last dim; topk_weights [T, K] f32, topk_indices [T, K] int32/int64/uint32,
// token_expert_indices [T, K] int32, all contiguous, 1 <= K <= E; bias [E] f32 or the gating
// dtype; is_padding [T] bool; everything on gating_output's device.
void topk_gating(const char* op, const at::Tensor& topk_weights, const at::Tensor& topk_indices,
                 const at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                 const OptTensor& bias, const OptTensor& is_padding) {
  HM_CHECK_DIM(op, gating_output, 2);
  HM_CHECK_DTYPE(op, gating_output, HM_FLOAT_DTYPES);
  HM_CHECK_LAST_DIM_CONTIGUOUS(op, gating_output);
  const int64_t num_tokens = gating_output.size(0);
  const int64_t num_experts = gating_output.size(1);
  HM_CHECK(op, num_experts <= std::numeric_limits<int32_t>::max(),
           "gating_output.size(1) (num_experts) must fit in int32, got ", num_experts);

  HM_CHECK_SAME_DEVICE(op, topk_weights, gating_output);
  HM_CHECK_DIM(op, topk_weights, 2);
  HM_CHECK_DTYPE(op, topk_weights, at::kFloat);
  HM_CHECK_SIZE(op, topk_weights, 0, num_tokens, "num_tokens = gating_output.size(0)");
  const int64_t topk = topk_weights.size(1);
  HM_CHECK(op, topk >= 1 && topk <= num_experts,
           "topk_weights.size(1) (topk) must be in [1, num_experts = ", num_experts, "], got ",
           topk);
  HM_CHECK_CONTIGUOUS(op, topk_weights);

  HM_CHECK_SAME_DEVICE(op, topk_indices, gating_output);
  HM_CHECK_DIM(op, topk_indices, 2);
  HM_CHECK_DTYPE(op, topk_indices, {at::kInt, at::kLong, at::kUInt32});
  HM_CHECK_SAME_SHAPE(op, topk_indices, topk_weights);
  HM_CHECK_CONTIGUOUS(op, topk_indices);

  HM_CHECK_SAME_DEVICE(op, token_expert_indices, gating_output);
  HM_CHECK_DIM(op, token_expert_indices, 2);
  HM_CHECK_DTYPE(op, token_expert_indices, at::kInt);
  HM_CHECK_SAME_SHAPE(op, token_expert_indices, topk_weights);
  HM_CHECK_CONTIGUOUS(op, token_expert_indices);
  HM_CHECK(op, num_tokens * topk <= std::numeric_limits<int32_t>::max(),
           "token_expert_indices holds k * num_tokens + t in int32: num_tokens * topk must be "
           "< 2^31, got ", num_tokens, " * ", topk);

  if (bias) {
    check_same_device_named(op, *bias, "bias", gating_output, "gating_output");
    check_dim_named(op, *bias, "bias", 1);
    check_bias_dtype(op, *bias, gating_output, "gating_output");
    check_size_named(op, *bias, "bias", 0, num_experts, "num_experts");
    check_contiguous_named(op, *bias, "bias");
  }
  if (is_padding) {
    check_same_device_named(op, *is_padding, "is_padding", gating_output, "gating_output");
    check_dim_named(op, *is_padding, "is_padding", 1);
    check_dtype_named(op, *is_padding, "is_padding", at::kBool);
    check_size_named(op, *is_padding, "is_padding", 0, num_tokens, "num_tokens");
    check_contiguous_named(op, *is_padding, "is_padding");
  }
  check_outputs_disjoint(op,
                         {{topk_weights, "topk_weights"},
                          {topk_indices, "topk_indices"},
                          {token_expert_indices, "token_expert_indices"}},
                         {{gating_output, "gating_output"}, {bias, "bias"},
                          {is_padding, "is_padding"}});
}

}  // namespace

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, const OptTensor& is_padding) {
  (void)renormalize;
  topk_gating("topk_softmax", topk_weights, topk_indices, token_expert_indices, gating_output,
              bias, is_padding);
}

void topk_sigmoid(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, double routed_scaling_factor,
                  const OptTensor& is_padding) {
  (void)renormalize;
  (void)routed_scaling_factor;  // any float, as in vLLM (NaN or inf make NaN/inf weights)
  topk_gating("topk_sigmoid", topk_weights, topk_indices, token_expert_indices, gating_output,
              bias, is_padding);
}

// scores [T, E] f32/f16/bf16 with a unit-stride last dim; bias [E] f32/f16/bf16 (any of the
// nine pairs, as vLLM) on the same device; E % n_group == 0; 1 <= topk_group <= n_group;
// 1 <= topk <= topk_group * (E / n_group); scoring_func 0 (none) or 1 (sigmoid).
void grouped_topk(const at::Tensor& scores, int64_t n_group, int64_t topk_group, int64_t topk,
                  bool renormalize, double routed_scaling_factor, const at::Tensor& bias,
                  int64_t scoring_func) {
  (void)renormalize;
  (void)routed_scaling_factor;
  constexpr const char* op = "grouped_topk";
  HM_CHECK_DIM(op, scores, 2);
  HM_CHECK_DTYPE(op, scores, HM_FLOAT_DTYPES);
  HM_CHECK_LAST_DIM_CONTIGUOUS(op, scores);
  const int64_t num_experts = scores.size(1);
  HM_CHECK(op, num_experts <= std::numeric_limits<int32_t>::max(),
           "scores.size(1) (num_experts) must fit in int32, got ", num_experts);

  HM_CHECK_SAME_DEVICE(op, bias, scores);
  HM_CHECK_DIM(op, bias, 1);
  HM_CHECK_DTYPE(op, bias, HM_FLOAT_DTYPES);
  HM_CHECK_SIZE(op, bias, 0, num_experts, "num_experts = scores.size(1)");
  HM_CHECK_CONTIGUOUS(op, bias);

  HM_CHECK(op, n_group >= 1 && num_experts % n_group == 0,
           "n_group must be >= 1 and divide num_experts = ", num_experts, ", got n_group = ",
           n_group);
  HM_CHECK(op, topk_group >= 1 && topk_group <= n_group,
           "topk_group must be in [1, n_group = ", n_group, "], got ", topk_group);
  const int64_t kept = topk_group * (num_experts / n_group);
  HM_CHECK(op, topk >= 1 && topk <= kept,
           "topk must be in [1, topk_group * num_experts / n_group = ", kept, "], got ", topk);
  HM_CHECK(op, scoring_func == 0 || scoring_func == 1,
           "scoring_func must be 0 (none) or 1 (sigmoid), got ", scoring_func);
}

}  // namespace hopper_moe::check
