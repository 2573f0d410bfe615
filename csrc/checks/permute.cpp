// Argument checks of the permutation family: moe_align_block_size, moe_permute (and its forms
// with caller-provided scratch: moe_permute_with_scratch, moe_prepare_scatter), moe_unpermute,
// shuffle_rows. Shared by the CPU definitions (csrc/cpu/permute.cpp) and the CUDA launchers
// (csrc/ops/permute.cu), so both devices reject exactly the same calls.
//
// Only shapes, dtypes, devices, layouts and integer arguments are checked here. Data-dependent
// validity (expert ids out of range, expert_map entries, gather indices out of range) is
// handled inside the ops by skipping, never by reading data on the host.
#include <limits>

#include "hopper_moe/common/checks.h"
#include "ops.h"

namespace hopper_moe::check {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Row tensors of the permute/unpermute/shuffle ops: activations in any float or FP8 format.
#define HM_ROW_DTYPES \
  {at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2}

// 2-D [rows, cols] with unit stride along cols; any row stride.
void check_rows_named(const char* op, const at::Tensor& t, const char* name) {
  check_dim_named(op, t, name, 2);
  check_dtype_named(op, t, name, HM_ROW_DTYPES);
  check_last_dim_contiguous_named(op, t, name);
}

}  // namespace

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& experts_ids,
                          at::Tensor& num_tokens_post_pad, const OptTensor& maybe_expert_map,
                          const OptTensor& scatter_idx) {
  constexpr const char* kOp = "moe_align_block_size";
  HM_CHECK_DTYPE(kOp, topk_ids, HM_INDEX_DTYPES);
  HM_CHECK_CONTIGUOUS(kOp, topk_ids);
  const int64_t numel = topk_ids.numel();
  HM_CHECK(kOp, numel <= kInt32Max, "topk_ids must have at most 2^31-1 elements (got ", numel,
           ")");
  // 65536 bounds the per-expert workspace; no MoE model comes near it.
  HM_CHECK(kOp, num_experts >= 1 && num_experts <= 65536,
           "num_experts must be in [1, 65536] (got ", num_experts, ")");
  HM_CHECK(kOp, block_size >= 1 && block_size <= kInt32Max,
           "block_size must be in [1, 2^31-1] (got ", block_size, ")");

  HM_CHECK_DTYPE(kOp, sorted_token_ids, at::kInt);
  HM_CHECK_DIM(kOp, sorted_token_ids, 1);
  HM_CHECK_CONTIGUOUS(kOp, sorted_token_ids);
  HM_CHECK_SAME_DEVICE(kOp, sorted_token_ids, topk_ids);
  // Every expert segment wastes at most block_size-1 slots and only non-empty experts have a
  // segment, so numel + min(numel, E) * (block_size-1) always holds the padded layout (vLLM's
  // bound, including its small-batch cap min(numel*block_size, numel + E*(block_size-1))).
  const int64_t needed = numel + std::min(numel, num_experts) * (block_size - 1);
  const int64_t len = sorted_token_ids.size(0);
  HM_CHECK(kOp, len >= needed, "sorted_token_ids must have at least numel + min(numel, ",
           "num_experts) * (block_size - 1) = ", needed, " elements (got ", len, ")");
  HM_CHECK(kOp, len <= kInt32Max, "sorted_token_ids must have at most 2^31-1 elements (got ",
           len, ")");

  HM_CHECK_DTYPE(kOp, experts_ids, at::kInt);
  HM_CHECK_DIM(kOp, experts_ids, 1);
  HM_CHECK_CONTIGUOUS(kOp, experts_ids);
  HM_CHECK_SAME_DEVICE(kOp, experts_ids, topk_ids);
  const int64_t blocks = (len + block_size - 1) / block_size;
  HM_CHECK(kOp, experts_ids.size(0) >= blocks,
           "experts_ids must have at least ceil(sorted_token_ids.numel() / block_size) = ", blocks,
           " elements (got ", experts_ids.size(0), ")");

  HM_CHECK_DTYPE(kOp, num_tokens_post_pad, at::kInt);
  HM_CHECK_NUMEL(kOp, num_tokens_post_pad, 1);
  HM_CHECK_SAME_DEVICE(kOp, num_tokens_post_pad, topk_ids);

  if (maybe_expert_map) {
    const auto& m = *maybe_expert_map;
    check_dtype_named(kOp, m, "maybe_expert_map", at::kInt);
    check_dim_named(kOp, m, "maybe_expert_map", 1);
    check_size_named(kOp, m, "maybe_expert_map", 0, num_experts, "num_experts");
    check_contiguous_named(kOp, m, "maybe_expert_map");
    check_same_device_named(kOp, m, "maybe_expert_map", topk_ids, "topk_ids");
  }
  if (scatter_idx) {
    const auto& s = *scatter_idx;
    check_dtype_named(kOp, s, "scatter_idx", at::kInt);
    check_numel_named(kOp, s, "scatter_idx", numel, "topk_ids.numel()");
    check_contiguous_named(kOp, s, "scatter_idx");
    check_same_device_named(kOp, s, "scatter_idx", topk_ids, "topk_ids");
  }
  check_outputs_disjoint(kOp,
                         {{sorted_token_ids, "sorted_token_ids"},
                          {experts_ids, "experts_ids"},
                          {num_tokens_post_pad, "num_tokens_post_pad"},
                          {scatter_idx, "scatter_idx"}},
                         {{topk_ids, "topk_ids"}, {maybe_expert_map, "maybe_expert_map"}});
}

namespace {

// The routing arguments shared by moe_permute, moe_permute_with_scratch and
// moe_prepare_scatter; `ref` is the tensor every argument must share a device with.
void check_routing(const char* kOp, const at::Tensor& topk_ids,
                   const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                   int64_t n_expert, int64_t n_local_expert, int64_t topk,
                   const at::Tensor& expert_first_token_offset,
                   const at::Tensor& inv_permuted_idx, const char* inv_name,
                   const at::Tensor& ref, const char* ref_name) {
  HM_CHECK(kOp, n_expert >= 1 && n_expert <= 65536, "n_expert must be in [1, 65536] (got ",
           n_expert, ")");
  HM_CHECK(kOp, n_local_expert >= 1 && n_local_expert <= n_expert,
           "n_local_expert must be in [1, n_expert] (got ", n_local_expert, ", n_expert ",
           n_expert, ")");

  HM_CHECK_DTYPE(kOp, topk_ids, HM_INDEX_DTYPES);
  HM_CHECK_DIM(kOp, topk_ids, 2);
  HM_CHECK_CONTIGUOUS(kOp, topk_ids);
  check_same_device_named(kOp, topk_ids, "topk_ids", ref, ref_name);
  HM_CHECK(kOp, topk >= 1 && topk == topk_ids.size(1),
           "topk must be >= 1 and equal topk_ids.size(1) (got topk ", topk,
           ", topk_ids.size(1) ", topk_ids.size(1), ")");
  const int64_t slots = topk_ids.numel();
  HM_CHECK(kOp, slots <= kInt32Max, "topk_ids must have at most 2^31-1 elements (got ", slots,
           ")");

  HM_CHECK_DTYPE(kOp, token_expert_indices, at::kInt);
  HM_CHECK_SAME_SHAPE(kOp, token_expert_indices, topk_ids);
  HM_CHECK_CONTIGUOUS(kOp, token_expert_indices);
  check_same_device_named(kOp, token_expert_indices, "token_expert_indices", ref, ref_name);

  if (expert_map) {
    const auto& m = *expert_map;
    check_dtype_named(kOp, m, "expert_map", at::kInt);
    check_dim_named(kOp, m, "expert_map", 1);
    check_size_named(kOp, m, "expert_map", 0, n_expert, "n_expert");
    check_contiguous_named(kOp, m, "expert_map");
    check_same_device_named(kOp, m, "expert_map", ref, ref_name);
  }

  HM_CHECK_DTYPE(kOp, expert_first_token_offset, at::kLong);
  HM_CHECK_DIM(kOp, expert_first_token_offset, 1);
  HM_CHECK_SIZE(kOp, expert_first_token_offset, 0, n_local_expert + 1, "n_local_expert + 1");
  HM_CHECK_CONTIGUOUS(kOp, expert_first_token_offset);
  check_same_device_named(kOp, expert_first_token_offset, "expert_first_token_offset", ref,
                          ref_name);

  check_dtype_named(kOp, inv_permuted_idx, inv_name, at::kInt);
  HM_CHECK(kOp, inv_permuted_idx.sizes() == topk_ids.sizes(), inv_name,
           " must have the same shape as topk_ids (", topk_ids.sizes(), "), got ",
           inv_permuted_idx.sizes());
  check_contiguous_named(kOp, inv_permuted_idx, inv_name);
  check_same_device_named(kOp, inv_permuted_idx, inv_name, ref, ref_name);
}

// A caller-provided buffer (vLLM's MoEPermuteScratch): exact dtype, contiguous, at least
// `numel` elements, on ref's device. Its contents before and after the call mean nothing.
void check_scratch(const char* kOp, const at::Tensor& t, const char* name, at::ScalarType dtype,
                   int64_t numel, const char* what, const at::Tensor& ref,
                   const char* ref_name) {
  check_dtype_named(kOp, t, name, dtype);
  check_contiguous_named(kOp, t, name);
  HM_CHECK(kOp, t.numel() >= numel, name, " must have at least ", numel, " elements (", what,
           "), got ", t.numel());
  check_same_device_named(kOp, t, name, ref, ref_name);
}

// The four scratch buffers of moe_permute_with_scratch / moe_prepare_scatter.
void check_permute_scratch(const char* kOp, int64_t slots, int64_t n_expert,
                           const at::Tensor& sort_workspace, const at::Tensor& sorted_experts,
                           const char* sorted_experts_name, const at::Tensor& sorted_rows,
                           const char* sorted_rows_name, const at::Tensor& topk_ids_for_sort,
                           const at::Tensor& ref, const char* ref_name) {
  check_scratch(kOp, sort_workspace, "sort_workspace", at::kChar,
                moe_permute_sort_workspace_size(slots, n_expert),
                "moe_permute_sort_workspace_size(num_tokens * topk, n_expert) bytes", ref,
                ref_name);
  check_scratch(kOp, sorted_experts, sorted_experts_name, at::kInt, slots, "num_tokens * topk",
                ref, ref_name);
  check_scratch(kOp, sorted_rows, sorted_rows_name, at::kInt, slots, "num_tokens * topk", ref,
                ref_name);
  check_scratch(kOp, topk_ids_for_sort, "topk_ids_for_sort", at::kInt, slots,
                "num_tokens * topk", ref, ref_name);
}

void check_permute(const char* kOp, const at::Tensor& input, const at::Tensor& topk_ids,
                   const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                   int64_t n_expert, int64_t n_local_expert, int64_t topk,
                   const at::Tensor& permuted_input, const at::Tensor& expert_first_token_offset,
                   const at::Tensor& inv_permuted_idx, const at::Tensor& permuted_idx) {
  check_rows_named(kOp, input, "input");
  const int64_t num_tokens = input.size(0);
  const int64_t hidden = input.size(1);
  HM_CHECK_DTYPE(kOp, topk_ids, HM_INDEX_DTYPES);
  HM_CHECK_DIM(kOp, topk_ids, 2);
  HM_CHECK_SIZE(kOp, topk_ids, 0, num_tokens, "input.size(0)");
  check_routing(kOp, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert, topk,
                expert_first_token_offset, inv_permuted_idx, "inv_permuted_idx", input,
                "input");
  const int64_t slots = num_tokens * topk;

  check_rows_named(kOp, permuted_input, "permuted_input");
  HM_CHECK(kOp, permuted_input.scalar_type() == input.scalar_type(),
           "permuted_input must have the dtype of input (", c10::toString(input.scalar_type()),
           "), got ", c10::toString(permuted_input.scalar_type()));
  HM_CHECK_SIZE(kOp, permuted_input, 1, hidden, "input.size(1)");
  HM_CHECK(kOp, permuted_input.size(0) >= slots,
           "permuted_input must have at least num_tokens * topk = ", slots, " rows (got ",
           permuted_input.size(0), ")");
  HM_CHECK_SAME_DEVICE(kOp, permuted_input, input);
  HM_CHECK_OUTPUT_DISTINCT(kOp, permuted_input);

  HM_CHECK_DTYPE(kOp, permuted_idx, at::kInt);
  HM_CHECK_DIM(kOp, permuted_idx, 1);
  HM_CHECK(kOp, permuted_idx.size(0) >= slots, "permuted_idx must have at least num_tokens * ",
           "topk = ", slots, " elements (got ", permuted_idx.size(0), ")");
  HM_CHECK_CONTIGUOUS(kOp, permuted_idx);
  HM_CHECK_SAME_DEVICE(kOp, permuted_idx, input);

  check_outputs_disjoint(kOp,
                         {{permuted_input, "permuted_input"},
                          {expert_first_token_offset, "expert_first_token_offset"},
                          {inv_permuted_idx, "inv_permuted_idx"},
                          {permuted_idx, "permuted_idx"}},
                         {{input, "input"},
                          {topk_ids, "topk_ids"},
                          {token_expert_indices, "token_expert_indices"},
                          {expert_map, "expert_map"}});
}

}  // namespace

void moe_permute(const at::Tensor& input, const at::Tensor& topk_ids,
                 const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                 int64_t n_expert, int64_t n_local_expert, int64_t topk,
                 at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,
                 at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx) {
  check_permute("moe_permute", input, topk_ids, token_expert_indices, expert_map, n_expert,
                n_local_expert, topk, permuted_input, expert_first_token_offset,
                inv_permuted_idx, permuted_idx);
}

void moe_permute_with_scratch(const at::Tensor& input, const at::Tensor& topk_ids,
                              const at::Tensor& token_expert_indices,
                              const OptTensor& expert_map, int64_t n_expert,
                              int64_t n_local_expert, int64_t topk, at::Tensor& permuted_input,
                              at::Tensor& expert_first_token_offset,
                              at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx,
                              at::Tensor& sort_workspace, at::Tensor& permuted_experts_id,
                              at::Tensor& sorted_row_idx, at::Tensor& topk_ids_for_sort) {
  constexpr const char* kOp = "moe_permute_with_scratch";
  check_permute(kOp, input, topk_ids, token_expert_indices, expert_map, n_expert,
                n_local_expert, topk, permuted_input, expert_first_token_offset,
                inv_permuted_idx, permuted_idx);
  check_permute_scratch(kOp, topk_ids.numel(), n_expert, sort_workspace, permuted_experts_id,
                        "permuted_experts_id", sorted_row_idx, "sorted_row_idx",
                        topk_ids_for_sort, input, "input");
  check_outputs_disjoint(kOp,
                         {{sort_workspace, "sort_workspace"},
                          {permuted_experts_id, "permuted_experts_id"},
                          {sorted_row_idx, "sorted_row_idx"},
                          {topk_ids_for_sort, "topk_ids_for_sort"}},
                         {{input, "input"},
                          {topk_ids, "topk_ids"},
                          {token_expert_indices, "token_expert_indices"},
                          {expert_map, "expert_map"},
                          {permuted_input, "permuted_input"},
                          {expert_first_token_offset, "expert_first_token_offset"},
                          {inv_permuted_idx, "inv_permuted_idx"},
                          {permuted_idx, "permuted_idx"}});
}

void moe_prepare_scatter(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices,
                         const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert,
                         at::Tensor& expert_first_token_offset, at::Tensor& scatter_idx,
                         at::Tensor& sort_workspace, at::Tensor& sorted_experts,
                         at::Tensor& sorted_rows, at::Tensor& topk_ids_for_sort) {
  constexpr const char* kOp = "moe_prepare_scatter";
  HM_CHECK_DIM(kOp, topk_ids, 2);
  check_routing(kOp, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                topk_ids.size(1), expert_first_token_offset, scatter_idx, "scatter_idx",
                topk_ids, "topk_ids");
  check_permute_scratch(kOp, topk_ids.numel(), n_expert, sort_workspace, sorted_experts,
                        "sorted_experts", sorted_rows, "sorted_rows", topk_ids_for_sort,
                        topk_ids, "topk_ids");
  check_outputs_disjoint(kOp,
                         {{expert_first_token_offset, "expert_first_token_offset"},
                          {scatter_idx, "scatter_idx"},
                          {sort_workspace, "sort_workspace"},
                          {sorted_experts, "sorted_experts"},
                          {sorted_rows, "sorted_rows"},
                          {topk_ids_for_sort, "topk_ids_for_sort"}},
                         {{topk_ids, "topk_ids"},
                          {token_expert_indices, "token_expert_indices"},
                          {expert_map, "expert_map"}});
}

void moe_unpermute(const at::Tensor& permuted_hidden_states, const at::Tensor& topk_weights,
                   const at::Tensor& inv_permuted_idx,
                   const OptTensor& expert_first_token_offset, int64_t topk,
                   at::Tensor& hidden_states) {
  constexpr const char* kOp = "moe_unpermute";
  check_rows_named(kOp, permuted_hidden_states, "permuted_hidden_states");

  check_rows_named(kOp, hidden_states, "hidden_states");
  HM_CHECK(kOp, hidden_states.scalar_type() == permuted_hidden_states.scalar_type(),
           "hidden_states must have the dtype of permuted_hidden_states (",
           c10::toString(permuted_hidden_states.scalar_type()), "), got ",
           c10::toString(hidden_states.scalar_type()));
  HM_CHECK_SIZE(kOp, hidden_states, 1, permuted_hidden_states.size(1),
                "permuted_hidden_states.size(1)");
  HM_CHECK_SAME_DEVICE(kOp, hidden_states, permuted_hidden_states);
  HM_CHECK_OUTPUT_DISTINCT(kOp, hidden_states);
  const int64_t num_tokens = hidden_states.size(0);

  HM_CHECK_DTYPE(kOp, topk_weights, at::kFloat);
  HM_CHECK_DIM(kOp, topk_weights, 2);
  HM_CHECK_SIZE(kOp, topk_weights, 0, num_tokens, "hidden_states.size(0)");
  HM_CHECK_CONTIGUOUS(kOp, topk_weights);
  HM_CHECK_SAME_DEVICE(kOp, topk_weights, permuted_hidden_states);
  HM_CHECK(kOp, topk >= 1 && topk == topk_weights.size(1),
           "topk must be >= 1 and equal topk_weights.size(1) (got topk ", topk,
           ", topk_weights.size(1) ", topk_weights.size(1), ")");

  HM_CHECK_DTYPE(kOp, inv_permuted_idx, at::kInt);
  HM_CHECK_NUMEL(kOp, inv_permuted_idx, num_tokens * topk, "num_tokens * topk");
  HM_CHECK_CONTIGUOUS(kOp, inv_permuted_idx);
  HM_CHECK_SAME_DEVICE(kOp, inv_permuted_idx, permuted_hidden_states);

  if (expert_first_token_offset) {
    const auto& o = *expert_first_token_offset;
    check_dtype_named(kOp, o, "expert_first_token_offset", at::kLong);
    check_dim_named(kOp, o, "expert_first_token_offset", 1);
    HM_CHECK(kOp, o.size(0) >= 1, "expert_first_token_offset must have at least 1 element ",
             "(n_local_expert + 1)");
    check_contiguous_named(kOp, o, "expert_first_token_offset");
    check_same_device_named(kOp, o, "expert_first_token_offset", permuted_hidden_states,
                            "permuted_hidden_states");
  }
  check_outputs_disjoint(kOp, {{hidden_states, "hidden_states"}},
                         {{permuted_hidden_states, "permuted_hidden_states"},
                          {topk_weights, "topk_weights"},
                          {inv_permuted_idx, "inv_permuted_idx"},
                          {expert_first_token_offset, "expert_first_token_offset"}});
}

void shuffle_rows(const at::Tensor& input_tensor, const at::Tensor& dst2src_map,
                  at::Tensor& output_tensor) {
  constexpr const char* kOp = "shuffle_rows";
  check_rows_named(kOp, input_tensor, "input_tensor");

  HM_CHECK_DTYPE(kOp, dst2src_map, HM_INDEX_DTYPES);
  HM_CHECK_DIM(kOp, dst2src_map, 1);
  HM_CHECK_CONTIGUOUS(kOp, dst2src_map);
  HM_CHECK_SAME_DEVICE(kOp, dst2src_map, input_tensor);

  check_rows_named(kOp, output_tensor, "output_tensor");
  HM_CHECK(kOp, output_tensor.scalar_type() == input_tensor.scalar_type(),
           "output_tensor must have the dtype of input_tensor (",
           c10::toString(input_tensor.scalar_type()), "), got ",
           c10::toString(output_tensor.scalar_type()));
  HM_CHECK_SIZE(kOp, output_tensor, 0, dst2src_map.size(0), "dst2src_map.size(0)");
  HM_CHECK_SIZE(kOp, output_tensor, 1, input_tensor.size(1), "input_tensor.size(1)");
  HM_CHECK_SAME_DEVICE(kOp, output_tensor, input_tensor);
  HM_CHECK_OUTPUT_DISTINCT(kOp, output_tensor);
  check_outputs_disjoint(kOp, {{output_tensor, "output_tensor"}},
                         {{input_tensor, "input_tensor"}, {dst2src_map, "dst2src_map"}});
}

}  // namespace hopper_moe::check
