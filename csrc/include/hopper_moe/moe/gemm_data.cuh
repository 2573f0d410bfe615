// Device kernels of the grouped-GEMM metadata ops (definitions in csrc/cpu/gemm_data.cpp).
//
// get_cutlass_moe_mm_data runs as a stable counting sort of the S = T*K slots by expert:
//   1. build_sort_keys: key[i] = topk_ids[i] if 0 <= id < E, else E (skipped slots sort last);
//      value[i] = i.
//   2. cub::DeviceRadixSort::SortPairs over the low bits that hold [0, E] (host side). A radix
//      sort is stable, so equal experts keep increasing slot order: the result is exactly the
//      CPU definition's order, with no atomics and no run-to-run variation.
//   3. write_offsets_and_sizes: one thread per expert e in [0, E]: expert_offsets[e] = number of
//      sorted keys < e (a binary search), m_e = offsets[e+1] - offsets[e], problem sizes.
//   4. write_permutations: one thread per sorted row p: the slot i sorted to p gives
//      input_permutation[p] = i / K and output_permutation[i] = p; rows p >= total (skipped
//      slots) give input_permutation[p] = -1 (no row: shuffle_rows writes zeros there) and
//      output_permutation[i] = total.
// Nothing reads data back to the host, and every buffer size depends only on S and E, so the op
// can be captured in a CUDA graph.
#pragma once

#include <cstdint>

namespace hopper_moe::gemm_data_detail {

// The number of the first `n` (sorted, ascending) keys that are < `value`.
__device__ __forceinline__ int64_t lower_bound(const uint32_t* keys, int64_t n, uint32_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ void write_problem_sizes(int32_t* ps1, int32_t* ps2, int64_t e,
                                                    int32_t m, int32_t n1, int32_t n, int32_t k,
                                                    bool swap_ab) {
  int32_t* p1 = ps1 + 3 * e;
  int32_t* p2 = ps2 + 3 * e;
  if (!swap_ab) {
    p1[0] = m, p1[1] = n1, p1[2] = k;
    p2[0] = m, p2[1] = k, p2[2] = n;
  } else {
    p1[0] = n1, p1[1] = m, p1[2] = k;
    p2[0] = k, p2[1] = m, p2[2] = n;
  }
}

template <typename id_t>
__global__ void build_sort_keys(const id_t* __restrict__ topk_ids, int64_t num_slots,
                                int64_t num_experts, uint32_t* __restrict__ keys,
                                int32_t* __restrict__ values) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_slots;
       i += stride) {
    const int64_t id = static_cast<int64_t>(topk_ids[i]);
    keys[i] = static_cast<uint32_t>((id >= 0 && id < num_experts) ? id : num_experts);
    values[i] = static_cast<int32_t>(i);
  }
}

// sorted_keys may be null when num_slots == 0 (every expert then gets m_e = 0).
template <typename offset_t>
__global__ void write_offsets_and_sizes(const uint32_t* __restrict__ sorted_keys,
                                        int64_t num_slots, int64_t num_experts,
                                        offset_t* __restrict__ expert_offsets,
                                        int32_t* __restrict__ ps1, int32_t* __restrict__ ps2,
                                        int32_t n1, int32_t n, int32_t k, bool swap_ab) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e <= num_experts; e += stride) {
    const int64_t first = lower_bound(sorted_keys, num_slots, static_cast<uint32_t>(e));
    expert_offsets[e] = static_cast<offset_t>(first);
    if (e < num_experts) {
      const int64_t last = lower_bound(sorted_keys, num_slots, static_cast<uint32_t>(e + 1));
      write_problem_sizes(ps1, ps2, e, static_cast<int32_t>(last - first), n1, n, k, swap_ab);
    }
  }
}

// vLLM's FP4 block-scale offsets: b[0] = 0, b[e + 1] = b[e] + m_e rounded up to 128. One
// thread (num_experts steps), after write_offsets_and_sizes.
template <typename offset_t>
__global__ void write_blockscale_offsets(const offset_t* __restrict__ expert_offsets,
                                         int64_t num_experts, int32_t* __restrict__ b) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t acc = 0;
  b[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    acc += (static_cast<int64_t>(expert_offsets[e + 1]) - expert_offsets[e] + 127) / 128 * 128;
    b[e + 1] = static_cast<int32_t>(acc);
  }
}

__global__ void write_permutations(const uint32_t* __restrict__ sorted_keys,
                                   const int32_t* __restrict__ sorted_slots, int64_t num_slots,
                                   int64_t num_experts, int64_t top_k,
                                   int32_t* __restrict__ input_permutation,
                                   int32_t* __restrict__ output_permutation) {
  // Rows [0, total) hold counting slots; every thread finds total itself (log2(S) loads).
  const int64_t total = lower_bound(sorted_keys, num_slots, static_cast<uint32_t>(num_experts));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < num_slots;
       p += stride) {
    const int32_t slot = sorted_slots[p];
    if (p < total) {
      input_permutation[p] = static_cast<int32_t>(slot / top_k);
      output_permutation[slot] = static_cast<int32_t>(p);
    } else {
      input_permutation[p] = -1;
      output_permutation[slot] = static_cast<int32_t>(total);
    }
  }
}

__global__ void sizes_from_expert_offsets(const int64_t* __restrict__ expert_first_token_offset,
                                          int64_t num_experts, int32_t* __restrict__ ps1,
                                          int32_t* __restrict__ ps2, int32_t n, int32_t k,
                                          bool swap_ab) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < num_experts;
       e += stride) {
    // Unsigned difference, then clamp: garbage offsets never give a negative or huge M.
    const auto diff = static_cast<int64_t>(static_cast<uint64_t>(expert_first_token_offset[e + 1]) -
                                           static_cast<uint64_t>(expert_first_token_offset[e]));
    const int64_t m = diff < 0 ? 0 : (diff > INT32_MAX ? INT32_MAX : diff);
    write_problem_sizes(ps1, ps2, e, static_cast<int32_t>(m), 2 * n, n, k, swap_ab);
  }
}

}  // namespace hopper_moe::gemm_data_detail
