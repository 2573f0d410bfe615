// Host-side interface of the SM90 grouped expert GEMM (swap-AB and standard mappings).
//
//   out[offsets[e] + t, n] = s(e, n, t) * sum_k W[e, n, k] * X[offsets[e] + t, k]
//
// for every expert e, token row t < offsets[e+1] - offsets[e] and output column n < N, with
//   X    [m_total, K]  rows grouped by expert, K contiguous (bf16, or fp8 e4m3)
//   W    [E, N, K]     K contiguous, the dtype of X
//   out  [m_total, N]  bf16 or fp16 (out_fp16), row stride ldo (with SiLU*mul: [m_total, N / 2],
//                      bf16 or e4m3)
//   s    1 (bf16); a_scale[0] * b_scale[e] (per tensor); b_scale[e*N + n] (per output channel);
//        a_scale[offsets[e] + t] (per token), combinable as the two ScaleModes say.
// With a row gather (MoeGemmArgs::gather) X's rows are read from an unpermuted x instead.
// With k_splits > 1 the sum over K is cut into that many ranges whose scaled fp32 partial sums
// go to `partial` and are added by a second kernel.
//
// Compiled for sm_90a: one file per dtype and swap-AB token tile (bf16 16/32/64/128, FP8
// 16/32/64 tokens), per dtype and warpgroup-pair token tile (16/32), and one per dtype for the
// standard mapping (csrc/instantiations/); the mapping, tile and K split are chosen per launch
// by heuristics/sm90.h. Persistent and warp-specialized, over the units of the experts that
// have rows, for at most heuristics::kMaxExperts experts (kernel_moe_gemm_sm90.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe::gemm {

enum class ScaleMode : int { kNone = 0, kPerTensor = 1, kPerRow = 2 };

struct MoeGemmArgs {
  const void* x = nullptr;            // [m_total, K]
  const void* w = nullptr;            // [E, N, K]
  void* out = nullptr;                // [m_total, N] bf16, or fp16 with out_fp16
  const int64_t* offsets = nullptr;   // [E + 1] expert row offsets into x / out (device)
  const float* a_scale = nullptr;     // [1] or [m_total] (device), by a_mode
  const float* b_scale = nullptr;     // [E] or [E, N] (device), by b_mode
  ScaleMode a_mode = ScaleMode::kNone;
  ScaleMode b_mode = ScaleMode::kNone;
  int num_experts = 0;
  int n = 0;
  int k = 0;
  int64_t m_total = 0;                // rows of x and out
  int64_t ldx = 0;                    // row stride of x, elements (16-byte multiple for TMA)
  int64_t ldo = 0;                    // row stride of out, elements
  int64_t max_rows_per_expert = 0;    // static bound on offsets[e+1]-offsets[e] (grid size)
  int k_splits = 1;                   // K split of each CTA's work (heuristics/sm90.h)
  float* partial = nullptr;           // [k_splits, m_total, N] fp32 workspace if k_splits > 1
  int grid = 0;                       // CTAs of the persistent grid (config.grid), at most
  // The plain store's output is fp16 instead of bf16: the epilogue (and the K split's reduce)
  // rounds the fp32 sums to fp16. A runtime flag, not a template argument, so that both
  // output dtypes share every instantiation. Not with SiLU*mul (bf16 or e4m3 only).
  bool out_fp16 = false;
  // SiLU*mul fused into the epilogue (GEMM1 of a layer): w holds [gate (act_n rows); up (act_n
  // rows)] per expert (n = 2 * act_n) and out [m_total, act_n] gets silu(gate) * up of the
  // bf16-rounded products, as bf16, or as e4m3 bytes quantized with the static per-tensor
  // scale out_scale [1] (device) when it is set.
  bool silu_mul = false;
  int act_n = 0;
  const float* out_scale = nullptr;
  // SiLU*mul into bf16: *amax_scale = max(*amax_scale, amax |out| / 448) over the rows written
  // (a dynamic per-tensor FP8 scale; *amax_scale holds a non-negative start value).
  float* amax_scale = nullptr;
  // The launch may overlap the previous kernel on the stream (programmatic dependent launch);
  // with offsets_ready the caller promises that kernel does not write `offsets`, so they and
  // the first weight tiles are read before it completes. (The kernels before that one have
  // completed by then when it follows common/pdl.cuh's rule, as hopper_moe's kernels do, or
  // is a grouped GEMM, which writes no offsets.)
  bool pdl = true;
  bool offsets_ready = false;
  // The weights are copied with L2's evict-first policy (config.evict_first).
  bool evict_first_weights = false;
  // Row gather: row r of X (r < m_total) is row gather[r] / gather_div of x ([x_rows, K], row
  // stride ldx), so that no permuted copy of x exists; per-row a_scale entries are x's rows
  // too (a_scale[gather[r] / gather_div]). The producer warp copies those rows with cp.async
  // (TMA has no row gather on SM90). Rows at or past an expert's end are never read.
  const int32_t* gather = nullptr;
  int gather_div = 1;
  int64_t x_rows = 0;
};

// Launches the instantiation of `config` (heuristics::choose_grouped_gemm_sm90) on `stream`
// and returns the launch's cudaError_t; cudaErrorInvalidValue for a config that has none.
cudaError_t moe_gemm_sm90(const MoeGemmArgs& args, const heuristics::GroupedGemmConfig& config,
                          cudaStream_t stream);

// Swap-AB with one token tile of heuristics::kTokenTilesBf16 / kTokenTilesE4m3, its warpgroup
// pair with one of heuristics::kPairTokenTiles, and the standard mapping, per dtype:
// explicitly instantiated in csrc/instantiations/ (defined in launch_moe_gemm_sm90.cuh).
template <heuristics::GemmDtype kDtype, int kBlockT>
cudaError_t moe_gemm_swapab_sm90(const MoeGemmArgs& args, cudaStream_t stream);
template <heuristics::GemmDtype kDtype, int kBlockT>
cudaError_t moe_gemm_swapab_pair_sm90(const MoeGemmArgs& args, cudaStream_t stream);
template <heuristics::GemmDtype kDtype>
cudaError_t moe_gemm_standard_sm90(const MoeGemmArgs& args, cudaStream_t stream);

}  // namespace hopper_moe::gemm
