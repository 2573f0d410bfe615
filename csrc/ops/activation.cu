// CUDA launchers of silu_and_mul and silu_and_mul_quant (kernels in
// hopper_moe/moe/activation_silu_and_mul.cuh). Results equal torch's F.silu(gate) * up on the GPU
// (and its static quantization) bit for bit; the CPU definitions evaluate exp with the CPU's
// exp, so they may differ from these by one rounding step on a few elements.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "hopper_moe/moe/activation_silu_and_mul.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "hopper_moe/moe/fp8_quant_utils.cuh"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

template <typename T, typename OutT, bool kQuant>
void launch_silu_and_mul(at::Tensor& result, const at::Tensor& input, const float* scale,
                         cudaStream_t stream) {
  const auto rows = quant::rows_view("silu_and_mul", input, "input");
  const int64_t d = rows.row_len / 2;
  constexpr int kN = quant::kVecElems<T>;
  const T* in = static_cast<const T*>(input.const_data_ptr());
  OutT* out = static_cast<OutT*>(result.data_ptr());
  // result is contiguous: its row stride is d.
  const bool vec = d % kN == 0 && quant::rows_aligned(in, rows.row_stride, sizeof(T), 16) &&
                   quant::rows_aligned(out, d, sizeof(OutT), kN * sizeof(OutT));
  const int64_t units = vec ? d / kN : d;
  const int64_t blocks_x = std::min<int64_t>((units + act::kSiluThreads - 1) / act::kSiluThreads,
                                             1024);
  const int64_t blocks_y = std::min<int64_t>(rows.num_rows, 65535);
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y));
  if (vec) {
    act::silu_and_mul_kernel<T, OutT, kQuant, true><<<grid, act::kSiluThreads, 0, stream>>>(
        out, in, scale, rows.num_rows, d, rows.row_stride, d);
  } else {
    act::silu_and_mul_kernel<T, OutT, kQuant, false><<<grid, act::kSiluThreads, 0, stream>>>(
        out, in, scale, rows.num_rows, d, rows.row_stride, d);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void silu_and_mul(at::Tensor& result, const at::Tensor& input) {
  check::silu_and_mul(result, input);
  if (result.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  HM_QUANT_DISPATCH_INPUT(input, "silu_and_mul", [&] {
    launch_silu_and_mul<scalar_t, scalar_t, false>(result, input, nullptr, stream);
  });
}

void silu_and_mul_quant(at::Tensor& result, const at::Tensor& input, const at::Tensor& scale) {
  check::silu_and_mul_quant(result, input, scale);
  if (result.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  HM_QUANT_DISPATCH_INPUT(input, "silu_and_mul_quant", [&] {
    launch_silu_and_mul<scalar_t, uint8_t, true>(result, input, scale.const_data_ptr<float>(),
                                                 stream);
  });
}

}  // namespace hopper_moe::cuda
