// Grouped expert GEMM for SM90, in two mappings of the same persistent kernel.
//
// Swap-AB (decode): C^T = W . X^T per expert. An expert sees a handful of tokens and a
// wgmma's A operand is always 64 rows, so the weight tile takes that side (kBlockN = 128
// weight rows: one 64-row wgmma per consumer warpgroup) and the tokens are the narrow N side
// (kBlockT = 16..128). Every expert's weights are then read once per token tile.
// Standard (many tokens): C = X . W^T. The token tile takes the A side (kBlockT = 128 rows, 64
// per consumer warpgroup) and the weight tile the N side (kBlockN = 256 bf16, 128 FP8): a bf16
// k-tile does twice the math of the 128 x 128 swap-AB tile for 1.5 times its bytes, and FP8
// (whose promoted accumulator doubles the registers) gets a 128-token tile, twice swap-AB's.
// The host picks the mapping and the tiles per launch from the rows the fullest expert is
// expected to get (heuristics/sm90.h), so a typical expert fits one token tile; one with more
// rows takes several, each streaming its weights again.
//
// Persistent and warp-specialized. The grid is at most one CTA per SM; CTA b takes the work
// units b, b + gridDim.x, ... of the launch. A unit is (token tile, weight tile, K split), and
// the token tiles are those of the experts that have rows: the CTA first turns the expert
// offsets into a prefix table of token tiles per expert (shared memory), so an expert with no
// rows owns no unit and costs nothing, and a unit's expert is a binary search in that table.
// Units are numbered split-fastest, then weight tile, then token tile, so the CTAs running at
// the same time share a token tile (it stays in L2) and stream different weights.
//   warpgroup 0, the producer (setmaxnreg down to 40 registers): one elected thread walks the
//     CTA's units and k-tiles and, per k-tile, waits for a free slot (empty[s]), arms full[s]
//     with the slot's byte count and issues the TMA copies (cp.async.bulk.tensor) of the
//     weight tile (two boxes of kBlockN / 2 rows: adjacent halves, or with SiLU*mul the gate
//     rows n0.. and the up rows I + n0..) and the token tile. It runs up to kStages k-tiles
//     ahead of the math, across unit boundaries, so the next unit's weights arrive while the
//     consumers run an epilogue.
//   Programmatic dependent launch: every CTA lets the next kernel start at once; with
//     offsets_ready the producer requests the first kStages weight tiles before waiting for
//     the previous kernel (griddepcontrol.wait), the token tiles after it.
//   A chain (moe_gemm_sm90.h, handoff_signal / handoff_wait): GEMM1 counts the outputs its
//     units have stored per expert; GEMM2's producer, instead of waiting for all of GEMM1,
//     acquires an expert's counter before it copies that expert's token rows, and its
//     consumers are ordered after that by the slots' arrivals (which come with the token
//     copies); GEMM2 waits for GEMM1 to complete only at its end.
//   warpgroups 1-2, the consumers (setmaxnreg up to 232): each issues the wgmma of its 64 rows
//     of the A tile x the whole B tile from shared memory and keeps one k-tile's batch in
//     flight: after issuing k-tile i it waits for i - 1's and releases that slot (empty[s],
//     256 arrivals). FP8: the tensor core's accumulation is promoted into a separate fp32
//     register accumulator every kPromoteInterval k-tiles (waiting for every batch there),
//     bounding the error at large K.
// Warpgroup pair (swap-AB, kBlockN = 64, heuristics::GroupedGemmConfig::pair()): a unit is 64
//   weight rows, so a launch has twice the units of half the bytes and its last wave is
//   shorter; both consumer warpgroups multiply the same 64-row tile, each over the k-tiles
//   whose place in the CTA's sequence has its parity (a slot is consumed by one warpgroup:
//   128 arrivals on empty[s]), and in the epilogue the second hands its fp32 sums to the
//   first through the epilogue tile. The slots are half the size and up to 24 deep.
// Slots hold the A tile (128 x kBlockK: weights for swap-AB, tokens for standard) and the B
// tile (the other operand), both K-major with the 128-byte swizzle wgmma reads. Out-of-range
// rows and K columns are zero-filled by TMA; rows that belong to the next expert or lie past N
// are computed and masked in the epilogue.
// Epilogue: the consumers scale their accumulators, convert them to bf16 and write them
// (transposed for swap-AB) into a shared-memory tile [kBlockT][kBlockN + pad]; after a named
// barrier the 256 consumer threads store that tile's rows to out[row, n0..] in 16-byte
// vectors (coalesced: consecutive threads write consecutive columns of a row), masking token
// rows past the expert's count and columns past N (element stores where N or the row stride
// is not a multiple of 8). With SiLU*mul the tile's columns j and j + kBlockN / 2 are a gate
// and an up value of output column n0 + j: the store phase writes silu(g) * u of the staged
// bf16 values, as bf16 or as e4m3 with the static out_scale.
// K split (k_splits > 1, chosen by the host when the units would
// leave SMs idle): each unit runs its split's k-tiles and writes the scaled fp32 partial tile
// to partial[split, row, n] from registers; a second kernel adds the splits of every row an
// expert owns and writes out, applying SiLU*mul when fused (rows no expert owns stay
// untouched).
// Shared memory: heuristics/sm90.h gemm_smem_bytes (rings, epilogue tile, barriers, table).
// Registers: the accumulator is kBlockN x kBlockT / 256 fp32 per consumer thread (twice for
// FP8), at most 128.
// Status: see moe_gemm_sm90.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"
#include "hopper_moe/moe/activation_math.cuh"

namespace hopper_moe::gemm {

// kBlockN weight rows and kBlockT token rows per unit; kSwapAB puts the weights on wgmma's A
// side, otherwise the tokens.
template <class Element, bool kSwapAB, int kBlockN, int kBlockT, int kBlockK, int kStages,
          int kPromoteInterval>
struct MoeGemmConfig {
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
  // The weight tile of a slot is loaded as two boxes of kBlockN / 2 rows (the gate and the up
  // half with SiLU*mul fused, else two adjacent halves), the token tile as one box. Rows of a
  // K-major 128-byte-swizzled tile are contiguous 1024-byte groups of 8, so a half of the tile
  // and a slot of the ring are plain offsets of the whole ring's layout.
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
};

// The longest staggered-start sleep of one CTA (MoeGemmParams::start_stagger_ns).
inline constexpr int kMaxStartStaggerNs = 20000;

struct MoeGemmParams {
  void* out;  // bf16, or e4m3 bytes when out_scale is set
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
  int n_tiles;      // weight tiles per expert
  int tile_cols;    // output columns per weight tile: kBlockN, or kBlockN / 2 with SiLU*mul
  int act_n;        // SiLU*mul: I, the output columns (gate rows [0, I), up rows [I, 2I))
  bool silu_mul;
  const float* out_scale;  // SiLU*mul into e4m3: the static per-tensor scale [1]
  float* amax_scale;       // SiLU*mul into bf16: max(*amax_scale, amax |out| / 448) (or null)
  bool offsets_ready;      // offsets may be read before the previous kernel completes
  bool vector_out;  // out, ldo and the output columns allow 8-column vector stores
  int start_stagger_ns;  // CTA b's producer sleeps ~b x this before its first copy (0: none)
  uint64_t weight_cache_hint;  // TMA::CacheHintSm90 of the weight copies
  // A chain (moe_gemm_sm90.h, MoeGemmArgs::handoff_*): GEMM1 adds the outputs each unit
  // writes to handoff_signal[expert]; GEMM2 reads an expert's rows once handoff_wait[expert]
  // reaches rows x k, instead of waiting for all of GEMM1 (either may be null).
  unsigned long long* handoff_signal;
  const unsigned long long* handoff_wait;
#ifdef HOPPER_MOE_GEMM_TIMELINE
  int64_t* timeline;  // [gridDim.x, kTimelineFields] stamps of this launch (or null)
#endif
};

// One work unit, decoded the same way by the producer and the consumers.
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

template <int kBlockN, int kBlockT, int kBlockK>
CUTLASS_DEVICE MoeGemmUnit decode_moe_gemm_unit(const MoeGemmParams& p, const int* tile_prefix,
                                               int n_tiles, int64_t unit) {
  MoeGemmUnit u;
  u.split = int(unit % p.k_splits);
  const int64_t rest = unit / p.k_splits;
  u.n0 = int(rest % n_tiles) * p.tile_cols;
  const int tile = int(rest / n_tiles);
  // The expert e with tile_prefix[e] <= tile < tile_prefix[e + 1]: the last e whose prefix is
  // <= tile (experts without rows have tile_prefix[e] == tile_prefix[e + 1] and are skipped).
  int lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_prefix[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  u.expert = lo;
  u.t0 = (tile - tile_prefix[lo]) * kBlockT;
  u.row_begin = cute::min(cute::max(p.offsets[lo], int64_t(0)), p.m_total);
  u.rows = cute::min(cute::max(p.offsets[lo + 1], u.row_begin), p.m_total) - u.row_begin;
  const int k_tiles = (p.k + kBlockK - 1) / kBlockK;
  const int per_split = (k_tiles + p.k_splits - 1) / p.k_splits;
  u.kt_begin = cute::min(u.split * per_split, k_tiles);
  u.kt_end = cute::min(u.kt_begin + per_split, k_tiles);
  return u;
}

// `first` if kFirst, else `second` (by reference).
template <bool kFirst, class A, class B>
CUTLASS_DEVICE const auto& pick(const A& first, const B& second) {
  if constexpr (kFirst) return first; else return second;
}

// Stores 8 SiLU*mul outputs at element offset `at` of out (min(valid, 8) of them): bf16, or
// e4m3 as clamp(v * (1 / out_scale)) (silu_and_mul_quant's expression), as one 16- or 8-byte
// vector when p.vector_out. Returns the largest |stored bf16 value| (0 for e4m3; NaN skipped
// as fmaxf does), for amax_scale.
CUTLASS_DEVICE float store_act_row(const MoeGemmParams& p, int64_t at, int valid,
                                   const float (&act)[8]) {
  if (p.out_scale != nullptr) {
    const float inv_scale = 1.0f / *p.out_scale;
    uint8_t q[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) q[e] = fp8::e4m3_bits(fp8::clamp_e4m3(act[e] * inv_scale));
    uint8_t* dst = static_cast<uint8_t*>(p.out) + at;
    if (p.vector_out && valid >= 8) {
      uint2 packed;
      memcpy(&packed, q, 8);
      *reinterpret_cast<uint2*>(dst) = packed;
    } else {
      for (int e = 0; e < 8 && e < valid; ++e) dst[e] = q[e];
    }
    return 0.0f;
  }
  cutlass::bfloat16_t b[8];
  float amax = 0.0f;
  CUTE_UNROLL
  for (int e = 0; e < 8; ++e) {
    b[e] = cutlass::bfloat16_t(act[e]);
    if (e < valid) amax = fmaxf(amax, fabsf(float(b[e])));
  }
  cutlass::bfloat16_t* dst = static_cast<cutlass::bfloat16_t*>(p.out) + at;
  if (p.vector_out && valid >= 8) {
    uint4 packed;
    memcpy(&packed, b, 16);
    *reinterpret_cast<uint4*>(dst) = packed;
  } else {
    for (int e = 0; e < 8 && e < valid; ++e) dst[e] = b[e];
  }
  return amax;
}

// Folds a warp's amax values into *p.amax_scale as max(*amax_scale, amax / 448) (the dynamic
// per-tensor scale's expression: division is monotonic, so the max of the quotients is the
// quotient of the max). Every lane of the warp must call it.
CUTLASS_DEVICE void fold_amax_scale(const MoeGemmParams& p, float amax) {
  CUTE_UNROLL
  for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  if (threadIdx.x % 32 == 0 && amax > 0.0f) {
    fp8::atomic_max_nonneg(p.amax_scale, amax / fp8::kE4M3Max);
  }
}

// The chain's handoff (MoeGemmArgs::handoff_signal / handoff_wait). GEMM1: after a unit's
// outputs are stored and the consumers have met at a barrier, one thread adds their count to
// the expert's counter with release semantics (the fence is cumulative over the stores the
// barrier ordered before it). GEMM2: the thread that copies an expert's rows acquires the
// counter until it reaches the expert's rows x k (every output GEMM1 writes for it), then
// orders its later bulk copies (the async proxy) after that acquire.
CUTLASS_DEVICE void handoff_add(unsigned long long* counter, unsigned long long count) {
  asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u64 [%0], %1;"
               :: "l"(counter), "l"(count) : "memory");
}
CUTLASS_DEVICE void handoff_wait(const unsigned long long* counter, unsigned long long target) {
  unsigned long long v;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(counter) : "memory");
    if (v >= target) break;
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// GEMM2 of a chain: until GEMM1 has written every output of unit u's expert.
CUTLASS_DEVICE void wait_for_expert_rows(const MoeGemmParams& p, const MoeGemmUnit& u) {
  handoff_wait(p.handoff_wait + u.expert, static_cast<unsigned long long>(u.rows) * p.k);
}

// A per-CTA timeline for diagnosis, compiled in only with -DHOPPER_MOE_GEMM_TIMELINE
// (tools/gemm_timeline.py): %globaltimer stamps (ns) at the kernel's start, when the prefix
// table is ready, after the producer's wait for the previous kernel, when it has issued its
// last copy, at the first k-tile's arrival and at the start of each of the first
// kTimelineUnits units, stored by each CTA as it ends into its row of the launch's record
// (MoeGemmParams::timeline; plain stores, so the launches after it are not held back as a
// printf's would be). Off, the kernel is unchanged.
#ifdef HOPPER_MOE_GEMM_TIMELINE
#define HM_TIMELINE(...) __VA_ARGS__
#else
#define HM_TIMELINE(...)
#endif
CUTLASS_DEVICE uint64_t timeline_now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
CUTLASS_DEVICE uint32_t timeline_sm() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

template <class Config, bool kSwapAB, int kBlockN, int kBlockT, int kBlockK, int kStages,
          int kPromoteInterval, class TmaA, class TmaB>
__global__ void __launch_bounds__(Config::kThreads, 1)
    moe_gemm_sm90_kernel(MoeGemmParams p, CUTLASS_GRID_CONSTANT TmaA const tma_a,
                         CUTLASS_GRID_CONSTANT TmaB const tma_b) {
  using namespace cute;
  using SharedStorage = typename Config::SharedStorage;
  constexpr int kTileA = Config::kTileA;
  constexpr int kTileB = Config::kTileB;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int lane = int(threadIdx.x % 32);

  // Programmatic dependent launch: the next kernel's CTAs may start as SMs free up (one CTA per
  // SM and all of this grid's CTAs resident, so they never hold back this grid). The offsets
  // are read before waiting for the previous kernel only when the caller says that kernel
  // does not write them (offsets_ready); the weights never depend on it.
  HM_TIMELINE(const uint64_t tl_start = timeline_now();)
  pdl::launch_dependents();
  if (!p.offsets_ready) pdl::wait_for_prerequisites();

  // Token tiles per expert (clamped like the CPU definition: begin in [0, M], end in
  // [begin, M]), then their exclusive prefix sum: warp 0 scans lane-sized chunks.
  for (int e = threadIdx.x; e < p.num_experts; e += Config::kThreads) {
    const int64_t begin = cute::min(cute::max(p.offsets[e], int64_t(0)), p.m_total);
    const int64_t rows = cute::min(cute::max(p.offsets[e + 1], begin), p.m_total) - begin;
    smem.tile_prefix[e + 1] = int((rows + kBlockT - 1) / kBlockT);
  }
  if (warp == 0 && cute::elect_one_sync()) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&smem.full[s], 1);
      EmptyBarrier::init(&smem.empty[s], Config::kMmaThreads);  // the slot's consumers
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (warp == 0) {
    const int chunk = (p.num_experts + 31) / 32;
    const int begin = cute::min(lane * chunk, p.num_experts);
    const int end = cute::min(begin + chunk, p.num_experts);
    int sum = 0;
    for (int e = begin; e < end; ++e) sum += smem.tile_prefix[e + 1];
    int inclusive = sum;
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    int run = inclusive - sum;
    for (int e = begin; e < end; ++e) {
      run += smem.tile_prefix[e + 1];
      smem.tile_prefix[e + 1] = run;
    }
    if (lane == 0) smem.tile_prefix[0] = 0;
  }
  __syncthreads();

  const int n_tiles = p.n_tiles;
  const int64_t units = int64_t(smem.tile_prefix[p.num_experts]) * n_tiles * p.k_splits;
  HM_TIMELINE(const uint64_t tl_ready = timeline_now();)

  // Coordinate views of the whole operands, the weights (E*N,K) and the tokens (M,K) on the
  // A or B side by the mapping. Rows are int32 TMA coordinates: E*N and m_total stay below
  // 2^31 (host check).
  const auto shape_w = make_shape(p.num_experts * p.n, p.k);
  const auto shape_x = make_shape(int(p.m_total), p.k);
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), typename Config::SmemLayoutA{});  // (TILE_A,BLK_K,PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), typename Config::SmemLayoutB{});  // (TILE_B,BLK_K,PIPE)

  if (warp < Config::kProducerThreads / 32) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
      cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
      const auto& tma_w = pick<kSwapAB>(tma_a, tma_b);  // the descriptors stay in param space
      const auto& tma_x = pick<kSwapAB>(tma_b, tma_a);
      Tensor mW = tma_w.get_tma_tensor(shape_w);  // (E*N,K)
      Tensor mX = tma_x.get_tma_tensor(shape_x);  // (M,K)
      auto* const w_ring = kSwapAB ? smem.a.begin() : smem.b.begin();
      auto* const x_ring = kSwapAB ? smem.b.begin() : smem.a.begin();
      constexpr int kWeightBox = Config::kWeightBox;
      constexpr int kTileX = Config::kTileX;
      // Slot s's two weight boxes: rows [r, r + kBlockN / 2) of the expert's N rows from r =
      // n0 (gate) and act_n + n0 (up) with SiLU*mul fused, else n0 and n0 + kBlockN / 2.
      const auto copy_weights = [&](const MoeGemmUnit& u, int kt, int s) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int r = p.silu_mul ? (h == 0 ? u.n0 : p.act_n + u.n0) : u.n0 + h * kWeightBox;
          Tensor gW = local_tile(domain_offset(make_coord(u.expert * p.n + r, 0), mW),
                                 make_shape(Int<kWeightBox>{}, Int<kBlockK>{}),
                                 make_coord(0, kt));  // (BOX,BLK_K)
          Tensor sW = make_tensor(
              make_smem_ptr(w_ring + (s * kBlockN + h * kWeightBox) * kBlockK),
              typename Config::SmemLayoutWBox{});  // (BOX,BLK_K)
          auto [tg, ts] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW),
                                        group_modes<0, 2>(gW));
          copy(tma_w.with(smem.full[s], 0, TMA::CacheHintSm90(p.weight_cache_hint)), tg, ts);
        }
      };
      const auto copy_tokens = [&](const MoeGemmUnit& u, int kt, int s) {
        Tensor gX = local_tile(domain_offset(make_coord(int(u.row_begin) + u.t0, 0), mX),
                               make_shape(Int<kTileX>{}, Int<kBlockK>{}),
                               make_coord(0, kt));  // (TILE_X,BLK_K)
        Tensor sX = make_tensor(make_smem_ptr(x_ring + s * kTileX * kBlockK),
                                typename Config::SmemLayoutXStage{});  // (TILE_X,BLK_K)
        auto [tg, ts] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                      group_modes<0, 2>(gX));
        copy(tma_x.with(smem.full[s]), tg, ts);
      };
      // With offsets_ready, the first kStages k-tiles' weights are requested before waiting
      // for the previous kernel (they do not depend on it), their tokens after the wait.
      // Phase 1 first: a fresh barrier counts its preceding phase as complete, so the first
      // kStages waits pass and the ring fills at once.
      // A staggered start: CTA b issues its first copies ~b x start_stagger_ns after the
      // others' (benchmarks/NOTES.md, v23), so the grid's first stages arrive in CTA order.
      if (p.start_stagger_ns > 0 && blockIdx.x > 0) {
        __nanosleep(uint32_t(cute::min(int64_t(blockIdx.x) * p.start_stagger_ns,
                                       int64_t(kMaxStartStaggerNs))));
      }
      int prefetched = 0;
      if (p.offsets_ready) {
        cutlass::PipelineState<kStages> ahead(0, 1, 0);
        for (int64_t unit = blockIdx.x; unit < units && prefetched < kStages;
             unit += gridDim.x) {
          const MoeGemmUnit u =
              decode_moe_gemm_unit<kBlockN, kBlockT, kBlockK>(p, smem.tile_prefix, n_tiles, unit);
          for (int kt = u.kt_begin; kt < u.kt_end && prefetched < kStages; ++kt, ++prefetched) {
            const int s = ahead.index();
            FullBarrier::expect_transaction(&smem.full[s], Config::kTxBytes);  // arrives below
            copy_weights(u, kt, s);
            ++ahead;
          }
        }
      }
      // The tokens (and, in a chain, each expert's rows as GEMM1 finishes them) come after
      // the wait. A prefetched slot's arrival comes with its token copy, so that the consumers
      // that wait on it are ordered after that wait too.
      const bool chained = p.handoff_wait != nullptr;
      if (!chained) pdl::wait_for_prerequisites();
      HM_TIMELINE(uint64_t tl_waited = timeline_now(); bool tl_waited_unit = false;)
      cutlass::PipelineState<kStages> write(0, 1, 0);
      int issued = 0;
      int ready_expert = -1;  // a chain: the expert whose rows GEMM1 has finished
      for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
        const MoeGemmUnit u =
            decode_moe_gemm_unit<kBlockN, kBlockT, kBlockK>(p, smem.tile_prefix, n_tiles, unit);
        if (chained && u.expert != ready_expert) {  // a CTA's units go in expert order
          wait_for_expert_rows(p, u);
          ready_expert = u.expert;
          HM_TIMELINE(if (!tl_waited_unit) tl_waited = timeline_now(); tl_waited_unit = true;)
        }
        for (int kt = u.kt_begin; kt < u.kt_end; ++kt, ++issued) {
          const int s = write.index();
          if (issued >= prefetched) {
            EmptyBarrier::wait(&smem.empty[s], write.phase());
            FullBarrier::arrive_and_expect_tx(&smem.full[s], Config::kTxBytes);
            copy_weights(u, kt, s);
          } else {
            FullBarrier::arrive(&smem.full[s]);
          }
          copy_tokens(u, kt, s);
          ++write;
        }
      }
      // A chained GEMM2 completes only after GEMM1 has (the kernels after it wait for it).
      if (chained) pdl::wait_for_prerequisites();
      HM_TIMELINE(if (p.timeline != nullptr) {
        int64_t* row = p.timeline + int64_t(blockIdx.x) * kTimelineFields;
        row[kTlIssued] = int64_t(timeline_now());
        row[kTlN] = p.n;
        row[kTlK] = p.k;
        row[kTlSilu] = p.silu_mul;
        row[kTlSplits] = p.k_splits;
        row[kTlGrid] = gridDim.x;
        row[kTlCta] = blockIdx.x;
        row[kTlSm] = timeline_sm();
        row[kTlStart] = int64_t(tl_start);
        row[kTlReady] = int64_t(tl_ready);
        row[kTlWaited] = int64_t(tl_waited);
        row[kTlProducer] = 1;
      })
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  // The tokens arrive after the producer's wait; the scales and the outputs are touched here.
  // In a chain the consumers are ordered after the producer's wait for each expert by the
  // slots' arrivals instead.
  if (p.handoff_wait == nullptr) pdl::wait_for_prerequisites();
  const int ct = int(threadIdx.x) - Config::kProducerThreads;  // 0..255
  [[maybe_unused]] const int wg = ct / 128;                    // consumer warpgroup
  typename Config::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(Config::kPair ? ct % 128 : ct);
  Tensor tCsA = thr_mma.partition_A(sA);                  // (MMA,MMA_M,MMA_K,PIPE)
  Tensor tCsB = thr_mma.partition_B(sB);                  // (MMA,MMA_N,MMA_K,PIPE)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);            // wgmma descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor cC = make_identity_tensor(make_shape(Int<kTileA>{}, Int<kTileB>{}));  // (TILE_A,TILE_B) -> (a,b)
  Tensor tCcC = thr_mma.partition_C(cC);                  // (MMA,MMA_M,MMA_N)
  // The tile coordinates of accumulator element i: weight row n and token row t.
  struct TileCoord {
    int n;
    int t;
  };
  const auto tile_nt = [&](int i) {
    const int a = get<0>(tCcC(i)), b = get<1>(tCcC(i));
    return kSwapAB ? TileCoord{a, b} : TileCoord{b, a};
  };
  Tensor acc = thr_mma.make_fragment_C(tCcC);             // fp32, what wgmma accumulates into
  Tensor total = make_fragment_like(acc);                 // FP8: the sum of promoted partials
  constexpr int kEpiBarrier = 1;  // named barrier of the 256 consumer threads (0 is syncthreads)

  cutlass::PipelineState<kStages> read;  // (slot 0, phase 0)
  // A pair's warpgroup wg takes the k-tiles whose place in the CTA's sequence (over all of
  // its units) has parity wg, and steps over the other's slots.
  [[maybe_unused]] int64_t seq = 0;
  HM_TIMELINE(uint64_t tl_first = 0; uint64_t tl_unit[kTimelineUnits] = {}; int tl_units = 0;)
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    HM_TIMELINE(if (tl_units < kTimelineUnits) tl_unit[tl_units] = timeline_now(); ++tl_units;)
    const MoeGemmUnit u =
        decode_moe_gemm_unit<kBlockN, kBlockT, kBlockK>(p, smem.tile_prefix, n_tiles, unit);
    // A chain's GEMM1: once every consumer has stored its part of the unit, the count of
    // outputs it wrote (rows x columns in range) goes to the expert's counter.
    const auto signal_handoff = [&] {
      if (p.handoff_signal == nullptr) return;
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
      if (ct == 0) {
        const int out_cols = p.silu_mul ? p.act_n : p.n;
        const int64_t rows = cute::min(int64_t(kBlockT), u.rows - u.t0);
        const int64_t cols = cute::min(p.tile_cols, out_cols - u.n0);
        handoff_add(p.handoff_signal + u.expert, static_cast<unsigned long long>(rows * cols));
      }
    };
    clear(acc);
    if constexpr (kPromoteInterval > 0) clear(total);

    // One wgmma batch in flight: after issuing k-tile kt, wait for the previous one's batch
    // and free its slot (in_flight); at an FP8 promotion, wait for both and free both.
    int in_flight = -1;
    [[maybe_unused]] int own = 0;  // a pair: k-tiles of the unit this warpgroup has issued
    // A pair's warpgroup visits only its own k-tiles (every other one, from the first whose
    // place in the sequence has its parity) and steps over the other's slots: no iteration
    // of the loop goes without a wgmma batch. (A loop over every k-tile that `continue`d past
    // the other's made ptxas serialize each wgmma, C7515; benchmarks/NOTES.md, v30.)
    int kt = u.kt_begin;
    constexpr int kKtStep = Config::kPair ? 2 : 1;
    if constexpr (Config::kPair) {
      if (int(seq % 2) != wg && kt < u.kt_end) {
        ++read;
        ++kt;
      }
      seq += u.kt_end - u.kt_begin;
    }
    for (; kt < u.kt_end; kt += kKtStep) {
      const int s = read.index();
      FullBarrier::wait(&smem.full[s], read.phase());
      HM_TIMELINE(if (tl_first == 0) tl_first = timeline_now();)
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      cute::gemm(mma, tCrA(_, _, _, s), tCrB(_, _, _, s), acc);
      warpgroup_commit_batch();
      ++read;
      if constexpr (Config::kPair) {
        if (kt + 1 < u.kt_end) ++read;  // the other warpgroup's next slot
      }
      bool promote = false;
      if constexpr (kPromoteInterval > 0 && Config::kPair) {  // its next k-tile is kt + 2
        promote = ++own % kPromoteInterval == 0 || kt + 2 >= u.kt_end;
      } else if constexpr (kPromoteInterval > 0) {
        promote = (kt - u.kt_begin + 1) % kPromoteInterval == 0 || kt + 1 == u.kt_end;
      }
      if (promote) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        if (in_flight >= 0) EmptyBarrier::arrive(&smem.empty[in_flight]);
        EmptyBarrier::arrive(&smem.empty[s]);
        in_flight = -1;
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          total(i) += acc(i);
          acc(i) = 0.0f;
        }
      } else {
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc);
        if (in_flight >= 0) EmptyBarrier::arrive(&smem.empty[in_flight]);
        in_flight = s;
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (in_flight >= 0) EmptyBarrier::arrive(&smem.empty[in_flight]);
    // A chained GEMM2's unit without k-tiles (an empty K split) waited on no slot.
    if (p.handoff_wait != nullptr && u.kt_begin == u.kt_end) {
      wait_for_expert_rows(p, u);
    }
    if constexpr (kPromoteInterval == 0) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) total(i) = acc(i);
    }
    // A pair adds the second warpgroup's sums into the first's through the epilogue tile (in
    // the fragment order both share); from here on the first warpgroup holds the unit's tile.
    // The first barrier keeps these writes behind the previous unit's reads of c.
    const bool holds_tile = !Config::kPair || wg == 0;
    if constexpr (Config::kPair) {
      float* sums = reinterpret_cast<float*>(smem.c);
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
      if (wg == 1) {
        CUTE_UNROLL
        for (int i = 0; i < size(total); ++i) sums[i * 128 + ct - 128] = total(i);
      }
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
      if (wg == 0) {
        CUTE_UNROLL
        for (int i = 0; i < size(total); ++i) total(i) += sums[i * 128 + ct];
      }
    }

    // Element (n, t) of the tile is weight row w_row(n) of the expert and token row t0 + t.
    // Without SiLU*mul it belongs to out[row_begin + t0 + t, n0 + n]; with it, tile columns
    // [0, kBlockN / 2) are gate rows n0 + n and [kBlockN / 2, kBlockN) the up rows of the
    // same output columns.
    constexpr int kHalf = kBlockN / 2;
    const auto w_row = [&](int nl) {
      return p.silu_mul ? (nl < kHalf ? u.n0 + nl : p.act_n + u.n0 + nl - kHalf) : u.n0 + nl;
    };
    const auto col_valid = [&](int nl) {
      return p.silu_mul ? u.n0 + (nl < kHalf ? nl : nl - kHalf) < p.act_n : u.n0 + nl < p.n;
    };
    const float tensor_scale = (p.a_mode == ScaleMode::kPerTensor ? p.a_scale[0] : 1.0f) *
                               (p.b_mode == ScaleMode::kPerTensor ? p.b_scale[u.expert] : 1.0f);
    const auto scaled = [&](int i, int wr, int64_t row) {
      float v = total(i) * tensor_scale;
      if (p.b_mode == ScaleMode::kPerRow) v *= p.b_scale[int64_t(u.expert) * p.n + wr];
      if (p.a_mode == ScaleMode::kPerRow) v *= p.a_scale[row];
      return v;
    };
    if (p.k_splits > 1) {
      // The split's scaled fp32 partial tile [row, weight row], straight from registers (the
      // scales are the same for every split, so the reduce kernel only adds, then applies
      // SiLU*mul when fused).
      float* partial = p.partial + int64_t(u.split) * p.m_total * p.n;
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) {
        const TileCoord c = tile_nt(i);
        const int t = u.t0 + c.t;
        if (holds_tile && col_valid(c.n) && t < u.rows) {
          const int64_t row = u.row_begin + t;
          const int wr = w_row(c.n);
          partial[row * p.n + wr] = scaled(i, wr, row);
        }
      }
      continue;
    }
    // Staged: registers -> shared tile c[t][n] (bf16) -> row stores of 8 columns. The first
    // barrier keeps this unit's writes behind the previous unit's reads of c (a pair's: behind
    // the first warpgroup's reads of the sums).
    cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
    if (holds_tile) {
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) {
        const TileCoord c = tile_nt(i);
        const int nl = c.n, tl = c.t;
        const int t = u.t0 + tl;
        const bool valid = col_valid(nl) && t < u.rows;
        smem.c[tl * Config::kEpilogueLd + nl] =
            cutlass::bfloat16_t(valid ? scaled(i, w_row(nl), u.row_begin + t) : 0.0f);
      }
    }
    cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
    if (!p.silu_mul) {
      auto* out = static_cast<cutlass::bfloat16_t*>(p.out);
      constexpr int kVectors = kBlockT * kBlockN / 8;  // 8 bf16 = 16 bytes
      CUTE_UNROLL
      for (int v = ct; v < kVectors; v += Config::kConsumerThreads) {
        const int tl = v / (kBlockN / 8);
        const int nl = (v % (kBlockN / 8)) * 8;
        const int t = u.t0 + tl;
        const int n = u.n0 + nl;
        if (t >= u.rows || n >= p.n) continue;
        const cutlass::bfloat16_t* src = &smem.c[tl * Config::kEpilogueLd + nl];
        cutlass::bfloat16_t* dst = out + (u.row_begin + t) * p.ldo + n;
        if (p.vector_out) {
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        } else {
          for (int j = 0; j < 8 && n + j < p.n; ++j) dst[j] = src[j];
        }
      }
      signal_handoff();
      continue;
    }
    // SiLU*mul: silu(gate) * up in fp32 of the bf16-rounded GEMM outputs (what a separate
    // silu_and_mul over a bf16 GEMM output computes), then bf16 or e4m3 (static scale).
    constexpr int kActVectors = kBlockT * kHalf / 8;
    float amax = 0.0f;
    CUTE_UNROLL
    for (int v = ct; v < kActVectors; v += Config::kConsumerThreads) {
      const int tl = v / (kHalf / 8);
      const int nl = (v % (kHalf / 8)) * 8;
      const int t = u.t0 + tl;
      const int j = u.n0 + nl;
      if (t >= u.rows || j >= p.act_n) continue;
      const cutlass::bfloat16_t* src = &smem.c[tl * Config::kEpilogueLd + nl];
      cutlass::bfloat16_t gate[8], up[8];
      const uint4 gate_bits = *reinterpret_cast<const uint4*>(src);
      const uint4 up_bits = *reinterpret_cast<const uint4*>(src + kHalf);
      memcpy(gate, &gate_bits, 16);
      memcpy(up, &up_bits, 16);
      float act[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) act[e] = act::silu_mul_f32(float(gate[e]), float(up[e]));
      amax = fmaxf(amax, store_act_row(p, (u.row_begin + t) * p.ldo + j, p.act_n - j, act));
    }
    if (p.amax_scale != nullptr) fold_amax_scale(p, amax);
    signal_handoff();
  }
  HM_TIMELINE(if (ct == 0 && p.timeline != nullptr) {
    int64_t* row = p.timeline + int64_t(blockIdx.x) * kTimelineFields;
    row[kTlFirst] = int64_t(tl_first);
    row[kTlUnits] = tl_units;
    for (int j = 0; j < kTimelineUnits; ++j) row[kTlUnit0 + j] = int64_t(tl_unit[j]);
    row[kTlEnd] = int64_t(timeline_now());
    row[kTlConsumer] = 1;
  })
}

// Sum of the K splits for the rows each expert owns (clamped as in the GEMM): out[row, n] =
// bf16(sum_s partial[s, row, n]), or with SiLU*mul out[row, j] = act(bf16(sum gate),
// bf16(sum up)) for the gate and up columns j and act_n + j of the partials. CTA (blockIdx.x
// = chunk of 8 * kThreads output columns, .y = block of kRows rows, .z = expert): thread i
// takes 8 adjacent columns of kRows rows. A template so that each instantiation's translation
// unit has its own weak copy.
template <int kThreads, int kRows>
__global__ void __launch_bounds__(kThreads)
    moe_gemm_splitk_reduce_kernel(MoeGemmParams p) {
  // A programmatic dependent launch of the GEMM (common/pdl.cuh's rule).
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  const int expert = blockIdx.z;
  const int64_t row_begin = cute::min(cute::max(p.offsets[expert], int64_t(0)), p.m_total);
  const int64_t rows =
      cute::min(cute::max(p.offsets[expert + 1], row_begin), p.m_total) - row_begin;
  const int cols = p.silu_mul ? p.act_n : p.n;
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
          if (p.silu_mul) sum_up[e] += src[s * plane + p.act_n + e];
        }
      }
    }
    if (!p.silu_mul) {
      auto* out = static_cast<cutlass::bfloat16_t*>(p.out) + row * p.ldo + col;
      for (int e = 0; e < valid; ++e) out[e] = cutlass::bfloat16_t(sum[e]);
      continue;
    }
    float act[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) {
      act[e] = act::silu_mul_f32(float(cutlass::bfloat16_t(sum[e])),
                                 float(cutlass::bfloat16_t(sum_up[e])));
    }
    amax = fmaxf(amax, store_act_row(p, row * p.ldo + col, valid, act));
  }
  if (p.amax_scale != nullptr) fold_amax_scale(p, amax);
}

// Builds the TMA descriptors and launches the persistent grid (a.grid CTAs, at most one per
// SM, no more than the launch can have units; as a programmatic dependent launch unless
// a.pdl is false), then, with a K split, the reduction of the partial tiles (the same kind of
// launch).
template <class Element, bool kSwapAB, int kBlockN, int kBlockT, int kBlockK, int kStages,
          int kPromoteInterval>
cudaError_t launch_moe_gemm_sm90(const MoeGemmArgs& a, cudaStream_t stream) {
  using namespace cute;
  using Config =
      MoeGemmConfig<Element, kSwapAB, kBlockN, kBlockT, kBlockK, kStages, kPromoteInterval>;
  if (a.m_total == 0 || a.num_experts == 0 || a.n == 0) return cudaSuccess;
  if (a.num_experts > heuristics::kMaxExperts || a.grid <= 0) return cudaErrorInvalidValue;
  if (a.silu_mul && (a.act_n <= 0 || 2 * int64_t(a.act_n) != a.n)) return cudaErrorInvalidValue;

  const auto* w_ptr = static_cast<const Element*>(a.w);
  const auto* x_ptr = static_cast<const Element*>(a.x);
  Tensor mW = make_tensor(make_gmem_ptr(w_ptr),
                          make_shape(a.num_experts * a.n, a.k), make_stride(int64_t(a.k), Int<1>{}));
  Tensor mX = make_tensor(make_gmem_ptr(x_ptr), make_shape(int(a.m_total), a.k),
                          make_stride(a.ldx, Int<1>{}));
  auto tma_w = make_tma_atom(SM90_TMA_LOAD{}, mW, typename Config::SmemLayoutWBox{},
                             make_shape(Int<Config::kWeightBox>{}, Int<kBlockK>{}));
  auto tma_x = make_tma_atom(SM90_TMA_LOAD{}, mX, typename Config::SmemLayoutXStage{},
                             make_shape(Int<Config::kTileX>{}, Int<kBlockK>{}));
  auto tma_a = [&] { if constexpr (kSwapAB) return tma_w; else return tma_x; }();
  auto tma_b = [&] { if constexpr (kSwapAB) return tma_x; else return tma_w; }();

  const int k_splits = a.k_splits > 1 ? a.k_splits : 1;
  if (k_splits > 1 && a.partial == nullptr) return cudaErrorInvalidValue;
  // A chain's GEMM1 counts the outputs its units store: the reduce kernel of a split would.
  if (k_splits > 1 && a.handoff_signal != nullptr) return cudaErrorInvalidValue;
  const int out_cols = a.silu_mul ? a.act_n : a.n;
  const int tile_cols = a.silu_mul ? kBlockN / 2 : kBlockN;
  const int n_tiles = (out_cols + tile_cols - 1) / tile_cols;
  const int vector_bytes = a.silu_mul && a.out_scale != nullptr ? 8 : 16;
  const bool vector_out = out_cols % 8 == 0 && a.ldo % 8 == 0 &&
                          reinterpret_cast<uintptr_t>(a.out) % vector_bytes == 0;
  MoeGemmParams p{a.out, a.partial, a.offsets, a.a_scale, a.b_scale, a.a_mode, a.b_mode,
                  a.n, a.k, a.m_total, a.ldo, k_splits, a.num_experts, n_tiles, tile_cols,
                  a.act_n, a.silu_mul, a.silu_mul ? a.out_scale : nullptr,
                  a.silu_mul && a.out_scale == nullptr ? a.amax_scale : nullptr, a.offsets_ready,
                  vector_out, a.start_stagger_ns > 0 ? a.start_stagger_ns : 0,
                  uint64_t(a.evict_first_weights ? TMA::CacheHintSm90::EVICT_FIRST
                                                 : TMA::CacheHintSm90::EVICT_NORMAL),
                  a.handoff_signal, a.handoff_wait
#ifdef HOPPER_MOE_GEMM_TIMELINE
                  , a.timeline
#endif
  };
  auto kernel = &moe_gemm_sm90_kernel<Config, kSwapAB, kBlockN, kBlockT, kBlockK, kStages,
                                      kPromoteInterval, decltype(tma_a), decltype(tma_b)>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Config::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Units: the experts' token tiles (at most ceil(m_total / kBlockT) + min(E, m_total): each
  // expert with rows wastes at most one partial tile) x weight tiles x K splits.
  const int64_t tile_bound = (a.m_total + kBlockT - 1) / kBlockT +
                             std::min<int64_t>(a.num_experts, a.m_total);
  const int64_t unit_bound = tile_bound * n_tiles * k_splits;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(unsigned(std::min<int64_t>(a.grid, unit_bound)));
  launch.blockDim = dim3(Config::kThreads);
  launch.dynamicSmemBytes = Config::kSmemBytes;
  launch.stream = stream;
  cudaLaunchAttribute attr = pdl::programmatic_serialization(a.pdl);
  launch.attrs = &attr;
  launch.numAttrs = 1;
  err = cudaLaunchKernelEx(&launch, kernel, p, tma_a, tma_b);
  if (err != cudaSuccess || k_splits == 1) return err;
  constexpr int kReduceThreads = 128, kReduceRows = 8;
  dim3 reduce_grid((out_cols + 8 * kReduceThreads - 1) / (8 * kReduceThreads),
                   unsigned((a.max_rows_per_expert + kReduceRows - 1) / kReduceRows),
                   unsigned(a.num_experts));
  launch.gridDim = reduce_grid;  // a dependent launch too: its start overlaps the GEMM's end
  launch.blockDim = dim3(kReduceThreads);
  launch.dynamicSmemBytes = 0;
  return cudaLaunchKernelEx(&launch, moe_gemm_splitk_reduce_kernel<kReduceThreads, kReduceRows>,
                            p);
}

// The instantiation of a heuristic config: every template argument comes from it, so what the
// host logs is what runs.
template <heuristics::GemmDtype kDtype, const heuristics::GroupedGemmConfig& c>
cudaError_t launch_config_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  using Element = std::conditional_t<kDtype == heuristics::GemmDtype::kBf16,
                                     cutlass::bfloat16_t, cutlass::float_e4m3_t>;
  using Config = MoeGemmConfig<Element, c.swap_ab, c.block_n, c.block_t, c.block_k, c.stages,
                               c.promote_interval>;
  static_assert(Config::kSmemBytes == c.smem_bytes,
                "the heuristic's shared-memory model is the kernel's SharedStorage");
  static_assert(c.block_k * sizeof(Element) == 128, "a k-tile is one 128-byte swizzle row");
  return launch_moe_gemm_sm90<Element, c.swap_ab, c.block_n, c.block_t, c.block_k, c.stages,
                              c.promote_interval>(args, stream);
}

// Swap-AB with token tile kBlockT, and the standard mapping (explicitly instantiated in
// csrc/instantiations/).
template <heuristics::GemmDtype kDtype, int kBlockT>
inline constexpr heuristics::GroupedGemmConfig kSwapAbConfig = heuristics::swapab_config(kDtype, kBlockT);
template <heuristics::GemmDtype kDtype, int kBlockT>
inline constexpr heuristics::GroupedGemmConfig kSwapAbPairConfig =
    heuristics::swapab_pair_config(kDtype, kBlockT);
template <heuristics::GemmDtype kDtype>
inline constexpr heuristics::GroupedGemmConfig kStandardConfig = heuristics::standard_config(kDtype);

template <heuristics::GemmDtype kDtype, int kBlockT>
cudaError_t moe_gemm_swapab_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  return launch_config_sm90<kDtype, kSwapAbConfig<kDtype, kBlockT>>(args, stream);
}

template <heuristics::GemmDtype kDtype, int kBlockT>
cudaError_t moe_gemm_swapab_pair_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  return launch_config_sm90<kDtype, kSwapAbPairConfig<kDtype, kBlockT>>(args, stream);
}

template <heuristics::GemmDtype kDtype>
cudaError_t moe_gemm_standard_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  return launch_config_sm90<kDtype, kStandardConfig<kDtype>>(args, stream);
}

}  // namespace hopper_moe::gemm
