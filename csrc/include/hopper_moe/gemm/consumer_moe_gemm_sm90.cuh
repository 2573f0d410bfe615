// The consumer role of the SM90 grouped GEMM: warpgroups 1-2. Per unit each issues the wgmma
// of its 64 rows of the A tile x the whole B tile from shared memory and keeps one k-tile's
// batch in flight: after issuing k-tile i it waits for i - 1's and releases that slot
// (empty[s], kMmaThreads arrivals). FP8: the tensor core's accumulation is promoted into a
// separate fp32 register accumulator every kPromoteInterval k-tiles (waiting for every batch
// there), bounding the error at large K. Then the unit's tile goes to the epilogue.
//
// Warpgroup pair (Config::kPair): both warpgroups multiply the same 64-row weight tile, each
// over the k-tiles whose place in the CTA's sequence (over all of its units) has its parity;
// a slot is consumed by one warpgroup, and the second hands its fp32 sums to the first through
// the epilogue tile before the epilogue.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/epilogue_moe_gemm_sm90.cuh"

namespace hopper_moe::gemm {

template <class Config, class Epilogue, class Scheduler>
CUTLASS_DEVICE void consume_moe_gemm(const MoeGemmParams& p,
                                     typename Config::SharedStorage& smem) {
  using namespace cute;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kPromoteInterval = Config::kPromoteInterval;

  const int ct = int(threadIdx.x) - Config::kProducerThreads;  // 0..255
  [[maybe_unused]] const int wg = ct / 128;                    // consumer warpgroup
  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()),
                          typename Config::SmemLayoutA{});  // (TILE_A,BLK_K,PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()),
                          typename Config::SmemLayoutB{});  // (TILE_B,BLK_K,PIPE)
  typename Config::TiledMma mma;
  ThrMMA thr_mma = mma.get_thread_slice(Config::kPair ? ct % 128 : ct);
  Tensor tCsA = thr_mma.partition_A(sA);        // (MMA,MMA_M,MMA_K,PIPE)
  Tensor tCsB = thr_mma.partition_B(sB);        // (MMA,MMA_N,MMA_K,PIPE)
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);  // wgmma descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor cC = make_identity_tensor(make_shape(Int<Config::kTileA>{},
                                              Int<Config::kTileB>{}));  // (TILE_A,TILE_B)
  Tensor tCcC = thr_mma.partition_C(cC);                                // (MMA,MMA_M,MMA_N)
  // The tile coordinates of accumulator element i: weight row n and token row t.
  const auto tile_nt = [&](int i) {
    const int a = get<0>(tCcC(i)), b = get<1>(tCcC(i));
    return Config::kSwapAB ? TileCoord{a, b} : TileCoord{b, a};
  };
  Tensor acc = thr_mma.make_fragment_C(tCcC);  // fp32, what wgmma accumulates into
  Tensor total = make_fragment_like(acc);      // FP8: the sum of promoted partials

  cutlass::PipelineState<Config::kStages> read;  // (slot 0, phase 0)
  [[maybe_unused]] int64_t seq = 0;  // a pair: k-tiles of the CTA's units so far
  MoeGemmUnit u;
  for (Scheduler sched(p, smem.tile_prefix); sched.next(u);) {
    clear(acc);
    if constexpr (kPromoteInterval > 0) clear(total);

    // One wgmma batch in flight: after issuing k-tile kt, wait for the previous one's batch
    // and free its slot (in_flight); at an FP8 promotion, wait for both and free both.
    int in_flight = -1;
    [[maybe_unused]] int own = 0;  // a pair: k-tiles of the unit this warpgroup has issued
    // A pair's warpgroup visits only its own k-tiles (every other one, from the first whose
    // place in the sequence has its parity) and steps over the other's slots, so no
    // iteration goes without a wgmma batch: a loop over every k-tile that skipped the other's
    // makes ptxas serialize the wgmma (C7515, which tools/check_ptxas.py rejects).
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
      // Gathered token rows were written by cp.async (the generic proxy); wgmma reads through
      // the async proxy.
      if (p.gather != nullptr) cutlass::arch::fence_view_async_shared();
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
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, Config::kEpilogueBarrier);
      if (wg == 1) {
        CUTE_UNROLL
        for (int i = 0; i < size(total); ++i) sums[i * 128 + ct - 128] = total(i);
      }
      cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, Config::kEpilogueBarrier);
      if (wg == 0) {
        CUTE_UNROLL
        for (int i = 0; i < size(total); ++i) total(i) += sums[i * 128 + ct];
      }
    }
    epilogue_moe_gemm<Config, Epilogue>(p, u, total, tile_nt, holds_tile, smem.c, ct);
  }
}

}  // namespace hopper_moe::gemm
