// Validation of the grouped-GEMM metadata ops, shared by their CPU and CUDA implementations.
#include "ops.h"

#include <limits>

#include "hopper_moe/common/checks.h"

namespace hopper_moe::check {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// problem_sizes{1,2}: int32 [num_experts, 3] contiguous, on the device of `ref`.
void check_problem_sizes(const char* op, const at::Tensor& ps, const char* name,
                         int64_t num_experts, const at::Tensor& ref, const char* ref_name) {
  check_dim_named(op, ps, name, 2);
  check_dtype_named(op, ps, name, at::kInt);
  check_same_device_named(op, ps, name, ref, ref_name);
  check_size_named(op, ps, name, 0, num_experts, "num_experts");
  check_size_named(op, ps, name, 1, 3, "one (M, N, K) triple per expert");
  check_contiguous_named(op, ps, name);
}

// n and k become int32 entries of the problem sizes (N of the first GEMM is 2n when gated).
void check_n_k(const char* op, int64_t n, int64_t k, bool gated) {
  HM_CHECK(op, n >= 1 && (gated ? 2 * n : n) <= kInt32Max,
           "n must be >= 1 and ", gated ? "2*n" : "n", " must fit in int32 (got n = ", n, ")");
  HM_CHECK(op, k >= 1 && k <= kInt32Max, "k must be >= 1 and fit in int32 (got k = ", k, ")");
}

}  // namespace

// topk_ids [T, K] int32/int64 contiguous; expert_offsets [num_experts + 1] int32/int64;
// problem_sizes{1,2} int32 [num_experts, 3]; input/output_permutation int32 [T*K]; all
// contiguous and on one device. blockscale_offsets (vLLM's FP4 path): None, or int32
// [num_experts + 1], written (as vLLM does although its schema declares it read-only).
void get_cutlass_moe_mm_data(const at::Tensor& topk_ids, at::Tensor& expert_offsets,
                             at::Tensor& problem_sizes1, at::Tensor& problem_sizes2,
                             at::Tensor& input_permutation, at::Tensor& output_permutation,
                             int64_t num_experts, int64_t n, int64_t k,
                             const OptTensor& blockscale_offsets, bool is_gated) {
  constexpr const char* kOp = "get_cutlass_moe_mm_data";
  HM_CHECK(kOp, num_experts >= 1 && num_experts < kInt32Max,
           "num_experts must be in [1, 2^31 - 1) (got ", num_experts, ")");
  check_n_k(kOp, n, k, is_gated);

  HM_CHECK_DIM(kOp, topk_ids, 2);
  HM_CHECK_DTYPE(kOp, topk_ids, HM_INDEX_DTYPES);
  HM_CHECK_CONTIGUOUS(kOp, topk_ids);
  HM_CHECK(kOp, topk_ids.numel() <= kInt32Max,
           "topk_ids must have at most 2^31 - 1 elements (slot indices are int32), got ",
           topk_ids.numel());

  HM_CHECK_DIM(kOp, expert_offsets, 1);
  HM_CHECK_DTYPE(kOp, expert_offsets, HM_INDEX_DTYPES);
  HM_CHECK_SAME_DEVICE(kOp, expert_offsets, topk_ids);
  HM_CHECK_SIZE(kOp, expert_offsets, 0, num_experts + 1, "num_experts + 1");
  HM_CHECK_CONTIGUOUS(kOp, expert_offsets);

  check_problem_sizes(kOp, problem_sizes1, "problem_sizes1", num_experts, topk_ids, "topk_ids");
  check_problem_sizes(kOp, problem_sizes2, "problem_sizes2", num_experts, topk_ids, "topk_ids");

  auto check_permutation = [&](const at::Tensor& perm, const char* name) {
    check_dim_named(kOp, perm, name, 1);
    check_dtype_named(kOp, perm, name, at::kInt);
    check_same_device_named(kOp, perm, name, topk_ids, "topk_ids");
    check_size_named(kOp, perm, name, 0, topk_ids.numel(), "topk_ids.numel()");
    check_contiguous_named(kOp, perm, name);
  };
  check_permutation(input_permutation, "input_permutation");
  check_permutation(output_permutation, "output_permutation");
  if (blockscale_offsets) {
    const auto& b = *blockscale_offsets;
    check_dim_named(kOp, b, "blockscale_offsets", 1);
    check_dtype_named(kOp, b, "blockscale_offsets", at::kInt);
    check_same_device_named(kOp, b, "blockscale_offsets", topk_ids, "topk_ids");
    check_size_named(kOp, b, "blockscale_offsets", 0, num_experts + 1, "num_experts + 1");
    check_contiguous_named(kOp, b, "blockscale_offsets");
  }
  check_outputs_disjoint(kOp,
                         {{expert_offsets, "expert_offsets"},
                          {problem_sizes1, "problem_sizes1"},
                          {problem_sizes2, "problem_sizes2"},
                          {input_permutation, "input_permutation"},
                          {output_permutation, "output_permutation"},
                          {blockscale_offsets, "blockscale_offsets"}},
                         {{topk_ids, "topk_ids"}});
}

// expert_first_token_offset int64 [E + 1] contiguous; problem_sizes{1,2} int32 [E, 3].
void get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
    const at::Tensor& expert_first_token_offset, at::Tensor& problem_sizes1,
    at::Tensor& problem_sizes2, int64_t n, int64_t k, bool swap_ab) {
  constexpr const char* kOp = "get_cutlass_moe_mm_problem_sizes_from_expert_offsets";
  (void)swap_ab;
  check_n_k(kOp, n, k, /*gated=*/true);
  HM_CHECK_DIM(kOp, expert_first_token_offset, 1);
  HM_CHECK_DTYPE(kOp, expert_first_token_offset, at::kLong);
  HM_CHECK_CONTIGUOUS(kOp, expert_first_token_offset);
  HM_CHECK_DIM(kOp, problem_sizes1, 2);
  const int64_t num_experts = problem_sizes1.size(0);
  HM_CHECK_SIZE(kOp, expert_first_token_offset, 0, num_experts + 1,
                "problem_sizes1.size(0) + 1");
  check_problem_sizes(kOp, problem_sizes1, "problem_sizes1", num_experts,
                      expert_first_token_offset, "expert_first_token_offset");
  check_problem_sizes(kOp, problem_sizes2, "problem_sizes2", num_experts,
                      expert_first_token_offset, "expert_first_token_offset");
  check_outputs_disjoint(kOp,
                         {{problem_sizes1, "problem_sizes1"}, {problem_sizes2, "problem_sizes2"}},
                         {{expert_first_token_offset, "expert_first_token_offset"}});
}

}  // namespace hopper_moe::check
