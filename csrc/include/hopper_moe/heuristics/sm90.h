// Config choice of the SM90 grouped expert GEMM (gemm/kernel_moe_gemm_swapab_sm90.cuh).
//
// Pure and host-only: plain C++ with no CUDA or CuTe include, so a unit test compiles it with
// the system compiler (tests/test_heuristics.py). The choice uses only what the host knows
// without reading device memory: the dtype, the rows of x and the problem's N, K and expert
// count. The per-expert row counts live on the device (and change under CUDA-graph replay).
//
// Token tile: the fullest expert streams its weights ceil(rows / kBlockT) times, so the tile
// is sized to the rows the fullest expert is expected to get under uniform routing,
// mean + 2.5 sqrt(mean) with mean = m_total / num_experts (exceeded by ~0.6% of experts; the
// rule of python/hopper_moe/triton/configs.py `expected_max_rows`), rounded up to a candidate.
// The candidates stop where the accumulator would spill: a 128 x kBlockT fp32 tile over 128
// threads is kBlockT registers per thread, and FP8 keeps a second one for the promotion, so
// bf16 stops at 128 tokens and FP8 at 64.
// Stages: as many as fit the 227 KB of shared memory a CTA can have, at most 8 (v2's 8 stages
// of 18 KB already keep far more bytes in flight per SM than HBM latency needs).
// K split: at most min(E, m_total) experts have rows and at least ceil(m_total / block_t) token
// tiles are needed, so a launch has about ceil(N / block_n) * max(min(E, m_total),
// ceil(m_total / block_t)) CTAs with work (at decode: one token tile per active expert).
// When that is at most half the SMs (one CTA fits an SM), the SMs without a CTA stream nothing:
// mixtral's GEMM2 at one token has 32 weight tiles x 2 experts = 64 CTAs for 132 SMs. Then each
// CTA's K range is split floor(sm_count / ctas) ways (whole waves), at most kMaxKSplits and
// keeping >= kMinKTilesPerSplit k-tiles per split so the ring still fills; the fp32 partial
// sums cost 4 bytes per output element and split, negligible at such sizes.
#pragma once

#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>

namespace hopper_moe::heuristics {

enum class GemmDtype : int { kBf16 = 0, kE4m3 = 1 };

inline const char* to_string(GemmDtype dtype) {
  return dtype == GemmDtype::kBf16 ? "bf16" : "e4m3";
}

// Token tiles with an instantiation (tools/generate_instantiations.py), in increasing order.
inline constexpr int kTokenTilesBf16[] = {16, 32, 64, 128};
inline constexpr int kTokenTilesE4m3[] = {16, 32, 64};

inline constexpr int kSmemBytesMax = 227 * 1024;  // dynamic shared memory of one SM90 CTA
inline constexpr int kMaxStages = 8;
inline constexpr int kMaxKSplits = 8;
inline constexpr int kMinKTilesPerSplit = 8;

// One instantiation of the swap-AB kernel: its template arguments and shared memory.
struct GroupedGemmConfig {
  GemmDtype dtype = GemmDtype::kBf16;
  int block_n = 0;           // weight rows per CTA: the 64-row wgmma side, twice
  int block_t = 0;           // token rows per CTA: the wgmma N
  int block_k = 0;           // one 128-byte swizzle row of K
  int stages = 0;            // shared-memory ring depth
  int promote_interval = 0;  // k-tiles between FP8 promotions to fp32 (0: bf16, none)
  int smem_bytes = 0;
  int k_splits = 1;          // K ranges per CTA's work (a launch-time choice, not a template)

  std::string to_string() const {
    return std::string("grouped_gemm_sm90 ") + heuristics::to_string(dtype) +
           " block_n=" + std::to_string(block_n) + " block_t=" + std::to_string(block_t) +
           " block_k=" + std::to_string(block_k) + " stages=" + std::to_string(stages) +
           " promote_interval=" + std::to_string(promote_interval) +
           " smem_bytes=" + std::to_string(smem_bytes) + " k_splits=" + std::to_string(k_splits);
  }
};

constexpr int element_bytes(GemmDtype dtype) { return dtype == GemmDtype::kBf16 ? 2 : 1; }

// The kernel's SharedStorage: weight ring and token ring, each 1024-byte aligned, then a full
// and an empty barrier per stage, the whole rounded up to its 1024-byte alignment. The kernel
// static_asserts that this equals sizeof(SharedStorage).
constexpr int swapab_smem_bytes(GemmDtype dtype, int block_n, int block_t, int block_k,
                                int stages) {
  const auto align = [](int bytes) { return (bytes + 1023) / 1024 * 1024; };
  const int w = align(stages * block_n * block_k * element_bytes(dtype));
  const int x = align(stages * block_t * block_k * element_bytes(dtype));
  return align(w + x + 2 * stages * 8);
}

// The full config of the instantiation for (dtype, token tile).
constexpr GroupedGemmConfig swapab_config(GemmDtype dtype, int block_t) {
  GroupedGemmConfig c;
  c.dtype = dtype;
  c.block_n = 128;
  c.block_t = block_t;
  c.block_k = 128 / element_bytes(dtype);
  c.promote_interval = dtype == GemmDtype::kBf16 ? 0 : 4;  // every 512 of K
  c.stages = kMaxStages;
  while (c.stages > 2 &&
         swapab_smem_bytes(dtype, c.block_n, block_t, c.block_k, c.stages) > kSmemBytesMax) {
    --c.stages;
  }
  c.smem_bytes = swapab_smem_bytes(dtype, c.block_n, block_t, c.block_k, c.stages);
  return c;
}

// Rows the fullest of num_experts experts is expected to get when m_total rows are routed
// uniformly.
inline double expected_max_rows(int64_t m_total, int num_experts) {
  const double mean = double(m_total) / double(num_experts > 1 ? num_experts : 1);
  return mean + 2.5 * std::sqrt(mean);
}

// K ranges per CTA for a launch of at most `ctas` CTAs with work (see the header comment).
inline int choose_k_splits(int64_t ctas, int k_tiles, int sm_count) {
  if (ctas <= 0 || 2 * ctas > sm_count) return 1;
  int64_t splits = sm_count / ctas;
  if (splits > kMaxKSplits) splits = kMaxKSplits;
  if (splits > k_tiles / kMinKTilesPerSplit) splits = k_tiles / kMinKTilesPerSplit;
  return splits > 1 ? int(splits) : 1;
}

// The token tile and config for one launch. n and k do not enter the token tile: whatever the
// weight shape, a second token tile of an expert streams all of its weights again. They, and
// the GPU's SM count, decide the K split.
inline GroupedGemmConfig choose_grouped_gemm_sm90(GemmDtype dtype, int64_t m_total,
                                                  int num_experts, int n, int k, int sm_count) {
  const double rows = expected_max_rows(m_total, num_experts);
  const int* tiles = dtype == GemmDtype::kBf16 ? kTokenTilesBf16 : kTokenTilesE4m3;
  const int count = dtype == GemmDtype::kBf16 ? int(std::size(kTokenTilesBf16))
                                              : int(std::size(kTokenTilesE4m3));
  int block_t = tiles[count - 1];
  for (int i = 0; i < count; ++i) {
    if (rows <= double(tiles[i])) {
      block_t = tiles[i];
      break;
    }
  }
  GroupedGemmConfig c = swapab_config(dtype, block_t);
  const int64_t active_experts = m_total < num_experts ? m_total : num_experts;
  const int64_t min_token_tiles = (m_total + c.block_t - 1) / c.block_t;
  const int64_t ctas = int64_t((n + c.block_n - 1) / c.block_n) *
                       (active_experts > min_token_tiles ? active_experts : min_token_tiles);
  c.k_splits = choose_k_splits(ctas, (k + c.block_k - 1) / c.block_k, sm_count);
  return c;
}

}  // namespace hopper_moe::heuristics
