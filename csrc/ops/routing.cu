// CUDA launchers of the routing ops: topk_softmax, topk_sigmoid, grouped_topk.
// Semantics: csrc/cpu/routing.cpp (the kernels reproduce it bit for bit). Kernels:
// csrc/include/hopper_moe/moe/topk_gating.cuh, topk_grouped.cuh.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "hopper_moe/moe/topk_gating.cuh"
#include "hopper_moe/moe/topk_grouped.cuh"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

using routing::kMaxSmemExperts;
using routing::kThreadsPerBlock;
using routing::kWarpsPerBlock;

routing::BiasType bias_type_of(const at::Tensor& bias) {
  switch (bias.scalar_type()) {
    case at::kHalf:
      return routing::BiasType::kF16;
    case at::kBFloat16:
      return routing::BiasType::kBF16;
    default:
      return routing::BiasType::kF32;  // the checks allow no other dtype
  }
}

int multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks for `rows` rows, one warp per row at a time: enough for full occupancy (16 blocks of
// 4 warps per SM), fewer when a global workspace row per warp would exceed ~64 MB.
int64_t num_blocks(int64_t rows, int device, int64_t workspace_bytes_per_warp) {
  int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  blocks = std::min<int64_t>(blocks, int64_t(multiprocessor_count(device)) * 16);
  if (workspace_bytes_per_warp > 0) {
    const int64_t max_warps =
        std::max<int64_t>(kWarpsPerBlock, (int64_t(64) << 20) / workspace_bytes_per_warp);
    blocks = std::min<int64_t>(blocks, max_warps / kWarpsPerBlock);
  }
  return std::max<int64_t>(blocks, 1);
}

// 16-byte loads need every row start 16-byte aligned and whole vectors per row.
bool rows_allow_vector_loads(const at::Tensor& x) {
  const int64_t vec = 16 / x.element_size();
  return x.size(1) % vec == 0 && (x.size(0) <= 1 || x.stride(0) % vec == 0) &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
}

// Picks the kernel instantiation (vector loads or not, scratch in shared memory or global) and
// launches it. `kernel_for` maps (kVec, kSmem) to a kernel pointer.
template <typename Params, typename KernelFor>
void launch_rows(Params& params, const at::Tensor& x, int64_t rows, int64_t scratch_words,
                 KernelFor kernel_for) {
  const int device = x.get_device();
  const bool smem = x.size(1) <= kMaxSmemExperts;
  const bool vec = smem && rows_allow_vector_loads(x);
  const int64_t scratch_bytes = scratch_words * int64_t(sizeof(uint32_t));
  const int64_t blocks = num_blocks(rows, device, smem ? 0 : scratch_bytes);
  at::Tensor workspace;
  size_t smem_bytes = 0;
  params.scratch_words = scratch_words;
  if (smem) {
    smem_bytes = static_cast<size_t>(scratch_bytes * kWarpsPerBlock);
    params.workspace = nullptr;
  } else {
    workspace = at::empty({blocks * kWarpsPerBlock * scratch_words},
                          x.options().dtype(at::kInt));
    params.workspace = reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>());
  }
  auto stream = c10::cuda::getCurrentCUDAStream(device);
  auto kernel = kernel_for(vec, smem);
  kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, smem_bytes, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool kSigmoid>
void launch_gating(routing::TopkGatingParams& params, const at::Tensor& x, int64_t rows) {
  constexpr int kVec = 16 / sizeof(T);
  using Kernel = void (*)(const routing::TopkGatingParams);
  launch_rows(params, x, rows, routing::padded_words(x.size(1)), [](bool vec, bool smem) -> Kernel {
    if (!smem) return routing::topk_gating_kernel<T, kSigmoid, 1, false>;
    return vec ? routing::topk_gating_kernel<T, kSigmoid, kVec, true>
               : routing::topk_gating_kernel<T, kSigmoid, 1, true>;
  });
}

template <typename T, bool kSigmoid>
void launch_grouped(routing::GroupedTopkParams& params, const at::Tensor& x, int64_t rows,
                    int64_t n_group) {
  constexpr int kVec = 16 / sizeof(T);
  using Kernel = void (*)(const routing::GroupedTopkParams);
  launch_rows(params, x, rows, routing::padded_words(x.size(1)) + n_group,
              [](bool vec, bool smem) -> Kernel {
                if (!smem) return routing::grouped_topk_kernel<T, kSigmoid, 1, false>;
                return vec ? routing::grouped_topk_kernel<T, kSigmoid, kVec, true>
                           : routing::grouped_topk_kernel<T, kSigmoid, 1, true>;
              });
}

template <bool kSigmoid>
void topk_gating(at::Tensor& topk_weights, at::Tensor& topk_indices,
                 at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                 bool renormalize, const OptTensor& bias, double routed_scaling_factor,
                 const OptTensor& is_padding) {
  const int64_t num_tokens = gating_output.size(0);
  if (num_tokens == 0) return;

  c10::cuda::CUDAGuard guard(gating_output.device());
  routing::TopkGatingParams params{};
  params.gating = gating_output.data_ptr();
  params.row_stride = gating_output.stride(0);
  params.num_tokens = num_tokens;
  params.num_experts = static_cast<int>(gating_output.size(1));
  params.top_k = static_cast<int>(topk_weights.size(1));
  params.bias = bias ? bias->data_ptr() : nullptr;
  params.bias_type = bias ? bias_type_of(*bias) : routing::BiasType::kF32;
  params.is_padding = is_padding ? is_padding->data_ptr<bool>() : nullptr;
  params.weights = topk_weights.data_ptr<float>();
  params.indices = topk_indices.data_ptr();
  params.indices_are_64bit = topk_indices.element_size() == 8;
  params.token_expert_indices = token_expert_indices.data_ptr<int32_t>();
  params.renormalize = renormalize;
  params.apply_scale = kSigmoid;
  params.scale = static_cast<float>(routed_scaling_factor);

  switch (gating_output.scalar_type()) {
    case at::kFloat:
      launch_gating<float, kSigmoid>(params, gating_output, num_tokens);
      break;
    case at::kHalf:
      launch_gating<c10::Half, kSigmoid>(params, gating_output, num_tokens);
      break;
    case at::kBFloat16:
      launch_gating<c10::BFloat16, kSigmoid>(params, gating_output, num_tokens);
      break;
    default:
      TORCH_CHECK(false, "hopper_moe::topk_gating: unreachable dtype");  // the checks reject it
  }
}

}  // namespace

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, const OptTensor& is_padding) {
  check::topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
                      renormalize, bias, is_padding);
  topk_gating<false>(topk_weights, topk_indices, token_expert_indices, gating_output,
                     renormalize, bias, 1.0, is_padding);
}

void topk_sigmoid(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, double routed_scaling_factor,
                  const OptTensor& is_padding) {
  check::topk_sigmoid(topk_weights, topk_indices, token_expert_indices, gating_output,
                      renormalize, bias, routed_scaling_factor, is_padding);
  topk_gating<true>(topk_weights, topk_indices, token_expert_indices, gating_output,
                    renormalize, bias, routed_scaling_factor, is_padding);
}

std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, int64_t n_group,
                                                int64_t topk_group, int64_t topk,
                                                bool renormalize, double routed_scaling_factor,
                                                const at::Tensor& bias, int64_t scoring_func) {
  check::grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor,
                      bias, scoring_func);
  const int64_t num_tokens = scores.size(0);
  const int64_t num_experts = scores.size(1);
  at::Tensor weights = at::empty({num_tokens, topk}, scores.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({num_tokens, topk}, scores.options().dtype(at::kInt));
  if (num_tokens == 0) return {weights, ids};

  c10::cuda::CUDAGuard guard(scores.device());
  routing::GroupedTopkParams params{};
  params.scores = scores.data_ptr();
  params.row_stride = scores.stride(0);
  params.num_tokens = num_tokens;
  params.num_experts = static_cast<int>(num_experts);
  params.n_group = static_cast<int>(n_group);
  params.group_size = static_cast<int>(num_experts / n_group);
  int lanes_per_group = 1;
  while (n_group * lanes_per_group * 2 <= routing::kWarpSize) lanes_per_group *= 2;
  params.lanes_per_group = lanes_per_group;
  params.topk_group = static_cast<int>(topk_group);
  params.top_k = static_cast<int>(topk);
  params.bias = bias.data_ptr();
  params.bias_type = bias_type_of(bias);
  params.renormalize = renormalize;
  params.scale = static_cast<float>(routed_scaling_factor);
  params.weights = weights.data_ptr<float>();
  params.ids = ids.data_ptr<int32_t>();

  const bool sigmoid = scoring_func == 1;
  switch (scores.scalar_type()) {
    case at::kFloat:
      sigmoid ? launch_grouped<float, true>(params, scores, num_tokens, n_group)
              : launch_grouped<float, false>(params, scores, num_tokens, n_group);
      break;
    case at::kHalf:
      sigmoid ? launch_grouped<c10::Half, true>(params, scores, num_tokens, n_group)
              : launch_grouped<c10::Half, false>(params, scores, num_tokens, n_group);
      break;
    case at::kBFloat16:
      sigmoid ? launch_grouped<c10::BFloat16, true>(params, scores, num_tokens, n_group)
              : launch_grouped<c10::BFloat16, false>(params, scores, num_tokens, n_group);
      break;
    default:
      TORCH_CHECK(false, "hopper_moe::grouped_topk: unreachable dtype");  // the checks reject it
  }
  return {weights, ids};
}

}  // namespace hopper_moe::cuda
