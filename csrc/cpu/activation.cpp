// CPU definitions of silu_and_mul and silu_and_mul_quant.
//
// input rows are [gate (d) | up (d)]. silu_and_mul stores, in the input dtype T,
//     silu(gate) rounded to T, times up, rounded to T
// (vLLM's rounding order) computed by ATen's CPU silu and mul on the gate and up views of input:
// the result equals torch's F.silu(input[..., :d]) * input[..., d:] on the CPU bit for bit.
// (ATen's CPU silu evaluates exp with a vectorized exp on most elements and libm's expf on the
// rest, so the result of an element can depend on the layout and the thread count, exactly as
// torch's does.) silu_and_mul_quant is the static per-tensor quantization of that output:
// e4m3(clamp_e4m3(v * (1 / scale))). The CUDA kernels compute the same expressions with CUDA's
// expf, which may differ from the CPU's by an ulp.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::cpu {
namespace {

// result = silu(gate) * up in input's dtype; result has input's leading shape and d columns.
void silu_mul_into(at::Tensor& result, const at::Tensor& input) {
  const int64_t d = input.size(-1) / 2;
  const at::Tensor silu = at::silu(input.narrow(-1, 0, d));
  at::mul_out(result, silu, input.narrow(-1, d, d));
}

}  // namespace

void silu_and_mul(at::Tensor& result, const at::Tensor& input) {
  check::silu_and_mul(result, input);
  if (result.numel() == 0) return;
  silu_mul_into(result, input);
}

void silu_and_mul_quant(at::Tensor& result, const at::Tensor& input, const at::Tensor& scale) {
  check::silu_and_mul_quant(result, input, scale);
  if (result.numel() == 0) return;
  at::Tensor v = at::empty(result.sizes(), input.options());
  silu_mul_into(v, input);
  const float inv_scale = 1.0f / scale.item<float>();
  const int64_t n = v.numel();
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  HM_QUANT_DISPATCH_INPUT(v, "silu_and_mul_quant", [&] {
    const scalar_t* src = v.const_data_ptr<scalar_t>();
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        out[i] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(src[i]) * inv_scale));
      }
    });
  });
}

}  // namespace hopper_moe::cpu
