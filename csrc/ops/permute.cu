// CUDA launchers of the permutation family: moe_align_block_size, moe_permute (and
// moe_permute_with_scratch, moe_prepare_scatter), moe_unpermute, shuffle_rows (same semantics
// as vLLM's ops; the definitions are the loops in csrc/cpu/permute.cpp, which these reproduce
// bit for bit). Device code: hopper_moe/moe/
// align.cuh (the stable bucket sort) and permute.cuh (row gathers, weighted reduction).
//
// No launcher reads device data on the host: every data-dependent size (valid rows, padded
// total) is read by the kernels themselves, so every op here can be captured in a CUDA graph.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/moe/align.cuh"
#include "hopper_moe/moe/permute.cuh"
#include "hopper_moe/moe/sort_plan.h"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

namespace ad = align_detail;
namespace pd = permute_detail;

constexpr int kThreads = ad::kThreads;
// Grid-stride loops: never more blocks than this.
constexpr int64_t kMaxBlocks = 65536;
static_assert(sort_plan::kWarp == ad::kWarp, "the sort plan chunks by whole warps");

unsigned grid_for(int64_t work, int64_t per_block) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((work + per_block - 1) / per_block, 1, kMaxBlocks));
}

// Threads per row: the power of two >= units, capped at the block size.
int log2_threads_per_row(int64_t units) {
  int l = 0;
  while ((int64_t{1} << l) < units && (1 << l) < kThreads) ++l;
  return l;
}

bool aligned_to(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// The stable bucket sort of align.cuh: the small one-block path when it fits, else the five
// phase kernels over a workspace sized by shapes only (sort_plan.h): `scratch` when the caller
// passes one of at least sort_plan::plan(...).workspace_ints ints, 4-byte aligned, else a new
// one. epilogue_work bounds the index spaces the epilogue loops over (it sizes the phase-4
// grid).
template <class KeyFn, class PadFn, class Epilogue, class SlotFn>
void bucket_sort(const KeyFn& key, const PadFn& pad, const Epilogue& epi, const SlotFn& on_slot,
                 int64_t numel, int nb, int64_t epilogue_work, const at::Device& device,
                 cudaStream_t stream, const at::Tensor* scratch = nullptr) {
  if (numel <= ad::kSmallMaxSlots && nb <= ad::kSmallMaxBuckets) {
    C10_CUDA_CHECK(pdl::launch(ad::sort_small_kernel<KeyFn, PadFn, Epilogue, SlotFn>, dim3(1),
                               dim3(kThreads), ad::small_smem_bytes(nb), stream, key, pad, epi,
                               on_slot, numel, nb));
    return;
  }
  const sort_plan::Plan plan = sort_plan::plan(numel, nb);
  const int64_t chunk = plan.chunk;
  const int64_t num_chunks = plan.num_chunks;

  at::Tensor workspace;
  int* hist = nullptr;  // [nb][num_chunks]
  if (scratch != nullptr && scratch->nbytes() >= static_cast<size_t>(4 * plan.workspace_ints) &&
      aligned_to(scratch->data_ptr(), 4)) {
    hist = static_cast<int*>(scratch->data_ptr());
  } else {
    workspace = at::empty({plan.workspace_ints},
                          at::TensorOptions().dtype(at::kInt).device(device));
    hist = workspace.data_ptr<int>();
  }
  int* cnt = hist + num_chunks * nb;      // [nb]
  int* seg = cnt + nb;                    // [nb + 1]
  const unsigned warp_blocks = static_cast<unsigned>((num_chunks + ad::kWarps - 1) / ad::kWarps);

  ad::count_kernel<<<warp_blocks, kThreads, 0, stream>>>(key, hist, numel, chunk, num_chunks,
                                                         nb);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ad::chunk_scan_kernel<<<static_cast<unsigned>(nb), kThreads, 0, stream>>>(hist, cnt,
                                                                            num_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ad::bucket_scan_kernel<<<1, kThreads, 0, stream>>>(cnt, seg, nb, pad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ad::epilogue_kernel<<<grid_for(epilogue_work, kThreads), kThreads, 0, stream>>>(epi, cnt, seg,
                                                                                   nb);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ad::rank_kernel<<<warp_blocks, kThreads, 0, stream>>>(key, on_slot, hist, seg, numel, chunk,
                                                        num_chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Gathers num_rows rows of `out` from `in` as told by source(r) (a row index, kZeroRow or
// kSkipRow), in the widest copy unit that the row size, pointers and row strides allow.
template <class SourceFn>
void launch_gather(const SourceFn& source, const at::Tensor& in, at::Tensor& out,
                   int64_t num_rows, cudaStream_t stream) {
  const int64_t elt = out.element_size();
  const int64_t row_bytes = out.size(1) * elt;
  pd::GatherParams p{};
  p.in = static_cast<const char*>(in.data_ptr());
  p.out = static_cast<char*>(out.data_ptr());
  p.in_stride = in.stride(0) * elt;
  p.out_stride = out.stride(0) * elt;
  p.num_rows = num_rows;
  int64_t unit = 16;
  while (unit > 1 && !(row_bytes % unit == 0 && aligned_to(p.in, unit) &&
                       aligned_to(p.out, unit) && p.in_stride % unit == 0 &&
                       p.out_stride % unit == 0)) {
    unit /= 2;
  }
  p.units = row_bytes / unit;
  p.log2_tpr = log2_threads_per_row(p.units);
  const unsigned blocks = grid_for(num_rows, kThreads >> p.log2_tpr);
  // A programmatic dependent launch: it waits for the kernel before it (the sort's indices).
  const auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(pdl::launch(kernel, dim3(blocks), dim3(kThreads), 0, stream, source, p));
  };
  switch (unit) {
    case 16: launch(pd::gather_rows_kernel<uint4, SourceFn>); break;
    case 8: launch(pd::gather_rows_kernel<uint2, SourceFn>); break;
    case 4: launch(pd::gather_rows_kernel<uint32_t, SourceFn>); break;
    case 2: launch(pd::gather_rows_kernel<uint16_t, SourceFn>); break;
    default: launch(pd::gather_rows_kernel<uint8_t, SourceFn>); break;
  }
}

template <typename T>
void launch_unpermute(pd::UnpermuteParams p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorized = p.hidden % kVec == 0 && aligned_to(p.permuted, 16) &&
                          aligned_to(p.out, 16) && p.perm_stride % kVec == 0 &&
                          p.out_stride % kVec == 0;
  const int vec = vectorized ? kVec : 1;
  p.log2_tpr = log2_threads_per_row(p.hidden / vec);
  const unsigned blocks = grid_for(p.num_tokens, kThreads >> p.log2_tpr);
  // A programmatic dependent launch: its blocks wait (griddepcontrol) for the previous kernel,
  // so their launch overlaps that kernel's end.
  const auto kernel = vectorized ? pd::unpermute_kernel<T, kVec> : pd::unpermute_kernel<T, 1>;
  C10_CUDA_CHECK(pdl::launch(kernel, dim3(blocks), dim3(kThreads), 0, stream, p));
}

}  // namespace

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& experts_ids,
                          at::Tensor& num_tokens_post_pad, const OptTensor& maybe_expert_map,
                          const OptTensor& scatter_idx) {
  check::moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                              num_tokens_post_pad, maybe_expert_map, scatter_idx);
  const int64_t numel = topk_ids.numel();
  if (numel == 0) {
    sorted_token_ids.fill_(0);
    experts_ids.fill_(-1);
    num_tokens_post_pad.fill_(0);
    return;
  }

  c10::cuda::CUDAGuard guard(topk_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int nb = static_cast<int>(num_experts);
  const int32_t* map = maybe_expert_map ? maybe_expert_map->const_data_ptr<int32_t>() : nullptr;
  int32_t* sorted = sorted_token_ids.data_ptr<int32_t>();
  ad::PadToBlock pad{static_cast<int>(block_size)};
  ad::AlignEpilogue epi{};
  epi.sorted_token_ids = sorted;
  epi.experts_ids = experts_ids.data_ptr<int32_t>();
  epi.num_tokens_post_pad = num_tokens_post_pad.data_ptr<int32_t>();
  epi.sorted_len = sorted_token_ids.numel();
  epi.num_blocks = experts_ids.numel();
  epi.block_size = static_cast<int>(block_size);
  epi.num_experts = nb;
  epi.numel = static_cast<int32_t>(numel);
  ad::AlignSlot slot{sorted, scatter_idx ? scatter_idx->data_ptr<int32_t>() : nullptr};
  const int64_t epilogue_work = std::max({epi.sorted_len, epi.num_blocks, num_experts});

  if (topk_ids.scalar_type() == at::kInt) {
    ad::AlignKey<int32_t> key{topk_ids.const_data_ptr<int32_t>(), map, nb};
    bucket_sort(key, pad, epi, slot, numel, nb, epilogue_work, topk_ids.device(), stream);
  } else {
    ad::AlignKey<int64_t> key{topk_ids.const_data_ptr<int64_t>(), map, nb};
    bucket_sort(key, pad, epi, slot, numel, nb, epilogue_work, topk_ids.device(), stream);
  }
}

namespace {

// moe_permute's sort of the slots (keys: local expert, then the non-local in-range ids, then
// the rest): expert_first_token_offset, inv (slot -> row) and perm (row -> slot, perm_len
// entries, rows past the valid ones get the slot count). Needs slots > 0.
void sort_routing(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices,
                  const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert,
                  at::Tensor& expert_first_token_offset, at::Tensor& inv, int32_t* perm,
                  int64_t perm_len, const at::Tensor* scratch, cudaStream_t stream) {
  const int64_t slots = topk_ids.numel();
  const int n_local = static_cast<int>(n_local_expert);
  const int nb = static_cast<int>(n_local_expert + n_expert + 1);
  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  int64_t* offsets = expert_first_token_offset.data_ptr<int64_t>();
  pd::PermuteEpilogue epi{offsets, perm, perm_len, n_local, static_cast<int32_t>(slots)};
  pd::PermuteSlot slot{token_expert_indices.const_data_ptr<int32_t>(), perm,
                       inv.data_ptr<int32_t>(), n_local, static_cast<int32_t>(slots)};
  const int64_t epilogue_work = std::max<int64_t>(n_local_expert + 1, perm_len);
  const at::Device device = topk_ids.device();
  if (topk_ids.scalar_type() == at::kInt) {
    pd::PermuteKey<int32_t> key{topk_ids.const_data_ptr<int32_t>(), map,
                                static_cast<int>(n_expert), n_local};
    bucket_sort(key, ad::Identity{}, epi, slot, slots, nb, epilogue_work, device, stream,
                scratch);
  } else {
    pd::PermuteKey<int64_t> key{topk_ids.const_data_ptr<int64_t>(), map,
                                static_cast<int>(n_expert), n_local};
    bucket_sort(key, ad::Identity{}, epi, slot, slots, nb, epilogue_work, device, stream,
                scratch);
  }
}

// moe_permute after its checks; scratch: a sort workspace (or nullptr).
void permute_checked(const at::Tensor& input, const at::Tensor& topk_ids,
                     const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                     int64_t n_expert, int64_t n_local_expert, int64_t topk,
                     at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,
                     at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx,
                     const at::Tensor* scratch) {
  const int64_t slots = input.size(0) * topk;
  if (slots == 0) {
    expert_first_token_offset.fill_(0);
    permuted_idx.fill_(0);
    return;
  }

  c10::cuda::CUDAGuard guard(input.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int32_t* perm = permuted_idx.data_ptr<int32_t>();
  sort_routing(topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
               expert_first_token_offset, inv_permuted_idx, perm, permuted_idx.numel(), scratch,
               stream);

  if (input.size(1) == 0) return;
  pd::PermuteSource source{perm, expert_first_token_offset.const_data_ptr<int64_t>() +
                                     n_local_expert,
                           slots, topk};
  launch_gather(source, input, permuted_input, slots, stream);
}

}  // namespace

void moe_permute(const at::Tensor& input, const at::Tensor& topk_ids,
                 const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                 int64_t n_expert, int64_t n_local_expert, int64_t topk,
                 at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,
                 at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx) {
  check::moe_permute(input, topk_ids, token_expert_indices, expert_map, n_expert,
                     n_local_expert, topk, permuted_input, expert_first_token_offset,
                     inv_permuted_idx, permuted_idx);
  permute_checked(input, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                  topk, permuted_input, expert_first_token_offset, inv_permuted_idx,
                  permuted_idx, nullptr);
}

void moe_permute_with_scratch(const at::Tensor& input, const at::Tensor& topk_ids,
                              const at::Tensor& token_expert_indices,
                              const OptTensor& expert_map, int64_t n_expert,
                              int64_t n_local_expert, int64_t topk, at::Tensor& permuted_input,
                              at::Tensor& expert_first_token_offset,
                              at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx,
                              at::Tensor& sort_workspace, at::Tensor& permuted_experts_id,
                              at::Tensor& sorted_row_idx, at::Tensor& topk_ids_for_sort) {
  check::moe_permute_with_scratch(input, topk_ids, token_expert_indices, expert_map, n_expert,
                                  n_local_expert, topk, permuted_input,
                                  expert_first_token_offset, inv_permuted_idx, permuted_idx,
                                  sort_workspace, permuted_experts_id, sorted_row_idx,
                                  topk_ids_for_sort);
  permute_checked(input, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                  topk, permuted_input, expert_first_token_offset, inv_permuted_idx,
                  permuted_idx, &sort_workspace);
}

void moe_prepare_scatter(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices,
                         const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert,
                         at::Tensor& expert_first_token_offset, at::Tensor& scatter_idx,
                         at::Tensor& sort_workspace, at::Tensor& sorted_experts,
                         at::Tensor& sorted_rows, at::Tensor& topk_ids_for_sort) {
  check::moe_prepare_scatter(topk_ids, token_expert_indices, expert_map, n_expert,
                             n_local_expert, expert_first_token_offset, scatter_idx,
                             sort_workspace, sorted_experts, sorted_rows, topk_ids_for_sort);
  const int64_t slots = topk_ids.numel();
  if (slots == 0) {
    expert_first_token_offset.fill_(0);
    return;
  }
  c10::cuda::CUDAGuard guard(topk_ids.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // sorted_rows holds moe_permute's permuted_idx (row -> slot) of the first `slots` rows.
  sort_routing(topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
               expert_first_token_offset, scatter_idx, sorted_rows.data_ptr<int32_t>(), slots,
               &sort_workspace, stream);
}

void moe_unpermute(const at::Tensor& permuted_hidden_states, const at::Tensor& topk_weights,
                   const at::Tensor& inv_permuted_idx,
                   const OptTensor& expert_first_token_offset, int64_t topk,
                   at::Tensor& hidden_states) {
  check::moe_unpermute(permuted_hidden_states, topk_weights, inv_permuted_idx,
                       expert_first_token_offset, topk, hidden_states);
  const int64_t num_tokens = hidden_states.size(0);
  const int64_t hidden = hidden_states.size(1);
  if (num_tokens == 0 || hidden == 0) return;

  c10::cuda::CUDAGuard guard(hidden_states.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  pd::UnpermuteParams p{};
  p.permuted = permuted_hidden_states.data_ptr();
  p.out = hidden_states.data_ptr();
  p.weights = topk_weights.const_data_ptr<float>();
  p.inv = inv_permuted_idx.const_data_ptr<int32_t>();
  if (expert_first_token_offset) {
    const auto& o = *expert_first_token_offset;
    p.num_valid = o.const_data_ptr<int64_t>() + (o.numel() - 1);
  }
  p.perm_stride = permuted_hidden_states.stride(0);
  p.out_stride = hidden_states.stride(0);
  p.perm_rows = permuted_hidden_states.size(0);
  p.num_tokens = num_tokens;
  p.hidden = hidden;
  p.topk = static_cast<int>(topk);

  switch (hidden_states.scalar_type()) {
    case at::kFloat:
      launch_unpermute<float>(p, stream);
      break;
    case at::kHalf:
      launch_unpermute<c10::Half>(p, stream);
      break;
    case at::kBFloat16:
      launch_unpermute<c10::BFloat16>(p, stream);
      break;
    case at::kFloat8_e4m3fn:
      launch_unpermute<c10::Float8_e4m3fn>(p, stream);
      break;
    case at::kFloat8_e5m2:
      launch_unpermute<c10::Float8_e5m2>(p, stream);
      break;
    default:
      TORCH_CHECK(false, "hopper_moe::moe_unpermute: unexpected dtype ",
                  c10::toString(hidden_states.scalar_type()));
  }
}

void shuffle_rows(const at::Tensor& input_tensor, const at::Tensor& dst2src_map,
                  at::Tensor& output_tensor) {
  check::shuffle_rows(input_tensor, dst2src_map, output_tensor);
  const int64_t rows_out = output_tensor.size(0);
  if (rows_out == 0 || output_tensor.size(1) == 0) return;

  c10::cuda::CUDAGuard guard(output_tensor.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (dst2src_map.scalar_type() == at::kInt) {
    pd::ShuffleSource<int32_t> source{dst2src_map.const_data_ptr<int32_t>(),
                                      input_tensor.size(0)};
    launch_gather(source, input_tensor, output_tensor, rows_out, stream);
  } else {
    pd::ShuffleSource<int64_t> source{dst2src_map.const_data_ptr<int64_t>(),
                                      input_tensor.size(0)};
    launch_gather(source, input_tensor, output_tensor, rows_out, stream);
  }
}

}  // namespace hopper_moe::cuda
