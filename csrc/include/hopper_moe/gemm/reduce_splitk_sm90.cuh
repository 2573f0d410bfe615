// The K split's second kernel: the sum of the splits' scaled fp32 partial tiles for the rows
// each expert owns (clamped as in the GEMM; rows no expert owns stay untouched), then the
// GEMM's epilogue on the sums: out[row, n] = bf16(sum_s partial[s, row, n]) (fp16 with
// p.out_fp16), or with SiLU*mul
// out[row, j] = act(bf16(sum gate), bf16(sum up)) for the gate and up columns j and act_n + j.
// CTA (blockIdx.x = chunk of 8 * kThreads output columns, .y = block of kRows rows, .z =
// expert): thread i takes 8 adjacent columns of kRows rows. A template, so that each
// instantiation's translation unit has its own weak copy.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/epilogue_moe_gemm_sm90.cuh"

namespace hopper_moe::gemm {

inline constexpr int kReduceThreads = 128;
inline constexpr int kReduceRows = 8;

template <int kThreads, int kRows, bool kSiluMul>
__global__ void __launch_bounds__(kThreads) moe_gemm_splitk_reduce_kernel(MoeGemmParams p) {
  // A programmatic dependent launch of the GEMM (common/pdl.cuh's rule).
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  const int expert = blockIdx.z;
  const int64_t row_begin = expert_row_begin(p, expert);
  const int64_t rows = expert_rows(p, expert, row_begin);
  const int cols = kSiluMul ? p.act_n : p.n;
  const int col = (blockIdx.x * kThreads + threadIdx.x) * 8;
  const int64_t t0 = int64_t(blockIdx.y) * kRows;
  const int valid = cute::min(8, cols - col);
  const int64_t plane = p.m_total * p.n;
  float amax = 0.0f;
  // Inactive threads skip the rows but stay for the warp's amax fold.
  const int64_t t_end = t0 < rows && col < cols ? cute::min(t0 + kRows, rows) : t0;
  for (int64_t t = t0; t < t_end; ++t) {
    const int64_t row = row_begin + t;
    const float* src = p.partial + row * p.n + col;
    float sum[8], sum_up[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) sum[e] = sum_up[e] = 0.0f;
    for (int s = 0; s < p.k_splits; ++s) {
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        if (e < valid) {
          sum[e] += src[s * plane + e];
          if constexpr (kSiluMul) sum_up[e] += src[s * plane + p.act_n + e];
        }
      }
    }
    if constexpr (!kSiluMul) {
      auto* out = static_cast<uint16_t*>(p.out) + row * p.ldo + col;
      for (int e = 0; e < valid; ++e) out[e] = out16_bits(sum[e], p.out_fp16);
    } else {
      float act[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        act[e] = act::silu_and_mul_value<cutlass::bfloat16_t>(
            float(cutlass::bfloat16_t(sum[e])), float(cutlass::bfloat16_t(sum_up[e])));
      }
      amax = fmaxf(amax, store_act_row(p, row * p.ldo + col, valid, act));
    }
  }
  if constexpr (kSiluMul) {
    if (p.amax_scale != nullptr) fold_amax_scale(p, amax);
  }
}

}  // namespace hopper_moe::gemm
