// silu_and_mul and silu_and_mul_quant kernels.
//
// input rows are [gate (d) | up (d)] (row stride >= 2d); v = act::silu_and_mul_value<T>(gate[j],
// up[j]) (silu rounded to T, then the product rounded to T: vLLM's order, equal bit for bit to
// torch's F.silu(gate) * up on the GPU), stored as T (silu_and_mul) or quantized to e4m3 with
// the static per-tensor scale as clamp_e4m3(v * (1 / scale)) (silu_and_mul_quant: the static
// quantization of silu_and_mul's output, as vLLM's silu_and_mul_quant).
//
// Work split: a 2-D grid. blockIdx.y walks rows (grid-stride, gridDim.y <= 65535), the x
// dimension walks the d columns in units of one 16-byte input vector (kVec) or one element
// (scalar fallback), grid-stride as well, so any number of rows and any d work, and small
// batches still spread one row over several blocks. Row offsets are 64-bit.
// kVec requires (host-checked): d % kVecElems<T> == 0, input base and row stride 16-byte
// aligned, output base and row stride aligned to the output vector width.
#pragma once

#include <cstdint>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/moe/activation_math.cuh"
#include "hopper_moe/moe/fp8_quant_utils.cuh"

namespace hopper_moe::act {

constexpr int kSiluThreads = 256;

// OutT is T (silu_and_mul) or uint8_t holding e4m3 bytes (silu_and_mul_quant, kQuant).
template <typename T, typename OutT, bool kQuant, bool kVec>
__global__ void __launch_bounds__(kSiluThreads)
    silu_and_mul_kernel(OutT* __restrict__ out, const T* __restrict__ input,
                        const float* __restrict__ scale, int64_t num_rows, int64_t d,
                        int64_t in_row_stride, int64_t out_row_stride) {
  constexpr int N = kVec ? quant::kVecElems<T> : 1;
  using InVec = quant::Vec<T, N>;
  using OutVec = quant::Vec<OutT, N>;

  float inv_scale = 0.0f;
  if constexpr (kQuant) inv_scale = __fdiv_rn(1.0f, *scale);

  const int64_t num_units = d / N;  // exact: kVec implies d % N == 0
  const int64_t unit_begin = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t unit_step = static_cast<int64_t>(gridDim.x) * blockDim.x;

  for (int64_t row = blockIdx.y; row < num_rows; row += gridDim.y) {
    const T* gate = input + row * in_row_stride;
    const T* up = gate + d;
    OutT* out_row = out + row * out_row_stride;
    for (int64_t u = unit_begin; u < num_units; u += unit_step) {
      const InVec g = reinterpret_cast<const InVec*>(gate)[u];
      const InVec x = reinterpret_cast<const InVec*>(up)[u];
      OutVec o;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const float v =
            silu_and_mul_value<T>(static_cast<float>(g.v[i]), static_cast<float>(x.v[i]));
        if constexpr (kQuant) {
          o.v[i] = fp8::e4m3_bits_hw(fp8::clamp_e4m3(__fmul_rn(v, inv_scale)));
        } else {
          o.v[i] = static_cast<T>(v);
        }
      }
      reinterpret_cast<OutVec*>(out_row)[u] = o;
    }
  }
}

}  // namespace hopper_moe::act
