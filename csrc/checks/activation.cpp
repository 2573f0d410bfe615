// Validation of the activation ops (silu_and_mul, silu_and_mul_quant), shared by CPU and CUDA.
#include "hopper_moe/common/checks.h"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::check {
namespace {

// input [..., 2d] (last dim contiguous, rows with one stride), result [..., d] contiguous and
// disjoint from input, both on one device.
void check_gated_shapes(const char* op, const at::Tensor& result, const at::Tensor& input) {
  HM_CHECK_SAME_DEVICE(op, result, input);
  HM_CHECK(op, input.dim() >= 1, "input must have at least 1 dimension (got a 0-D tensor)");
  HM_CHECK(op, input.size(-1) % 2 == 0,
           "input.size(-1) must be even (gate and up halves of d each), got ", input.size(-1),
           " (shape ", input.sizes(), ")");
  quant::rows_view(op, input, "input");
  auto expected = input.sizes().vec();
  expected.back() /= 2;
  HM_CHECK(op, result.sizes() == at::IntArrayRef(expected),
           "result must have shape input.shape[:-1] + [input.size(-1) / 2] = ",
           at::IntArrayRef(expected), ", got ", result.sizes());
  HM_CHECK_CONTIGUOUS(op, result);
  HM_CHECK_NO_OVERLAP(op, result, input);
}

}  // namespace

void silu_and_mul(at::Tensor& result, const at::Tensor& input) {
  constexpr const char* kOp = "silu_and_mul";
  HM_CHECK_DTYPE(kOp, input, HM_FLOAT_DTYPES);
  HM_CHECK(kOp, result.scalar_type() == input.scalar_type(),
           "result must have the dtype of input (", c10::toString(input.scalar_type()),
           "), got ", c10::toString(result.scalar_type()));
  check_gated_shapes(kOp, result, input);
}

void silu_and_mul_quant(at::Tensor& result, const at::Tensor& input, const at::Tensor& scale) {
  constexpr const char* kOp = "silu_and_mul_quant";
  HM_CHECK_DTYPE(kOp, input, HM_FLOAT_DTYPES);
  HM_CHECK_DTYPE(kOp, result, at::kFloat8_e4m3fn);
  HM_CHECK_DTYPE(kOp, scale, at::kFloat);
  HM_CHECK_SAME_DEVICE(kOp, scale, input);
  HM_CHECK_NUMEL(kOp, scale, 1, "one static per-tensor scale");
  check_gated_shapes(kOp, result, input);
  HM_CHECK_NO_OVERLAP(kOp, result, scale);
}

}  // namespace hopper_moe::check
