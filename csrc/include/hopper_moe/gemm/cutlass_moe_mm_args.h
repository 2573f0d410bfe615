// cutlass_moe_mm's row ranges as moe_grouped_gemm's offsets, built with ATen ops on the
// tensors' device (no host sync, capturable in a CUDA graph).
//
// vLLM's cutlass_moe_mm gets each expert's first row (expert_offsets [E]) and its problem
// size (problem_sizes [E, 3]: (m_e, N, K), or (N, m_e, K) when the caller swapped them for
// M_tot <= 64). get_cutlass_moe_mm_data writes contiguous groups, offsets[e+1] =
// offsets[e] + m_e, so the row ranges are [offsets[e], offsets[e+1]) and the last one ends at
// offsets[E-1] + m_{E-1}. That is the definition here (both devices): only the last expert's
// problem size is read.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace hopper_moe::gemm {

// int64 [E + 1]: expert_offsets (int32/int64 [E]) followed by the end of the last group.
inline at::Tensor cutlass_moe_mm_row_offsets(const at::Tensor& expert_offsets,
                                             const at::Tensor& problem_sizes, bool swapped) {
  const int64_t e = expert_offsets.numel();
  at::Tensor ext = at::empty({e + 1}, expert_offsets.options().dtype(at::kLong));
  if (e == 0) return ext.zero_();
  ext.slice(0, 0, e).copy_(expert_offsets);
  const at::Tensor last_m = problem_sizes.select(0, e - 1).select(0, swapped ? 1 : 0);
  ext.slice(0, e, e + 1).copy_(expert_offsets.slice(0, e - 1, e).to(at::kLong).add(last_m));
  return ext;
}

// The swap-AB contract of cutlass_moe_mm: problem sizes are swapped when M_tot <= 64.
inline bool cutlass_moe_mm_swapped(const at::Tensor& a) { return a.size(0) <= 64; }

}  // namespace hopper_moe::gemm
