// CUDA launchers of the grouped-GEMM metadata ops (same semantics as vLLM's
// get_cutlass_moe_mm_data / get_cutlass_moe_mm_problem_sizes_from_expert_offsets; definitions
// in csrc/cpu/gemm_data.cpp, kernels in hopper_moe/moe/gemm_data.cuh).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

#include "hopper_moe/common/swap_ab.h"
#include "hopper_moe/moe/gemm_data.cuh"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

namespace detail = gemm_data_detail;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride loops cover the rest

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Bits needed to hold every key in [0, num_experts].
int key_bits(int64_t num_experts) {
  int bits = 1;
  while ((int64_t{1} << bits) <= num_experts) ++bits;
  return bits;
}

}  // namespace

void get_cutlass_moe_mm_data(const at::Tensor& topk_ids, at::Tensor& expert_offsets,
                             at::Tensor& problem_sizes1, at::Tensor& problem_sizes2,
                             at::Tensor& input_permutation, at::Tensor& output_permutation,
                             int64_t num_experts, int64_t n, int64_t k,
                             const OptTensor& blockscale_offsets, bool is_gated) {
  check::get_cutlass_moe_mm_data(topk_ids, expert_offsets, problem_sizes1, problem_sizes2,
                                 input_permutation, output_permutation, num_experts, n, k,
                                 blockscale_offsets, is_gated);
  // No empty-problem return: with 0 slots the offsets and problem sizes are still written
  // (by one small kernel; the sort and the permutation kernels are skipped).
  c10::cuda::CUDAGuard guard(topk_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int64_t num_slots = topk_ids.numel();
  // With blockscale_offsets (vLLM's FP4 layout) the sizes are never swapped.
  const bool swap_ab = !blockscale_offsets && num_slots <= kSwapAbMaxSlots;
  const auto n1 = static_cast<int32_t>(is_gated ? 2 * n : n);

  // Sort buffers: sizes depend on the shapes only (graph-capturable allocations).
  const auto i32 = topk_ids.options().dtype(at::kInt);
  at::Tensor keys_in, keys_out, slots_in, slots_out;
  if (num_slots > 0) {
    keys_in = at::empty({num_slots}, i32);
    keys_out = at::empty({num_slots}, i32);
    slots_in = at::empty({num_slots}, i32);
    slots_out = at::empty({num_slots}, i32);
    auto* kin = reinterpret_cast<uint32_t*>(keys_in.mutable_data_ptr<int32_t>());
    auto* kout = reinterpret_cast<uint32_t*>(keys_out.mutable_data_ptr<int32_t>());
    int32_t* sin = slots_in.mutable_data_ptr<int32_t>();
    int32_t* sout = slots_out.mutable_data_ptr<int32_t>();

    if (topk_ids.scalar_type() == at::kInt) {
      detail::build_sort_keys<<<grid_for(num_slots), kThreads, 0, stream>>>(
          topk_ids.const_data_ptr<int32_t>(), num_slots, num_experts, kin, sin);
    } else {
      detail::build_sort_keys<<<grid_for(num_slots), kThreads, 0, stream>>>(
          topk_ids.const_data_ptr<int64_t>(), num_slots, num_experts, kin, sin);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    const int end_bit = key_bits(num_experts);
    const int items = static_cast<int>(num_slots);  // check:: bounds it by 2^31 - 1
    size_t temp_bytes = 0;
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, kin, kout, sin, sout,
                                                   items, 0, end_bit, stream));
    at::Tensor temp =
        at::empty({static_cast<int64_t>(std::max<size_t>(temp_bytes, 1))},
                  topk_ids.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.mutable_data_ptr(), temp_bytes, kin,
                                                   kout, sin, sout, items, 0, end_bit, stream));
  }
  const uint32_t* sorted_keys =
      num_slots > 0 ? reinterpret_cast<const uint32_t*>(keys_out.const_data_ptr<int32_t>())
                    : nullptr;

  int32_t* ps1 = problem_sizes1.mutable_data_ptr<int32_t>();
  int32_t* ps2 = problem_sizes2.mutable_data_ptr<int32_t>();
  const auto n32 = static_cast<int32_t>(n);
  const auto k32 = static_cast<int32_t>(k);
  if (expert_offsets.scalar_type() == at::kInt) {
    detail::write_offsets_and_sizes<<<grid_for(num_experts + 1), kThreads, 0, stream>>>(
        sorted_keys, num_slots, num_experts, expert_offsets.mutable_data_ptr<int32_t>(), ps1,
        ps2, n1, n32, k32, swap_ab);
  } else {
    detail::write_offsets_and_sizes<<<grid_for(num_experts + 1), kThreads, 0, stream>>>(
        sorted_keys, num_slots, num_experts, expert_offsets.mutable_data_ptr<int64_t>(), ps1,
        ps2, n1, n32, k32, swap_ab);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (blockscale_offsets) {
    int32_t* b = blockscale_offsets->mutable_data_ptr<int32_t>();
    if (expert_offsets.scalar_type() == at::kInt) {
      detail::write_blockscale_offsets<<<1, 1, 0, stream>>>(
          expert_offsets.const_data_ptr<int32_t>(), num_experts, b);
    } else {
      detail::write_blockscale_offsets<<<1, 1, 0, stream>>>(
          expert_offsets.const_data_ptr<int64_t>(), num_experts, b);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  if (num_slots > 0) {
    detail::write_permutations<<<grid_for(num_slots), kThreads, 0, stream>>>(
        sorted_keys, slots_out.const_data_ptr<int32_t>(), num_slots, num_experts,
        topk_ids.size(1), input_permutation.mutable_data_ptr<int32_t>(),
        output_permutation.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
    const at::Tensor& expert_first_token_offset, at::Tensor& problem_sizes1,
    at::Tensor& problem_sizes2, int64_t n, int64_t k, bool swap_ab) {
  check::get_cutlass_moe_mm_problem_sizes_from_expert_offsets(
      expert_first_token_offset, problem_sizes1, problem_sizes2, n, k, swap_ab);
  const int64_t num_experts = problem_sizes1.size(0);
  if (num_experts == 0) return;

  c10::cuda::CUDAGuard guard(expert_first_token_offset.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  detail::sizes_from_expert_offsets<<<grid_for(num_experts), kThreads, 0, stream>>>(
      expert_first_token_offset.const_data_ptr<int64_t>(), num_experts,
      problem_sizes1.mutable_data_ptr<int32_t>(), problem_sizes2.mutable_data_ptr<int32_t>(),
      static_cast<int32_t>(n), static_cast<int32_t>(k), swap_ab);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hopper_moe::cuda
