// grouped_topk kernel (DeepSeek-V3 routing): group-limited top-k over biased scores.
//
// Layout: blocks of kWarpsPerBlock independent warps, one token row per warp at a time
// (grid-stride). The warp's scratch row (shared memory for E <= kMaxSmemExperts, else a global
// workspace) holds E value words followed by n_group group words. Per row:
//   1. s = f(x) (0.5 * tanhf(x / 2) + 0.5 in fp32, or x as is), sb = s + bias[e]; store sb,
//      or -inf when x, bias[e] or sb is not finite (an invalid expert);
//   2. group scores: lanes split into sub-warps of `lanes_per_group` lanes (a power of two;
//      1 when n_group >= 32), one sub-warp per group, each finds its group's top-2 sb
//      candidates (sub-warp butterfly on uint64 candidates) and stores sb1 + sb2 (sb1 alone
//      when a group has one expert);
//   3. topk_group arg-max passes over the group scores; the last pick is the threshold: group g
//      is kept iff its candidate is >= the threshold's;
//   4. the value words become keys: rank_key(sb) in kept groups, 0 ("not eligible") elsewhere;
//   5. topk arg-max passes over the keys; lane k % 32 recomputes the winner's unbiased s from
//      the logit (0 for an invalid winner, whose key is rank_key(-inf)) and writes id and weight;
//   6. no valid winner: every weight 1/topk (renormalize) or 0; else renormalize:
//      w / (fp64 sum of the topk weights + 1e-20) * routed_scaling_factor, or
//      w * routed_scaling_factor.
// topk <= topk_group * (E / n_group) (checked), so kept groups always hold enough experts.
#pragma once

#include "hopper_moe/moe/topk_common.cuh"

namespace hopper_moe::routing {

struct GroupedTopkParams {
  const void* scores;  // [T, E], row stride `row_stride` elements, last dim contiguous
  int64_t row_stride;
  int64_t num_tokens;
  int num_experts;
  int n_group;
  int group_size;       // E / n_group
  int lanes_per_group;  // power of two; 32 / lanes_per_group groups per step
  int topk_group;
  int top_k;
  const void* bias;  // [E] fp32, fp16 or bf16
  BiasType bias_type;
  bool renormalize;
  float scale;      // routed_scaling_factor
  float* weights;   // [T, topk]
  int32_t* ids;     // [T, topk]
  uint32_t* workspace;
  int64_t scratch_words;  // padded_words(E) + n_group
};

template <bool kSigmoid>
__device__ __forceinline__ float grouped_score(float x) {
  if constexpr (kSigmoid) {
    return grouped_sigmoid_of_logit(x);
  } else {
    return x;
  }
}

// __launch_bounds__(threads, 1): without the minimum-blocks hint ptxas squeezed some
// instantiations into 32 registers by spilling to the stack.
template <typename T, bool kSigmoid, int kVec, bool kScratchInSmem>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    grouped_topk_kernel(const GroupedTopkParams p) {
  extern __shared__ uint32_t smem_rows[];
  const int lane = threadIdx.x % kWarpSize;
  const int warp_in_block = threadIdx.x / kWarpSize;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_in_block;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  uint32_t* buf = kScratchInSmem ? smem_rows + warp_in_block * p.scratch_words
                                 : p.workspace + warp * p.scratch_words;
  const int E = p.num_experts;
  const int G = p.group_size;
  uint32_t* group_buf = buf + padded_words(E);  // n_group words

  for (int64_t row = warp; row < p.num_tokens; row += num_warps) {
    const T* x = static_cast<const T*>(p.scores) + row * p.row_stride;

    // 1. biased scores
    __syncwarp();  // the previous row's passes are done with buf
    for_each_in_row<T, kVec>(x, E, lane, [&](float v, int e) {
      const float b = bias_at(p.bias, p.bias_type, e);
      const float sb = fadd_rn(grouped_score<kSigmoid>(v), b);
      const bool valid = finite_f32(v) && finite_f32(b) && finite_f32(sb);
      buf[pad_index(e)] = f32_to_bits(valid ? sb : -INFINITY);
    });
    __syncwarp();

    // 2. group scores: sum of the group's two best biased scores
    const int lpg = p.lanes_per_group;
    const int sub = lane % lpg;
    for (int g0 = 0; g0 < p.n_group; g0 += kWarpSize / lpg) {
      const int g = g0 + lane / lpg;
      uint64_t top1 = 0;
      uint64_t top2 = 0;
      if (g < p.n_group) {
        const int end = (g + 1) * G;
        for (int e = g * G + sub; e < end; e += lpg) {
          const uint64_t c = pack_candidate(rank_key(bits_to_f32(buf[pad_index(e)])), e);
          if (c > top1) {
            top2 = top1;
            top1 = c;
          } else if (c > top2) {
            top2 = c;
          }
        }
      }
      for (int off = lpg / 2; off > 0; off >>= 1) {  // stays inside the sub-warp
        const uint64_t o1 = __shfl_xor_sync(kFullMask, top1, off);
        const uint64_t o2 = __shfl_xor_sync(kFullMask, top2, off);
        const uint64_t hi = top1 > o1 ? top1 : o1;
        const uint64_t lo = top1 > o1 ? o1 : top1;
        const uint64_t rest = top2 > o2 ? top2 : o2;
        top1 = hi;
        top2 = lo > rest ? lo : rest;
      }
      if (g < p.n_group && sub == 0) {
        float gs = bits_to_f32(buf[pad_index(candidate_id(top1))]);
        if (G > 1) gs = fadd_rn(gs, bits_to_f32(buf[pad_index(candidate_id(top2))]));
        group_buf[g] = f32_to_bits(gs);
      }
    }
    __syncwarp();

    // 3. keep the topk_group best groups: find the last kept one
    uint64_t threshold = ~0ull;
    for (int j = 0; j < p.topk_group; ++j) {
      uint64_t best = 0;
      for (int g = lane; g < p.n_group; g += kWarpSize) {
        const uint64_t c = pack_candidate(rank_key(bits_to_f32(group_buf[g])), g);
        if (c < threshold && c > best) best = c;
      }
      threshold = warp_max_u64(best);
    }

    // 4. keys of the experts in kept groups; 0 elsewhere
    for (int e = lane; e < E; e += kWarpSize) {
      const int g = e / G;
      const bool kept = pack_candidate(rank_key(bits_to_f32(group_buf[g])), g) >= threshold;
      buf[pad_index(e)] = kept ? rank_key(bits_to_f32(buf[pad_index(e)])) : 0u;
    }
    __syncwarp();

    // 5. topk passes
    const int64_t out = row * p.top_k;
    uint64_t prev = ~0ull;
    double weight_part = 0.0;
    bool lane_any_valid = false;
    const uint32_t invalid_key = rank_key(-INFINITY);
    for (int k = 0; k < p.top_k; ++k) {
      uint64_t best = 0;
      for (int e = lane; e < E; e += kWarpSize) {
        const uint32_t key = buf[pad_index(e)];
        const uint64_t c = pack_candidate(key, e);
        if (key != 0u && c < prev && c > best) best = c;
      }
      best = warp_max_u64(best);
      prev = best;
      if (lane == (k % kWarpSize)) {
        const int id = candidate_id(best);
        const bool valid = static_cast<uint32_t>(best >> 32) != invalid_key;
        float w = 0.0f;
        if (valid && static_cast<unsigned>(id) < static_cast<unsigned>(E)) {
          w = grouped_score<kSigmoid>(to_f32(x[id]));
        }
        lane_any_valid = lane_any_valid || valid;
        p.ids[out + k] = id;
        p.weights[out + k] = w;
        weight_part += static_cast<double>(w);
      }
    }

    // 6. renormalize and scale; lane k % 32 rereads only its own stores.
    const bool any_valid = __any_sync(kFullMask, lane_any_valid);
    const float denom = fadd_rn(static_cast<float>(warp_sum_f64(weight_part)), 1e-20f);
    const float uniform = p.renormalize ? div_f32(1.0f, static_cast<float>(p.top_k)) : 0.0f;
    for (int k = lane; k < p.top_k; k += kWarpSize) {
      float w = p.weights[out + k];
      if (!any_valid) {
        w = uniform;
      } else {
        w = p.renormalize ? fmul_rn(div_f32(w, denom), p.scale) : fmul_rn(w, p.scale);
      }
      p.weights[out + k] = w;
    }
  }
}

}  // namespace hopper_moe::routing
