// The producer role of the SM90 grouped GEMM: one elected thread of warpgroup 0 walks the
// CTA's units and their k-tiles and, per k-tile, waits for a free slot (empty[s]), arms
// full[s] with the slot's byte count and issues the TMA copies (cp.async.bulk.tensor) of the
// weight tile (two boxes of kBlockN / 2 rows, at the rows the epilogue names) and the token
// tile. With a row gather (MoeGemmParams::gather) the whole warpgroup walks them: the elected
// thread issues the weights' TMA and each thread copies one token row with cp.async
// (gather_tokens). It runs up to kStages k-tiles ahead of the math, across unit boundaries,
// so the next unit's weights arrive while the consumers run an epilogue.
//
// Programmatic dependent launch: with offsets_ready the first kStages weight tiles are
// requested before waiting for the previous kernel (they never depend on it), the token tiles
// after the wait. A prefetched slot's arrival comes with its token copy, so the consumers that
// wait on it are ordered after the wait too.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"

namespace hopper_moe::gemm {

// `first` if kFirst, else `second` (by reference: the descriptors stay in param space).
template <bool kFirst, class A, class B>
CUTLASS_DEVICE const auto& pick(const A& first, const B& second) {
  if constexpr (kFirst) return first; else return second;
}

// One 16-byte cp.async into shared memory, zero-filled when src_bytes is 0 (then nothing is
// read; src must still be a valid address).
CUTLASS_DEVICE void cp_async_16_zfill(void* smem_dst, const void* src, int src_bytes) {
  const uint32_t dst = cute::cast_smem_ptr_to_uint(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// The token tile of k-tile kt into slot s by the producer warpgroup (a row gather): thread l
// copies tile row l (src: its source row, null past the expert's end) as kVecsPerRow 16-byte
// pieces at their places in the 128-byte-swizzled stage (row r's piece v at byte
// r * 128 + ((v ^ (r % 8)) * 16): TMA's SWIZZLE_128B on a 1024-byte aligned tile, what wgmma
// reads), then arrives on full[s] when its copies have landed (cp.async.mbarrier.arrive.noinc:
// full[s] counts the kGatherThreads arrivals besides the TMA one). Rows past the expert's end
// and the K tail are zero-filled.
template <class Config>
CUTLASS_DEVICE void gather_tokens(const MoeGemmParams& p, typename Config::SharedStorage& smem,
                                  typename Config::Element* x_ring,
                                  const typename Config::Element* src, int row, int kt, int s) {
  using Element = typename Config::Element;
  constexpr int kTileX = Config::kTileX, kBlockK = Config::kBlockK;
  static_assert(kBlockK * sizeof(Element) == 128, "a stage row is one 128-byte swizzle row");
  if (row < kTileX) {
    char* const stage_row =
        reinterpret_cast<char*>(x_ring + s * kTileX * kBlockK) + row * 128;
    CUTE_UNROLL
    for (int v = 0; v < Config::kVecsPerRow; ++v) {
      const int k = kt * kBlockK + v * Config::kVecElems;
      const bool in = src != nullptr && k < p.k;
      cp_async_16_zfill(stage_row + ((v ^ (row % 8)) * 16),
                        in ? src + k : static_cast<const Element*>(p.x_gather), in ? 16 : 0);
    }
  }
  cutlass::arch::cpasync_barrier_arrive_noinc(&smem.full[s]);
}

// kGather: run by the whole producer warpgroup (leader: the one thread that issues TMA and arms
// the barriers); otherwise by one thread (leader).
template <class Config, class Epilogue, class Scheduler, bool kGather, class TmaA, class TmaB>
CUTLASS_DEVICE void produce_moe_gemm_loop(const MoeGemmParams& p,
                                          typename Config::SharedStorage& smem,
                                          const TmaA& tma_a, const TmaB& tma_b, bool leader) {
  using namespace cute;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  using Element = typename Config::Element;
  constexpr bool kSwapAB = Config::kSwapAB;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kBlockK = Config::kBlockK;
  constexpr int kStages = Config::kStages;
  constexpr int kWeightBox = Config::kWeightBox;
  constexpr int kTileX = Config::kTileX;
  constexpr uint32_t kTxBytes = kGather ? Config::kWeightTxBytes : Config::kTxBytes;

  if (leader) {
    cute::prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_b.get_tma_descriptor());
  }
  const auto& tma_w = pick<kSwapAB>(tma_a, tma_b);
  const auto& tma_x = pick<kSwapAB>(tma_b, tma_a);
  // Coordinate views of the whole operands: the weights (E*N,K) and the tokens (M,K). Rows are
  // int32 TMA coordinates: E*N and m_total stay below 2^31 (host check).
  Tensor mW = tma_w.get_tma_tensor(make_shape(p.num_experts * p.n, p.k));  // (E*N,K)
  Tensor mX = tma_x.get_tma_tensor(make_shape(int(p.m_total), p.k));       // (M,K)
  auto* const w_ring = kSwapAB ? smem.a.begin() : smem.b.begin();
  auto* const x_ring = kSwapAB ? smem.b.begin() : smem.a.begin();
  const auto copy_weights = [&](const MoeGemmUnit& u, int kt, int s) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = Epilogue::weight_box_row(p, u.n0, h);
      Tensor gW = local_tile(domain_offset(make_coord(u.expert * p.n + r, 0), mW),
                             make_shape(Int<kWeightBox>{}, Int<kBlockK>{}),
                             make_coord(0, kt));  // (BOX,BLK_K)
      Tensor sW = make_tensor(make_smem_ptr(w_ring + (s * kBlockN + h * kWeightBox) * kBlockK),
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

  // Phase 1 first: a fresh barrier counts its preceding phase as complete, so the first
  // kStages waits pass and the ring fills at once.
  MoeGemmUnit u;
  int prefetched = 0;
  if (p.offsets_ready) {
    cutlass::PipelineState<kStages> ahead(0, 1, 0);
    for (Scheduler sched(p, smem.tile_prefix); prefetched < kStages && sched.next(u);) {
      for (int kt = u.kt_begin; kt < u.kt_end && prefetched < kStages; ++kt, ++prefetched) {
        const int s = ahead.index();
        if (leader) {
          FullBarrier::expect_transaction(&smem.full[s], kTxBytes);  // arrives below
          copy_weights(u, kt, s);
        }
        ++ahead;
      }
    }
  }
  pdl::wait_for_prerequisites();
  const int gather_row = int(threadIdx.x) % Config::kGatherThreads;  // its tile row
  cutlass::PipelineState<kStages> write(0, 1, 0);
  int issued = 0;
  for (Scheduler sched(p, smem.tile_prefix); sched.next(u);) {
    // The gathered row's source for this unit (null: past the expert's end).
    const Element* src = nullptr;
    if constexpr (kGather) {
      const int t = u.t0 + gather_row;
      const int64_t row =
          gather_row < kTileX && t < u.rows ? x_source_row(p, u.row_begin + t) : -1;
      src = row >= 0 ? static_cast<const Element*>(p.x_gather) + row * p.ldx : nullptr;
    }
    for (int kt = u.kt_begin; kt < u.kt_end; ++kt, ++issued) {
      const int s = write.index();
      if (issued >= prefetched) {
        EmptyBarrier::wait(&smem.empty[s], write.phase());
        if (leader) {
          FullBarrier::arrive_and_expect_tx(&smem.full[s], kTxBytes);
          copy_weights(u, kt, s);
        }
      } else if (leader) {
        FullBarrier::arrive(&smem.full[s]);
      }
      if constexpr (kGather) {
        gather_tokens<Config>(p, smem, x_ring, src, gather_row, kt, s);
      } else {
        copy_tokens(u, kt, s);
      }
      ++write;
    }
  }
}

// The producer: called by the whole producer warpgroup. Without a gather one elected thread
// of warp 0 runs it (TMA for both operands); with one, the whole warpgroup (TMA for the
// weights by that thread, a token row by each thread).
template <class Config, class Epilogue, class Scheduler, class TmaA, class TmaB>
CUTLASS_DEVICE void produce_moe_gemm(const MoeGemmParams& p,
                                     typename Config::SharedStorage& smem, const TmaA& tma_a,
                                     const TmaB& tma_b) {
  const bool leader = cutlass::canonical_warp_idx_sync() == 0 && cute::elect_one_sync();
  if (p.gather != nullptr) {
    produce_moe_gemm_loop<Config, Epilogue, Scheduler, true>(p, smem, tma_a, tma_b, leader);
  } else if (leader) {
    produce_moe_gemm_loop<Config, Epilogue, Scheduler, false>(p, smem, tma_a, tma_b, true);
  }
}

}  // namespace hopper_moe::gemm
