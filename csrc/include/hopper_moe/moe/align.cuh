// Deterministic stable bucket sort of the flat top-k slots, and moe_align_block_size on it.
//
// Both moe_align_block_size and moe_permute sort the slots i in [0, numel) by a small integer
// key (the local expert) and give each slot its position in the sorted order. vLLM does it with
// atomics (align: order inside an expert unspecified) or a CUB radix sort (permute). Here one
// counting sort does both and is *stable*: inside a bucket, slots keep ascending slot order,
// so the GPU output equals the CPU definition bit for bit and never changes between runs.
//
// The slots are cut into chunks of `chunk` consecutive slots; one warp owns one chunk.
//   1 count    each warp counts its chunk's slots per bucket into its own column hist[*][c]
//              (__match_any_sync groups equal keys of a 32-slot step; the group leader adds
//              the group size: no atomics, each column has exactly one writer).
//   2 prefix   per bucket, exclusive prefix of hist[b][c] over the chunks c (in place), and
//              the bucket's total count cnt[b].
//   3 scan     seg[b] = exclusive prefix over buckets of pad(cnt[b]) (pad rounds up to the
//              block size for align, identity for permute); seg[nb] = the padded total.
//   4 epilogue op-specific writes that need only seg/cnt (block ids, padding, offsets).
//   5 rank     each warp walks its chunk again: slot position = seg[b] + hist[b][c] + number
//              of equal keys in lower lanes of the step; the leader then adds the group size.
// Two drivers run these phases:
//   small  (numel <= kSmallMaxSlots, nb <= kSmallMaxBuckets): one block of 8 warps, hist in
//          shared memory, phases separated by __syncthreads: one launch, the decode case,
//          as a programmatic dependent launch (common/pdl.cuh's rule).
//   large  any size: phases are separate kernels (phase 2: one block per bucket), hist/cnt/seg
//          in a global workspace whose size depends only on shapes (graph capture safe).
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "hopper_moe/common/pdl.cuh"

namespace hopper_moe::align_detail {

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // every kernel of this file runs 256 threads = 8 warps
constexpr int kWarps = kThreads / kWarp;
// One scan tile covers kThreads * kScanItems buckets.
constexpr int kScanItems = 4;
// Small path: one block of kWarps warps, at most 32 steps of 32 slots per warp.
constexpr int64_t kSmallMaxSlots = int64_t{kWarps} * kWarp * 32;
constexpr int kSmallMaxBuckets = kThreads * kScanItems;
static_assert(kThreads % kWarp == 0, "blocks are whole warps");
static_assert(kSmallMaxSlots == 8192, "32 steps of 32 slots per warp");

// Shared memory of the small path: hist[nb][kWarps], cnt[nb], seg[nb + 1] (ints).
inline int64_t small_smem_bytes(int nb) {
  return (int64_t{kWarps} * nb + nb + nb + 1) * static_cast<int64_t>(sizeof(int));
}

__device__ __forceinline__ unsigned lanemask_lt(int lane) { return (1u << lane) - 1u; }

// Phase 1 for one chunk [begin, end): col[b * stride] = number of slots with key b.
// key(i) returns a bucket in [0, nb) or a negative value for a slot that is not placed.
template <class KeyFn>
__device__ void count_chunk(const KeyFn& key, int64_t begin, int64_t end, int* col,
                            int64_t stride, int nb, int lane) {
  for (int b = lane; b < nb; b += kWarp) col[b * stride] = 0;
  __syncwarp();
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int k = i < end ? key(i) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, k);
    if (k >= 0 && (peers & lanemask_lt(lane)) == 0) col[k * stride] += __popc(peers);
    __syncwarp();
  }
}

// Phase 5 for one chunk: col[b * stride] enters as the number of bucket-b slots in earlier
// chunks. Calls on_slot(i, key, pos) for every slot of the chunk (pos -1: not placed).
template <class KeyFn, class SlotFn>
__device__ void rank_chunk(const KeyFn& key, const SlotFn& on_slot, int64_t begin, int64_t end,
                           int* col, int64_t stride, const int* seg, int lane) {
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int k = i < end ? key(i) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, k);
    const int lower = __popc(peers & lanemask_lt(lane));
    const int pos = k >= 0 ? seg[k] + col[k * stride] + lower : -1;
    __syncwarp();  // every peer has read its count before the leader advances it
    if (k >= 0 && lower == 0) col[k * stride] += __popc(peers);
    __syncwarp();
    if (i < end) on_slot(i, k, pos);
  }
}

// Exclusive scan with the calling block (kThreads threads): out[j] = sum_{j' < j} f(in[j'])
// for j in [0, n). in and out may be the same array. Returns the total (in every thread).
template <class F>
__device__ int block_exclusive_scan(const int* in, int* out, int64_t n, const F& f) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  int carry = 0;
  for (int64_t tile = 0; tile < n; tile += kThreads * kScanItems) {
    const int64_t first = tile + int64_t{threadIdx.x} * kScanItems;
    int v[kScanItems];
    int sum = 0;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      v[j] = first + j < n ? f(in[first + j]) : 0;
      sum += v[j];
    }
    int excl = 0, total = 0;
    BlockScan(temp).ExclusiveSum(sum, excl, total);
    int run = carry + excl;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (first + j < n) out[first + j] = run;
      run += v[j];
    }
    carry += total;
    __syncthreads();  // temp is reused by the next tile
  }
  return carry;
}

struct Identity {
  __device__ __forceinline__ int operator()(int c) const { return c; }
};

// Largest bucket e in [0, nb) with seg[e] <= x, for 0 <= x < seg[nb]. Empty buckets share
// their start with the next one, so the largest such e is the one whose segment holds x.
__device__ __forceinline__ int owner_of(const int* seg, int nb, int64_t x) {
  int lo = 0, hi = nb - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (seg[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------------- drivers

// Small path: the whole sort in one block. epi.run(cnt, seg, total, tid, nthreads) is phase 4
// (loops over its own index spaces with the given thread id and count).
template <class KeyFn, class PadFn, class Epilogue, class SlotFn>
__global__ void __launch_bounds__(kThreads)
    sort_small_kernel(KeyFn key, PadFn pad, Epilogue epi, SlotFn on_slot, int64_t numel,
                      int nb) {
  extern __shared__ int smem[];
  int* hist = smem;               // [nb][kWarps]
  int* cnt = hist + kWarps * nb;  // [nb]
  int* seg = cnt + nb;            // [nb + 1]
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  // Chunks are whole 32-slot steps so that a step never straddles two warps.
  const int64_t chunk = (numel + kWarps * kWarp - 1) / (kWarps * kWarp) * kWarp;
  const int64_t begin = min(numel, warp * chunk);
  const int64_t end = min(numel, begin + chunk);

  pdl::wait_for_prerequisites();  // the keys come from the kernels before
  pdl::launch_dependents();
  count_chunk(key, begin, end, hist + warp, kWarps, nb, lane);
  __syncthreads();
  for (int b = threadIdx.x; b < nb; b += kThreads) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = hist[b * kWarps + w];
      hist[b * kWarps + w] = run;
      run += c;
    }
    cnt[b] = run;
  }
  __syncthreads();
  const int total = block_exclusive_scan(cnt, seg, nb, pad);
  if (threadIdx.x == 0) seg[nb] = total;
  __syncthreads();
  epi.run(cnt, seg, total, static_cast<int64_t>(threadIdx.x), int64_t{kThreads});
  rank_chunk(key, on_slot, begin, end, hist + warp, kWarps, seg, lane);
}

// Large path. hist is [nb][num_chunks]: bucket b's counts over the chunks are contiguous.
// Phase 1: global warp c owns chunk c.
template <class KeyFn>
__global__ void __launch_bounds__(kThreads)
    count_kernel(KeyFn key, int* hist, int64_t numel, int64_t chunk, int64_t num_chunks,
                 int nb) {
  const int64_t c = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarp;
  if (c >= num_chunks) return;
  const int64_t begin = c * chunk;
  count_chunk(key, begin, min(numel, begin + chunk), hist + c, num_chunks, nb,
              static_cast<int>(threadIdx.x % kWarp));
}

// Phase 2: block b scans bucket b's counts over the chunks in place.
__global__ void __launch_bounds__(kThreads)
    chunk_scan_kernel(int* hist, int* cnt, int64_t num_chunks) {
  int* row = hist + int64_t{blockIdx.x} * num_chunks;
  const int total = block_exclusive_scan(row, row, num_chunks, Identity{});
  if (threadIdx.x == 0) cnt[blockIdx.x] = total;
}

// Phase 3: one block scans the padded bucket counts.
template <class PadFn>
__global__ void __launch_bounds__(kThreads)
    bucket_scan_kernel(const int* cnt, int* seg, int nb, PadFn pad) {
  const int total = block_exclusive_scan(cnt, seg, nb, pad);
  if (threadIdx.x == 0) seg[nb] = total;
}

// Phase 4: epi.run over a grid-stride range.
template <class Epilogue>
__global__ void __launch_bounds__(kThreads)
    epilogue_kernel(Epilogue epi, const int* cnt, const int* seg, int nb) {
  epi.run(cnt, seg, seg[nb], int64_t{blockIdx.x} * kThreads + threadIdx.x,
          int64_t{gridDim.x} * kThreads);
}

// Phase 5.
template <class KeyFn, class SlotFn>
__global__ void __launch_bounds__(kThreads)
    rank_kernel(KeyFn key, SlotFn on_slot, int* hist, const int* seg, int64_t numel,
                int64_t chunk, int64_t num_chunks) {
  const int64_t c = int64_t{blockIdx.x} * kWarps + threadIdx.x / kWarp;
  if (c >= num_chunks) return;
  const int64_t begin = c * chunk;
  rank_chunk(key, on_slot, begin, min(numel, begin + chunk), hist + c, num_chunks, seg,
             static_cast<int>(threadIdx.x % kWarp));
}

// ------------------------------------------------------------------- moe_align_block_size

// Key of slot i: its local expert in [0, num_experts), or -1 (skipped): an id outside
// [0, num_experts), or an expert_map entry outside [0, num_experts) (-1 = not local).
template <typename id_t>
struct AlignKey {
  const id_t* topk_ids;
  const int32_t* expert_map;  // nullptr: identity
  int num_experts;
  __device__ __forceinline__ int operator()(int64_t i) const {
    const int64_t id = static_cast<int64_t>(topk_ids[i]);
    if (id < 0 || id >= num_experts) return -1;
    const int e = expert_map != nullptr ? expert_map[id] : static_cast<int>(id);
    return (e >= 0 && e < num_experts) ? e : -1;
  }
};

struct PadToBlock {
  int block_size;
  __device__ __forceinline__ int operator()(int c) const {
    return (c + block_size - 1) / block_size * block_size;
  }
};

// Phase 4 of align: num_tokens_post_pad, experts_ids of every block, and numel in every
// sorted position that no slot takes (segment padding and the tail after the last segment).
struct AlignEpilogue {
  int32_t* sorted_token_ids;
  int32_t* experts_ids;
  int32_t* num_tokens_post_pad;
  int64_t sorted_len;
  int64_t num_blocks;  // experts_ids.numel()
  int block_size;
  int num_experts;
  int32_t numel;
  __device__ void run(const int* cnt, const int* seg, int total, int64_t tid,
                      int64_t nthreads) const {
    if (tid == 0) *num_tokens_post_pad = total;
    for (int64_t b = tid; b < num_blocks; b += nthreads) {
      const int64_t x = b * block_size;
      experts_ids[b] = x < total ? owner_of(seg, num_experts, x) : -1;
    }
    for (int64_t e = tid; e < num_experts; e += nthreads) {
      for (int p = seg[e] + cnt[e]; p < seg[e + 1]; ++p) sorted_token_ids[p] = numel;
    }
    for (int64_t p = total + tid; p < sorted_len; p += nthreads) sorted_token_ids[p] = numel;
  }
};

// Phase 5 of align: the slot's sorted position, and scatter_idx[i] = i for a placed slot, -1
// for a skipped one (the masked identity of the routed rows, as vLLM defines it).
struct AlignSlot {
  int32_t* sorted_token_ids;
  int32_t* scatter_idx;  // nullptr when not asked for
  __device__ __forceinline__ void operator()(int64_t i, int key, int pos) const {
    if (key >= 0) sorted_token_ids[pos] = static_cast<int32_t>(i);
    if (scatter_idx != nullptr) scatter_idx[i] = key >= 0 ? static_cast<int32_t>(i) : -1;
  }
};

}  // namespace hopper_moe::align_detail
