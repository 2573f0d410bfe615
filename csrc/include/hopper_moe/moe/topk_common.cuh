// Device building blocks of the routing kernels (topk_gating.cuh, topk_grouped.cuh).
//
// Rank order. Every routing op picks experts in one strict total order: higher score first, a
// NaN score after every number (-inf included), equal scores by lower expert id. On the device
// a candidate is one uint64: rank_key(score) in the high word (an order-preserving map of the
// float, NaN -> 1, "not eligible" -> 0) and ~id in the low word, so "ranks before" is ">" and a
// warp arg-max is a max over uint64. The k-th pick is the largest candidate below the (k-1)-th,
// which needs no per-expert "taken" flags and works for any number of experts.
//
// Warps. One warp owns one token row at a time; every reduction is a butterfly
// (__shfl_xor_sync), so all 32 lanes end with the same value and may branch on it.
// Per-warp scratch rows hold the row's values between passes, one pad word every 32 words so
// lane-strided and group-strided accesses spread over the shared-memory banks.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "hopper_moe/moe/topk_math.cuh"

namespace hopper_moe::routing {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
// Rows of at most this many experts live in shared memory (4 warps x ~4.2 KB); longer rows use
// a global workspace of the same layout.
constexpr int kMaxSmemExperts = 1024;

// Words of one warp's scratch row for `n` values, and where value i lives in it.
HM_ROUTING_HD int64_t padded_words(int64_t n) { return n + n / 32 + 1; }
__device__ __forceinline__ int pad_index(int i) { return i + (i >> 5); }

// Order-preserving key of a float: a > b (as floats) <=> key(a) > key(b); -0 and +0 share a
// key; NaN gets 1, below every number (keys of numbers are >= 0x007fffff); 0 is "not eligible".
__device__ __forceinline__ uint32_t rank_key(float f) {
  if (f != f) return 1u;
  const uint32_t u = (f == 0.0f) ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t pack_candidate(uint32_t key, int id) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint64_t>(0xffffffffu - uint32_t(id));
}

__device__ __forceinline__ int candidate_id(uint64_t c) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(c));
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    const uint64_t o = __shfl_xor_sync(kFullMask, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// fmaxf ignores NaN, so the result is the largest non-NaN value (-inf if there is none).
__device__ __forceinline__ float warp_max_f32(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  }
  return v;
}

// Lane l holds the fp64 partial sum of the elements i = l, l+32, ... (in that order); the
// butterfly adds partner partials, p[l] + p[l ^ off], the order the CPU definition replays.
__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = v + __shfl_xor_sync(kFullMask, v, off);
  return v;
}

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  return static_cast<float>(v);
}

// Loads 16 bytes (kVec elements) as floats; kVec == 1 is a plain scalar load.
template <typename T, int kVec>
__device__ __forceinline__ void load_f32(const T* p, float (&v)[kVec]) {
  if constexpr (kVec == 1) {
    v[0] = to_f32(p[0]);
  } else {
    static_assert(kVec * sizeof(T) == 16, "vector loads are 16 bytes");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(T) == 4) {
        v[i] = __uint_as_float(w[i]);
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
        v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
      }
    }
  }
}

// Calls f(value, e) for every element e < n of a row, each exactly once, with lane-strided
// 16-byte loads (kVec > 1 needs n % kVec == 0 and a 16-byte aligned row: the host checks).
template <typename T, int kVec, class F>
__device__ __forceinline__ void for_each_in_row(const T* row, int n, int lane, F&& f) {
  for (int base = lane * kVec; base < n; base += kWarpSize * kVec) {
    float v[kVec];
    load_f32<T, kVec>(row + base, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f(v[i], base + i);
  }
}

// The dtype of a bias vector: fp32, fp16 or bf16, whatever the dtype of the scores it is added
// to (the checks say which pairs an op takes).
enum class BiasType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

__device__ __forceinline__ float bias_at(const void* bias, BiasType type, int e) {
  switch (type) {
    case BiasType::kF16:
      return to_f32(static_cast<const c10::Half*>(bias)[e]);
    case BiasType::kBF16:
      return to_f32(static_cast<const c10::BFloat16*>(bias)[e]);
    default:
      return static_cast<const float*>(bias)[e];
  }
}

}  // namespace hopper_moe::routing
