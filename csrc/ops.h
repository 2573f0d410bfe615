// Declarations of every hopper_moe op, one group per device.
//
// The schemas live in torch_bindings.cpp; the C++ signatures here follow them argument by
// argument (Tensor! -> at::Tensor&, Tensor? -> const std::optional<at::Tensor>&,
// float -> double, int -> int64_t). Each op has
//   check::<op>   validation shared by both devices            (csrc/checks/<family>.cpp)
//   cpu::<op>     the readable CPU definition of the semantics  (csrc/cpu/<family>.cpp)
//   cuda::<op>    the CUDA launcher                             (csrc/ops/<family>.cu)
// cpu:: and cuda:: call check:: first, so both reject the same inputs with the same message.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe {

using OptTensor = std::optional<at::Tensor>;

#define HOPPER_MOE_DECLARE_OPS                                                                 \
  /* routing (routing.*) */                                                                    \
  void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,                        \
                    at::Tensor& token_expert_indices, const at::Tensor& gating_output,         \
                    bool renormalize, const OptTensor& bias, const OptTensor& is_padding);     \
  void topk_sigmoid(at::Tensor& topk_weights, at::Tensor& topk_indices,                        \
                    at::Tensor& token_expert_indices, const at::Tensor& gating_output,         \
                    bool renormalize, const OptTensor& bias, double routed_scaling_factor,     \
                    const OptTensor& is_padding);                                              \
  /* permutation (permute.*) */                                                                \
  void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts,                   \
                            int64_t block_size, at::Tensor& sorted_token_ids,                  \
                            at::Tensor& experts_ids, at::Tensor& num_tokens_post_pad,          \
                            const OptTensor& maybe_expert_map, const OptTensor& scatter_idx);  \
  void moe_permute(const at::Tensor& input, const at::Tensor& topk_ids,                        \
                   const at::Tensor& token_expert_indices, const OptTensor& expert_map,        \
                   int64_t n_expert, int64_t n_local_expert, int64_t topk,                     \
                   at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,          \
                   at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx);                    \
  void moe_permute_with_scratch(                                                               \
      const at::Tensor& input, const at::Tensor& topk_ids,                                     \
      const at::Tensor& token_expert_indices, const OptTensor& expert_map, int64_t n_expert,   \
      int64_t n_local_expert, int64_t topk, at::Tensor& permuted_input,                        \
      at::Tensor& expert_first_token_offset, at::Tensor& inv_permuted_idx,                     \
      at::Tensor& permuted_idx, at::Tensor& sort_workspace, at::Tensor& permuted_experts_id,   \
      at::Tensor& sorted_row_idx, at::Tensor& topk_ids_for_sort);                              \
  void moe_prepare_scatter(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices, \
                           const OptTensor& expert_map, int64_t n_expert,                      \
                           int64_t n_local_expert, at::Tensor& expert_first_token_offset,      \
                           at::Tensor& scatter_idx, at::Tensor& sort_workspace,                \
                           at::Tensor& sorted_experts, at::Tensor& sorted_rows,                \
                           at::Tensor& topk_ids_for_sort);                                     \
  void moe_unpermute(const at::Tensor& permuted_hidden_states, const at::Tensor& topk_weights, \
                     const at::Tensor& inv_permuted_idx,                                       \
                     const OptTensor& expert_first_token_offset, int64_t topk,                 \
                     at::Tensor& hidden_states);                                               \
  void shuffle_rows(const at::Tensor& input_tensor, const at::Tensor& dst2src_map,             \
                    at::Tensor& output_tensor);                                                \
  /* reduction (reduce.*) */                                                                   \
  void moe_sum(const at::Tensor& input, at::Tensor& output, const OptTensor& topk_ids,         \
               const OptTensor& expert_map);                                                   \
  /* activation (activation.*) */                                                              \
  void silu_and_mul(at::Tensor& result, const at::Tensor& input);                              \
  void silu_and_mul_quant(at::Tensor& result, const at::Tensor& input,                         \
                          const at::Tensor& scale);                                            \
  /* FP8 quantization (quant.*) */                                                             \
  void static_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,                    \
                               const at::Tensor& scale,                                        \
                               std::optional<at::IntArrayRef> group_shape);                    \
  void fp8_quant_rows(at::Tensor& result, const at::Tensor& input, at::Tensor& scale,          \
                      c10::string_view kind, int64_t group_size, const OptTensor& slot_ids,    \
                      const OptTensor& expert_map, int64_t num_experts,                        \
                      const OptTensor& row_end);                                               \
  void dynamic_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,                   \
                                at::Tensor& scale);                                            \
  void dynamic_per_token_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,         \
                                          at::Tensor& scale, const OptTensor& scale_ub);       \
  void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q,                \
                                 at::Tensor& output_s, int64_t group_size, double eps,         \
                                 double fp8_min, double fp8_max, bool scale_ue8m0,             \
                                 bool dummy_is_scale_transposed, bool dummy_is_tma_aligned);   \
  /* grouped-GEMM metadata (gemm_data.*) */                                                    \
  void get_cutlass_moe_mm_data(const at::Tensor& topk_ids, at::Tensor& expert_offsets,         \
                               at::Tensor& problem_sizes1, at::Tensor& problem_sizes2,         \
                               at::Tensor& input_permutation, at::Tensor& output_permutation,  \
                               int64_t num_experts, int64_t n, int64_t k,                      \
                               const OptTensor& blockscale_offsets, bool is_gated);            \
  void get_cutlass_moe_mm_problem_sizes_from_expert_offsets(                                   \
      const at::Tensor& expert_first_token_offset, at::Tensor& problem_sizes1,                 \
      at::Tensor& problem_sizes2, int64_t n, int64_t k, bool swap_ab);                         \
  /* grouped GEMM (grouped_gemm.*) */                                                          \
  void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,             \
                        const at::Tensor& expert_offsets, const OptTensor& a_scales,           \
                        const OptTensor& b_scales, bool offsets_ready,                         \
                        c10::string_view config);                                              \
  void moe_grouped_gemm_silu_mul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,    \
                                 const at::Tensor& expert_offsets, const OptTensor& a_scales,  \
                                 const OptTensor& b_scales, const OptTensor& out_scale,        \
                                 bool offsets_ready, const OptTensor& amax_scale,              \
                                 c10::string_view config);                                     \
  void moe_grouped_gemm_chain(at::Tensor& out, at::Tensor& h, const at::Tensor& a,             \
                              const at::Tensor& w1, const at::Tensor& w2,                      \
                              const at::Tensor& expert_offsets, const OptTensor& a_scales,     \
                              const OptTensor& w1_scales, const OptTensor& h_scale,            \
                              const OptTensor& w2_scales, bool offsets_ready,                  \
                              c10::string_view config);                                        \
  void cutlass_moe_mm(at::Tensor& out_tensors, const at::Tensor& a_tensors,                    \
                      const at::Tensor& b_tensors, const at::Tensor& a_scales,                 \
                      const at::Tensor& b_scales, const at::Tensor& expert_offsets,            \
                      const at::Tensor& problem_sizes, const at::Tensor& a_strides,            \
                      const at::Tensor& b_strides, const at::Tensor& c_strides,                \
                      bool per_act_token, bool per_out_ch);

// grouped_topk is the one op that returns tensors; it is declared beside the macro because
// its check:: form returns nothing.
#define HOPPER_MOE_GROUPED_TOPK_ARGS                                                           \
  (const at::Tensor& scores, int64_t n_group, int64_t topk_group, int64_t topk,               \
   bool renormalize, double routed_scaling_factor, const at::Tensor& bias, int64_t scoring_func)

// The whole layer over the SM90 grouped GEMM (csrc/layer/fused_experts_sm90.cpp): one
// composition for both devices, over the cpu:: or cuda:: ops.
#define HOPPER_MOE_LAYER_ARGS                                                                  \
  (at::Tensor & out, const at::Tensor& hidden_states, const at::Tensor& w1,                   \
   const at::Tensor& w2, const at::Tensor& topk_weights, const at::Tensor& topk_ids,          \
   bool apply_router_weight_on_input, int64_t global_num_experts, const OptTensor& expert_map, \
   const OptTensor& w1_scale, const OptTensor& w2_scale, const OptTensor& a1_scale,           \
   const OptTensor& a2_scale, bool per_act_token_quant, bool per_out_ch_quant)

// The layer's GEMM1 over rows gathered from the unpermuted input: row r of the GEMM's A
// operand is x[perm[r] / topk] (perm: moe_permute's permuted_idx; rows at or past the expert
// offsets' end are never read), and per-row a_scales are x's rows' ([x.size(0)]). No permuted
// copy of x is made on the GPU: the kernel's producer gathers the rows. Not ops (no schema):
// fused_experts_sm90 checks its arguments before it calls them.
struct RowGather {
  const at::Tensor& x;     // [num_tokens, K], rows 16-byte aligned
  const at::Tensor& perm;  // int32 [>= rows]
  int64_t topk;
};
#define HOPPER_MOE_DECLARE_GATHERED_GEMMS                                                      \
  void moe_grouped_gemm_silu_mul_gathered(                                                     \
      at::Tensor& out, const RowGather& a, const at::Tensor& b,                                \
      const at::Tensor& expert_offsets, const OptTensor& a_scales, const OptTensor& b_scales,  \
      const OptTensor& out_scale, bool offsets_ready, const OptTensor& amax_scale);            \
  void moe_grouped_gemm_chain_gathered(                                                        \
      at::Tensor& out, at::Tensor& h, const RowGather& a, const at::Tensor& w1,                \
      const at::Tensor& w2, const at::Tensor& expert_offsets, const OptTensor& a_scales,       \
      const OptTensor& w1_scales, const OptTensor& h_scale, const OptTensor& w2_scales,        \
      bool offsets_ready);

// What check::fused_experts_sm90 resolves from a valid call.
struct LayerScheme {
  bool fp8 = false;            // e4m3 weights (else 16-bit, run in bf16)
  bool per_act_token = false;  // one dynamic activation scale per row
  bool per_out_ch = false;     // one weight scale per output channel (vLLM's inference included)
  int64_t num_global = 0;      // global_num_experts resolved (expert_map's length, else E)
};

// Validation: throws a RuntimeError naming the argument and the rule; returns normally when
// the call is valid.
namespace check {
LayerScheme fused_experts_sm90(
    const at::Tensor& out, const at::Tensor& hidden_states, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
    bool apply_router_weight_on_input, int64_t global_num_experts, const OptTensor& expert_map,
    const OptTensor& w1_scale, const OptTensor& w2_scale, const OptTensor& a1_scale,
    const OptTensor& a2_scale, bool per_act_token_quant, bool per_out_ch_quant);
HOPPER_MOE_DECLARE_OPS
void grouped_topk HOPPER_MOE_GROUPED_TOPK_ARGS;
// The grouped-GEMM ops' `config`: "" (the heuristic's choice) or comma-separated key=value
// pairs, mapping=swap_ab|standard, pair=0|1, k_splits=1..heuristics::kMaxKSplits, pdl=0|1.
heuristics::GroupedGemmOverride grouped_gemm_config(const char* op, c10::string_view config);
}  // namespace check

namespace cpu {
HOPPER_MOE_DECLARE_OPS
HOPPER_MOE_DECLARE_GATHERED_GEMMS
std::tuple<at::Tensor, at::Tensor> grouped_topk HOPPER_MOE_GROUPED_TOPK_ARGS;
void fused_experts_sm90 HOPPER_MOE_LAYER_ARGS;
}  // namespace cpu

#ifdef HOPPER_MOE_WITH_CUDA
namespace cuda {
HOPPER_MOE_DECLARE_OPS
HOPPER_MOE_DECLARE_GATHERED_GEMMS
std::tuple<at::Tensor, at::Tensor> grouped_topk HOPPER_MOE_GROUPED_TOPK_ARGS;
void fused_experts_sm90 HOPPER_MOE_LAYER_ARGS;
}  // namespace cuda
#endif

// True when this build can run cutlass_moe_mm on a GPU of the given capability (major*10+minor).
bool cutlass_group_gemm_supported(int64_t cuda_device_capability);

// moe_permute and moe_unpermute run on every device this build has (vLLM's capability query).
bool moe_permute_unpermute_supported();

// Bytes of the sort_workspace that moe_permute_with_scratch / moe_prepare_scatter need for
// num_expanded_rows = num_tokens * topk slots and n_expert experts (any n_local_expert).
int64_t moe_permute_sort_workspace_size(int64_t num_expanded_rows, int64_t n_expert);

}  // namespace hopper_moe
