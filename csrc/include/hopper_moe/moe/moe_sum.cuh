// moe_sum device kernel: output[t, :] = sum over the counting slots k of input[t, k, :].
//
// Work split: one thread per (token, chunk of kVec hidden elements), grid-stride over
// num_tokens * num_chunks. A chunk is 16 bytes (kVec = 16 / sizeof(scalar_t)) when the host
// proved the hidden dimension unit-stride, every row start 16-byte aligned and
// hidden_size % kVec == 0, else one element read through the hidden stride. Each
// thread reads the token's top_k ids itself (they sit in L1 after the first reader) and sums in
// fp32 in increasing k from +0.0f with one final rounding, exactly as the CPU definition does,
// so both devices agree bit for bit.
#pragma once

#include <cstdint>

namespace hopper_moe::moe_sum_detail {

struct MoeSumParams {
  const void* input;         // [num_tokens, top_k, hidden], element strides below
  void* output;              // [num_tokens, hidden], row stride below, unit column stride
  const void* topk_ids;      // [num_tokens, top_k], strides below, or nullptr (all slots count)
  const int32_t* expert_map; // [map_size] or nullptr
  int64_t map_size;
  int64_t num_tokens, top_k, hidden;
  int64_t in_stride_t, in_stride_k, in_stride_h, out_stride_t;  // in elements
  int64_t ids_stride_t, ids_stride_k;                           // in elements
};

// True when the slot whose id `id_ptr` points at takes part in the sum (see
// csrc/cpu/reduce.cpp).
template <typename id_t>
__device__ __forceinline__ bool slot_counts(const id_t* id_ptr, const int32_t* map,
                                            int64_t map_size) {
  const int64_t id = static_cast<int64_t>(*id_ptr);
  if (id < 0) return false;
  if (map == nullptr) return true;
  return id < map_size && map[id] >= 0;
}

template <typename scalar_t, int kVec>
struct alignas(sizeof(scalar_t) * kVec) VecOf {
  scalar_t v[kVec];
};

// id_t: int32_t or int64_t; kHasIds: topk_ids given. kVec: elements per chunk (1 or 16 bytes).
template <typename scalar_t, typename id_t, bool kHasIds, int kVec>
__global__ void __launch_bounds__(256) moe_sum_kernel(MoeSumParams p) {
  static_assert(kVec == 1 || sizeof(scalar_t) * kVec == 16,
                "a chunk is one element or one 16-byte vector");
  using Vec = VecOf<scalar_t, kVec>;
  const auto* in = static_cast<const scalar_t*>(p.input);
  auto* out = static_cast<scalar_t*>(p.output);
  const auto* ids = static_cast<const id_t*>(p.topk_ids);

  const int64_t num_chunks = p.hidden / kVec;
  const int64_t total = p.num_tokens * num_chunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t t = idx / num_chunks;
    const int64_t h = (idx - t * num_chunks) * kVec;
    float acc[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;

    // kVec > 1 implies in_stride_h == 1.
    const scalar_t* row = in + t * p.in_stride_t + h * p.in_stride_h;
    for (int64_t k = 0; k < p.top_k; ++k) {
      if constexpr (kHasIds) {
        const id_t* id_ptr = ids + t * p.ids_stride_t + k * p.ids_stride_k;
        if (!slot_counts(id_ptr, p.expert_map, p.map_size)) continue;
      }
      const Vec x = *reinterpret_cast<const Vec*>(row + k * p.in_stride_k);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += static_cast<float>(x.v[j]);
    }

    Vec y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) y.v[j] = static_cast<scalar_t>(acc[j]);
    *reinterpret_cast<Vec*>(out + t * p.out_stride_t + h) = y;
  }
}

}  // namespace hopper_moe::moe_sum_detail
