// CUDA launcher of moe_sum (same semantics as vLLM's moe_sum; definition in csrc/cpu/reduce.cpp).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "hopper_moe/moe/moe_sum.cuh"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

using moe_sum_detail::MoeSumParams;

constexpr int kThreads = 256;
// Grid-stride loop: enough blocks to fill the GPU many times over, never more.
constexpr int64_t kMaxBlocks = 65536;

template <typename scalar_t, typename id_t, bool kHasIds, int kVec>
void launch(const MoeSumParams& p, cudaStream_t stream) {
  const int64_t total = p.num_tokens * (p.hidden / kVec);
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  moe_sum_detail::moe_sum_kernel<scalar_t, id_t, kHasIds, kVec>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
}

template <typename scalar_t, typename id_t, bool kHasIds>
void launch_vec(const MoeSumParams& p, bool vectorized, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  if (vectorized) {
    launch<scalar_t, id_t, kHasIds, kVec>(p, stream);
  } else {
    launch<scalar_t, id_t, kHasIds, 1>(p, stream);
  }
}

template <typename scalar_t>
void launch_typed(const MoeSumParams& p, const OptTensor& topk_ids, bool vectorized,
                  cudaStream_t stream) {
  if (!topk_ids) {
    launch_vec<scalar_t, int32_t, false>(p, vectorized, stream);
  } else if (topk_ids->scalar_type() == at::kInt) {
    launch_vec<scalar_t, int32_t, true>(p, vectorized, stream);
  } else {
    launch_vec<scalar_t, int64_t, true>(p, vectorized, stream);
  }
}

// 16-byte chunks need a unit-stride hidden dimension, every row start of input and output
// 16-byte aligned and whole chunks.
bool can_vectorize(const at::Tensor& input, const at::Tensor& output) {
  const int64_t vec = 16 / input.element_size();
  auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  return input.stride(2) == 1 && aligned(input) && aligned(output) && input.size(2) % vec == 0 &&
         input.stride(0) % vec == 0 && input.stride(1) % vec == 0 &&
         output.stride(0) % vec == 0;
}

}  // namespace

void moe_sum(const at::Tensor& input, at::Tensor& output, const OptTensor& topk_ids,
             const OptTensor& expert_map) {
  check::moe_sum(input, output, topk_ids, expert_map);
  if (input.size(0) == 0 || input.size(2) == 0) return;

  c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  MoeSumParams p{};
  p.input = input.data_ptr();
  p.output = output.data_ptr();
  p.topk_ids = topk_ids ? topk_ids->data_ptr() : nullptr;
  p.expert_map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  p.map_size = expert_map ? expert_map->size(0) : 0;
  p.num_tokens = input.size(0);
  p.top_k = input.size(1);
  p.hidden = input.size(2);
  p.in_stride_t = input.stride(0);
  p.in_stride_k = input.stride(1);
  p.in_stride_h = input.stride(2);
  p.out_stride_t = output.stride(0);
  p.ids_stride_t = topk_ids ? topk_ids->stride(0) : 0;
  p.ids_stride_k = topk_ids ? topk_ids->stride(1) : 0;
  const bool vectorized = can_vectorize(input, output);

  switch (input.scalar_type()) {
    case at::kFloat:
      launch_typed<float>(p, topk_ids, vectorized, stream);
      break;
    case at::kHalf:
      launch_typed<c10::Half>(p, topk_ids, vectorized, stream);
      break;
    case at::kBFloat16:
      launch_typed<c10::BFloat16>(p, topk_ids, vectorized, stream);
      break;
    default:
      TORCH_CHECK(false, "hopper_moe::moe_sum: unreachable dtype");  // check:: rejects it
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace hopper_moe::cuda
