// Device building blocks of the activation and FP8 quantization kernels: 16-byte vector
// types, max reductions, and the host-side test of whether the vector path may be used.
#pragma once

#include <cstdint>

#include "hopper_moe/common/fp8.cuh"

namespace hopper_moe::quant {

// N elements of T moved as one aligned access (16 bytes for the floating inputs, 4 or 8 bytes
// for the fp8 outputs).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements of T per 16-byte load.
template <typename T>
constexpr int kVecElems = static_cast<int>(16 / sizeof(T));

// True when every row of a [rows, row_len] view with the given base pointer and row stride
// (elements of elem_bytes) can be accessed with width-byte vectors: base and row stride are
// multiples of width. The caller also requires row_len (or group length) % (width/elem) == 0.
inline bool rows_aligned(const void* base, int64_t row_stride, int64_t elem_bytes,
                         int64_t width) {
  return reinterpret_cast<uintptr_t>(base) % width == 0 && (row_stride * elem_bytes) % width == 0;
}

#ifdef __CUDACC__

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Max over the block of non-negative values (fmaxf: NaN operands are ignored). Every thread of
// the block must call it; all get the result. smem holds 33 floats; the leading
// __syncthreads makes back-to-back calls with the same smem safe.
__device__ __forceinline__ float block_reduce_max(float v, float* smem) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = (blockDim.x + 31) / 32;
  v = warp_reduce_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < num_warps ? smem[lane] : 0.0f;
    w = warp_reduce_max(w);
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  return smem[32];
}

#endif  // __CUDACC__

}  // namespace hopper_moe::quant
