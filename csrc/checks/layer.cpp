// Validation of fused_experts_sm90 (the whole MoE layer over the SM90 grouped GEMM), shared by
// CPU and CUDA. The rules are hopper_moe.fused_experts' (python/hopper_moe/api.py) and
// QuantConfig.validate's, restricted to the schemes the SM90 layer runs, with the argument
// names of the op's schema.
#include "hopper_moe/common/checks.h"
#include "hopper_moe/heuristics/sm90.h"
#include "ops.h"

#include <limits>
#include <utility>

namespace hopper_moe {

namespace check {

namespace {

constexpr const char* kOp = "fused_experts_sm90";

void check_weight_scale(const at::Tensor& scale, const char* name, const at::Tensor& w,
                        const char* w_name, bool per_out_ch) {
  check_dtype_named(kOp, scale, name, at::kFloat);
  check_same_device_named(kOp, scale, name, w, w_name);
  const int64_t e = w.size(0), n = w.size(1);
  if (per_out_ch) {
    const bool ok = (scale.dim() == 2 && scale.size(0) == e && scale.size(1) == n) ||
                    (scale.dim() == 3 && scale.size(0) == e && scale.size(1) == n &&
                     scale.size(2) == 1);
    HM_CHECK(kOp, ok, name, " must have shape (num_experts, N) = [", e, ", ", n,
             "] or (num_experts, N, 1) for per-channel weights (N = ", w_name,
             ".size(1)), got ", scale.sizes());
  } else {
    HM_CHECK(kOp, scale.dim() == 1 && scale.size(0) == e, name,
             " must have shape (num_experts,) = [", e, "] for per-tensor weights, got ",
             scale.sizes());
  }
}

void check_act_scale(const OptTensor& scale, const char* name, const at::Tensor& ref,
                     bool per_act_token) {
  if (!scale) return;
  HM_CHECK(kOp, !per_act_token, name,
           " must be None with per_act_token_quant (those activation scales are dynamic)");
  HM_CHECK(kOp, scale->numel() == 1 && scale->dim() <= 1, name,
           " must be a per-tensor scale of shape (1,) or (), got ", scale->sizes());
  check_dtype_named(kOp, *scale, name, at::kFloat);
  check_same_device_named(kOp, *scale, name, ref, "hidden_states");
}

}  // namespace

LayerScheme fused_experts_sm90(
    const at::Tensor& out, const at::Tensor& hidden_states, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
    bool apply_router_weight_on_input, int64_t global_num_experts, const OptTensor& expert_map,
    const OptTensor& w1_scale, const OptTensor& w2_scale, const OptTensor& a1_scale,
    const OptTensor& a2_scale, bool per_act_token_quant, bool per_out_ch_quant) {
  HM_CHECK_DIM(kOp, hidden_states, 2);
  HM_CHECK_DTYPE(kOp, hidden_states, HM_FLOAT_DTYPES);
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, hidden_states);
  HM_CHECK_DIM(kOp, w1, 3);
  HM_CHECK_DIM(kOp, w2, 3);
  HM_CHECK_SAME_DEVICE(kOp, w1, hidden_states);
  HM_CHECK_SAME_DEVICE(kOp, w2, hidden_states);
  const int64_t num_tokens = hidden_states.size(0), hidden = hidden_states.size(1);
  const int64_t num_experts = w1.size(0), n1 = w1.size(1);
  HM_CHECK(kOp, num_experts >= 1, "w1 must have at least one expert (w1.size(0) >= 1)");
  HM_CHECK(kOp, num_experts <= heuristics::kMaxExperts, "w1.size(0) (num_experts) must be at most ",
           heuristics::kMaxExperts, " (the GEMM's per-expert tile table), got ", num_experts);
  HM_CHECK(kOp, w1.size(2) == hidden && n1 % 2 == 0 && n1 > 0,
           "w1 must have shape (num_experts, 2*intermediate_size, hidden_size) with hidden_size = ",
           hidden, ", got ", w1.sizes());
  const int64_t inter = n1 / 2;
  HM_CHECK(kOp, w2.size(0) == num_experts && w2.size(1) == hidden && w2.size(2) == inter,
           "w2 must have shape (num_experts, hidden_size, intermediate_size) = [", num_experts,
           ", ", hidden, ", ", inter, "], got ", w2.sizes());
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, w1);
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, w2);
  HM_CHECK(kOp, w1.scalar_type() == w2.scalar_type(), "w1 and w2 must have the same dtype, got ",
           w1.scalar_type(), " and ", w2.scalar_type());
  // The GEMMs read bf16 / e4m3 weights as they are (contiguous ones without a copy) with bulk
  // tensor copies, which need a 16-byte aligned start; other dtypes are converted, other
  // layouts copied, both into fresh (aligned) memory.
  for (const auto& [w, name] : {std::pair<const at::Tensor&, const char*>{w1, "w1"}, {w2, "w2"}}) {
    const bool read_as_is = (w.scalar_type() == at::kBFloat16 ||
                             w.scalar_type() == at::kFloat8_e4m3fn) && w.is_contiguous();
    HM_CHECK(kOp, !read_as_is || w.numel() == 0 ||
                      reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
             name, " must start on a 16-byte boundary (the GEMM reads it with bulk tensor ",
             "copies), got data pointer ", w.data_ptr(), "; a view at an element offset can ",
             "be passed as a copy (", name, ".clone())");
  }

  LayerScheme s;
  s.fp8 = w1.scalar_type() == at::kFloat8_e4m3fn;
  if (s.fp8) {
    HM_CHECK(kOp, w1_scale.has_value() && w2_scale.has_value(),
             "w1_scale and w2_scale are required with Float8_e4m3fn weights");
    // vLLM's rule: per-token activations with a per-channel w1_scale ([E, N] or [E, N, 1],
    // N > 1) mean per-channel weights even when per_out_ch_quant is not set.
    const at::Tensor& s1 = *w1_scale;
    const bool channel_shaped =
        n1 > 1 && s1.dim() >= 2 && s1.dim() <= 3 && s1.size(0) == num_experts &&
        s1.size(1) == n1 && (s1.dim() == 2 || s1.size(2) == 1);
    s.per_out_ch = per_out_ch_quant || (per_act_token_quant && channel_shaped);
    s.per_act_token = per_act_token_quant;
    check_weight_scale(*w1_scale, "w1_scale", w1, "w1", s.per_out_ch);
    check_weight_scale(*w2_scale, "w2_scale", w2, "w2", s.per_out_ch);
    check_act_scale(a1_scale, "a1_scale", hidden_states, per_act_token_quant);
    check_act_scale(a2_scale, "a2_scale", hidden_states, per_act_token_quant);
  } else {
    HM_CHECK(kOp, w1.scalar_type() == hidden_states.scalar_type(),
             "w1 must have the dtype of hidden_states (", hidden_states.scalar_type(),
             ") or be Float8_e4m3fn with scales, got ", w1.scalar_type());
    HM_CHECK(kOp, !w1_scale && !w2_scale && !a1_scale && !a2_scale,
             "w1_scale, w2_scale, a1_scale and a2_scale must be None unless the weights are "
             "Float8_e4m3fn");
    HM_CHECK(kOp, !per_act_token_quant && !per_out_ch_quant,
             "per_act_token_quant and per_out_ch_quant must be False unless the weights are "
             "Float8_e4m3fn");
  }
  // The bulk tensor copies read rows of a multiple of 16 bytes: H (GEMM1's K) and I (GEMM2's).
  const int64_t elem = s.fp8 ? 1 : 2;
  HM_CHECK(kOp, (hidden * elem) % 16 == 0, "hidden size H (w1.size(2)) = ", hidden,
           " must be a multiple of ", 16 / elem, " for ", s.fp8 ? "FP8" : "16-bit",
           " weights");
  HM_CHECK(kOp, (inter * elem) % 16 == 0, "intermediate size I (w2.size(2)) = ", inter,
           " must be a multiple of ", 16 / elem, " for ", s.fp8 ? "FP8" : "16-bit",
           " weights");

  HM_CHECK_DIM(kOp, topk_ids, 2);
  HM_CHECK_DTYPE(kOp, topk_ids, HM_INDEX_DTYPES);
  HM_CHECK_DTYPE(kOp, topk_weights, HM_FLOAT_DTYPES);
  HM_CHECK_SAME_DEVICE(kOp, topk_ids, hidden_states);
  HM_CHECK_SAME_DEVICE(kOp, topk_weights, hidden_states);
  HM_CHECK(kOp, topk_ids.sizes() == topk_weights.sizes(),
           "topk_ids and topk_weights must have the same shape (num_tokens, topk), got ",
           topk_ids.sizes(), " and ", topk_weights.sizes());
  HM_CHECK_SIZE(kOp, topk_ids, 0, num_tokens, "num_tokens, the rows of hidden_states");
  const int64_t topk = topk_ids.size(1);
  HM_CHECK(kOp, topk >= 1, "topk_ids must have at least one column (topk >= 1)");
  HM_CHECK(kOp, num_tokens * topk <= std::numeric_limits<int32_t>::max(),
           "num_tokens * topk must be at most 2^31-1, got ", num_tokens * topk);
  HM_CHECK(kOp, !apply_router_weight_on_input || topk == 1,
           "apply_router_weight_on_input requires topk == 1, got topk = ", topk);

  s.num_global = global_num_experts;
  if (expert_map) {
    const at::Tensor& m = *expert_map;
    check_dim_named(kOp, m, "expert_map", 1);
    check_dtype_named(kOp, m, "expert_map", HM_INDEX_DTYPES);
    check_same_device_named(kOp, m, "expert_map", hidden_states, "hidden_states");
    if (s.num_global == -1) s.num_global = m.size(0);
    HM_CHECK(kOp, m.size(0) == s.num_global, "expert_map must have global_num_experts = ",
             s.num_global, " entries, got ", m.size(0));
    HM_CHECK(kOp, s.num_global >= 1 && s.num_global <= 65536,
             "global_num_experts (expert_map's entries) must be in [1, 65536], got ",
             s.num_global);
  }
  HM_CHECK(kOp, global_num_experts == -1 || global_num_experts >= 1,
           "global_num_experts must be -1 or >= 1, got ", global_num_experts);
  // As vLLM: without expert_map every physical expert of w1 is computed, whatever
  // global_num_experts says.
  if (!expert_map) s.num_global = num_experts;

  HM_CHECK_DIM(kOp, out, 2);
  HM_CHECK_SAME_DEVICE(kOp, out, hidden_states);
  HM_CHECK(kOp, out.sizes() == hidden_states.sizes(),
           "out must have the shape of hidden_states (", hidden_states.sizes(), "), got ",
           out.sizes());
  HM_CHECK(kOp, out.scalar_type() == hidden_states.scalar_type(),
           "out must have the dtype of hidden_states (", hidden_states.scalar_type(), "), got ",
           out.scalar_type());
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, out);
  HM_CHECK(kOp, out.size(0) <= 1 || out.stride(0) >= out.size(1),
           "out's rows must not overlap (out.stride(0) >= out.size(1)), got strides ",
           out.strides());
  check_outputs_disjoint(kOp, {{out, "out"}},
                         {{hidden_states, "hidden_states"}, {w1, "w1"}, {w2, "w2"},
                          {topk_weights, "topk_weights"}, {topk_ids, "topk_ids"},
                          {expert_map, "expert_map"}, {w1_scale, "w1_scale"},
                          {w2_scale, "w2_scale"}, {a1_scale, "a1_scale"},
                          {a2_scale, "a2_scale"}});
  return s;
}

}  // namespace check

}  // namespace hopper_moe
