// CPU definitions of the routing ops: topk_softmax, topk_sigmoid, grouped_topk.
//
// These loops ARE the semantics; the CUDA kernels reproduce them bit for bit (same float
// operations through topk_math.cuh, sums in the same order) and the tests compare the two with
// torch.equal. The one exception is grouped_topk's sigmoid, whose tanh is each device's own
// (below): the tests give both devices the same scores to compare the rest bit for bit.
// Same semantics as vLLM 0.33's kernels, with these decisions where vLLM is ambiguous
// (docs/OPS.md, "Routing", says why):
//
// Rank order (every selection below): higher score first; a NaN score ranks after every number,
// -inf included; equal scores (and -0 == +0) go to the lower expert id. So the K ids of a row
// are always K distinct experts in [0, E), whatever the inputs hold.
//
// topk_softmax: x = float(gating[t]); max = largest non-NaN x (-inf if none);
//   ex[e] = exp(x[e] - max); sum = ordered_sum(ex); p[e] = ex[e] / sum, then p[e] = 0 where it is
//   not finite (vLLM's clamp: a row holding a NaN or +inf, or only -inf, has p = NaN everywhere
//   before it, so such a row becomes all zeros).
//   score[e] = p[e] + float(bias[e]) (p[e] without bias); ids = the K best scores in rank
//   order, so a zeroed row picks 0..K-1 (or the K largest biases); weights = p[id] (unbiased).
//   renormalize: weights / s with s = ordered_sum(weights), s replaced by 1 when it is not > 0
//   (vLLM's guard: a zeroed row keeps weights 0).
// topk_sigmoid: p[e] = 1 / (1 + exp(-x[e])), 0 where that is not finite (x = NaN; x = +inf
//   gives 1 and x = -inf gives 0, both finite); selection and renormalize as above; then every
//   weight is multiplied by float(routed_scaling_factor), renormalized or not (vLLM applies the
//   factor after the optional renormalization, always).
// Both: is_padding[t] rows get ids -1 and weights 0; token_expert_indices[t, k] = k * T + t on
//   every row.
// grouped_topk: s[e] = 0.5 * tanh(x[e] / 2) + 0.5 in fp32 (scoring_func 1; vLLM's form, never
//   rounded to the scores dtype, as vLLM's kernels; the tanh is torch's on the CPU and tanhf in
//   the kernel, so that s is what torch computes on each device) or x[e] (0). Expert e is
//   valid when x[e], bias[e] and sb[e] = s[e] + float(bias[e]) are all finite; an invalid
//   expert gets sb[e] = -inf (so it ranks after every valid one; -inf ties go to the lower
//   id) and weight 0.
//   Group g holds experts [g*G, (g+1)*G), G = E / n_group; its score is sb of its best expert
//   plus sb of its second best (rank order; the best alone when G == 1). The topk_group best
//   groups (rank order on group scores, lower group first on ties) are kept; ids = the topk best
//   sb among the kept groups' experts; w = s[id] for valid ids, 0 for invalid ones.
//   If every picked id is invalid: weights = 1/topk when renormalize, else 0 (vLLM's output
//   for a row without a finite score; the factor is not applied). Otherwise renormalize:
//   w / (ordered_sum(w) + 1e-20) * factor, else w * factor (vLLM's arithmetic).
//
// exp and / are routing::exp_f32 (<= 1.01 ulp) and routing::div_f32 (correctly rounded but for
// subnormal quotients), identical on host and device. ordered_sum(v) adds
// v[i] into 32 fp64 partials (i % 32, increasing i), combines them pairwise as a warp
// butterfly does and rounds once to fp32: the order the kernels sum in.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <ATen/ops/tanh.h>

#include "hopper_moe/moe/topk_math.cuh"
#include "ops.h"

namespace hopper_moe::cpu {
namespace {

using routing::div_f32;
using routing::exp_f32;
using routing::finite_f32;
using routing::grouped_sigmoid;
using routing::sigmoid_f32;

// True when expert (or group) a with score sa is picked before b with score sb.
bool ranks_before(float sa, int64_t a, float sb, int64_t b) {
  const bool a_nan = std::isnan(sa);
  const bool b_nan = std::isnan(sb);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && sa != sb) return sa > sb;
  return a < b;
}

// The first k of `candidates` in rank order of score[candidate].
std::vector<int64_t> best_k(const std::vector<float>& score, std::vector<int64_t> candidates,
                            int64_t k) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(),
                    [&](int64_t a, int64_t b) { return ranks_before(score[a], a, score[b], b); });
  candidates.resize(k);
  return candidates;
}

// Sum in the kernels' order: 32 strided fp64 partials, butterfly, one rounding to fp32.
float ordered_sum(const std::vector<float>& v) {
  std::array<double, 32> part{};
  for (size_t i = 0; i < v.size(); ++i) part[i % 32] += static_cast<double>(v[i]);
  for (int off = 16; off > 0; off >>= 1) {
    std::array<double, 32> next{};
    for (int l = 0; l < 32; ++l) next[l] = part[l] + part[l ^ off];
    part = next;
  }
  return static_cast<float>(part[0]);
}

// gating / scores as fp32 [T, E] contiguous (the conversion from f16/bf16 is exact).
at::Tensor as_f32_rows(const at::Tensor& x) { return x.to(at::kFloat).contiguous(); }

void topk_gating(at::Tensor& topk_weights, at::Tensor& topk_indices,
                 at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                 bool renormalize, const OptTensor& bias, bool use_sigmoid, double scale,
                 const OptTensor& is_padding) {
  const int64_t T = gating_output.size(0);
  const int64_t E = gating_output.size(1);
  const int64_t K = topk_weights.size(1);
  if (T == 0) return;

  const at::Tensor x = as_f32_rows(gating_output);
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor pad = is_padding ? is_padding->contiguous() : at::Tensor();
  const float* xp = x.data_ptr<float>();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const bool* padp = is_padding ? pad.data_ptr<bool>() : nullptr;
  float* wp = topk_weights.data_ptr<float>();
  int32_t* tep = token_expert_indices.data_ptr<int32_t>();
  // int32 and uint32 ids share their bits (-1 is 0xffffffff as uint32).
  const bool ids64 = topk_indices.element_size() == 8;
  auto write_id = [&](int64_t i, int64_t id) {
    if (ids64) {
      static_cast<int64_t*>(topk_indices.data_ptr())[i] = id;
    } else {
      static_cast<int32_t*>(topk_indices.data_ptr())[i] = static_cast<int32_t>(id);
    }
  };
  const float factor = static_cast<float>(scale);

  std::vector<float> p(E), score(E), w(K);
  std::vector<int64_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) tep[t * K + k] = static_cast<int32_t>(k * T + t);
    if (padp && padp[t]) {
      for (int64_t k = 0; k < K; ++k) {
        write_id(t * K + k, -1);
        wp[t * K + k] = 0.0f;
      }
      continue;
    }
    const float* row = xp + t * E;
    if (use_sigmoid) {
      for (int64_t e = 0; e < E; ++e) p[e] = sigmoid_f32(row[e]);
    } else {
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < E; ++e) max = std::fmax(max, row[e]);
      for (int64_t e = 0; e < E; ++e) p[e] = exp_f32(row[e] - max);
      const float sum = ordered_sum(p);
      for (int64_t e = 0; e < E; ++e) p[e] = div_f32(p[e], sum);
    }
    for (int64_t e = 0; e < E; ++e) {
      if (!finite_f32(p[e])) p[e] = 0.0f;
      score[e] = bp ? p[e] + bp[e] : p[e];
    }

    const std::vector<int64_t> ids = best_k(score, experts, K);
    for (int64_t k = 0; k < K; ++k) w[k] = p[ids[k]];
    float denom = ordered_sum(w);
    if (!(denom > 0.0f)) denom = 1.0f;
    for (int64_t k = 0; k < K; ++k) {
      float v = w[k];
      if (renormalize) v = div_f32(v, denom);
      if (use_sigmoid) v = v * factor;
      write_id(t * K + k, ids[k]);
      wp[t * K + k] = v;
    }
  }
}

}  // namespace

void topk_softmax(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, const OptTensor& is_padding) {
  check::topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
                      renormalize, bias, is_padding);
  topk_gating(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize, bias,
              /*use_sigmoid=*/false, 1.0, is_padding);
}

void topk_sigmoid(at::Tensor& topk_weights, at::Tensor& topk_indices,
                  at::Tensor& token_expert_indices, const at::Tensor& gating_output,
                  bool renormalize, const OptTensor& bias, double routed_scaling_factor,
                  const OptTensor& is_padding) {
  check::topk_sigmoid(topk_weights, topk_indices, token_expert_indices, gating_output,
                      renormalize, bias, routed_scaling_factor, is_padding);
  topk_gating(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize, bias,
              /*use_sigmoid=*/true, routed_scaling_factor, is_padding);
}

std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& scores, int64_t n_group,
                                                int64_t topk_group, int64_t topk,
                                                bool renormalize, double routed_scaling_factor,
                                                const at::Tensor& bias, int64_t scoring_func) {
  check::grouped_topk(scores, n_group, topk_group, topk, renormalize, routed_scaling_factor,
                      bias, scoring_func);
  const int64_t T = scores.size(0);
  const int64_t E = scores.size(1);
  at::Tensor weights = scores.new_empty({T, topk}, scores.options().dtype(at::kFloat));
  at::Tensor ids = scores.new_empty({T, topk}, scores.options().dtype(at::kInt));
  if (T == 0) return {weights, ids};

  const int64_t G = E / n_group;
  const at::Tensor x = as_f32_rows(scores);
  const at::Tensor b = bias.to(at::kFloat).contiguous();
  // tanh(x / 2) by torch's own CPU tanh: grouped_sigmoid below is then bit for bit
  // 0.5 * torch.tanh(0.5 * x) + 0.5 on this machine, whatever vector unit it has.
  const at::Tensor half_tanh = scoring_func == 1 ? at::tanh(x.mul(0.5)) : at::Tensor();
  const float* tp = scoring_func == 1 ? half_tanh.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int32_t* idp = ids.data_ptr<int32_t>();
  const float factor = static_cast<float>(routed_scaling_factor);

  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> s(E), sb(E), group_score(n_group), w(topk);
  std::vector<int64_t> groups(n_group);
  std::iota(groups.begin(), groups.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * E;
    for (int64_t e = 0; e < E; ++e) {
      const float v = scoring_func == 1 ? grouped_sigmoid(tp[t * E + e]) : row[e];
      const float biased = v + bp[e];
      const bool valid = finite_f32(row[e]) && finite_f32(bp[e]) && finite_f32(biased);
      s[e] = valid ? v : 0.0f;
      sb[e] = valid ? biased : -kInf;
    }
    for (int64_t g = 0; g < n_group; ++g) {
      std::vector<int64_t> members(G);
      std::iota(members.begin(), members.end(), g * G);
      const std::vector<int64_t> top = best_k(sb, members, std::min<int64_t>(G, 2));
      group_score[g] = G == 1 ? sb[top[0]] : sb[top[0]] + sb[top[1]];
    }
    std::vector<int64_t> candidates;
    for (int64_t g : best_k(group_score, groups, topk_group)) {
      for (int64_t e = g * G; e < (g + 1) * G; ++e) candidates.push_back(e);
    }
    const std::vector<int64_t> chosen = best_k(sb, candidates, topk);
    bool any_valid = false;
    for (int64_t k = 0; k < topk; ++k) {
      w[k] = s[chosen[k]];
      any_valid = any_valid || sb[chosen[k]] != -kInf;
    }
    const float denom = ordered_sum(w) + 1e-20f;
    const float uniform = renormalize ? div_f32(1.0f, static_cast<float>(topk)) : 0.0f;
    for (int64_t k = 0; k < topk; ++k) {
      idp[t * topk + k] = static_cast<int32_t>(chosen[k]);
      float v = uniform;
      if (any_valid) v = renormalize ? div_f32(w[k], denom) * factor : w[k] * factor;
      wp[t * topk + k] = v;
    }
  }
  return {weights, ids};
}

}  // namespace hopper_moe::cpu
