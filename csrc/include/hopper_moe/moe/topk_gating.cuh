// topk_softmax / topk_sigmoid kernel: softmax or sigmoid over E experts, top-K by score (+bias).
//
// Layout: blocks of kWarpsPerBlock independent warps, one token row per warp at a time
// (grid-stride over rows, so any number of tokens works with a capped grid). Per row:
//   1. load the E logits (16-byte loads when the row allows) into the warp's scratch row
//      (shared memory for E <= kMaxSmemExperts, else a global workspace, same layout);
//   2. softmax: row max (NaN ignored), ex = exp(x - max), sum = warp_sum_f64 over lane-strided
//      partials, p = ex / sum; sigmoid: p = 1 / (1 + exp(-x)); p = 0 where it is not finite;
//      score = p (+ bias[e]); the scratch row then holds rank_key(score);
//   3. K arg-max passes over the keys; pass k's winner is broadcast to all lanes and lane
//      k % 32 recomputes its unbiased weight p from the logit (same arithmetic as step 2) and
//      writes id and weight;
//   4. renormalize: divide by the fp64 sum of the K weights (1 when that sum is not > 0);
//      sigmoid: multiply by routed_scaling_factor.
// Padding rows write id -1 and weight 0. token_expert_indices[t, k] = k * T + t for every row.
// No shared state between warps: __syncwarp orders the scratch row between phases.
#pragma once

#include "hopper_moe/moe/topk_common.cuh"

namespace hopper_moe::routing {

struct TopkGatingParams {
  const void* gating;   // [T, E], row stride `row_stride` elements, last dim contiguous
  int64_t row_stride;
  int64_t num_tokens;
  int num_experts;
  int top_k;
  const void* bias;     // [E] fp32 or the gating dtype, or nullptr
  BiasType bias_type;
  const bool* is_padding;  // [T] or nullptr
  float* weights;          // [T, K]
  void* indices;           // [T, K] int32 / uint32 (4 bytes) or int64
  bool indices_are_64bit;
  int32_t* token_expert_indices;  // [T, K]
  bool renormalize;
  bool apply_scale;  // sigmoid: weights *= scale
  float scale;
  uint32_t* workspace;    // scratch rows when they are not in shared memory
  int64_t scratch_words;  // words of one warp's scratch row
};

__device__ __forceinline__ void store_index(const TopkGatingParams& p, int64_t i, int id) {
  if (p.indices_are_64bit) {
    static_cast<int64_t*>(p.indices)[i] = id;
  } else {
    static_cast<int32_t*>(p.indices)[i] = id;
  }
}

// A non-finite probability (NaN or +inf logits in a softmax row, a NaN logit under sigmoid)
// counts as 0.
__device__ __forceinline__ float zero_if_not_finite(float p) { return finite_f32(p) ? p : 0.0f; }

template <bool kSigmoid>
__device__ __forceinline__ float gating_weight(float x, float row_max, float row_sum) {
  if constexpr (kSigmoid) {
    return zero_if_not_finite(sigmoid_f32(x));
  } else {
    return zero_if_not_finite(div_f32(exp_f32(fsub_rn(x, row_max)), row_sum));
  }
}

// __launch_bounds__(threads, 1): without the minimum-blocks hint ptxas squeezed some
// instantiations into 32 registers by spilling to the stack.
template <typename T, bool kSigmoid, int kVec, bool kScratchInSmem>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    topk_gating_kernel(const TopkGatingParams p) {
  extern __shared__ uint32_t smem_rows[];
  const int lane = threadIdx.x % kWarpSize;
  const int warp_in_block = threadIdx.x / kWarpSize;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp_in_block;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  uint32_t* buf = kScratchInSmem ? smem_rows + warp_in_block * p.scratch_words
                                 : p.workspace + warp * p.scratch_words;
  const int E = p.num_experts;
  const int K = p.top_k;
  const int64_t num_tokens = p.num_tokens;

  for (int64_t row = warp; row < num_tokens; row += num_warps) {
    const int64_t out = row * K;
    for (int k = lane; k < K; k += kWarpSize) {
      p.token_expert_indices[out + k] =
          static_cast<int32_t>(static_cast<int64_t>(k) * num_tokens + row);
    }
    if (p.is_padding != nullptr && p.is_padding[row]) {
      for (int k = lane; k < K; k += kWarpSize) {
        store_index(p, out + k, -1);
        p.weights[out + k] = 0.0f;
      }
      continue;
    }
    const T* x = static_cast<const T*>(p.gating) + row * p.row_stride;

    __syncwarp();  // the previous row's passes are done with buf
    float lane_max = -INFINITY;
    for_each_in_row<T, kVec>(x, E, lane, [&](float v, int e) {
      buf[pad_index(e)] = f32_to_bits(v);
      lane_max = fmaxf(lane_max, v);
    });
    __syncwarp();

    float row_max = 0.0f;
    float row_sum = 1.0f;
    if constexpr (!kSigmoid) {
      row_max = warp_max_f32(lane_max);
      double part = 0.0;
      for (int e = lane; e < E; e += kWarpSize) {
        const float ex = exp_f32(fsub_rn(bits_to_f32(buf[pad_index(e)]), row_max));
        buf[pad_index(e)] = f32_to_bits(ex);
        part += static_cast<double>(ex);
      }
      row_sum = static_cast<float>(warp_sum_f64(part));
    }
    for (int e = lane; e < E; e += kWarpSize) {
      const float v = bits_to_f32(buf[pad_index(e)]);
      float score = zero_if_not_finite(kSigmoid ? sigmoid_f32(v) : div_f32(v, row_sum));
      if (p.bias != nullptr) score = fadd_rn(score, bias_at(p.bias, p.bias_type, e));
      buf[pad_index(e)] = rank_key(score);
    }
    __syncwarp();

    uint64_t prev = ~0ull;  // every candidate ranks below it
    double weight_part = 0.0;
    for (int k = 0; k < K; ++k) {
      uint64_t best = 0;
      for (int e = lane; e < E; e += kWarpSize) {
        const uint64_t c = pack_candidate(buf[pad_index(e)], e);
        if (c < prev && c > best) best = c;
      }
      best = warp_max_u64(best);
      prev = best;
      if (lane == (k % kWarpSize)) {
        // K <= E, so every pass finds a candidate; the guard keeps a broken invariant from
        // turning into an out-of-bounds read.
        const int id = candidate_id(best);
        float w = 0.0f;
        if (static_cast<unsigned>(id) < static_cast<unsigned>(E)) {
          w = gating_weight<kSigmoid>(to_f32(x[id]), row_max, row_sum);
        }
        store_index(p, out + k, id);
        p.weights[out + k] = w;
        weight_part += static_cast<double>(w);
      }
    }

    if (p.renormalize || p.apply_scale) {
      float denom = static_cast<float>(warp_sum_f64(weight_part));
      if (!(denom > 0.0f)) denom = 1.0f;
      // Lane k % 32 wrote weights[out + k] above: each lane rereads only its own stores.
      for (int k = lane; k < K; k += kWarpSize) {
        float w = p.weights[out + k];
        if (p.renormalize) w = div_f32(w, denom);
        if (p.apply_scale) w = fmul_rn(w, p.scale);
        p.weights[out + k] = w;
      }
    }
  }
}

}  // namespace hopper_moe::routing
