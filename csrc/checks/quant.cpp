// Validation of the FP8 quantization ops, shared by CPU and CUDA.
//
// Every op views input [..., K] as rows (hopper_moe/moe/fp8_quant_layout.cuh): last dimension
// contiguous, leading dimensions collapsing into one row stride. result / output_q have
// input's shape, dtype float8_e4m3fn, and may be row-strided the same way.
#include <cmath>
#include <limits>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::check {
namespace {

// input floating, out e4m3 of input's shape, both row views valid, one device.
void check_quant_io(const char* op, const at::Tensor& out, const char* out_name,
                    const at::Tensor& input) {
  HM_CHECK_DTYPE(op, input, HM_FLOAT_DTYPES);
  check_dtype_named(op, out, out_name, at::kFloat8_e4m3fn);
  check_same_device_named(op, out, out_name, input, "input");
  quant::rows_view(op, input, "input");
  check_same_shape_named(op, out, out_name, input, "input");
  quant::output_rows_view(op, out, out_name);
  check_no_overlap_named(op, out, out_name, input, "input");
}

void check_scale_f32(const char* op, const at::Tensor& scale, const char* name,
                     const at::Tensor& input) {
  check_dtype_named(op, scale, name, at::kFloat);
  check_same_device_named(op, scale, name, input, "input");
}

}  // namespace

void static_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                             const at::Tensor& scale, std::optional<at::IntArrayRef> group_shape) {
  constexpr const char* kOp = "static_scaled_fp8_quant";
  check_quant_io(kOp, result, "result", input);
  check_scale_f32(kOp, scale, "scale", input);
  const auto rows = quant::rows_view(kOp, input, "input");
  quant::resolve_static_groups(kOp, rows.num_rows, rows.row_len, scale, group_shape);
  check_no_overlap_named(kOp, result, "result", scale, "scale");
}

void fp8_quant_rows(at::Tensor& result, const at::Tensor& input, at::Tensor& scale,
                    c10::string_view kind, int64_t group_size, const OptTensor& slot_ids,
                    const OptTensor& expert_map, int64_t num_experts, const OptTensor& row_end) {
  constexpr const char* kOp = "fp8_quant_rows";
  const auto q = quant::parse_rows_quant(kOp, kind);
  check_quant_io(kOp, result, "result", input);
  check_scale_f32(kOp, scale, "scale", input);
  const auto rows = quant::rows_view(kOp, input, "input");
  if (q == quant::RowsQuant::kStaticTensor) {
    check_numel_named(kOp, scale, "scale", 1, "one per-tensor scale");
  } else if (q == quant::RowsQuant::kPerToken) {
    HM_CHECK(kOp, scale.dim() == 2 && scale.size(0) == rows.num_rows && scale.size(1) == 1,
             "scale must have shape [", rows.num_rows, ", 1] (one scale per row of input), got ",
             scale.sizes());
    check_contiguous_named(kOp, scale, "scale");
  } else {
    HM_CHECK(kOp, group_size >= 1 && rows.row_len % group_size == 0,
             "group_size must be >= 1 and divide the row length ", rows.row_len, " (got ",
             group_size, ")");
    const int64_t groups = rows.row_len / group_size;
    HM_CHECK(kOp, scale.dim() == 2 && scale.size(0) == rows.num_rows && scale.size(1) == groups,
             "scale must have shape [", rows.num_rows, ", ", groups,
             "] (one scale per row and group of group_size columns), got ", scale.sizes());
    check_contiguous_named(kOp, scale, "scale");
  }
  HM_CHECK(kOp, slot_ids.has_value() != row_end.has_value(),
           "exactly one of slot_ids and row_end must be given (got ",
           slot_ids.has_value() ? "both" : "neither", ")");
  if (slot_ids.has_value()) {
    HM_CHECK(kOp, slot_ids->scalar_type() == at::kInt || slot_ids->scalar_type() == at::kLong,
             "slot_ids must be int32 or int64, got ", slot_ids->scalar_type());
    check_same_device_named(kOp, *slot_ids, "slot_ids", input, "input");
    check_contiguous_named(kOp, *slot_ids, "slot_ids");
    check_numel_named(kOp, *slot_ids, "slot_ids", rows.num_rows, "one id per row of input");
    HM_CHECK(kOp, num_experts >= 0 && num_experts <= std::numeric_limits<int32_t>::max(),
             "num_experts must be in [0, 2^31-1] (got ", num_experts, ")");
    if (expert_map.has_value()) {
      check_dtype_named(kOp, *expert_map, "expert_map", at::kInt);
      check_same_device_named(kOp, *expert_map, "expert_map", input, "input");
      check_contiguous_named(kOp, *expert_map, "expert_map");
      check_numel_named(kOp, *expert_map, "expert_map", num_experts,
                        "one entry per expert id (num_experts)");
    }
  } else {
    HM_CHECK(kOp, !expert_map.has_value(), "expert_map is only taken with slot_ids");
    check_dtype_named(kOp, *row_end, "row_end", at::kLong);
    check_same_device_named(kOp, *row_end, "row_end", input, "input");
    check_numel_named(kOp, *row_end, "row_end", 1, "the number of leading rows that count");
  }
  const Named read_only[] = {{slot_ids, "slot_ids"}, {expert_map, "expert_map"},
                             {row_end, "row_end"}};
  if (q == quant::RowsQuant::kStaticTensor) {
    check_outputs_disjoint(kOp, {{result, "result"}},
                           {{scale, "scale"}, read_only[0], read_only[1], read_only[2]});
  } else {
    check_output_elements_distinct_named(kOp, scale, "scale");
    check_outputs_disjoint(kOp, {{result, "result"}, {scale, "scale"}},
                           {{input, "input"}, read_only[0], read_only[1], read_only[2]});
  }
}

void dynamic_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, at::Tensor& scale) {
  constexpr const char* kOp = "dynamic_scaled_fp8_quant";
  check_quant_io(kOp, result, "result", input);
  check_scale_f32(kOp, scale, "scale", input);
  // vLLM's op writes the first element of whatever scale it is given (its tests pass a
  // [num_tokens, 1] buffer), so any shape and strides with at least one element are accepted;
  // only scale.data_ptr() is written.
  HM_CHECK(kOp, scale.numel() >= 1,
           "scale must have at least 1 element (its first element receives the per-tensor "
           "scale this op computes), got shape ", scale.sizes());
  check_outputs_disjoint(kOp, {{result, "result"}, {scale, "scale"}}, {{input, "input"}});
}

void dynamic_per_token_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                                        at::Tensor& scale, const OptTensor& scale_ub) {
  constexpr const char* kOp = "dynamic_per_token_scaled_fp8_quant";
  check_quant_io(kOp, result, "result", input);
  check_scale_f32(kOp, scale, "scale", input);
  const auto rows = quant::rows_view(kOp, input, "input");
  HM_CHECK(kOp, scale.dim() >= 1 && scale.size(-1) == 1 && scale.numel() == rows.num_rows,
           "scale must have shape [num_tokens, 1] with num_tokens = ", rows.num_rows,
           " (one scale per row of input), got ", scale.sizes());
  HM_CHECK_CONTIGUOUS(kOp, scale);
  if (scale_ub.has_value()) {
    check_scale_f32(kOp, *scale_ub, "scale_ub", input);
    check_numel_named(kOp, *scale_ub, "scale_ub", 1, "one upper bound for the row amax");
  }
  check_outputs_disjoint(kOp, {{result, "result"}, {scale, "scale"}},
                         {{input, "input"}, {scale_ub, "scale_ub"}});
}

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q,
                               at::Tensor& output_s, int64_t group_size, double eps,
                               double fp8_min, double fp8_max, bool scale_ue8m0,
                               bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) {
  constexpr const char* kOp = "per_token_group_fp8_quant";
  (void)scale_ue8m0;
  (void)dummy_is_scale_transposed;  // the layout of output_s is read from its strides
  (void)dummy_is_tma_aligned;
  check_quant_io(kOp, output_q, "output_q", input);
  check_scale_f32(kOp, output_s, "output_s", input);
  HM_CHECK(kOp, group_size > 0, "group_size must be > 0, got ", group_size);
  const int64_t k = input.size(-1);
  HM_CHECK(kOp, k % group_size == 0, "input.size(-1) (", k, ") must be divisible by group_size (",
           group_size, ")");
  HM_CHECK(kOp, std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
  HM_CHECK(kOp, std::isfinite(fp8_max) && fp8_max > 0.0 && fp8_max <= fp8::kE4M3Max,
           "fp8_max must be in (0, 448], got ", fp8_max);
  HM_CHECK(kOp, std::isfinite(fp8_min) && fp8_min >= -fp8::kE4M3Max && fp8_min < fp8_max,
           "fp8_min must be in [-448, fp8_max), got ", fp8_min);
  auto expected = input.sizes().vec();
  expected.back() = k / group_size;
  HM_CHECK(kOp, output_s.sizes() == at::IntArrayRef(expected),
           "output_s must have shape input.shape[:-1] + [input.size(-1) / group_size] = ",
           at::IntArrayRef(expected), ", got ", output_s.sizes(), " (any strides)");
  quant::output_rows_view(kOp, output_s, "output_s", /*any_last_stride=*/true);
  check_outputs_disjoint(kOp, {{output_q, "output_q"}, {output_s, "output_s"}},
                         {{input, "input"}});
}

}  // namespace hopper_moe::check
