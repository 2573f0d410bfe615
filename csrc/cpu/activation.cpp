// CPU definitions of silu_and_mul and silu_and_mul_quant (the semantics the CUDA kernels are
// tested against, bit for bit).
//
// input rows are [gate (d) | up (d)]; v = silu(gate) * up in fp32 with act::silu_mul_f32 (the
// same function the kernels call). silu_and_mul rounds v once to the input dtype;
// silu_and_mul_quant stores e4m3(clamp_e4m3(v * (1 / scale))).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/moe/activation_math.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::cpu {
namespace {

// Calls f(v, out_row, j) for every output element, v = silu(gate[j]) * up[j] in fp32.
template <typename T, typename OutT, typename F>
void for_each_silu_mul(const at::Tensor& input, at::Tensor& result, F f) {
  const auto rows = quant::rows_view("silu_and_mul", input, "input");
  const int64_t d = rows.row_len / 2;
  const T* in = input.const_data_ptr<T>();
  OutT* out = static_cast<OutT*>(result.data_ptr());
  at::parallel_for(0, rows.num_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * rows.row_stride;
      const T* up = gate + d;
      OutT* out_row = out + r * d;
      for (int64_t j = 0; j < d; ++j) {
        f(act::silu_mul_f32(static_cast<float>(gate[j]), static_cast<float>(up[j])), out_row, j);
      }
    }
  });
}

}  // namespace

void silu_and_mul(at::Tensor& result, const at::Tensor& input) {
  check::silu_and_mul(result, input);
  if (result.numel() == 0) return;
  HM_QUANT_DISPATCH_INPUT(input, "silu_and_mul", [&] {
    for_each_silu_mul<scalar_t, scalar_t>(input, result, [](float v, scalar_t* o, int64_t j) {
      o[j] = static_cast<scalar_t>(v);
    });
  });
}

void silu_and_mul_quant(at::Tensor& result, const at::Tensor& input, const at::Tensor& scale) {
  check::silu_and_mul_quant(result, input, scale);
  if (result.numel() == 0) return;
  const float inv_scale = 1.0f / scale.item<float>();
  HM_QUANT_DISPATCH_INPUT(input, "silu_and_mul_quant", [&] {
    for_each_silu_mul<scalar_t, uint8_t>(input, result, [=](float v, uint8_t* o, int64_t j) {
      o[j] = fp8::e4m3_bits_host(fp8::clamp_e4m3(v * inv_scale));
    });
  });
}

}  // namespace hopper_moe::cpu
