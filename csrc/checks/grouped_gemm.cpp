// Validation of moe_grouped_gemm, shared by CPU and CUDA.
#include "hopper_moe/common/checks.h"
#include "ops.h"

#include <limits>
#include <string>
#include <utility>

namespace hopper_moe::check {

namespace {

// a [M, K] bf16 or fp8 e4m3 (last dim contiguous, 16-byte aligned rows); b [E, N, K] of a's
// dtype, contiguous; expert_offsets int64 [E + 1] (row ranges of a and out; their values are
// data and are not checked here: the kernels clamp them into [0, M]); a_scales f32 [1] or
// [M] / [M, 1]; b_scales f32 [E] or [E, N] / [E, N, 1]. Scales are required with fp8
// operands and rejected with bf16 ones. out: out_cols columns, M rows, last dim contiguous.
void check_operands(const char* kOp, const at::Tensor& out, int64_t out_cols,
                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& expert_offsets,
                    const OptTensor& a_scales, const OptTensor& b_scales) {
  HM_CHECK_DTYPE(kOp, a, {at::kBFloat16, at::kFloat8_e4m3fn});
  HM_CHECK(kOp, b.scalar_type() == a.scalar_type(), "b must have the dtype of a (",
           a.scalar_type(), "), got ", b.scalar_type());
  HM_CHECK_DTYPE(kOp, expert_offsets, at::kLong);
  HM_CHECK_DIM(kOp, a, 2);
  HM_CHECK_DIM(kOp, b, 3);
  HM_CHECK_DIM(kOp, out, 2);
  HM_CHECK_DIM(kOp, expert_offsets, 1);
  const int64_t m = a.size(0), k = a.size(1), e = b.size(0), n = b.size(1);
  HM_CHECK_SIZE(kOp, b, 2, k, "K, the columns of a");
  HM_CHECK_SIZE(kOp, out, 0, m, "the rows of a");
  HM_CHECK(kOp, out.size(1) == out_cols, "out.size(1) must be ", out_cols, " (",
           out_cols == n ? "N, the rows of each expert of b" : "N / 2, half the rows of each expert of b",
           "), got ", out.size(1));
  HM_CHECK_NUMEL(kOp, expert_offsets, e + 1, "num_experts + 1 row offsets");
  // K = 0 would be out = 0, but the kernel's bulk copies cannot describe a zero-width operand:
  // every device rejects it.
  HM_CHECK(kOp, k > 0, "a.size(1) (K) must be > 0, got ", k);
  HM_CHECK(kOp, e <= heuristics::kMaxExperts, "b.size(0) (E) must be at most ",
           heuristics::kMaxExperts, " experts (the kernel's per-expert tile table; the same ",
           "rule on every device), got ", e);
  HM_CHECK_SAME_DEVICE(kOp, b, a);
  HM_CHECK_SAME_DEVICE(kOp, out, a);
  HM_CHECK_SAME_DEVICE(kOp, expert_offsets, a);
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, a);
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, out);
  HM_CHECK_CONTIGUOUS(kOp, b);
  HM_CHECK_CONTIGUOUS(kOp, expert_offsets);
  // Bulk tensor copies (TMA) read a and b: 16-byte aligned base and row pitch.
  const int64_t elem = a.element_size();
  HM_CHECK(kOp, (k * elem) % 16 == 0, "a.size(1) * element size must be a multiple of 16 bytes",
           " (K = ", k, ")");
  HM_CHECK(kOp, a.numel() == 0 || (a.stride(0) * elem) % 16 == 0,
           "a's row stride must be a multiple of 16 bytes (stride ", a.stride(0), ")");
  HM_CHECK(kOp, m <= 1 || a.stride(0) >= k, "a.stride(0) (", a.stride(0),
           ") must be >= a.size(1) (K = ", k,
           "): rows of a must not overlap (a broadcast a, e.g. a.expand, has row stride 0)");
  check_output_elements_distinct_named(kOp, out, "out");
  check_outputs_disjoint(kOp, {{out, "out"}},
                         {{a, "a"}, {b, "b"}, {expert_offsets, "expert_offsets"},
                          {a_scales, "a_scales"}, {b_scales, "b_scales"}});
  if (a.numel() > 0) check_aligned16_named(kOp, a, "a");
  if (b.numel() > 0) check_aligned16_named(kOp, b, "b");
  HM_CHECK(kOp, e * n < std::numeric_limits<int32_t>::max() &&
                    m < std::numeric_limits<int32_t>::max(),
           "num_experts * N and the rows of a must be below 2^31 (copy coordinates are 32-bit)");

  const bool fp8 = a.scalar_type() == at::kFloat8_e4m3fn;
  HM_CHECK(kOp, a_scales.has_value() == fp8 && b_scales.has_value() == fp8,
           fp8 ? "a_scales and b_scales are required with Float8_e4m3fn operands"
               : "a_scales and b_scales must be None with BFloat16 operands");
  if (fp8) {
    const at::Tensor& as = *a_scales;
    const at::Tensor& bs = *b_scales;
    check_dtype_named(kOp, as, "a_scales", at::kFloat);
    check_dtype_named(kOp, bs, "b_scales", at::kFloat);
    check_same_device_named(kOp, as, "a_scales", a, "a");
    check_same_device_named(kOp, bs, "b_scales", a, "a");
    check_contiguous_named(kOp, as, "a_scales");
    check_contiguous_named(kOp, bs, "b_scales");
    HM_CHECK(kOp, as.numel() == 1 || (as.numel() == m && as.size(0) == m),
             "a_scales must hold 1 (per tensor) or M = ", m, " (per token) values, got shape ",
             as.sizes());
    HM_CHECK(kOp, bs.dim() >= 1 && bs.size(0) == e && (bs.numel() == e || bs.numel() == e * n),
             "b_scales must have shape [E] (per expert) or [E, N] / [E, N, 1] (per channel) ",
             "with E = ", e, ", N = ", n, ", got ", bs.sizes());
  }
}

// out [M, N] bf16, or fp16 where fp16_out allows it; the operands as check_operands says.
void check_gemm(const char* kOp, const at::Tensor& out, const at::Tensor& a,
                const at::Tensor& b, const at::Tensor& expert_offsets,
                const OptTensor& a_scales, const OptTensor& b_scales, bool fp16_out) {
  if (fp16_out) {
    HM_CHECK_DTYPE(kOp, out, {at::kBFloat16, at::kHalf});
  } else {
    HM_CHECK_DTYPE(kOp, out, at::kBFloat16);
  }
  HM_CHECK_DIM(kOp, b, 3);
  check_operands(kOp, out, b.size(1), a, b, expert_offsets, a_scales, b_scales);
}

// b [E, 2I, K] (each expert's gate rows, then its up rows); out [M, I] bf16, or
// Float8_e4m3fn with out_scale f32 [1] (the static per-tensor scale of the result);
// amax_scale f32 [1] (bf16 out only).
void check_gemm_silu_mul(const char* kOp, const at::Tensor& out, const at::Tensor& a,
                         const at::Tensor& b, const at::Tensor& expert_offsets,
                         const OptTensor& a_scales, const OptTensor& b_scales,
                         const OptTensor& out_scale, const OptTensor& amax_scale) {
  HM_CHECK_DIM(kOp, b, 3);
  HM_CHECK(kOp, b.size(1) % 2 == 0,
           "b.size(1) must be even: each expert holds I gate rows, then I up rows (got ",
           b.size(1), ")");
  if (out_scale) {
    check_dtype_named(kOp, out, "out", at::kFloat8_e4m3fn);
    check_dtype_named(kOp, *out_scale, "out_scale", at::kFloat);
    HM_CHECK(kOp, out_scale->numel() == 1,
             "out_scale must hold 1 value (a static per-tensor scale), got shape ",
             out_scale->sizes());
    check_same_device_named(kOp, *out_scale, "out_scale", a, "a");
  } else {
    HM_CHECK(kOp, out.scalar_type() == at::kBFloat16,
             "out must be BFloat16 without out_scale (Float8_e4m3fn needs out_scale), got ",
             out.scalar_type());
  }
  if (amax_scale) {
    HM_CHECK(kOp, !out_scale,
             "amax_scale (the amax of a bf16 out) cannot be combined with out_scale (e4m3 out)");
    check_dtype_named(kOp, *amax_scale, "amax_scale", at::kFloat);
    HM_CHECK(kOp, amax_scale->numel() == 1, "amax_scale must hold 1 value, got shape ",
             amax_scale->sizes());
    check_same_device_named(kOp, *amax_scale, "amax_scale", a, "a");
  }
  check_operands(kOp, out, b.size(1) / 2, a, b, expert_offsets, a_scales, b_scales);
  check_outputs_disjoint(kOp, {{out, "out"}, {amax_scale, "amax_scale"}},
                         {{out_scale, "out_scale"}});
  if (amax_scale) {
    check_outputs_disjoint(kOp, {{*amax_scale, "amax_scale"}},
                           {{a, "a"}, {b, "b"}, {expert_offsets, "expert_offsets"},
                            {a_scales, "a_scales"}, {b_scales, "b_scales"}});
  }
}

// An integer value of grouped_gemm_config in [lo, hi].
int config_int(const char* kOp, const std::string& key, const std::string& value, int lo,
               int hi) {
  size_t used = 0;
  long v = 0;
  bool ok = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos &&
            value.size() < 10;
  if (ok) {
    v = std::stol(value, &used);
    ok = used == value.size() && v >= lo && v <= hi;
  }
  if (lo == 0 && hi == 1) {
    HM_CHECK(kOp, ok, "config: ", key, " must be 0 or 1 (got '", value, "')");
  } else {
    HM_CHECK(kOp, ok, "config: ", key, " must be an integer in [", lo, ", ", hi, "] (got '",
             value, "')");
  }
  return int(v);
}

}  // namespace

heuristics::GroupedGemmOverride grouped_gemm_config(const char* kOp, c10::string_view config) {
  heuristics::GroupedGemmOverride force;
  const std::string text(config.data(), config.size());
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(begin, end - begin);
    begin = end + 1;
    const size_t eq = item.find('=');
    HM_CHECK(kOp, eq != std::string::npos && eq > 0, "config: '", item,
             "' is not key=value (keys: mapping, pair, k_splits, pdl)");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "mapping") {
      HM_CHECK(kOp, value == "swap_ab" || value == "standard",
               "config: mapping must be swap_ab or standard (got '", value, "')");
      force.swap_ab = value == "swap_ab" ? 1 : 0;
    } else if (key == "pair") {
      force.pair = config_int(kOp, key, value, 0, 1);
    } else if (key == "k_splits") {
      force.k_splits = config_int(kOp, key, value, 1, heuristics::kMaxKSplits);
    } else if (key == "pdl") {
      force.pdl = config_int(kOp, key, value, 0, 1);
    } else {
      HM_CHECK(kOp, false, "config: unknown key '", key,
               "' (keys: mapping, pair, k_splits, pdl)");
    }
  }
  return force;
}

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& expert_offsets, const OptTensor& a_scales,
                      const OptTensor& b_scales, bool /*offsets_ready*/,
                      c10::string_view config) {
  check_gemm("moe_grouped_gemm", out, a, b, expert_offsets, a_scales, b_scales,
             /*fp16_out=*/true);
  grouped_gemm_config("moe_grouped_gemm", config);
}

void moe_grouped_gemm_silu_mul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& expert_offsets, const OptTensor& a_scales,
                               const OptTensor& b_scales, const OptTensor& out_scale,
                               bool /*offsets_ready*/, const OptTensor& amax_scale,
                               c10::string_view config) {
  check_gemm_silu_mul("moe_grouped_gemm_silu_mul", out, a, b, expert_offsets, a_scales,
                      b_scales, out_scale, amax_scale);
  grouped_gemm_config("moe_grouped_gemm_silu_mul", config);
}

// GEMM1 (h = silu_mul(a . w1^T)) and GEMM2 (out = h . w2^T) of one expert set: a, w1 and w2
// of one dtype; bf16 operands without scales, or e4m3 ones with a_scales and w1_scales
// (GEMM1's), h e4m3 with its static per-tensor h_scale [1] (GEMM1's out_scale, GEMM2's a
// scale) and w2_scales (GEMM2's b scales); w2 [E, N2, I] for w1 [E, 2I, K]. Then each GEMM's
// own rules, named by its part of the chain.
void moe_grouped_gemm_chain(at::Tensor& out, at::Tensor& h, const at::Tensor& a,
                            const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& expert_offsets, const OptTensor& a_scales,
                            const OptTensor& w1_scales, const OptTensor& h_scale,
                            const OptTensor& w2_scales, bool /*offsets_ready*/,
                            c10::string_view config) {
  constexpr const char* kOp = "moe_grouped_gemm_chain";
  grouped_gemm_config(kOp, config);
  HM_CHECK_DTYPE(kOp, a, {at::kBFloat16, at::kFloat8_e4m3fn});
  const bool fp8 = a.scalar_type() == at::kFloat8_e4m3fn;
  HM_CHECK(kOp, w1.scalar_type() == a.scalar_type() && w2.scalar_type() == a.scalar_type(),
           "w1 and w2 must have the dtype of a (", a.scalar_type(), "), got ", w1.scalar_type(),
           " and ", w2.scalar_type());
  if (fp8) {
    HM_CHECK(kOp, h.scalar_type() == at::kFloat8_e4m3fn && h_scale.has_value(),
             "with Float8_e4m3fn operands h must be Float8_e4m3fn with its static per-tensor "
             "h_scale (GEMM2 reads it quantized), got h ", h.scalar_type(),
             h_scale ? " with h_scale" : " without h_scale");
    HM_CHECK(kOp, w2_scales.has_value(), "w2_scales are required with Float8_e4m3fn operands");
  } else {
    HM_CHECK(kOp, h.scalar_type() == at::kBFloat16, "with BFloat16 operands h must be BFloat16, got ",
             h.scalar_type());
    HM_CHECK(kOp, !h_scale && !w2_scales,
             "h_scale and w2_scales must be None with BFloat16 operands");
  }
  HM_CHECK_DIM(kOp, w1, 3);
  HM_CHECK_DIM(kOp, w2, 3);
  HM_CHECK(kOp, w2.size(0) == w1.size(0), "w2.size(0) must be E = w1.size(0) = ", w1.size(0),
           ", got ", w2.size(0));
  HM_CHECK(kOp, 2 * w2.size(2) == w1.size(1),
           "w2.size(2) must be I = w1.size(1) / 2 = ", w1.size(1) / 2, ", got ", w2.size(2));
  // h is written by GEMM1 and read by GEMM2, out written by GEMM2: neither may share memory
  // with the other or with an operand.
  check_outputs_disjoint(kOp, {{h, "h"}, {out, "out"}},
                         {{a, "a"}, {w1, "w1"}, {w2, "w2"}, {expert_offsets, "expert_offsets"},
                          {a_scales, "a_scales"}, {w1_scales, "w1_scales"},
                          {h_scale, "h_scale"}, {w2_scales, "w2_scales"}});
  check_gemm_silu_mul("moe_grouped_gemm_chain, GEMM1 (out = h, b = w1, b_scales = w1_scales, "
                      "out_scale = h_scale)",
                      h, a, w1, expert_offsets, a_scales, w1_scales, h_scale, std::nullopt);
  check_gemm("moe_grouped_gemm_chain, GEMM2 (a = h, b = w2, a_scales = h_scale, "
             "b_scales = w2_scales)",
             out, h, w2, expert_offsets, h_scale, w2_scales, /*fp16_out=*/false);
}

// cutlass_moe_mm (vLLM's schema; row ranges in gemm/cutlass_moe_mm_args.h): out_tensors
// [M_tot, N] bf16 or fp16; a_tensors [M_tot, K] e4m3; b_tensors [E, N, K] e4m3 contiguous;
// a_scales f32 [1] (per_act_token false) or M_tot values; b_scales f32 [E] (per_out_ch false)
// or [E, N] / [E, N, 1]; expert_offsets int32/int64 [E]; problem_sizes int32 [E, 3];
// a_strides / b_strides / c_strides int64 [E] (vLLM passes the dense leading dimensions; the
// kernel reads the strides of the tensors themselves, so their values are not used).
void cutlass_moe_mm(at::Tensor& out_tensors, const at::Tensor& a_tensors,
                    const at::Tensor& b_tensors, const at::Tensor& a_scales,
                    const at::Tensor& b_scales, const at::Tensor& expert_offsets,
                    const at::Tensor& problem_sizes, const at::Tensor& a_strides,
                    const at::Tensor& b_strides, const at::Tensor& c_strides,
                    bool per_act_token, bool per_out_ch) {
  constexpr const char* kOp = "cutlass_moe_mm";
  check_dtype_named(kOp, a_tensors, "a_tensors", at::kFloat8_e4m3fn);
  check_dtype_named(kOp, out_tensors, "out_tensors", {at::kBFloat16, at::kHalf});
  HM_CHECK(kOp, b_tensors.dim() == 3, "b_tensors must be [E, N, K], got ", b_tensors.sizes());
  const int64_t e = b_tensors.size(0);
  HM_CHECK(kOp, expert_offsets.dim() == 1 && expert_offsets.numel() == e,
           "expert_offsets must be [E] = [", e, "] (each expert's first row), got ",
           expert_offsets.sizes());
  check_dtype_named(kOp, expert_offsets, "expert_offsets", {at::kInt, at::kLong});
  check_contiguous_named(kOp, expert_offsets, "expert_offsets");
  check_same_device_named(kOp, expert_offsets, "expert_offsets", a_tensors, "a_tensors");
  HM_CHECK(kOp, problem_sizes.dim() == 2 && problem_sizes.size(0) == e &&
                    problem_sizes.size(1) == 3,
           "problem_sizes must be [E, 3] = [", e, ", 3], got ", problem_sizes.sizes());
  check_dtype_named(kOp, problem_sizes, "problem_sizes", at::kInt);
  check_same_device_named(kOp, problem_sizes, "problem_sizes", a_tensors, "a_tensors");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{a_strides, "a_strides"},
                                {b_strides, "b_strides"},
                                {c_strides, "c_strides"}}) {
    HM_CHECK(kOp, t.dim() == 1 && t.numel() == e, name, " must be [E] = [", e, "], got ",
             t.sizes());
    check_dtype_named(kOp, t, name, at::kLong);
  }
  check_dtype_named(kOp, b_tensors, "b_tensors", at::kFloat8_e4m3fn);
  HM_CHECK(kOp, a_tensors.dim() == 2 && a_tensors.size(1) == b_tensors.size(2),
           "a_tensors must be [M_tot, K] with K = b_tensors.size(2) = ", b_tensors.size(2),
           ", got ", a_tensors.sizes());
  const int64_t m = a_tensors.size(0);
  HM_CHECK(kOp, out_tensors.dim() == 2 && out_tensors.size(0) == m &&
                    out_tensors.size(1) == b_tensors.size(1),
           "out_tensors must be [M_tot, N] = [", m, ", ", b_tensors.size(1), "], got ",
           out_tensors.sizes());
  check_dtype_named(kOp, a_scales, "a_scales", at::kFloat);
  check_dtype_named(kOp, b_scales, "b_scales", at::kFloat);
  HM_CHECK(kOp, a_scales.numel() == (per_act_token ? m : 1),
           "a_scales must hold ", per_act_token ? "M_tot values (per_act_token)" : "1 value",
           ", got shape ", a_scales.sizes());
  HM_CHECK(kOp, a_tensors.size(1) > 0, "a_tensors.size(1) (K) must be > 0, got ",
           a_tensors.size(1));
  // The layout rules of moe_grouped_gemm (the kernel this op runs), under this op's names.
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{b_tensors, "b_tensors"},
        {out_tensors, "out_tensors"}, {a_scales, "a_scales"}, {b_scales, "b_scales"}}) {
    check_same_device_named(kOp, t, name, a_tensors, "a_tensors");
  }
  check_last_dim_contiguous_named(kOp, a_tensors, "a_tensors");
  check_last_dim_contiguous_named(kOp, out_tensors, "out_tensors");
  check_contiguous_named(kOp, b_tensors, "b_tensors");
  check_contiguous_named(kOp, a_scales, "a_scales");
  check_contiguous_named(kOp, b_scales, "b_scales");
  HM_CHECK(kOp, a_tensors.size(1) % 16 == 0,
           "a_tensors.size(1) (K) must be a multiple of 16 (16-byte rows of FP8), got ",
           a_tensors.size(1));
  HM_CHECK(kOp, a_tensors.numel() == 0 || a_tensors.stride(0) % 16 == 0,
           "a_tensors' row stride must be a multiple of 16 bytes (stride ", a_tensors.stride(0),
           ")");
  if (a_tensors.numel() > 0) check_aligned16_named(kOp, a_tensors, "a_tensors");
  if (b_tensors.numel() > 0) check_aligned16_named(kOp, b_tensors, "b_tensors");
  HM_CHECK(kOp, m <= 1 || a_tensors.stride(0) >= a_tensors.size(1), "a_tensors.stride(0) (",
           a_tensors.stride(0), ") must be >= a_tensors.size(1) (K = ", a_tensors.size(1),
           "): rows of a_tensors must not overlap (a broadcast a_tensors has row stride 0)");
  HM_CHECK(kOp, e <= heuristics::kMaxExperts, "b_tensors.size(0) (E) must be at most ",
           heuristics::kMaxExperts, " experts (the kernel's per-expert tile table; the same ",
           "rule on every device), got ", e);
  check_output_elements_distinct_named(kOp, out_tensors, "out_tensors");
  check_outputs_disjoint(kOp, {{out_tensors, "out_tensors"}},
                         {{a_tensors, "a_tensors"}, {b_tensors, "b_tensors"},
                          {a_scales, "a_scales"}, {b_scales, "b_scales"},
                          {expert_offsets, "expert_offsets"}, {problem_sizes, "problem_sizes"}});
  const int64_t n = b_tensors.size(1);
  HM_CHECK(kOp, b_scales.dim() >= 1 && b_scales.size(0) == e &&
                    b_scales.numel() == (per_out_ch ? e * n : e),
           "b_scales must be ", per_out_ch ? "[E, N] (per_out_ch)" : "[E]", " with E = ", e,
           ", N = ", n, ", got ", b_scales.sizes());
}

}  // namespace hopper_moe::check
