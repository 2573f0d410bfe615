// The compile-time shape of one SM90 grouped-GEMM instantiation (MoeGemmConfig), the runtime
// parameters every part of the kernel reads (MoeGemmParams) and the work unit the scheduler
// hands to the roles (MoeGemmUnit). kernel_moe_gemm_sm90.cuh says how the parts fit.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe::gemm {

// kBlockN weight rows and kBlockT token rows per unit; kSwapAB puts the weights on wgmma's A
// side, otherwise the tokens.
template <class Element_, bool kSwapAB_, int kBlockN_, int kBlockT_, int kBlockK_, int kStages_,
          int kPromoteInterval_>
struct MoeGemmConfig {
  using Element = Element_;
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockT = kBlockT_;
  static constexpr int kBlockK = kBlockK_;
  static constexpr int kStages = kStages_;
  static constexpr int kPromoteInterval = kPromoteInterval_;  // FP8: k-tiles per promotion
  // Warpgroup pair: swap-AB with a 64-row weight tile that both consumer warpgroups multiply,
  // each over every other k-tile of the unit (heuristics::GroupedGemmConfig::pair()).
  static constexpr bool kPair = kSwapAB && kBlockN == heuristics::kPairBlockN;
  static constexpr int kTileA = kSwapAB ? kBlockN : kBlockT;  // wgmma M: 64 per warpgroup
  static constexpr int kTileB = kSwapAB ? kBlockT : kBlockN;  // wgmma N
  static_assert(kTileA == (kPair ? 64 : 128),
                "the A tile is one 64-row wgmma per consumer warpgroup (a pair: one for both)");
  static_assert(kTileB % 16 == 0 && kTileB >= 16 && kTileB <= 256,
                "the B side is a wgmma N: a multiple of 16 (whole epilogue vectors) <= 256");
  static_assert(kBlockN % 8 == 0, "epilogue rows are whole 16-byte vectors");
  static_assert(kBlockK * sizeof(Element) % 128 == 0,
                "a k-tile spans whole 128-byte swizzle atoms");
  static_assert(kStages >= 2, "the pipeline needs at least two slots to overlap copy and math");

  using AtomShape = cute::Shape<cute::_64, cute::Int<kTileB>, cute::Int<kBlockK>>;
  using SmemLayoutA = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileA>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileB>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  // The weight tile of a slot is loaded as two boxes of kBlockN / 2 rows (the epilogue says
  // which rows: epilogue_moe_gemm_sm90.cuh), the token tile as one box. Rows of a K-major
  // 128-byte-swizzled tile are contiguous 1024-byte groups of 8, so a half of the tile and a
  // slot of the ring are plain offsets of the whole ring's layout.
  static constexpr int kWeightBox = kBlockN / 2;
  static constexpr int kTileX = kSwapAB ? kTileB : kTileA;
  using SmemLayoutWBox = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kWeightBox>{}, cute::Int<kBlockK>{})));
  using SmemLayoutXStage = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kTileX>{}, cute::Int<kBlockK>{})));
  static_assert(kWeightBox * kBlockK * sizeof(Element) % 1024 == 0,
                "a weight half starts on a swizzle period");
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float, AtomShape,
                                                      cute::GMMA::Major::K,
                                                      cute::GMMA::Major::K>());
  // Two consumer warpgroups stacked along the A tile's rows, 64 rows each; a pair's
  // warpgroups each run the whole 64-row tile (one warpgroup's MMA, on alternate slots).
  static constexpr int kMmaWarpgroups = kPair ? 1 : 2;
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::Int<kMmaWarpgroups>, cute::_1, cute::_1>>{}));
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;  // threads of one slot's wgmma
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536,
                "the register split fits the SM's 64K registers");
  static_assert(cute::size(TiledMma{}) == kMmaThreads, "the warpgroups of one slot's wgmma");
  static_assert(kTileA * kTileB / kMmaThreads * (kPromoteInterval > 0 ? 2 : 1) <= 128,
                "the fp32 accumulators (two with FP8 promotion) leave registers for the rest "
                "of the consumer: larger tiles spill");
  static constexpr int kEpilogueLd = kBlockN + heuristics::kEpiloguePad;  // bf16 elements
  // The epilogue tile, bf16 elements: the staged [kBlockT][kEpilogueLd] tile, and for a pair
  // first the second warpgroup's fp32 sums (heuristics::epilogue_bytes).
  static constexpr int kEpilogueElems =
      heuristics::epilogue_bytes(kPair, kBlockN, kBlockT) / int(sizeof(cutlass::bfloat16_t));
  static constexpr int kEpilogueBarrier = 1;  // named barrier of the 256 consumer threads

  // 128-byte-swizzled tiles repeat every 1024 bytes: TMA writes and wgmma descriptors (base
  // offset 0) agree only on 1024-byte aligned tiles.
  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutA>> a;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutB>> b;
    alignas(16) cutlass::bfloat16_t c[kEpilogueElems];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
    int tile_prefix[heuristics::kMaxExperts + 1];  // token tiles of the experts before e
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB an SM90 CTA can have");
  static_assert(kTileB * kBlockK * sizeof(Element) % 1024 == 0,
                "each B slot keeps the next slot 1024-byte aligned");
  static constexpr uint32_t kTxBytes = (kTileA + kTileB) * kBlockK * sizeof(Element);
  // With a row gather the producer warpgroup copies the token tile itself (cp.async, one row
  // per thread): TMA brings only the weights, and each producer thread arrives on full[s]
  // when its copies land.
  static constexpr uint32_t kWeightTxBytes = kBlockN * kBlockK * sizeof(Element);
  static constexpr int kGatherThreads = kProducerThreads;
  static constexpr int kVecElems = 16 / int(sizeof(Element));  // one 16-byte copy
  static constexpr int kVecsPerRow = kBlockK / kVecElems;      // per token row of a k-tile
  static_assert(kTileX <= kGatherThreads, "a gathered token tile is one row per thread");
};

struct MoeGemmParams {
  void* out;       // bf16 (fp16 with out_fp16), or e4m3 bytes when out_scale is set
  float* partial;  // [k_splits, m_total, n] fp32 (k_splits > 1 only)
  const int64_t* offsets;
  const float* a_scale;
  const float* b_scale;
  ScaleMode a_mode;
  ScaleMode b_mode;
  int n;
  int k;
  int64_t m_total;
  int64_t ldo;
  int k_splits;
  int num_experts;
  int n_tiles;             // weight tiles per expert
  int tile_cols;           // output columns per weight tile: kBlockN, or kBlockN / 2 with SiLU*mul
  int act_n;               // SiLU*mul: I, the output columns (gate rows [0, I), up rows [I, 2I))
  const float* out_scale;  // SiLU*mul into e4m3: the static per-tensor scale [1]
  float* amax_scale;       // SiLU*mul into bf16: max(*amax_scale, amax |out| / 448) (or null)
  bool offsets_ready;      // offsets may be read before the previous kernel completes
  bool vector_out;         // out, ldo and the output columns allow 8-column vector stores
  bool out_fp16;           // plain store: out is fp16 (the staged tile holds fp16 bits)
  uint64_t weight_cache_hint;  // TMA::CacheHintSm90 of the weight copies
  // Row gather (or null): row r of X is row gather[r] / gather_div of x_gather ([x_rows, K],
  // row stride ldx), copied by the producer warp instead of TMA; per-row a scales are read at
  // that row too.
  const int32_t* gather;
  int gather_div;
  const void* x_gather;
  int64_t x_rows;
  int64_t ldx;
};

// One work unit, decoded the same way by the producer and the consumers (tile_scheduler_*).
struct MoeGemmUnit {
  int expert;
  int64_t row_begin;  // the expert's first row of x / out
  int64_t rows;       // its row count
  int t0;             // first token row of the tile within the expert
  int n0;             // first weight row (output column)
  int split;
  int kt_begin;       // the split's k-tiles [kt_begin, kt_end), possibly empty
  int kt_end;
};

// The expert's rows, clamped like the CPU definition: begin in [0, M], end in [begin, M].
CUTLASS_HOST_DEVICE int64_t expert_row_begin(const MoeGemmParams& p, int e) {
  return cute::min(cute::max(p.offsets[e], int64_t(0)), p.m_total);
}
CUTLASS_HOST_DEVICE int64_t expert_rows(const MoeGemmParams& p, int e, int64_t begin) {
  return cute::min(cute::max(p.offsets[e + 1], begin), p.m_total) - begin;
}

// The row of x that X's row `row` is: itself, or through the gather (-1 when the gathered
// index is out of x's rows; the host's rows never are).
CUTLASS_DEVICE int64_t x_source_row(const MoeGemmParams& p, int64_t row) {
  if (p.gather == nullptr) return row;
  const int64_t src = int64_t(__ldg(p.gather + row)) / p.gather_div;
  return src >= 0 && src < p.x_rows ? src : -1;
}

}  // namespace hopper_moe::gemm
