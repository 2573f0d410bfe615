// Grouped expert GEMM for SM90: the persistent, warp-specialized kernel that joins its parts.
//
// Two mappings of the same kernel (MoeGemmConfig::kSwapAB):
//   Swap-AB (decode): C^T = W . X^T per expert. An expert sees a handful of tokens and a
//   wgmma's A operand is always 64 rows, so the weight tile takes that side (kBlockN = 128
//   weight rows: one 64-row wgmma per consumer warpgroup, or 64 rows for a warpgroup pair) and
//   the tokens are the narrow N side (kBlockT = 16..128).
//   Standard (many tokens): C = X . W^T. The token tile takes the A side (kBlockT = 128 rows,
//   64 per consumer warpgroup) and the weight tile the N side (kBlockN = 256 bf16, 128 FP8).
// The host picks the mapping, tiles and K split per launch (heuristics/sm90.h,
// launch_moe_gemm_sm90.cuh).
//
// The parts, each in its own file with a fixed interface:
//   config_moe_gemm_sm90.cuh     MoeGemmConfig (tiles, ring, register split, SharedStorage),
//                                MoeGemmParams, MoeGemmUnit
//   tile_scheduler_moe_sm90.cuh  StaticPersistentScheduler: the units of the experts that have
//                                rows, CTA b taking b, b + gridDim.x, ... (next())
//   producer_moe_gemm_sm90.cuh   warpgroup 0 (setmaxnreg down to 40): one thread issues the
//                                TMA copies into a kStages ring (full[s] / empty[s] barriers);
//                                with a row gather the warpgroup copies the token rows
//                                (cp.async, one per thread)
//   consumer_moe_gemm_sm90.cuh   warpgroups 1-2 (setmaxnreg up to 232): wgmma from the ring,
//                                FP8 promotion, the warpgroup pair's hand-off
//   epilogue_moe_gemm_sm90.cuh   EpilogueStore / EpilogueSiluMul (compile-time types) and the
//                                driver: scales, split-K partials, staged coalesced stores
//   reduce_splitk_sm90.cuh       the K split's reduction kernel
//   launch_moe_gemm_sm90.cuh     TMA descriptors, params, grid, the launches
// Barriers: full[s] is armed by the producer with the slot's bytes (one arrival, plus one per
// producer thread with a row gather) and completed by TMA; empty[s] takes one arrival per
// thread of the slot's wgmma (kMmaThreads). Named barrier 1 orders the 256 consumer threads
// around the shared epilogue tile.
// Programmatic dependent launch: every CTA lets the next kernel start at once (one CTA per SM,
// all of this grid resident, so they never hold it back); the offsets are read before the
// wait for the previous kernel only with offsets_ready, the weights may always be.
// Shared memory: heuristics/sm90.h gemm_smem_bytes (rings, epilogue tile, barriers, prefix
// table). Registers: the accumulator is kTileA x kTileB / kMmaThreads fp32 per consumer
// thread (twice for FP8), at most 128.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>  // CUTLASS_GRID_CONSTANT

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/consumer_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/epilogue_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/producer_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/tile_scheduler_moe_sm90.cuh"

namespace hopper_moe::gemm {

template <class Config, class Epilogue, class Scheduler, class TmaA, class TmaB>
__global__ void __launch_bounds__(Config::kThreads, 1)
    moe_gemm_sm90_kernel(MoeGemmParams p, CUTLASS_GRID_CONSTANT TmaA const tma_a,
                         CUTLASS_GRID_CONSTANT TmaB const tma_b) {
  using SharedStorage = typename Config::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int warp = cutlass::canonical_warp_idx_sync();

  pdl::launch_dependents();
  if (!p.offsets_ready) pdl::wait_for_prerequisites();

  Scheduler::count_tiles(p, smem.tile_prefix);
  if (warp == 0 && cute::elect_one_sync()) {
    for (int s = 0; s < Config::kStages; ++s) {
      // The TMA arrival, and with a row gather one per producer thread.
      cutlass::arch::ClusterTransactionBarrier::init(
          &smem.full[s], p.gather != nullptr ? 1 + Config::kGatherThreads : 1);
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], Config::kMmaThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (warp == 0) Scheduler::scan_tiles(p, smem.tile_prefix, int(threadIdx.x % 32));
  __syncthreads();

  if (warp < Config::kProducerThreads / 32) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    produce_moe_gemm<Config, Epilogue, Scheduler>(p, smem, tma_a, tma_b);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
  // The tokens arrive after the producer's wait; the scales and the outputs are touched here.
  pdl::wait_for_prerequisites();
  consume_moe_gemm<Config, Epilogue, Scheduler>(p, smem);
}

}  // namespace hopper_moe::gemm
