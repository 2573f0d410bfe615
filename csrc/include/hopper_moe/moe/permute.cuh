// Device code of moe_permute, moe_unpermute and shuffle_rows.
//
// moe_permute = the stable bucket sort of align.cuh over the keys below (every slot is placed:
// local experts first, then non-local and invalid slots), then a row gather into
// permuted_input. moe_unpermute = per token, a fixed-order (k = 0..topk-1) fp32 weighted sum of
// its permuted rows. shuffle_rows = a row gather. No atomics anywhere: results are bitwise
// deterministic.
//
// Row gathers copy bytes in units of U (16, 8, 4, 2 or 1 bytes): the host picks the widest
// unit that divides the row size, both base pointers and both row strides, so aligned rows move
// as 16-byte vectors and anything else still works. A row is handled by a group of `tpr`
// threads (a power of two <= 256, about the row's unit count), so short rows do not leave most
// of a block idle.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/moe/align.cuh"

namespace hopper_moe::permute_detail {

using align_detail::kThreads;

// ------------------------------------------------------------------------------ moe_permute

// Sort key of slot i: its local expert in [0, n_local); else, for an id in [0, n_expert) that
// is not local, n_local + id (vLLM orders those by global id); else n_local + n_expert.
template <typename id_t>
struct PermuteKey {
  const id_t* topk_ids;
  const int32_t* expert_map;  // nullptr: identity
  int n_expert;
  int n_local;
  __device__ __forceinline__ int operator()(int64_t i) const {
    const int64_t id = static_cast<int64_t>(topk_ids[i]);
    if (id < 0 || id >= n_expert) return n_local + n_expert;
    const int local = expert_map != nullptr ? expert_map[id] : static_cast<int>(id);
    return (local >= 0 && local < n_local) ? local : n_local + static_cast<int>(id);
  }
};

// Phase 4 of permute: offsets of the local experts (the last one is the valid count) and the
// sentinel `slots` in every permuted_idx entry past the valid rows.
struct PermuteEpilogue {
  int64_t* expert_first_token_offset;
  int32_t* permuted_idx;
  int64_t permuted_idx_len;
  int n_local;
  int32_t slots;
  __device__ void run(const int* cnt, const int* seg, int total, int64_t tid,
                      int64_t nthreads) const {
    (void)cnt;
    (void)total;
    for (int64_t e = tid; e <= n_local; e += nthreads) expert_first_token_offset[e] = seg[e];
    for (int64_t r = seg[n_local] + tid; r < permuted_idx_len; r += nthreads) {
      permuted_idx[r] = slots;
    }
  }
};

// Phase 5 of permute: slot i carries v = token_expert_indices[i] to its row pos.
struct PermuteSlot {
  const int32_t* token_expert_indices;
  int32_t* permuted_idx;
  int32_t* inv_permuted_idx;
  int n_local;
  int32_t slots;
  __device__ __forceinline__ void operator()(int64_t i, int key, int pos) const {
    const int32_t v = token_expert_indices[i];
    if (key < n_local) permuted_idx[pos] = v;
    if (v >= 0 && v < slots) inv_permuted_idx[v] = pos;
  }
};

// ---------------------------------------------------------------------------- row gathers

// What a gather does with destination row r.
constexpr int64_t kZeroRow = -1;  // write zeros
constexpr int64_t kSkipRow = -2;  // leave the row untouched

// permuted_input row r < valid count <- input row permuted_idx[r] / topk; rows past the
// valid count are untouched.
struct PermuteSource {
  const int32_t* permuted_idx;
  const int64_t* num_valid;  // &expert_first_token_offset[n_local]
  int64_t slots;
  int64_t topk;
  __device__ __forceinline__ int64_t operator()(int64_t r) const {
    if (r >= *num_valid) return kSkipRow;
    const int64_t v = permuted_idx[r];
    return (v >= 0 && v < slots) ? v / topk : kZeroRow;
  }
};

// output row i <- input row dst2src_map[i]; an index outside [0, rows_in) gives zeros.
template <typename id_t>
struct ShuffleSource {
  const id_t* dst2src_map;
  int64_t rows_in;
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    const int64_t s = static_cast<int64_t>(dst2src_map[i]);
    return (s >= 0 && s < rows_in) ? s : kZeroRow;
  }
};

struct GatherParams {
  const char* in;
  char* out;
  int64_t in_stride;   // bytes between rows
  int64_t out_stride;  // bytes between rows
  int64_t num_rows;    // destination rows to visit
  int64_t units;       // units of U per row
  int log2_tpr;        // threads per row = 1 << log2_tpr
};

template <typename U, class SourceFn>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(SourceFn source, GatherParams p) {
  // A dependent launch (common/pdl.cuh's rule): the row indices come from the sort before.
  // The kernel after this one may then start (the grouped GEMM streams its weights).
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  const int tpr = 1 << p.log2_tpr;
  const int rows_per_block = kThreads >> p.log2_tpr;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  for (int64_t r = int64_t{blockIdx.x} * rows_per_block + (threadIdx.x >> p.log2_tpr);
       r < p.num_rows; r += int64_t{gridDim.x} * rows_per_block) {
    const int64_t s = source(r);
    if (s == kSkipRow) continue;
    U* dst = reinterpret_cast<U*>(p.out + r * p.out_stride);
    if (s >= 0) {
      const U* src = reinterpret_cast<const U*>(p.in + s * p.in_stride);
      for (int64_t u = lane; u < p.units; u += tpr) dst[u] = src[u];
    } else {
      for (int64_t u = lane; u < p.units; u += tpr) dst[u] = U{};
    }
  }
}

// ---------------------------------------------------------------------------- moe_unpermute

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

struct UnpermuteParams {
  const void* permuted;     // [perm_rows, hidden]
  void* out;                // [num_tokens, hidden]
  const float* weights;     // [num_tokens, topk]
  const int32_t* inv;       // [num_tokens * topk]
  const int64_t* num_valid; // nullptr, or &expert_first_token_offset[last]
  int64_t perm_stride;      // elements between permuted rows
  int64_t out_stride;       // elements between output rows
  int64_t perm_rows;
  int64_t num_tokens;
  int64_t hidden;
  int topk;
  int log2_tpr;
};

// out[t] = sum_{k ascending} w[t,k] * permuted[inv[t,k]] in fp32, each product and each sum
// rounded separately (__fmul_rn/__fadd_rn: no FMA contraction), exactly as the CPU loop. The k
// are taken kUnpermuteChunk at a time with all their index, weight and row loads issued before
// the sum, so a decode row costs a few memory latencies rather than two per k.
constexpr int kUnpermuteChunk = 8;
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) unpermute_kernel(UnpermuteParams p) {
  // Launched as a programmatic dependent of the kernel that wrote `permuted`.
  pdl::wait_for_prerequisites();
  pdl::launch_dependents();
  using P = Pack<T, kVec>;
  const int tpr = 1 << p.log2_tpr;
  const int rows_per_block = kThreads >> p.log2_tpr;
  const int lane = static_cast<int>(threadIdx.x) & (tpr - 1);
  int64_t rows = p.perm_rows;
  if (p.num_valid != nullptr) rows = min(rows, *p.num_valid);
  const int64_t packs = p.hidden / kVec;
  const T* perm = static_cast<const T*>(p.permuted);
  T* out = static_cast<T*>(p.out);
  for (int64_t t = int64_t{blockIdx.x} * rows_per_block + (threadIdx.x >> p.log2_tpr);
       t < p.num_tokens; t += int64_t{gridDim.x} * rows_per_block) {
    for (int64_t g = lane; g < packs; g += tpr) {
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
      for (int k0 = 0; k0 < p.topk; k0 += kUnpermuteChunk) {
        int64_t r[kUnpermuteChunk];
        float w[kUnpermuteChunk];
        P x[kUnpermuteChunk];
#pragma unroll
        for (int c = 0; c < kUnpermuteChunk; ++c) {
          r[c] = k0 + c < p.topk ? p.inv[t * p.topk + k0 + c] : -1;
          if (r[c] >= rows) r[c] = -1;
        }
#pragma unroll
        for (int c = 0; c < kUnpermuteChunk; ++c) {
          if (r[c] >= 0) {
            w[c] = p.weights[t * p.topk + k0 + c];
            x[c] = *reinterpret_cast<const P*>(perm + r[c] * p.perm_stride + g * kVec);
          }
        }
#pragma unroll
        for (int c = 0; c < kUnpermuteChunk; ++c) {
          if (r[c] < 0) continue;  // a slot no local expert computed
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            acc[j] = __fadd_rn(acc[j], __fmul_rn(w[c], static_cast<float>(x[c].v[j])));
          }
        }
      }
      P y;
#pragma unroll
      for (int j = 0; j < kVec; ++j) y.v[j] = static_cast<T>(acc[j]);
      *reinterpret_cast<P*>(out + t * p.out_stride + g * kVec) = y;
    }
  }
}

}  // namespace hopper_moe::permute_detail
