// The static persistent unit scheduler of the SM90 grouped GEMM.
//
// A unit is (token tile, weight tile, K split). The token tiles are those of the experts that
// have rows: each CTA first turns the expert offsets into a prefix table of token tiles per
// expert in shared memory (count_tiles by every thread, then scan_tiles by warp 0), so an
// expert with no rows owns no unit and costs nothing, and a unit's expert is a binary search
// in that table. Units are numbered split-fastest, then weight tile, then token tile, so the
// CTAs running at the same time share a token tile (it stays in L2) and stream different
// weights. CTA b takes units b, b + gridDim.x, ...: every role walks the same sequence with its
// own scheduler object and next(), so a dynamic or chained order is another scheduler with the
// same next(), not an edit of the roles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"

namespace hopper_moe::gemm {

template <class Config>
struct StaticPersistentScheduler {
  static constexpr int kBlockT = Config::kBlockT;
  static constexpr int kBlockK = Config::kBlockK;

  // Token tiles per expert into tile_prefix[e + 1] (every thread of the CTA takes a share).
  CUTLASS_DEVICE static void count_tiles(const MoeGemmParams& p, int* tile_prefix) {
    for (int e = threadIdx.x; e < p.num_experts; e += Config::kThreads) {
      const int64_t begin = expert_row_begin(p, e);
      tile_prefix[e + 1] = int((expert_rows(p, e, begin) + kBlockT - 1) / kBlockT);
    }
  }

  // Their exclusive prefix sum in place, by one warp: each lane scans a chunk of experts.
  CUTLASS_DEVICE static void scan_tiles(const MoeGemmParams& p, int* tile_prefix, int lane) {
    const int chunk = (p.num_experts + 31) / 32;
    const int begin = cute::min(lane * chunk, p.num_experts);
    const int end = cute::min(begin + chunk, p.num_experts);
    int sum = 0;
    for (int e = begin; e < end; ++e) sum += tile_prefix[e + 1];
    int inclusive = sum;
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    int run = inclusive - sum;
    for (int e = begin; e < end; ++e) {
      run += tile_prefix[e + 1];
      tile_prefix[e + 1] = run;
    }
    if (lane == 0) tile_prefix[0] = 0;
  }

  // After the table is complete (a __syncthreads after scan_tiles).
  CUTLASS_DEVICE StaticPersistentScheduler(const MoeGemmParams& p, const int* tile_prefix)
      : p_(p),
        tile_prefix_(tile_prefix),
        unit_(blockIdx.x),
        units_(int64_t(tile_prefix[p.num_experts]) * p.n_tiles * p.k_splits) {}

  // The CTA's next unit into u; false when it has none left.
  CUTLASS_DEVICE bool next(MoeGemmUnit& u) {
    if (unit_ >= units_) return false;
    u = decode(unit_);
    unit_ += gridDim.x;
    return true;
  }

 private:
  CUTLASS_DEVICE MoeGemmUnit decode(int64_t unit) const {
    MoeGemmUnit u;
    u.split = int(unit % p_.k_splits);
    const int64_t rest = unit / p_.k_splits;
    u.n0 = int(rest % p_.n_tiles) * p_.tile_cols;
    const int tile = int(rest / p_.n_tiles);
    // The expert e with tile_prefix[e] <= tile < tile_prefix[e + 1]: the last e whose prefix
    // is <= tile (experts without rows have tile_prefix[e] == tile_prefix[e + 1]: skipped).
    int lo = 0, hi = p_.num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_prefix_[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    u.expert = lo;
    u.t0 = (tile - tile_prefix_[lo]) * kBlockT;
    u.row_begin = expert_row_begin(p_, lo);
    u.rows = expert_rows(p_, lo, u.row_begin);
    const int k_tiles = (p_.k + kBlockK - 1) / kBlockK;
    const int per_split = (k_tiles + p_.k_splits - 1) / p_.k_splits;
    u.kt_begin = cute::min(u.split * per_split, k_tiles);
    u.kt_end = cute::min(u.kt_begin + per_split, k_tiles);
    return u;
  }

  const MoeGemmParams& p_;
  const int* tile_prefix_;
  int64_t unit_;
  int64_t units_;
};

}  // namespace hopper_moe::gemm
