// CPU definition of moe_grouped_gemm: the readable semantics the SM90 kernel is tested against.
//
//   out[r, n] = sa(r) * sb(e, n) * sum_k a[r, k] * b[e, n, k]   for offsets[e] <= r < offsets[e+1]
//
// in fp32, rounded once to out's dtype (bf16, or fp16). Each expert's range is clamped: begin into [0, M], end into
// [begin, M] (the CUDA kernel clamps the same way, so no offset can make it touch memory
// outside out). Offsets are meant to be non-decreasing (as moe_permute and
// get_cutlass_moe_mm_data produce them); rows in no range are left untouched, rows in two
// overlapping ranges are unspecified.
#include <ATen/ops/empty_like.h>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/gemm/cutlass_moe_mm_args.h"
#include "ops.h"

#include <algorithm>
#include <cmath>

namespace hopper_moe::cpu {

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& expert_offsets, const OptTensor& a_scales,
                      const OptTensor& b_scales, bool offsets_ready, c10::string_view config) {
  check::moe_grouped_gemm(out, a, b, expert_offsets, a_scales, b_scales, offsets_ready, config);
  const int64_t m = a.size(0), e_count = b.size(0), n = b.size(1);
  if (m == 0 || e_count == 0 || n == 0) return;  // no expert: no row is written (as on CUDA)
  const auto offsets = expert_offsets.cpu();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const at::Tensor af = a.to(at::kFloat);
  at::Tensor a_rows_scale, b_scale_f;
  if (a_scales) a_rows_scale = a_scales->reshape({-1}).to(at::kFloat);
  if (b_scales) b_scale_f = b_scales->reshape({e_count, -1}).to(at::kFloat);
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t begin = std::clamp<int64_t>(off[e], 0, m);
    const int64_t end = std::clamp<int64_t>(off[e + 1], begin, m);
    if (end == begin) continue;
    at::Tensor y = af.slice(0, begin, end).matmul(b[e].to(at::kFloat).t());  // [rows, N]
    if (b_scales) y = y.mul(b_scale_f[e].reshape({1, -1}));  // [1] or [N] broadcast over rows
    if (a_scales) {
      y = a_rows_scale.numel() == 1 ? y.mul(a_rows_scale[0])
                                    : y.mul(a_rows_scale.slice(0, begin, end).reshape({-1, 1}));
    }
    out.slice(0, begin, end).copy_(y.to(out.scalar_type()));
  }
}

// moe_grouped_gemm_silu_mul: the GEMM into a bf16 [M, 2I] temporary, then, on the rows each
// expert owns, silu_and_mul (bf16 out) or silu_and_mul_quant (e4m3 out with out_scale) of
// those rows: the composition the fused CUDA epilogue computes in one pass.
void moe_grouped_gemm_silu_mul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& expert_offsets, const OptTensor& a_scales,
                               const OptTensor& b_scales, const OptTensor& out_scale,
                               bool offsets_ready, const OptTensor& amax_scale,
                               c10::string_view config) {
  check::moe_grouped_gemm_silu_mul(out, a, b, expert_offsets, a_scales, b_scales, out_scale,
                                   offsets_ready, amax_scale, config);
  const int64_t m = a.size(0), e_count = b.size(0);
  if (m == 0 || e_count == 0 || out.size(1) == 0) return;
  at::Tensor h = a.new_zeros({m, b.size(1)}, a.options().dtype(at::kBFloat16));
  moe_grouped_gemm(h, a, b, expert_offsets, a_scales, b_scales, offsets_ready, "");
  const auto offsets = expert_offsets.cpu();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t begin = std::clamp<int64_t>(off[e], 0, m);
    const int64_t end = std::clamp<int64_t>(off[e + 1], begin, m);
    if (end == begin) continue;
    // out may have any row stride (the check's rule); silu_and_mul(_quant) writes contiguous
    // rows, so those rows are computed into a contiguous block first when out's are not.
    at::Tensor rows = out.slice(0, begin, end);
    at::Tensor dst =
        rows.is_contiguous() ? rows : at::empty_like(rows, at::MemoryFormat::Contiguous);
    if (out_scale) {
      silu_and_mul_quant(dst, h.slice(0, begin, end), *out_scale);
    } else {
      silu_and_mul(dst, h.slice(0, begin, end));
    }
    if (!dst.is_same(rows)) rows.copy_(dst);
    if (!out_scale && amax_scale) {
      // max(scale, amax / 448) with fmaxf's rule: NaN elements do not count.
      const at::Tensor v = rows.to(at::kFloat).abs();
      const float amax = v.masked_fill(v.isnan(), 0.0).max().item<float>();
      amax_scale->fill_(std::fmax(amax_scale->item<float>(), amax / 448.0f));
    }
  }
}

// moe_grouped_gemm_chain: the two ops, one after the other.
void moe_grouped_gemm_chain(at::Tensor& out, at::Tensor& h, const at::Tensor& a,
                            const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& expert_offsets, const OptTensor& a_scales,
                            const OptTensor& w1_scales, const OptTensor& h_scale,
                            const OptTensor& w2_scales, bool offsets_ready,
                            c10::string_view config) {
  check::moe_grouped_gemm_chain(out, h, a, w1, w2, expert_offsets, a_scales, w1_scales, h_scale,
                                w2_scales, offsets_ready, config);
  moe_grouped_gemm_silu_mul(h, a, w1, expert_offsets, a_scales, w1_scales, h_scale,
                            offsets_ready, std::nullopt, "");
  moe_grouped_gemm(out, h, w2, expert_offsets, h_scale, w2_scales, offsets_ready, "");
}

// The gathered GEMM1 of the layer: the permuted copy of x (and of per-row scales) that the
// CUDA kernel never makes, then the ops above. Rows past the valid ones (perm holds the slot
// count there) take a clamped index; no GEMM reads them.
namespace {
at::Tensor gather_rows(const at::Tensor& t, const RowGather& g, int64_t rows) {
  const int64_t slots = g.x.size(0) * g.topk;
  const at::Tensor src = g.perm.slice(0, 0, rows)
                             .to(at::kLong)
                             .clamp(0, std::max<int64_t>(slots - 1, 0))
                             .div(g.topk, "floor");
  return t.index_select(0, src);
}
OptTensor gather_scales(const OptTensor& a_scales, const RowGather& g, int64_t rows) {
  if (!a_scales || a_scales->numel() == 1) return a_scales;
  return gather_rows(a_scales->reshape({-1, 1}), g, rows);
}
}  // namespace

void moe_grouped_gemm_silu_mul_gathered(at::Tensor& out, const RowGather& a, const at::Tensor& b,
                                        const at::Tensor& expert_offsets,
                                        const OptTensor& a_scales, const OptTensor& b_scales,
                                        const OptTensor& out_scale, bool offsets_ready,
                                        const OptTensor& amax_scale) {
  const int64_t rows = out.size(0);
  moe_grouped_gemm_silu_mul(out, gather_rows(a.x, a, rows), b, expert_offsets,
                            gather_scales(a_scales, a, rows), b_scales, out_scale, offsets_ready,
                            amax_scale, "");
}

void moe_grouped_gemm_chain_gathered(at::Tensor& out, at::Tensor& h, const RowGather& a,
                                     const at::Tensor& w1, const at::Tensor& w2,
                                     const at::Tensor& expert_offsets, const OptTensor& a_scales,
                                     const OptTensor& w1_scales, const OptTensor& h_scale,
                                     const OptTensor& w2_scales, bool offsets_ready) {
  const int64_t rows = out.size(0);
  moe_grouped_gemm_chain(out, h, gather_rows(a.x, a, rows), w1, w2, expert_offsets,
                         gather_scales(a_scales, a, rows), w1_scales, h_scale, w2_scales,
                         offsets_ready, "");
}

// cutlass_moe_mm: moe_grouped_gemm over the row ranges of gemm/cutlass_moe_mm_args.h.
void cutlass_moe_mm(at::Tensor& out_tensors, const at::Tensor& a_tensors,
                    const at::Tensor& b_tensors, const at::Tensor& a_scales,
                    const at::Tensor& b_scales, const at::Tensor& expert_offsets,
                    const at::Tensor& problem_sizes, const at::Tensor& a_strides,
                    const at::Tensor& b_strides, const at::Tensor& c_strides,
                    bool per_act_token, bool per_out_ch) {
  check::cutlass_moe_mm(out_tensors, a_tensors, b_tensors, a_scales, b_scales, expert_offsets,
                        problem_sizes, a_strides, b_strides, c_strides, per_act_token,
                        per_out_ch);
  const at::Tensor offsets = gemm::cutlass_moe_mm_row_offsets(
      expert_offsets, problem_sizes, gemm::cutlass_moe_mm_swapped(a_tensors));
  moe_grouped_gemm(out_tensors, a_tensors, b_tensors, offsets, a_scales, b_scales,
                   /*offsets_ready=*/false, /*config=*/"");
}

}  // namespace hopper_moe::cpu
