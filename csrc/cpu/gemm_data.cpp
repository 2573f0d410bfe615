// CPU definitions of the grouped-GEMM metadata ops (same semantics as vLLM's
// get_cutlass_moe_mm_data and get_cutlass_moe_mm_problem_sizes_from_expert_offsets). The CUDA
// launchers are tested against these bit for bit.
//
// get_cutlass_moe_mm_data, for the S = T*K slots i of topk_ids (row-major, token i / K):
//   slot i counts iff 0 <= topk_ids[i] < num_experts (anything else, -1 included, is skipped);
//   m_e                   = number of counting slots with id e;
//   expert_offsets[e]     = m_0 + ... + m_{e-1} for e = 0..E (length E + 1, int32 or int64);
//                           the grouped GEMM (cutlass_moe_mm) takes expert_offsets[:-1]
//                           (as int64, which is also what moe_permute's
//                           expert_first_token_offset[:-1] gives);
//   input_permutation[p]  for p < expert_offsets[E]: the token (i / K) of the slot placed at
//                           row p, slots grouped by expert in increasing e and, within one
//                           expert, in increasing slot index i (a stable sort); rows p >=
//                           expert_offsets[E] hold -1 (vLLM 0.33: no row, so shuffle_rows
//                           writes a zero row there);
//   output_permutation[i] = the row p of slot i, or expert_offsets[E] (one past the last GEMM
//                           row: vLLM's "reads a zero row") for a slot that does not count;
//   problem_sizes1[e]     = (m_e, N1, k) with N1 = 2n if is_gated else n; problem_sizes2[e] =
//                           (m_e, k, n); both swapped to (N, M, K) order when S <= 64 (vLLM's
//                           swap-AB threshold; the grouped GEMM then runs with A and B swapped)
//                           and blockscale_offsets is None;
//   blockscale_offsets    (optional, vLLM's FP4 layout) [0] = 0, [e + 1] = [e] + m_e rounded up
//                           to a multiple of 128.
//
// get_cutlass_moe_mm_problem_sizes_from_expert_offsets: m_e = expert_first_token_offset[e+1] -
// expert_first_token_offset[e] clamped to [0, 2^31 - 1] (garbage offsets never yield a negative
// GEMM size), problem_sizes1[e] = (m_e, 2n, k), problem_sizes2[e] = (m_e, k, n), swapped to
// (2n, m_e, k) / (k, m_e, n) when swap_ab.
#include "hopper_moe/common/swap_ab.h"
#include "ops.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace hopper_moe::cpu {
namespace {

void write_problem_sizes(int32_t* ps1, int32_t* ps2, int64_t e, int32_t m, int32_t n1,
                         int32_t n, int32_t k, bool swap_ab) {
  int32_t* p1 = ps1 + 3 * e;
  int32_t* p2 = ps2 + 3 * e;
  if (!swap_ab) {
    p1[0] = m, p1[1] = n1, p1[2] = k;
    p2[0] = m, p2[1] = k, p2[2] = n;
  } else {
    p1[0] = n1, p1[1] = m, p1[2] = k;
    p2[0] = k, p2[1] = m, p2[2] = n;
  }
}

template <typename id_t, typename offset_t>
void moe_mm_data_loops(const id_t* ids, int64_t num_slots, int64_t top_k, int64_t num_experts,
                       offset_t* expert_offsets, int32_t* ps1, int32_t* ps2, int32_t* in_perm,
                       int32_t* out_perm, int32_t n1, int32_t n, int32_t k, bool swap_ab) {
  auto counts = [&](int64_t i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    return id >= 0 && id < num_experts;
  };
  std::vector<int64_t> m(num_experts, 0);
  for (int64_t i = 0; i < num_slots; ++i) {
    if (counts(i)) ++m[static_cast<int64_t>(ids[i])];
  }
  std::vector<int64_t> cursor(num_experts);  // next free row of each expert
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    expert_offsets[e] = static_cast<offset_t>(total);
    cursor[e] = total;
    write_problem_sizes(ps1, ps2, e, static_cast<int32_t>(m[e]), n1, n, k, swap_ab);
    total += m[e];
  }
  expert_offsets[num_experts] = static_cast<offset_t>(total);

  for (int64_t i = 0; i < num_slots; ++i) {
    if (counts(i)) {
      const int64_t row = cursor[static_cast<int64_t>(ids[i])]++;
      in_perm[row] = static_cast<int32_t>(i / top_k);
      out_perm[i] = static_cast<int32_t>(row);
    } else {
      out_perm[i] = static_cast<int32_t>(total);
    }
  }
  std::fill(in_perm + total, in_perm + num_slots, -1);
}

template <typename id_t>
void moe_mm_data_typed(const at::Tensor& topk_ids, at::Tensor& expert_offsets, int32_t* ps1,
                       int32_t* ps2, int32_t* in_perm, int32_t* out_perm, int64_t num_experts,
                       int32_t n1, int32_t n, int32_t k, bool swap_ab) {
  const id_t* ids = topk_ids.const_data_ptr<id_t>();
  const int64_t num_slots = topk_ids.numel();
  const int64_t top_k = topk_ids.size(1);
  if (expert_offsets.scalar_type() == at::kInt) {
    moe_mm_data_loops(ids, num_slots, top_k, num_experts,
                      expert_offsets.mutable_data_ptr<int32_t>(), ps1, ps2, in_perm, out_perm,
                      n1, n, k, swap_ab);
  } else {
    moe_mm_data_loops(ids, num_slots, top_k, num_experts,
                      expert_offsets.mutable_data_ptr<int64_t>(), ps1, ps2, in_perm, out_perm,
                      n1, n, k, swap_ab);
  }
}

}  // namespace

void get_cutlass_moe_mm_data(const at::Tensor& topk_ids, at::Tensor& expert_offsets,
                             at::Tensor& problem_sizes1, at::Tensor& problem_sizes2,
                             at::Tensor& input_permutation, at::Tensor& output_permutation,
                             int64_t num_experts, int64_t n, int64_t k,
                             const OptTensor& blockscale_offsets, bool is_gated) {
  check::get_cutlass_moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2,
                                 input_permutation, output_permutation, num_experts, n, k,
                                 blockscale_offsets, is_gated);
  // No empty-problem return: with 0 slots the offsets and problem sizes are still written.
  // With blockscale_offsets (vLLM's FP4 layout) the sizes are never swapped.
  const bool swap_ab = !blockscale_offsets && topk_ids.numel() <= kSwapAbMaxSlots;
  const auto n1 = static_cast<int32_t>(is_gated ? 2 * n : n);
  int32_t* ps1 = problem_sizes1.mutable_data_ptr<int32_t>();
  int32_t* ps2 = problem_sizes2.mutable_data_ptr<int32_t>();
  int32_t* in_perm = input_permutation.mutable_data_ptr<int32_t>();
  int32_t* out_perm = output_permutation.mutable_data_ptr<int32_t>();
  if (topk_ids.scalar_type() == at::kInt) {
    moe_mm_data_typed<int32_t>(topk_ids, expert_offsets, ps1, ps2, in_perm, out_perm,
                               num_experts, n1, static_cast<int32_t>(n),
                               static_cast<int32_t>(k), swap_ab);
  } else {
    moe_mm_data_typed<int64_t>(topk_ids, expert_offsets, ps1, ps2, in_perm, out_perm,
                               num_experts, n1, static_cast<int32_t>(n),
                               static_cast<int32_t>(k), swap_ab);
  }
  if (blockscale_offsets) {
    // Each expert's rows rounded up to 128 (the FP4 block-scale tiles), as a prefix sum.
    int32_t* b = blockscale_offsets->mutable_data_ptr<int32_t>();
    const at::Tensor off = expert_offsets.to(at::kLong);
    const int64_t* o = off.const_data_ptr<int64_t>();
    int64_t acc = 0;
    b[0] = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      acc += (o[e + 1] - o[e] + 127) / 128 * 128;
      b[e + 1] = static_cast<int32_t>(acc);
    }
  }
}

void get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
    const at::Tensor& expert_first_token_offset, at::Tensor& problem_sizes1,
    at::Tensor& problem_sizes2, int64_t n, int64_t k, bool swap_ab) {
  check::get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
      expert_first_token_offset, problem_sizes1, problem_sizes2, n, k, swap_ab);
  const int64_t num_experts = problem_sizes1.size(0);
  if (num_experts == 0) return;

  const int64_t* off = expert_first_token_offset.const_data_ptr<int64_t>();
  int32_t* ps1 = problem_sizes1.mutable_data_ptr<int32_t>();
  int32_t* ps2 = problem_sizes2.mutable_data_ptr<int32_t>();
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  for (int64_t e = 0; e < num_experts; ++e) {
    // Unsigned difference: well defined even for garbage offsets of opposite signs.
    const auto diff = static_cast<int64_t>(static_cast<uint64_t>(off[e + 1]) -
                                           static_cast<uint64_t>(off[e]));
    const auto m = static_cast<int32_t>(std::clamp<int64_t>(diff, 0, kInt32Max));
    write_problem_sizes(ps1, ps2, e, m, static_cast<int32_t>(2 * n), static_cast<int32_t>(n),
                        static_cast<int32_t>(k), swap_ab);
  }
}

}  // namespace hopper_moe::cpu
