// Host-side layout logic shared by the checks, the CPU definitions and the CUDA launchers of
// the activation and FP8 quantization ops (no device code).
//
// These ops see a tensor [..., K] as num_rows = numel / K rows of K elements. The last
// dimension must be contiguous; the leading dimensions must collapse into one row index with a
// single row stride (true for contiguous tensors and for row-sliced views such as x[:, :K] or
// x[::2]). RowsView holds that view.
//
// static_scaled_fp8_quant's scale is resolved into StaticScaleGroups: element (m, n) uses
//     scale[(m / group_m) * stride_m + (n / group_n) * stride_n]
// which covers per-tensor, per-token, per-channel and 2-D block scales.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/moe/row_filter.cuh"

// Dispatch over the input dtypes these ops accept (float, half, bfloat16), as scalar_t.
#define HM_QUANT_DISPATCH_INPUT(t, name, ...)                          \
  AT_DISPATCH_SWITCH((t).scalar_type(), name,                          \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)         \
                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)      \
                             AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace hopper_moe::quant {

struct RowsView {
  int64_t num_rows = 0;    // product of the leading dimensions (1 for a 1-D tensor)
  int64_t row_len = 0;     // size of the last dimension
  int64_t row_stride = 0;  // elements between consecutive rows
  int64_t col_stride = 1;  // elements between consecutive columns (1 unless any_last_stride)
};

// Views t as [num_rows, row_len] rows. Throws naming `name` when the last dimension is not
// contiguous (unless any_last_stride) or the leading dimensions do not collapse into one row
// stride.
inline RowsView rows_view(const char* op, const at::Tensor& t, const char* name,
                          bool any_last_stride = false) {
  HM_CHECK(op, t.dim() >= 1, name, " must have at least 1 dimension (got a 0-D tensor)");
  if (!any_last_stride) check_last_dim_contiguous_named(op, t, name);
  RowsView v;
  v.row_len = t.size(-1);
  v.col_stride = any_last_stride ? t.stride(-1) : 1;
  v.num_rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) v.num_rows *= t.size(d);
  v.row_stride = std::max<int64_t>(v.row_len, 1);
  if (v.num_rows == 0) return v;
  // Going outwards from the row dimension, every leading dimension of size > 1 must step over
  // whole blocks of the dimensions inside it; the innermost one gives the row stride.
  bool have_row_stride = false;
  int64_t expected = 0;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (!have_row_stride) {
      v.row_stride = t.stride(d);
      have_row_stride = true;
    } else {
      HM_CHECK(op, t.stride(d) == expected, name, " must be viewable as rows [num_rows, ",
               v.row_len,
               "] with one row stride (its leading dimensions must be contiguous with each "
               "other; shape ",
               t.sizes(), ", strides ", t.strides(), ")");
    }
    expected = t.stride(d) * t.size(d);
  }
  return v;
}

// rows_view of a tensor the op writes: additionally no two elements may share memory.
inline RowsView output_rows_view(const char* op, const at::Tensor& t, const char* name,
                                 bool any_last_stride = false) {
  const RowsView v = rows_view(op, t, name, any_last_stride);
  const int64_t R = v.num_rows, C = v.row_len, rs = v.row_stride, cs = v.col_stride;
  bool disjoint;
  if (R <= 1 || C <= 1) {
    disjoint = (R <= 1 || rs >= 1) && (C <= 1 || cs >= 1);
  } else {
    disjoint = (cs >= 1 && rs >= C * cs) || (rs >= 1 && cs >= R * rs);
  }
  HM_CHECK(op, t.numel() == 0 || disjoint, name,
           " must not have overlapping elements (shape ", t.sizes(), ", strides ", t.strides(),
           ")");
  return v;
}

struct StaticScaleGroups {
  int64_t group_m = 1;   // rows per scale group (>= 1)
  int64_t group_n = 1;   // columns per scale group (>= 1)
  int64_t stride_m = 0;  // scale elements between row groups (0: one scale for all rows)
  int64_t stride_n = 0;  // scale elements between column groups (0: one scale for all columns)
  bool per_tensor() const { return stride_m == 0 && stride_n == 0; }
};

// ceil(a / b) for a >= 0, b >= 1 without forming a + b - 1 (a group_shape entry near
// INT64_MAX would overflow it into a wrong, even zero, group count).
inline int64_t ceil_div(int64_t a, int64_t b) { return a == 0 ? 0 : 1 + (a - 1) / b; }

// Scale layouts accepted by static_scaled_fp8_quant (same semantics as vLLM's
// static_scaled_fp8_quant, plus partial last groups; a group_shape entry of -1 means the whole
// dimension):
//   scale.numel() == 1 (any shape)   per-tensor; group_shape, if given, must be well formed
//   1-D scale with numel != 1        needs group_shape = (gm, gn): the scale holds
//                                    ceil(M/gm) * ceil(K/gn) entries and one of those two
//                                    counts must be 1 (per-token (1, -1), per-channel (-1, 1))
//   2-D scale [sm, sn]               with group_shape: [ceil(M/gm), ceil(K/gn)];
//                                    without: gm = M / sm, gn = K / sn (must divide exactly)
inline StaticScaleGroups resolve_static_groups(const char* op, int64_t M, int64_t K,
                                               const at::Tensor& scale,
                                               std::optional<at::IntArrayRef> group_shape) {
  int64_t gm = 0, gn = 0;
  if (group_shape.has_value()) {
    const auto gs = *group_shape;
    HM_CHECK(op, gs.size() == 2, "group_shape must have 2 entries (group_m, group_n), got ",
             gs.size());
    for (int64_t g : gs) {
      HM_CHECK(op, g == -1 || g > 0,
               "group_shape entries must be positive or -1 (whole dimension); 0 and other "
               "negative values are rejected, got ", gs);
    }
    gm = gs[0] == -1 ? std::max<int64_t>(M, 1) : gs[0];
    gn = gs[1] == -1 ? std::max<int64_t>(K, 1) : gs[1];
  }

  StaticScaleGroups g;
  if (scale.numel() == 1) {
    g.group_m = std::max<int64_t>(M, 1);
    g.group_n = std::max<int64_t>(K, 1);
    return g;
  }
  if (scale.dim() == 1) {
    HM_CHECK(op, group_shape.has_value(),
             "a 1-D scale with ", scale.numel(),
             " elements needs an explicit group_shape: (1, -1) for per-token or (-1, 1) "
             "for per-channel scales");
    const int64_t groups_m = ceil_div(M, gm), groups_n = ceil_div(K, gn);
    HM_CHECK(op, scale.numel() == groups_m * groups_n, "scale has ", scale.numel(),
             " elements but group_shape ", *group_shape, " on input rows [", M, ", ", K,
             "] needs ceil(M / group_m) x ceil(K / group_n) = ", groups_m, " x ", groups_n,
             " = ", groups_m * groups_n, " (one scale per group)");
    HM_CHECK(op, groups_m == 1 || groups_n == 1, "a 1-D scale needs group_shape ",
             *group_shape, " to leave one of its dimensions whole; use a 2-D scale of shape [",
             groups_m, ", ", groups_n, "] for 2-D groups");
    g.group_m = gm;
    g.group_n = gn;
    g.stride_m = groups_m == 1 ? 0 : scale.stride(0);
    g.stride_n = groups_m == 1 ? scale.stride(0) : 0;
    return g;
  }
  HM_CHECK(op, scale.dim() == 2, "scale must be a single value, 1-D or 2-D (got ",
           scale.dim(), "-D with shape ", scale.sizes(), ")");
  const int64_t sm = scale.size(0), sn = scale.size(1);
  if (group_shape.has_value()) {
    const int64_t groups_m = ceil_div(M, gm), groups_n = ceil_div(K, gn);
    HM_CHECK(op, sm == groups_m && sn == groups_n, "scale must have shape [", groups_m, ", ",
             groups_n, "] for group_shape ", *group_shape, " on input rows [", M, ", ", K,
             "], got ", scale.sizes());
  } else {
    const bool divides_m = sm > 0 ? M % sm == 0 : M == 0;
    const bool divides_n = sn > 0 ? K % sn == 0 : K == 0;
    HM_CHECK(op, divides_m && divides_n, "scale of shape ", scale.sizes(),
             " does not divide input rows [", M, ", ", K,
             "] into equal groups; pass group_shape for partial groups");
    gm = sm > 0 ? std::max<int64_t>(M / sm, 1) : 1;
    gn = sn > 0 ? std::max<int64_t>(K / sn, 1) : 1;
  }
  g.group_m = gm;
  g.group_n = gn;
  g.stride_m = sm == 1 ? 0 : scale.stride(0);
  g.stride_n = sn == 1 ? 0 : scale.stride(1);
  return g;
}

// fp8_quant_rows' kind: how the rows that count are quantized.
enum class RowsQuant {
  kStaticTensor,  // "static_tensor": scale [1] given (static_scaled_fp8_quant per tensor)
  kPerToken,      // "per_token": scale [R, 1] written (dynamic_per_token_scaled_fp8_quant)
  kPerGroup,      // "per_group": scale [R, K / group_size] written (per_token_group_fp8_quant
                  // with its defaults: eps kRowsGroupEps, range +-448, no ue8m0)
};
constexpr float kRowsGroupEps = 1e-10f;

// Calls fn(rows) with the row filter (row_filter.cuh) that fp8_quant_rows' checked arguments
// name: LeadingRows with row_end, else SlotRows of slot_ids' dtype (int32 or int64).
template <class Fn>
void visit_row_filter(const std::optional<at::Tensor>& slot_ids,
                      const std::optional<at::Tensor>& expert_map, int64_t num_experts,
                      const std::optional<at::Tensor>& row_end, Fn&& fn) {
  if (row_end.has_value()) {
    fn(LeadingRows{row_end->const_data_ptr<int64_t>()});
    return;
  }
  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  if (slot_ids->scalar_type() == at::kInt) {
    fn(SlotRows<int32_t>{slot_ids->const_data_ptr<int32_t>(), map, num_experts});
  } else {
    fn(SlotRows<int64_t>{slot_ids->const_data_ptr<int64_t>(), map, num_experts});
  }
}

inline RowsQuant parse_rows_quant(const char* op, c10::string_view kind) {
  if (kind == "static_tensor") return RowsQuant::kStaticTensor;
  if (kind == "per_token") return RowsQuant::kPerToken;
  HM_CHECK(op, kind == "per_group",
           "kind must be \"static_tensor\", \"per_token\" or \"per_group\", got \"",
           std::string(kind), "\"");
  return RowsQuant::kPerGroup;
}

}  // namespace hopper_moe::quant
