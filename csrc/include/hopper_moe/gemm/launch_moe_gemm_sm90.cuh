// Host launcher of the SM90 grouped GEMM: from MoeGemmArgs and a heuristic config to the TMA
// descriptors, the kernel's params, the persistent grid and the launches (the GEMM, then with
// a K split the reduction, both programmatic dependent launches unless args.pdl is false).
// The instantiation files (csrc/instantiations/, tools/generate_instantiations.py) include
// this header and instantiate moe_gemm_{swapab,swapab_pair,standard}_sm90.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/epilogue_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/kernel_moe_gemm_sm90.cuh"
#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/gemm/reduce_splitk_sm90.cuh"
#include "hopper_moe/gemm/tile_scheduler_moe_sm90.cuh"
#include "hopper_moe/heuristics/sm90.h"

namespace hopper_moe::gemm {

// The GEMM kernel with Epilogue over p, then (k_splits > 1) the reduction of its partials.
template <class Config, class Epilogue, class TmaA, class TmaB>
cudaError_t launch_moe_gemm_kernels(const MoeGemmArgs& a, const MoeGemmParams& p,
                                    const TmaA& tma_a, const TmaB& tma_b, int out_cols,
                                    cudaStream_t stream) {
  using Scheduler = StaticPersistentScheduler<Config>;
  auto kernel = &moe_gemm_sm90_kernel<Config, Epilogue, Scheduler, TmaA, TmaB>;
  // The shared-memory attribute is set once per kernel and device (one bit per device
  // index below 64; others set it on every launch): the call costs microseconds of host time.
  static std::atomic<uint64_t> smem_set{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (smem_set.load(std::memory_order_acquire) & bit) == 0) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Config::kSmemBytes);
    if (err != cudaSuccess) return err;
    smem_set.fetch_or(bit, std::memory_order_release);
  }
  // Units: the experts' token tiles (at most ceil(m_total / kBlockT) + min(E, m_total): each
  // expert with rows wastes at most one partial tile) x weight tiles x K splits.
  const int64_t tile_bound = (a.m_total + Config::kBlockT - 1) / Config::kBlockT +
                             std::min<int64_t>(a.num_experts, a.m_total);
  const int64_t unit_bound = tile_bound * p.n_tiles * p.k_splits;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(unsigned(std::min<int64_t>(a.grid, unit_bound)));
  launch.blockDim = dim3(Config::kThreads);
  launch.dynamicSmemBytes = Config::kSmemBytes;
  launch.stream = stream;
  cudaLaunchAttribute attr = pdl::programmatic_serialization(a.pdl);
  launch.attrs = &attr;
  launch.numAttrs = 1;
  err = cudaLaunchKernelEx(&launch, kernel, p, tma_a, tma_b);
  if (err != cudaSuccess || p.k_splits == 1) return err;
  launch.gridDim = dim3((out_cols + 8 * kReduceThreads - 1) / (8 * kReduceThreads),
                        unsigned((a.max_rows_per_expert + kReduceRows - 1) / kReduceRows),
                        unsigned(a.num_experts));
  launch.blockDim = dim3(kReduceThreads);
  launch.dynamicSmemBytes = 0;
  return cudaLaunchKernelEx(
      &launch, moe_gemm_splitk_reduce_kernel<kReduceThreads, kReduceRows, Epilogue::kSiluMul>,
      p);
}

// Builds the TMA descriptors and the params of config Config and launches the epilogue that
// args asks for (SiLU*mul or a plain store).
template <class Config>
cudaError_t launch_moe_gemm_sm90(const MoeGemmArgs& a, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Config::Element;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kBlockK = Config::kBlockK;
  if (a.m_total == 0 || a.num_experts == 0 || a.n == 0) return cudaSuccess;
  if (a.num_experts > heuristics::kMaxExperts || a.grid <= 0) return cudaErrorInvalidValue;
  if (a.silu_mul && (a.act_n <= 0 || 2 * int64_t(a.act_n) != a.n || a.out_fp16)) {
    return cudaErrorInvalidValue;
  }
  if (a.gather != nullptr &&
      (a.gather_div <= 0 || a.x_rows <= 0 || a.ldx * int64_t(sizeof(Element)) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(a.x) % 16 != 0)) {  // whole 16-byte copies
    return cudaErrorInvalidValue;
  }

  const auto* w_ptr = static_cast<const Element*>(a.w);
  const auto* x_ptr = static_cast<const Element*>(a.x);
  Tensor mW = make_tensor(make_gmem_ptr(w_ptr), make_shape(a.num_experts * a.n, a.k),
                          make_stride(int64_t(a.k), Int<1>{}));
  // With a row gather the descriptor spans x's own rows; the producer copies them itself.
  const int64_t x_rows = a.gather != nullptr ? std::max<int64_t>(a.x_rows, 1) : a.m_total;
  Tensor mX = make_tensor(make_gmem_ptr(x_ptr), make_shape(int(x_rows), a.k),
                          make_stride(a.ldx, Int<1>{}));
  auto tma_w = make_tma_atom(SM90_TMA_LOAD{}, mW, typename Config::SmemLayoutWBox{},
                             make_shape(Int<Config::kWeightBox>{}, Int<kBlockK>{}));
  auto tma_x = make_tma_atom(SM90_TMA_LOAD{}, mX, typename Config::SmemLayoutXStage{},
                             make_shape(Int<Config::kTileX>{}, Int<kBlockK>{}));
  auto tma_a = [&] { if constexpr (Config::kSwapAB) return tma_w; else return tma_x; }();
  auto tma_b = [&] { if constexpr (Config::kSwapAB) return tma_x; else return tma_w; }();

  const int k_splits = a.k_splits > 1 ? a.k_splits : 1;
  if (k_splits > 1 && a.partial == nullptr) return cudaErrorInvalidValue;
  const int out_cols = a.silu_mul ? a.act_n : a.n;
  const int tile_cols = a.silu_mul ? kBlockN / 2 : kBlockN;
  const int vector_bytes = a.silu_mul && a.out_scale != nullptr ? 8 : 16;
  MoeGemmParams p{};
  p.out = a.out;
  p.partial = a.partial;
  p.offsets = a.offsets;
  p.a_scale = a.a_scale;
  p.b_scale = a.b_scale;
  p.a_mode = a.a_mode;
  p.b_mode = a.b_mode;
  p.n = a.n;
  p.k = a.k;
  p.m_total = a.m_total;
  p.ldo = a.ldo;
  p.k_splits = k_splits;
  p.num_experts = a.num_experts;
  p.n_tiles = (out_cols + tile_cols - 1) / tile_cols;
  p.tile_cols = tile_cols;
  p.act_n = a.act_n;
  p.out_scale = a.silu_mul ? a.out_scale : nullptr;
  p.amax_scale = a.silu_mul && a.out_scale == nullptr ? a.amax_scale : nullptr;
  p.offsets_ready = a.offsets_ready;
  p.out_fp16 = a.out_fp16;
  p.vector_out = out_cols % 8 == 0 && a.ldo % 8 == 0 &&
                 reinterpret_cast<uintptr_t>(a.out) % vector_bytes == 0;
  p.gather = a.gather;
  p.gather_div = a.gather_div;
  p.x_gather = a.x;
  p.x_rows = a.gather != nullptr ? a.x_rows : a.m_total;
  p.ldx = a.ldx;
  p.weight_cache_hint = uint64_t(a.evict_first_weights ? TMA::CacheHintSm90::EVICT_FIRST
                                                       : TMA::CacheHintSm90::EVICT_NORMAL);
  if (a.silu_mul) {
    return launch_moe_gemm_kernels<Config, EpilogueSiluMul<Config>>(a, p, tma_a, tma_b,
                                                                     out_cols, stream);
  }
  return launch_moe_gemm_kernels<Config, EpilogueStore<Config>>(a, p, tma_a, tma_b, out_cols,
                                                                stream);
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
  return launch_moe_gemm_sm90<Config>(args, stream);
}

// Swap-AB with token tile kBlockT, its warpgroup pair, and the standard mapping (explicitly
// instantiated in csrc/instantiations/).
template <heuristics::GemmDtype kDtype, int kBlockT>
inline constexpr heuristics::GroupedGemmConfig kSwapAbConfig =
    heuristics::swapab_config(kDtype, kBlockT);
template <heuristics::GemmDtype kDtype, int kBlockT>
inline constexpr heuristics::GroupedGemmConfig kSwapAbPairConfig =
    heuristics::swapab_pair_config(kDtype, kBlockT);
template <heuristics::GemmDtype kDtype>
inline constexpr heuristics::GroupedGemmConfig kStandardConfig =
    heuristics::standard_config(kDtype);

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
