// FP8 (e4m3) quantization kernels: static (per-tensor or grouped scales), dynamic per-tensor,
// dynamic per-token and per-token-group. The expressions are those of the CPU definitions
// (csrc/cpu/quant.cpp) and give the same bytes.
//
// Shapes: input rows [num_rows, k] with row stride in_rs (elements), last dim contiguous; out
// rows [num_rows, k] e4m3 bytes with row stride out_rs. All row offsets are 64-bit.
// Vector path (kVec, host-checked): 16-byte input loads of kVecElems<T> elements and matching
// 4- or 8-byte fp8 stores; k (or group_size) is a multiple of kVecElems<T> and every row base
// is aligned for those widths. Otherwise the scalar path does one element per thread step.
//
// Work split:
//   scaled_quant / amax: 2-D grid, blockIdx.y walks rows, x walks vector units of a row; both
//     grid-stride. amax reduces per block and does one atomicMax per block.
//   per_token_quant: one block per row (grid-stride over rows); block max, then the row is
//     quantized in a second pass (re-read from L1/L2).
//   per_token_group_quant: 16 lanes per group, 16 groups per 256-thread block (grid-stride
//     over groups); the 16-lane max uses xor shuffles within half-warps, executed by every lane
//     of the block (inactive teams included) so the full-warp masks are valid.
#pragma once

#include <cstdint>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/moe/fp8_quant_utils.cuh"
#include "hopper_moe/moe/row_filter.cuh"

namespace hopper_moe::quant {

constexpr int kQuantThreads = 256;
constexpr int kGroupLanes = 16;
constexpr int kGroupsPerBlock = kQuantThreads / kGroupLanes;
static_assert(kQuantThreads % 32 == 0, "block reductions assume whole warps");
static_assert(32 % kGroupLanes == 0, "a group team must sit inside one warp");

// q = e4m3(clamp_e4m3(x * inv_scale)). Element (row, col) uses
// scale[(row / group_m) * stride_m + (col / group_n) * stride_n]; kPerTensor uses scale[0].
// kVec also requires group_n % kVecElems<T> == 0, so one vector never straddles two groups.
// Rows (row_filter.cuh): a row it rejects is neither read nor written.
template <typename T, bool kVec, bool kPerTensor, class Rows = AllRows>
__global__ void __launch_bounds__(kQuantThreads)
    scaled_quant_kernel(uint8_t* __restrict__ out, const T* __restrict__ input,
                        const float* __restrict__ scale, int64_t num_rows, int64_t k,
                        int64_t in_rs, int64_t out_rs, int64_t group_m, int64_t group_n,
                        int64_t stride_m, int64_t stride_n, Rows rows = Rows{}) {
  // A programmatic dependent launch (common/pdl.cuh's rule); a dependent GEMM may then stream
  // its weights meanwhile.
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  constexpr int N = kVec ? kVecElems<T> : 1;
  using InVec = Vec<T, N>;
  using OutVec = Vec<uint8_t, N>;
  float inv_tensor = 0.0f;
  if constexpr (kPerTensor) inv_tensor = 1.0f / scale[0];
  const int64_t num_units = k / N;
  const int64_t unit_begin = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t unit_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    if (!rows(row)) continue;
    const InVec* x = reinterpret_cast<const InVec*>(input + row * in_rs);
    OutVec* q = reinterpret_cast<OutVec*>(out + row * out_rs);
    const float* s_row = kPerTensor ? scale : scale + (row / group_m) * stride_m;
    for (int64_t u = unit_begin; u < num_units; u += unit_step) {
      const float inv_scale = kPerTensor ? inv_tensor : 1.0f / s_row[(u * N / group_n) * stride_n];
      const InVec v = x[u];
      OutVec o;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        o.v[i] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(v.v[i]) * inv_scale));
      }
      q[u] = o;
    }
  }
}

// *scale = kMinScale: the floor, and the start value of the atomic max below.
static __global__ void init_dynamic_scale_kernel(float* __restrict__ scale) {
  *scale = fp8::kMinScale;
}

// *scale = max(*scale, amax(|input|) / 448), NaN elements ignored (fmaxf).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kQuantThreads)
    amax_scale_kernel(float* __restrict__ scale, const T* __restrict__ input, int64_t num_rows,
                      int64_t k, int64_t in_rs) {
  __shared__ float smem[33];
  constexpr int N = kVec ? kVecElems<T> : 1;
  using InVec = Vec<T, N>;
  const int64_t num_units = k / N;
  const int64_t unit_begin = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t unit_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float a = 0.0f;
  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const InVec* x = reinterpret_cast<const InVec*>(input + row * in_rs);
    for (int64_t u = unit_begin; u < num_units; u += unit_step) {
      const InVec v = x[u];
#pragma unroll
      for (int i = 0; i < N; ++i) a = fmaxf(a, fabsf(static_cast<float>(v.v[i])));
    }
  }
  a = block_reduce_max(a, smem);
  // Division by 448 is monotonic, so the max of the quotients is the quotient of the max.
  if (threadIdx.x == 0) fp8::atomic_max_nonneg(scale, a / fp8::kE4M3Max);
}

// Dynamic per tensor in one block, for small tensors (the launcher's kSmallDynamicElems):
// *scale = max(kMinScale, amax(|input|) / 448) and q = e4m3(clamp_e4m3(x * (1 / *scale))), the
// values of the three-kernel path (init, amax, scaled_quant) in one launch. The second pass
// re-reads the input from L1/L2.
constexpr int kOneBlockThreads = 1024;
template <typename T, bool kVec>
__global__ void __launch_bounds__(kOneBlockThreads)
    dynamic_quant_one_block_kernel(uint8_t* __restrict__ out, float* __restrict__ scale,
                                   const T* __restrict__ input, int64_t num_rows, int64_t k,
                                   int64_t in_rs, int64_t out_rs) {
  __shared__ float smem[33];
  constexpr int N = kVec ? kVecElems<T> : 1;
  using InVec = Vec<T, N>;
  using OutVec = Vec<uint8_t, N>;
  // A programmatic dependent launch (common/pdl.cuh's rule); a dependent GEMM may then stream
  // its weights meanwhile.
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  // 32-bit unit indices: the launcher bounds the tensor far below 2^31 elements.
  const uint32_t num_units = static_cast<uint32_t>(k / N);
  const uint32_t total = static_cast<uint32_t>(num_rows) * num_units;
  float a = 0.0f;
#pragma unroll 4
  for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const uint32_t row = i / num_units, u = i - row * num_units;
    const InVec v = reinterpret_cast<const InVec*>(input + row * in_rs)[u];
#pragma unroll
    for (int j = 0; j < N; ++j) a = fmaxf(a, fabsf(static_cast<float>(v.v[j])));
  }
  a = block_reduce_max(a, smem);
  const float s = fmaxf(fp8::kMinScale, a / fp8::kE4M3Max);
  if (threadIdx.x == 0) *scale = s;
  const float inv_scale = 1.0f / s;
#pragma unroll 4
  for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const uint32_t row = i / num_units, u = i - row * num_units;
    const InVec v = reinterpret_cast<const InVec*>(input + row * in_rs)[u];
    OutVec o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      o.v[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(v.v[j]) * inv_scale));
    }
    reinterpret_cast<OutVec*>(out + row * out_rs)[u] = o;
  }
}

// Per row: s = max(min(amax, *scale_ub) / 448, kMinScale); scales[row] = s;
// q = e4m3(clamp_e4m3(x / s)).
// Rows (row_filter.cuh): a row it rejects is neither read nor written, its scale included.
template <typename T, bool kVec, class Rows = AllRows>
__global__ void __launch_bounds__(kQuantThreads)
    per_token_quant_kernel(uint8_t* __restrict__ out, float* __restrict__ scales,
                           const T* __restrict__ input, const float* __restrict__ scale_ub,
                           int64_t num_rows, int64_t k, int64_t in_rs, int64_t out_rs,
                           Rows rows = Rows{}) {
  __shared__ float smem[33];
  constexpr int N = kVec ? kVecElems<T> : 1;
  using InVec = Vec<T, N>;
  using OutVec = Vec<uint8_t, N>;
  const int64_t num_units = k / N;
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    if (!rows(row)) continue;  // the same for the whole block: its reduction stays whole
    const InVec* x = reinterpret_cast<const InVec*>(input + row * in_rs);
    OutVec* q = reinterpret_cast<OutVec*>(out + row * out_rs);
    float a = 0.0f;
    for (int64_t u = threadIdx.x; u < num_units; u += blockDim.x) {
      const InVec v = x[u];
#pragma unroll
      for (int i = 0; i < N; ++i) a = fmaxf(a, fabsf(static_cast<float>(v.v[i])));
    }
    a = block_reduce_max(a, smem);
    if (scale_ub != nullptr) a = fminf(a, *scale_ub);
    const float s = fmaxf(a / fp8::kE4M3Max, fp8::kMinScale);
    if (threadIdx.x == 0) scales[row] = s;
    for (int64_t u = threadIdx.x; u < num_units; u += blockDim.x) {
      const InVec v = x[u];
      OutVec o;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        o.v[i] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(v.v[i]) / s));
      }
      q[u] = o;
    }
  }
}

// Per group of group_size columns: s = max(eps, amax) * (1 / hi) (fp8::group_scale), rounded
// up to a power of two when kUe8m0; scales[row * s_rs + group * s_cs] = s;
// q = e4m3(clamp_range(x / s, lo, hi)).
// Rows (row_filter.cuh): the groups of a row it rejects are neither read nor written.
template <typename T, bool kVec, bool kUe8m0, class Rows = AllRows>
__global__ void __launch_bounds__(kQuantThreads)
    per_token_group_quant_kernel(uint8_t* __restrict__ out, float* __restrict__ scales,
                                 const T* __restrict__ input, int64_t num_groups,
                                 int64_t groups_per_row, int64_t group_size, int64_t in_rs,
                                 int64_t out_rs, int64_t s_rs, int64_t s_cs, float eps, float lo,
                                 float hi, Rows rows = Rows{}) {
  constexpr int N = kVec ? kVecElems<T> : 1;
  using InVec = Vec<T, N>;
  using OutVec = Vec<uint8_t, N>;
  const int team = threadIdx.x / kGroupLanes;
  const int lane = threadIdx.x % kGroupLanes;
  const int64_t num_units = group_size / N;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock; first < num_groups;
       first += static_cast<int64_t>(gridDim.x) * kGroupsPerBlock) {
    const int64_t group = first + team;
    const int64_t row = group < num_groups ? group / groups_per_row : 0;
    const bool active = group < num_groups && rows(row);
    const int64_t col_group = active ? group - row * groups_per_row : 0;
    const InVec* x = reinterpret_cast<const InVec*>(input + row * in_rs + col_group * group_size);
    float a = eps;
    if (active) {
      for (int64_t u = lane; u < num_units; u += kGroupLanes) {
        const InVec v = x[u];
#pragma unroll
        for (int i = 0; i < N; ++i) a = fmaxf(a, fabsf(static_cast<float>(v.v[i])));
      }
    }
#pragma unroll
    for (int offset = kGroupLanes / 2; offset > 0; offset >>= 1) {
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    }
    float s = fp8::group_scale(a, hi);
    if constexpr (kUe8m0) s = fp8::ue8m0_round_up(s);
    if (active) {
      if (lane == 0) scales[row * s_rs + col_group * s_cs] = s;
      OutVec* q = reinterpret_cast<OutVec*>(out + row * out_rs + col_group * group_size);
      for (int64_t u = lane; u < num_units; u += kGroupLanes) {
        const InVec v = x[u];
        OutVec o;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          o.v[i] = fp8::e4m3_bits(fp8::clamp_range(static_cast<float>(v.v[i]) / s, lo, hi));
        }
        q[u] = o;
      }
    }
  }
}

}  // namespace hopper_moe::quant
