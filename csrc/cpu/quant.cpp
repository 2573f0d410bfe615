// CPU definitions of the FP8 quantization ops (the semantics the CUDA kernels are tested
// against, bit for bit). Same semantics as vLLM's ops of the same names, all in fp32:
//
//   static_scaled_fp8_quant      q = e4m3(clamp_e4m3(x * (1 / scale[group of (m, n)])))
//   dynamic_scaled_fp8_quant     s = max(amax(|x|) / 448, 1/(448*512)), written to the first
//                                element of scale (any shape with >= 1 element);
//                                q = e4m3(clamp_e4m3(x * (1 / s)))
//   dynamic_per_token_...        per row: a = amax(|row|), a = min(a, scale_ub) when given,
//                                s = max(a / 448, 1/(448*512));  q = e4m3(clamp_e4m3(x / s))
//   per_token_group_fp8_quant    per group of group_size columns: a = max(eps, amax(|group|)),
//                                s = a * (1 / fp8_max), s = 2^ceil(log2(max(s, 1e-10))) if ue8m0;
//                                q = e4m3(clamp_range(x / s, fp8_min, fp8_max))
//
// amax folds with fmaxf from 0 (eps for groups), so NaN elements are ignored by the scale;
// +-inf gives an infinite scale. clamp_e4m3 sends NaN to +448, clamp_range to fp8_min
// (hopper_moe/common/fp8.cuh).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::cpu {
namespace {

template <typename T>
float row_amax(const T* x, int64_t n, float init) {
  float a = init;
  for (int64_t j = 0; j < n; ++j) a = fmaxf(a, fabsf(static_cast<float>(x[j])));
  return a;
}

}  // namespace

void static_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                             const at::Tensor& scale, std::optional<at::IntArrayRef> group_shape) {
  constexpr const char* kOp = "static_scaled_fp8_quant";
  check::static_scaled_fp8_quant(result, input, scale, group_shape);
  if (input.numel() == 0) return;
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  const auto groups =
      quant::resolve_static_groups(kOp, in_rows.num_rows, in_rows.row_len, scale, group_shape);
  const float* s = scale.const_data_ptr<float>();
  const int64_t k = in_rows.row_len;
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    at::parallel_for(0, in_rows.num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = in + r * in_rows.row_stride;
        uint8_t* q = out + r * out_rows.row_stride;
        const float* s_row = s + (r / groups.group_m) * groups.stride_m;
        for (int64_t j = 0; j < k; ++j) {
          const float inv_scale = 1.0f / s_row[(j / groups.group_n) * groups.stride_n];
          q[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(x[j]) * inv_scale));
        }
      }
    });
  });
}

void fp8_quant_rows(at::Tensor& result, const at::Tensor& input, at::Tensor& scale,
                    c10::string_view kind, int64_t group_size, const OptTensor& slot_ids,
                    const OptTensor& expert_map, int64_t num_experts, const OptTensor& row_end) {
  constexpr const char* kOp = "fp8_quant_rows";
  check::fp8_quant_rows(result, input, scale, kind, group_size, slot_ids, expert_map,
                        num_experts, row_end);
  if (input.numel() == 0) return;
  const auto q = quant::parse_rows_quant(kOp, kind);
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  const int64_t k = in_rows.row_len;
  // Per token: one group of k columns with the per-token formula; per tensor: one scale.
  const int64_t g = q == quant::RowsQuant::kPerGroup ? group_size : k;
  const int64_t groups_per_row = k / g;
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  float* scales = scale.data_ptr<float>();
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    // Only the rows that count (row_filter.cuh), and their scales, are read and written.
    quant::visit_row_filter(slot_ids, expert_map, num_experts, row_end, [&](auto counts) {
      at::parallel_for(0, in_rows.num_rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          if (!counts(r)) continue;
          for (int64_t grp = 0; grp < groups_per_row; ++grp) {
            const scalar_t* x = in + r * in_rows.row_stride + grp * g;
            uint8_t* qr = out + r * out_rows.row_stride + grp * g;
            if (q == quant::RowsQuant::kStaticTensor) {
              const float inv_scale = 1.0f / scales[0];
              for (int64_t j = 0; j < g; ++j) {
                qr[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(x[j]) * inv_scale));
              }
            } else if (q == quant::RowsQuant::kPerToken) {
              const float s = fmaxf(row_amax(x, g, 0.0f) / fp8::kE4M3Max, fp8::kMinScale);
              scales[r] = s;
              for (int64_t j = 0; j < g; ++j) {
                qr[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(x[j]) / s));
              }
            } else {
              const float s =
                  fp8::group_scale(row_amax(x, g, quant::kRowsGroupEps), fp8::kE4M3Max);
              scales[r * groups_per_row + grp] = s;
              for (int64_t j = 0; j < g; ++j) {
                qr[j] = fp8::e4m3_bits(fp8::clamp_range(static_cast<float>(x[j]) / s,
                                                        -fp8::kE4M3Max, fp8::kE4M3Max));
              }
            }
          }
        }
      });
    });
  });
}

void dynamic_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, at::Tensor& scale) {
  constexpr const char* kOp = "dynamic_scaled_fp8_quant";
  check::dynamic_scaled_fp8_quant(result, input, scale);
  // An empty input writes nothing, scale included (the CUDA op launches nothing for it).
  if (input.numel() == 0) return;
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  const int64_t k = in_rows.row_len;
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    float amax = 0.0f;
    for (int64_t r = 0; r < in_rows.num_rows; ++r) {
      amax = row_amax(in + r * in_rows.row_stride, k, amax);
    }
    const float s = fmaxf(amax / fp8::kE4M3Max, fp8::kMinScale);
    *scale.data_ptr<float>() = s;
    const float inv_scale = 1.0f / s;
    at::parallel_for(0, in_rows.num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = in + r * in_rows.row_stride;
        uint8_t* q = out + r * out_rows.row_stride;
        for (int64_t j = 0; j < k; ++j) {
          q[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(x[j]) * inv_scale));
        }
      }
    });
  });
}

void dynamic_per_token_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                                        at::Tensor& scale, const OptTensor& scale_ub) {
  constexpr const char* kOp = "dynamic_per_token_scaled_fp8_quant";
  check::dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub);
  // K = 0: each row is empty, and an empty row's amax is 0, so its scale is the floor
  // 1/(448*512), as for a row of zeros (scale_ub cannot lower it: max(min(0, ub)/448, floor)).
  if (input.numel() == 0) {
    if (scale.numel() > 0) scale.fill_(fp8::kMinScale);
    return;
  }
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  const int64_t k = in_rows.row_len;
  const bool has_ub = scale_ub.has_value();
  const float ub = has_ub ? scale_ub->item<float>() : 0.0f;
  float* scales = scale.data_ptr<float>();
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    at::parallel_for(0, in_rows.num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* x = in + r * in_rows.row_stride;
        uint8_t* q = out + r * out_rows.row_stride;
        float a = row_amax(x, k, 0.0f);
        if (has_ub) a = fminf(a, ub);
        const float s = fmaxf(a / fp8::kE4M3Max, fp8::kMinScale);
        scales[r] = s;
        for (int64_t j = 0; j < k; ++j) {
          q[j] = fp8::e4m3_bits(fp8::clamp_e4m3(static_cast<float>(x[j]) / s));
        }
      }
    });
  });
}

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q,
                               at::Tensor& output_s, int64_t group_size, double eps,
                               double fp8_min, double fp8_max, bool scale_ue8m0,
                               bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) {
  constexpr const char* kOp = "per_token_group_fp8_quant";
  check::per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
                                   scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned);
  if (input.numel() == 0) return;
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto q_rows = quant::rows_view(kOp, output_q, "output_q");
  const auto s_rows = quant::rows_view(kOp, output_s, "output_s", /*any_last_stride=*/true);
  const int64_t groups_per_row = in_rows.row_len / group_size;
  const float eps_f = static_cast<float>(eps);
  const float lo = static_cast<float>(fp8_min);
  const float hi = static_cast<float>(fp8_max);
  float* scales = output_s.data_ptr<float>();
  uint8_t* out = static_cast<uint8_t*>(output_q.data_ptr());
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    at::parallel_for(0, in_rows.num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t g = 0; g < groups_per_row; ++g) {
          const scalar_t* x = in + r * in_rows.row_stride + g * group_size;
          uint8_t* q = out + r * q_rows.row_stride + g * group_size;
          float s = fp8::group_scale(row_amax(x, group_size, eps_f), hi);
          if (scale_ue8m0) s = fp8::ue8m0_round_up(s);
          scales[r * s_rows.row_stride + g * s_rows.col_stride] = s;
          for (int64_t j = 0; j < group_size; ++j) {
            q[j] = fp8::e4m3_bits(fp8::clamp_range(static_cast<float>(x[j]) / s, lo, hi));
          }
        }
      }
    });
  });
}

}  // namespace hopper_moe::cpu
