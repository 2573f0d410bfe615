// SCAFFOLD: replaced by the quant implementation.
#include "ops.h"

namespace hopper_moe::check {

void static_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, const at::Tensor& scale, std::optional<at::IntArrayRef> group_shape) { TORCH_CHECK(false, "hopper_moe::static_scaled_fp8_quant: not built yet"); }

void dynamic_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, at::Tensor& scale) { TORCH_CHECK(false, "hopper_moe::dynamic_scaled_fp8_quant: not built yet"); }

void dynamic_per_token_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, at::Tensor& scale, const OptTensor& scale_ub) { TORCH_CHECK(false, "hopper_moe::dynamic_per_token_scaled_fp8_quant: not built yet"); }

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q, at::Tensor& output_s, int64_t group_size, double eps, double fp8_min, double fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) { TORCH_CHECK(false, "hopper_moe::per_token_group_fp8_quant: not built yet"); }

}
