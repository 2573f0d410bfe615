// Grouped expert GEMM for SM90, swap-AB mapping: C^T = W . X^T per expert (decode).
//
// At decode an expert sees a handful of tokens. A wgmma's A operand is always 64 rows, so the
// weight tile takes that side (kBlockN = 128 weight rows: one 64-row wgmma per consumer
// warpgroup) and the tokens are the narrow N side (kBlockT = 16..128). Every expert's weights
// are then read once per token tile. The host picks kBlockT per launch from the rows the
// fullest expert is expected to get (heuristics/sm90.h), so a typical expert fits one token
// tile; one with more rows takes several, each streaming its weights again.
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
//     with the slot's byte count and issues the two TMA copies (cp.async.bulk.tensor) of the
//     weight tile and the token tile. It runs up to kStages k-tiles ahead of the math, across
//     unit boundaries, so the next unit's weights arrive while the consumers run an epilogue.
//   warpgroups 1-2, the consumers (setmaxnreg up to 232): each issues the wgmma of 64 weight
//     rows x kBlockT tokens from shared memory, waits for it, and releases the slot (empty[s],
//     256 arrivals). FP8: the tensor core's accumulation is promoted into a separate fp32
//     register accumulator every kPromoteInterval k-tiles, bounding the error at large K.
// Slots hold a weight tile (kBlockN x kBlockK) and a token tile (kBlockT x kBlockK), both
// K-major with the 128-byte swizzle wgmma reads. Out-of-range rows and K columns are
// zero-filled by TMA; rows that belong to the next expert or lie past N are computed and
// masked in the epilogue.
// Epilogue: the consumers scale their accumulators, convert them to bf16 and write them
// transposed into a shared-memory tile [kBlockT][kBlockN + pad]; after a named barrier the 256
// consumer threads store that tile's rows to out[row, n0..] in 16-byte vectors (coalesced:
// consecutive threads write consecutive columns of a row), masking token rows past the
// expert's count and columns past N (element stores where N or the row stride is not a
// multiple of 8). K split (k_splits > 1, chosen by the host when the units would leave SMs
// idle): each unit runs its split's k-tiles and writes the scaled fp32 partial tile to
// partial[split, row, n] from registers; a second kernel adds the splits of every row an
// expert owns and writes out (rows no expert owns stay untouched).
// Shared memory: heuristics/sm90.h swapab_smem_bytes (rings, epilogue tile, barriers, table).
// Registers: the accumulator is kBlockT / 2 fp32 per consumer thread (twice for FP8).
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

#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe::gemm {

template <class Element, int kBlockN, int kBlockT, int kBlockK, int kStages, int kPromoteInterval>
struct SwapAbConfig {
  static_assert(kBlockN == 128, "the weight tile is one 64-row wgmma per consumer warpgroup");
  static_assert(kBlockT % 16 == 0 && kBlockT >= 16 && kBlockT <= 256,
                "the token side is a wgmma N: a multiple of 16 (whole epilogue vectors) <= 256");
  static_assert(kBlockK * sizeof(Element) % 128 == 0,
                "a k-tile spans whole 128-byte swizzle atoms");
  static_assert(kStages >= 2, "the pipeline needs at least two slots to overlap copy and math");

  using TileShape = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockT>, cute::Int<kBlockK>>;
  using AtomShape = cute::Shape<cute::_64, cute::Int<kBlockT>, cute::Int<kBlockK>>;
  using SmemLayoutW = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kBlockN>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  using SmemLayoutX = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kBlockT>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float, AtomShape,
                                                      cute::GMMA::Major::K,
                                                      cute::GMMA::Major::K>());
  // Two consumer warpgroups stacked along the weight rows: 64 rows each.
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536,
                "the register split fits the SM's 64K registers");
  static_assert(cute::size(TiledMma{}) == kConsumerThreads, "two warpgroups issue the wgmma");
  static_assert(kBlockN * kBlockT / kConsumerThreads * (kPromoteInterval > 0 ? 2 : 1) <= 128,
                "the fp32 accumulators (two with FP8 promotion) leave registers for the rest "
                "of the consumer: larger token tiles spill");
  static constexpr int kEpilogueLd = kBlockN + heuristics::kEpiloguePad;  // bf16 elements

  // 128-byte-swizzled tiles repeat every 1024 bytes: TMA writes and wgmma descriptors (base
  // offset 0) agree only on 1024-byte aligned tiles.
  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutW>> w;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutX>> x;
    alignas(16) cutlass::bfloat16_t c[kBlockT * kEpilogueLd];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
    int tile_prefix[heuristics::kMaxExperts + 1];  // token tiles of the experts before e
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB an SM90 CTA can have");
  static_assert(kBlockT * kBlockK * sizeof(Element) % 1024 == 0,
                "each token-tile slot keeps the next slot 1024-byte aligned");
  static constexpr uint32_t kTxBytes = (kBlockN + kBlockT) * kBlockK * sizeof(Element);
};

struct SwapAbParams {
  void* out;
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
  bool vector_out;  // out, ldo and n allow 16-byte stores of 8 columns
};

// One work unit, decoded the same way by the producer and the consumers.
struct SwapAbUnit {
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
CUTLASS_DEVICE SwapAbUnit decode_swapab_unit(const SwapAbParams& p, const int* tile_prefix,
                                             int n_tiles, int64_t unit) {
  SwapAbUnit u;
  u.split = int(unit % p.k_splits);
  const int64_t rest = unit / p.k_splits;
  u.n0 = int(rest % n_tiles) * kBlockN;
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

template <class Config, class Element, class TmaW, class TmaX, int kPromoteInterval>
__global__ void __launch_bounds__(Config::kThreads, 1)
    moe_gemm_swapab_sm90_kernel(SwapAbParams p, CUTLASS_GRID_CONSTANT TmaW const tma_w,
                                CUTLASS_GRID_CONSTANT TmaX const tma_x) {
  using namespace cute;
  using SharedStorage = typename Config::SharedStorage;
  constexpr int kBlockN = size<0>(typename Config::TileShape{});
  constexpr int kBlockT = size<1>(typename Config::TileShape{});
  constexpr int kBlockK = size<2>(typename Config::TileShape{});
  constexpr int kStages = size<2>(typename Config::SmemLayoutW{});
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int lane = int(threadIdx.x % 32);

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
      EmptyBarrier::init(&smem.empty[s], Config::kConsumerThreads);
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

  const int n_tiles = (p.n + kBlockN - 1) / kBlockN;
  const int64_t units = int64_t(smem.tile_prefix[p.num_experts]) * n_tiles * p.k_splits;

  // Coordinate views of the whole operands. Rows are int32 TMA coordinates: E*N and m_total
  // stay below 2^31 (host check).
  Tensor mW = tma_w.get_tma_tensor(make_shape(p.num_experts * p.n, p.k));  // (E*N,K)
  Tensor mX = tma_x.get_tma_tensor(make_shape(int(p.m_total), p.k));       // (M,K)
  Tensor sW = make_tensor(make_smem_ptr(smem.w.begin()), typename Config::SmemLayoutW{});  // (BLK_N,BLK_K,PIPE)
  Tensor sX = make_tensor(make_smem_ptr(smem.x.begin()), typename Config::SmemLayoutX{});  // (BLK_T,BLK_K,PIPE)

  if (warp < Config::kProducerThreads / 32) {
    // ------------------------------------------------------------------ producer
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (warp == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(tma_w.get_tma_descriptor());
      cute::prefetch_tma_descriptor(tma_x.get_tma_descriptor());
      // Phase 1 first: a fresh barrier counts its preceding phase as complete, so the first
      // kStages waits pass and the ring fills at once.
      cutlass::PipelineState<kStages> write(0, 1, 0);
      for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
        const SwapAbUnit u =
            decode_swapab_unit<kBlockN, kBlockT, kBlockK>(p, smem.tile_prefix, n_tiles, unit);
        Tensor gW = local_tile(domain_offset(make_coord(u.expert * p.n + u.n0, 0), mW),
                               make_shape(Int<kBlockN>{}, Int<kBlockK>{}), make_coord(0, _));  // (BLK_N,BLK_K,k)
        Tensor gX = local_tile(domain_offset(make_coord(int(u.row_begin) + u.t0, 0), mX),
                               make_shape(Int<kBlockT>{}, Int<kBlockK>{}), make_coord(0, _));  // (BLK_T,BLK_K,k)
        auto [tWgW, tWsW] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW),
                                          group_modes<0, 2>(gW));  // (TMA,k), (TMA,PIPE)
        auto [tXgX, tXsX] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                          group_modes<0, 2>(gX));  // (TMA,k), (TMA,PIPE)
        for (int kt = u.kt_begin; kt < u.kt_end; ++kt) {
          const int s = write.index();
          EmptyBarrier::wait(&smem.empty[s], write.phase());
          FullBarrier::arrive_and_expect_tx(&smem.full[s], Config::kTxBytes);
          copy(tma_w.with(smem.full[s]), tWgW(_, kt), tWsW(_, s));
          copy(tma_x.with(smem.full[s]), tXgX(_, kt), tXsX(_, s));
          ++write;
        }
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  const int ct = int(threadIdx.x) - Config::kProducerThreads;  // 0..255
  typename Config::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(ct);
  Tensor tCsW = thr_mma.partition_A(sW);                  // (MMA,MMA_N,MMA_K,PIPE)
  Tensor tCsX = thr_mma.partition_B(sX);                  // (MMA,MMA_T,MMA_K,PIPE)
  Tensor tCrW = thr_mma.make_fragment_A(tCsW);            // wgmma descriptors
  Tensor tCrX = thr_mma.make_fragment_B(tCsX);
  Tensor cC = make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kBlockT>{}));  // (BLK_N,BLK_T) -> (n,t)
  Tensor tCcC = thr_mma.partition_C(cC);                  // (MMA,MMA_N,MMA_T)
  Tensor acc = thr_mma.make_fragment_C(tCcC);             // fp32, what wgmma accumulates into
  Tensor total = make_fragment_like(acc);                 // FP8: the sum of promoted partials
  auto* out = static_cast<cutlass::bfloat16_t*>(p.out);
  constexpr int kEpiBarrier = 1;  // named barrier of the 256 consumer threads (0 is syncthreads)

  cutlass::PipelineState<kStages> read;  // (slot 0, phase 0)
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    const SwapAbUnit u =
        decode_swapab_unit<kBlockN, kBlockT, kBlockK>(p, smem.tile_prefix, n_tiles, unit);
    clear(acc);
    if constexpr (kPromoteInterval > 0) clear(total);

    for (int kt = u.kt_begin; kt < u.kt_end; ++kt) {
      const int s = read.index();
      FullBarrier::wait(&smem.full[s], read.phase());
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      cute::gemm(mma, tCrW(_, _, _, s), tCrX(_, _, _, s), acc);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      EmptyBarrier::arrive(&smem.empty[s]);
      ++read;
      if constexpr (kPromoteInterval > 0) {
        if ((kt - u.kt_begin + 1) % kPromoteInterval == 0 || kt + 1 == u.kt_end) {
          CUTE_UNROLL
          for (int i = 0; i < size(acc); ++i) {
            total(i) += acc(i);
            acc(i) = 0.0f;
          }
        }
      }
    }
    if constexpr (kPromoteInterval == 0) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) total(i) = acc(i);
    }

    // Element (n, t) of the tile belongs to out[row_begin + t0 + t, n0 + n].
    const float tensor_scale = (p.a_mode == ScaleMode::kPerTensor ? p.a_scale[0] : 1.0f) *
                               (p.b_mode == ScaleMode::kPerTensor ? p.b_scale[u.expert] : 1.0f);
    const auto scaled = [&](int i, int n, int64_t row) {
      float v = total(i) * tensor_scale;
      if (p.b_mode == ScaleMode::kPerRow) v *= p.b_scale[int64_t(u.expert) * p.n + n];
      if (p.a_mode == ScaleMode::kPerRow) v *= p.a_scale[row];
      return v;
    };
    if (p.k_splits > 1) {
      // The split's scaled fp32 partial tile, straight from registers (the scales are the same
      // for every split, so the reduce kernel only adds).
      float* partial = p.partial + int64_t(u.split) * p.m_total * p.n;
      CUTE_UNROLL
      for (int i = 0; i < size(total); ++i) {
        const int n = u.n0 + get<0>(tCcC(i));
        const int t = u.t0 + get<1>(tCcC(i));
        if (n < p.n && t < u.rows) {
          const int64_t row = u.row_begin + t;
          partial[row * p.n + n] = scaled(i, n, row);
        }
      }
      continue;
    }
    // Staged: registers -> shared tile c[t][n] (bf16) -> 16-byte row stores. The first barrier
    // keeps this unit's writes behind the previous unit's reads of c.
    cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
    CUTE_UNROLL
    for (int i = 0; i < size(total); ++i) {
      const int nl = get<0>(tCcC(i));
      const int tl = get<1>(tCcC(i));
      const int n = u.n0 + nl;
      const int t = u.t0 + tl;
      const bool valid = n < p.n && t < u.rows;
      smem.c[tl * Config::kEpilogueLd + nl] =
          cutlass::bfloat16_t(valid ? scaled(i, n, u.row_begin + t) : 0.0f);
    }
    cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, kEpiBarrier);
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
  }
}

// Sum of the K splits: out[row, n] = bf16(sum_s partial[s, row, n]) for the rows each expert
// owns (clamped as in the GEMM). CTA (blockIdx.x = column chunk, .y = block of kRows rows,
// .z = expert): thread i adds column chunk * kThreads + i of kRows rows. A template so that
// each instantiation's translation unit has its own weak copy.
template <int kThreads, int kRows>
__global__ void __launch_bounds__(kThreads)
    moe_gemm_splitk_reduce_kernel(cutlass::bfloat16_t* out, int64_t ldo, const float* partial,
                                  const int64_t* offsets, int64_t m_total, int n,
                                  int k_splits) {
  const int expert = blockIdx.z;
  const int64_t row_begin = cute::min(cute::max(offsets[expert], int64_t(0)), m_total);
  const int64_t rows =
      cute::min(cute::max(offsets[expert + 1], row_begin), m_total) - row_begin;
  const int col = blockIdx.x * kThreads + threadIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * kRows;
  if (t0 >= rows || col >= n) return;
  for (int64_t t = t0; t < cute::min(t0 + kRows, rows); ++t) {
    const int64_t row = row_begin + t;
    float v = 0.0f;
    for (int s = 0; s < k_splits; ++s) v += partial[(s * m_total + row) * n + col];
    out[row * ldo + col] = cutlass::bfloat16_t(v);
  }
}

// Builds the TMA descriptors and launches the persistent grid (at most one CTA per SM, no more
// than the launch can have units), then, with a K split, the reduction of the partial tiles.
template <class Element, int kBlockN, int kBlockT, int kBlockK, int kStages, int kPromoteInterval>
cudaError_t launch_moe_gemm_swapab_sm90(const MoeGemmArgs& a, cudaStream_t stream) {
  using namespace cute;
  using Config = SwapAbConfig<Element, kBlockN, kBlockT, kBlockK, kStages, kPromoteInterval>;
  if (a.m_total == 0 || a.num_experts == 0 || a.n == 0) return cudaSuccess;
  if (a.num_experts > heuristics::kMaxExperts || a.sm_count <= 0) return cudaErrorInvalidValue;

  const auto* w_ptr = static_cast<const Element*>(a.w);
  const auto* x_ptr = static_cast<const Element*>(a.x);
  Tensor mW = make_tensor(make_gmem_ptr(w_ptr),
                          make_shape(a.num_experts * a.n, a.k), make_stride(int64_t(a.k), Int<1>{}));
  Tensor mX = make_tensor(make_gmem_ptr(x_ptr), make_shape(int(a.m_total), a.k),
                          make_stride(a.ldx, Int<1>{}));
  auto sW = typename Config::SmemLayoutW{};
  auto sX = typename Config::SmemLayoutX{};
  auto tma_w = make_tma_atom(SM90_TMA_LOAD{}, mW, sW(_, _, 0),
                             make_shape(Int<kBlockN>{}, Int<kBlockK>{}));
  auto tma_x = make_tma_atom(SM90_TMA_LOAD{}, mX, sX(_, _, 0),
                             make_shape(Int<kBlockT>{}, Int<kBlockK>{}));

  const int k_splits = a.k_splits > 1 ? a.k_splits : 1;
  if (k_splits > 1 && a.partial == nullptr) return cudaErrorInvalidValue;
  const bool vector_out = a.n % 8 == 0 && a.ldo % 8 == 0 &&
                          reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  SwapAbParams p{a.out, a.partial, a.offsets, a.a_scale, a.b_scale, a.a_mode, a.b_mode,
                 a.n, a.k, a.m_total, a.ldo, k_splits, a.num_experts, vector_out};
  auto kernel = &moe_gemm_swapab_sm90_kernel<Config, Element, decltype(tma_w), decltype(tma_x),
                                             kPromoteInterval>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Config::kSmemBytes);
  if (err != cudaSuccess) return err;
  // Units: the experts' token tiles (at most ceil(m_total / kBlockT) + min(E, m_total): each
  // expert with rows wastes at most one partial tile) x weight tiles x K splits.
  const int64_t tile_bound = (a.m_total + kBlockT - 1) / kBlockT +
                             std::min<int64_t>(a.num_experts, a.m_total);
  const int64_t unit_bound = tile_bound * ((a.n + kBlockN - 1) / kBlockN) * k_splits;
  const dim3 grid(unsigned(std::min<int64_t>(a.sm_count, unit_bound)));
  kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(p, tma_w, tma_x);
  err = cudaGetLastError();
  if (err != cudaSuccess || k_splits == 1) return err;
  constexpr int kReduceThreads = 256, kReduceRows = 8;
  dim3 reduce_grid((a.n + kReduceThreads - 1) / kReduceThreads,
                   unsigned((a.max_rows_per_expert + kReduceRows - 1) / kReduceRows),
                   unsigned(a.num_experts));
  moe_gemm_splitk_reduce_kernel<kReduceThreads, kReduceRows>
      <<<reduce_grid, kReduceThreads, 0, stream>>>(static_cast<cutlass::bfloat16_t*>(a.out),
                                                    a.ldo, a.partial, a.offsets, a.m_total,
                                                    a.n, k_splits);
  return cudaGetLastError();
}

// The instantiation for (dtype, token tile): every other template argument is the heuristic's
// config of that tile, so what the host logs is what runs.
template <heuristics::GemmDtype kDtype, int kBlockT>
cudaError_t moe_gemm_swapab_sm90(const MoeGemmArgs& args, cudaStream_t stream) {
  constexpr heuristics::GroupedGemmConfig c = heuristics::swapab_config(kDtype, kBlockT);
  using Element = std::conditional_t<kDtype == heuristics::GemmDtype::kBf16,
                                     cutlass::bfloat16_t, cutlass::float_e4m3_t>;
  using Config = SwapAbConfig<Element, c.block_n, kBlockT, c.block_k, c.stages, c.promote_interval>;
  static_assert(Config::kSmemBytes == c.smem_bytes,
                "the heuristic's shared-memory model is the kernel's SharedStorage");
  static_assert(c.block_k * sizeof(Element) == 128, "a k-tile is one 128-byte swizzle row");
  return launch_moe_gemm_swapab_sm90<Element, c.block_n, kBlockT, c.block_k, c.stages,
                                     c.promote_interval>(args, stream);
}

}  // namespace hopper_moe::gemm
