// Grouped expert GEMM for SM90, swap-AB mapping: C^T = W . X^T per expert (decode).
//
// At decode an expert sees a handful of tokens. A wgmma's A operand is always 64 rows, so the
// weight tile takes that side (kBlockN = 64 or 128 weight rows, 1 or 2 wgmma per k-step) and
// the tokens are the narrow N side (kBlockT = 8..256). Every expert's weights are then read
// once, by ceil(N / kBlockN) CTAs per token tile. The host picks kBlockT per launch from the
// rows the fullest expert is expected to get (heuristics/sm90.h), so a typical expert fits one
// token tile; one with more rows takes several, each streaming its weights again.
//
// CTA (blockIdx.x = weight tile n0, .y = token tile t0, .z = expert e * k_splits + K split):
// one warpgroup of 128 threads. An expert with no rows in this token tile returns before
// touching shared memory.
// K split (k_splits > 1, chosen by the host when the launch has too few CTAs to fill the SMs,
// e.g. two experts at decode): each CTA runs the k-tiles [split * per, (split + 1) * per) and
// writes its scaled fp32 partial tile to partial[split, row, n]; a second kernel adds the
// splits of every row an expert owns and writes out (rows no expert owns stay untouched).
// Pipeline: kStages shared-memory slots, each holding a weight tile (kBlockN x kBlockK) and a
// token tile (kBlockT x kBlockK), both K-major with the 128-byte swizzle wgmma reads.
//   full[s]  transaction barrier: one elected thread arms it with the slot's byte count and
//            issues the two TMA copies (cp.async.bulk.tensor) into slot s;
//   empty[s] 128 arrivals: the warpgroup's wgmma batch on slot s has retired.
// The producer keeps kStages k-tiles in flight ahead of the math; it refills slot s only
// after empty[s] completes. Out-of-range rows and K columns are zero-filled by TMA; rows that
// belong to the next expert or past N are computed and masked in the epilogue.
// FP8: the tensor core's accumulation is promoted into a separate fp32 register accumulator
// every kPromoteInterval k-tiles (0: never, for bf16), bounding the error at large K.
// Shared memory: kStages * (kBlockN + kBlockT) * kBlockK * sizeof(Element) + barriers.
// Epilogue: scales, conversion to bf16 and a predicated store of each accumulator element
// to out[row, n] (direct, not yet staged through shared memory).
// Registers: the accumulator is kBlockT fp32 per thread (twice for FP8), the reason the token
// tiles stop at 128 (bf16) and 64 (FP8). Status: see moe_gemm_sm90.h.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <type_traits>

#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe::gemm {

template <class Element, int kBlockN, int kBlockT, int kBlockK, int kStages, int kPromoteInterval>
struct SwapAbConfig {
  static_assert(kBlockN == 64 || kBlockN == 128, "the weight tile is one or two 64-row wgmma");
  static_assert(kBlockT % 8 == 0 && kBlockT >= 8 && kBlockT <= 256,
                "the token side is a wgmma N: a multiple of 8 up to 256");
  static_assert(kBlockK * sizeof(Element) % 128 == 0,
                "a k-tile spans whole 128-byte swizzle atoms");
  static_assert(kStages >= 2, "the pipeline needs at least two slots to overlap copy and math");

  using TileShape = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockT>, cute::Int<kBlockK>>;
  using SmemLayoutW = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kBlockN>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  using SmemLayoutX = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_K_SW128_Atom<Element>{},
      cute::make_shape(cute::Int<kBlockT>{}, cute::Int<kBlockK>{}, cute::Int<kStages>{})));
  using MmaAtom = decltype(cute::GMMA::ss_op_selector<Element, Element, float, TileShape,
                                                      cute::GMMA::Major::K,
                                                      cute::GMMA::Major::K>());
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}));
  static constexpr int kThreads = 128;
  static_assert(cute::size(TiledMma{}) == kThreads, "one warpgroup issues every wgmma");
  static_assert(kBlockN * kBlockT / kThreads * (kPromoteInterval > 0 ? 2 : 1) <= 128,
                "the fp32 accumulators (two with FP8 promotion) leave registers for the rest "
                "of the kernel: larger token tiles spill");

  // 128-byte-swizzled tiles repeat every 1024 bytes: TMA writes and wgmma descriptors (base
  // offset 0) agree only on 1024-byte aligned tiles.
  struct SharedStorage {
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutW>> w;
    alignas(1024) cute::ArrayEngine<Element, cute::cosize_v<SmemLayoutX>> x;
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
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
};

template <class Config, class Element, class TmaW, class TmaX, int kPromoteInterval>
__global__ void __launch_bounds__(Config::kThreads, 1)
    moe_gemm_swapab_sm90_kernel(SwapAbParams p, CUTLASS_GRID_CONSTANT TmaW const tma_w,
                                CUTLASS_GRID_CONSTANT TmaX const tma_x, int num_experts) {
  using namespace cute;
  using SharedStorage = typename Config::SharedStorage;
  constexpr int kBlockN = size<0>(typename Config::TileShape{});
  constexpr int kBlockT = size<1>(typename Config::TileShape{});
  constexpr int kBlockK = size<2>(typename Config::TileShape{});
  constexpr int kStages = size<2>(typename Config::SmemLayoutW{});

  // The expert's rows, clamped like the CPU definition: begin in [0, M], end in [begin, M].
  const int expert = blockIdx.z / p.k_splits;
  const int split = blockIdx.z % p.k_splits;
  const int64_t row_begin = cute::min(cute::max(p.offsets[expert], int64_t(0)), p.m_total);
  const int64_t rows =
      cute::min(cute::max(p.offsets[expert + 1], row_begin), p.m_total) - row_begin;
  const int t0 = blockIdx.y * kBlockT;
  const int n0 = blockIdx.x * kBlockN;
  if (t0 >= rows || n0 >= p.n) return;  // uniform over the CTA: no tokens here, no work

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  Tensor sW = make_tensor(make_smem_ptr(smem.w.begin()), typename Config::SmemLayoutW{});  // (BLK_N,BLK_K,PIPE)
  Tensor sX = make_tensor(make_smem_ptr(smem.x.begin()), typename Config::SmemLayoutX{});  // (BLK_T,BLK_K,PIPE)

  // Coordinate views of the whole operands, shifted to this CTA's first row. Rows are
  // int32 TMA coordinates: E*N and m_total stay below 2^31 (host check).
  Tensor mW = tma_w.get_tma_tensor(make_shape(num_experts * p.n, p.k));              // (E*N,K)
  Tensor mX = tma_x.get_tma_tensor(make_shape(int(p.m_total), p.k));                 // (M,K)
  Tensor gW = local_tile(domain_offset(make_coord(expert * p.n + n0, 0), mW),
                         make_shape(Int<kBlockN>{}, Int<kBlockK>{}), make_coord(0, _));  // (BLK_N,BLK_K,k)
  Tensor gX = local_tile(domain_offset(make_coord(int(row_begin) + t0, 0), mX),
                         make_shape(Int<kBlockT>{}, Int<kBlockK>{}), make_coord(0, _));  // (BLK_T,BLK_K,k)

  auto [tWgW, tWsW] = tma_partition(tma_w, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sW),
                                    group_modes<0, 2>(gW));  // (TMA,k), (TMA,PIPE)
  auto [tXgX, tXsX] = tma_partition(tma_x, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                    group_modes<0, 2>(gX));  // (TMA,k), (TMA,PIPE)

  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  const int warp = cutlass::canonical_warp_idx_sync();
  const bool elected = (warp == 0) && cute::elect_one_sync();
  if (elected) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&smem.full[s], 1);
      EmptyBarrier::init(&smem.empty[s], Config::kThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // This CTA's k-tiles [kt_begin, kt_end): all of K, or its split's share (may be empty,
  // then the partial tile is zero). Pipeline slots count from kt_begin.
  const int k_tiles = (p.k + kBlockK - 1) / kBlockK;
  const int per_split = (k_tiles + p.k_splits - 1) / p.k_splits;
  const int kt_begin = cute::min(split * per_split, k_tiles);
  const int kt_end = cute::min(kt_begin + per_split, k_tiles);
  int k_load = kt_begin;
  if (elected) {
    for (; k_load < kt_end && k_load - kt_begin < kStages; ++k_load) {
      const int slot = k_load - kt_begin;
      FullBarrier::arrive_and_expect_tx(&smem.full[slot], Config::kTxBytes);
      copy(tma_w.with(smem.full[slot]), tWgW(_, k_load), tWsW(_, slot));
      copy(tma_x.with(smem.full[slot]), tXgX(_, k_load), tXsX(_, slot));
    }
  }

  typename Config::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(threadIdx.x);
  Tensor tCsW = thr_mma.partition_A(sW);                  // (MMA,MMA_N,MMA_K,PIPE)
  Tensor tCsX = thr_mma.partition_B(sX);                  // (MMA,MMA_T,MMA_K,PIPE)
  Tensor tCrW = thr_mma.make_fragment_A(tCsW);            // wgmma descriptors
  Tensor tCrX = thr_mma.make_fragment_B(tCsX);
  Tensor cC = make_identity_tensor(make_shape(Int<kBlockN>{}, Int<kBlockT>{}));  // (BLK_N,BLK_T) -> (n,t)
  Tensor tCcC = thr_mma.partition_C(cC);                  // (MMA,MMA_N,MMA_T)
  Tensor acc = thr_mma.make_fragment_C(tCcC);             // fp32, what wgmma accumulates into
  clear(acc);
  // FP8 promotion: `total` holds the sum of the promoted partial accumulators.
  Tensor total = make_fragment_like(acc);
  clear(total);

  // read: the slot and full-barrier phase the math waits for next. write: the slot the
  // producer refills next and the empty-barrier phase that frees it; the first refill of
  // slot s waits for the first consumption of s (phase 0), so it starts at (0, 0) even though
  // the prologue already filled every slot once.
  auto read = cutlass::PipelineState<kStages>();
  auto write = cutlass::PipelineState<kStages>();

  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int slot = read.index();
    FullBarrier::wait(&smem.full[slot], read.phase());

    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    cute::gemm(mma, tCrW(_, _, _, slot), tCrX(_, _, _, slot), acc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);

    EmptyBarrier::arrive(&smem.empty[slot]);
    ++read;

    if constexpr (kPromoteInterval > 0) {
      if ((kt - kt_begin + 1) % kPromoteInterval == 0 || kt + 1 == kt_end) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc); ++i) {
          total(i) += acc(i);
          acc(i) = 0.0f;
        }
      }
    }

    if (elected && k_load < kt_end) {
      const int ws = write.index();
      EmptyBarrier::wait(&smem.empty[ws], write.phase());
      FullBarrier::arrive_and_expect_tx(&smem.full[ws], Config::kTxBytes);
      copy(tma_w.with(smem.full[ws]), tWgW(_, k_load), tWsW(_, ws));
      copy(tma_x.with(smem.full[ws]), tXgX(_, k_load), tXsX(_, ws));
      ++write;
      ++k_load;
    }
  }
  if constexpr (kPromoteInterval == 0) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) total(i) = acc(i);
  }

  // Epilogue: element (n, t) of the tile is out[row_begin + t0 + t, n0 + n] (with a K split:
  // partial[split, row, n], scaled, since the scales are the same for every split).
  auto* out = static_cast<cutlass::bfloat16_t*>(p.out);
  float* partial = p.partial + int64_t(split) * p.m_total * p.n;
  const float tensor_scale = (p.a_mode == ScaleMode::kPerTensor ? p.a_scale[0] : 1.0f) *
                             (p.b_mode == ScaleMode::kPerTensor ? p.b_scale[expert] : 1.0f);
  CUTE_UNROLL
  for (int i = 0; i < size(total); ++i) {
    const int n = n0 + get<0>(tCcC(i));
    const int t = t0 + get<1>(tCcC(i));
    if (n < p.n && t < rows) {
      const int64_t row = row_begin + t;
      float v = total(i) * tensor_scale;
      if (p.b_mode == ScaleMode::kPerRow) v *= p.b_scale[int64_t(expert) * p.n + n];
      if (p.a_mode == ScaleMode::kPerRow) v *= p.a_scale[row];
      if (p.k_splits > 1) {
        partial[row * p.n + n] = v;
      } else {
        out[row * p.ldo + n] = cutlass::bfloat16_t(v);
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

// Builds the TMA descriptors and launches one grid over (weight tiles, token tiles, experts x
// K splits), then, with a K split, the reduction of the partial tiles.
template <class Element, int kBlockN, int kBlockT, int kBlockK, int kStages, int kPromoteInterval>
cudaError_t launch_moe_gemm_swapab_sm90(const MoeGemmArgs& a, cudaStream_t stream) {
  using namespace cute;
  using Config = SwapAbConfig<Element, kBlockN, kBlockT, kBlockK, kStages, kPromoteInterval>;
  if (a.m_total == 0 || a.num_experts == 0 || a.n == 0) return cudaSuccess;

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
  SwapAbParams p{a.out, a.partial, a.offsets, a.a_scale, a.b_scale, a.a_mode, a.b_mode,
                 a.n, a.k, a.m_total, a.ldo, k_splits};
  auto kernel = &moe_gemm_swapab_sm90_kernel<Config, Element, decltype(tma_w), decltype(tma_x),
                                             kPromoteInterval>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Config::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t t_tiles = (a.max_rows_per_expert + kBlockT - 1) / kBlockT;
  dim3 grid((a.n + kBlockN - 1) / kBlockN, unsigned(t_tiles),
            unsigned(a.num_experts) * unsigned(k_splits));
  kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(p, tma_w, tma_x, a.num_experts);
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
