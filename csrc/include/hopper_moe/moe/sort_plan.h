// The chunking of the stable bucket sort's large path (align.cuh) and the size of its
// workspace, from shapes only. Host code, shared by the CUDA launchers (csrc/ops/permute.cu)
// and moe_permute_sort_workspace_size, which every build registers (CPU builds too: the size a
// caller allocates must not depend on the device that runs the sort).
#pragma once

#include <algorithm>
#include <cstdint>

namespace hopper_moe::sort_plan {

constexpr int64_t kWarp = 32;
// Bound of the per-chunk counts (ints): few buckets get many small chunks (more warps in
// flight), many buckets get fewer, larger chunks.
constexpr int64_t kMaxHistEntries = int64_t{8} << 20;
// Smallest chunk (slots; a multiple of kWarp).
constexpr int64_t kMinChunk = 256;

struct Plan {
  int64_t chunk;           // slots per chunk
  int64_t num_chunks;      // chunks over numel slots
  int64_t workspace_ints;  // hist [nb][num_chunks], cnt [nb], seg [nb + 1]
};

inline Plan plan(int64_t numel, int64_t nb) {
  const int64_t max_chunks = std::max<int64_t>(1, kMaxHistEntries / nb);
  int64_t chunk = (numel + max_chunks - 1) / max_chunks;
  chunk = std::max(kMinChunk, (chunk + kWarp - 1) / kWarp * kWarp);
  const int64_t num_chunks = (numel + chunk - 1) / chunk;
  return {chunk, num_chunks, num_chunks * nb + 2 * nb + 1};
}

// An upper bound of plan(numel, nb).workspace_ints for every nb <= nb_max: num_chunks never
// exceeds max(1, kMaxHistEntries / nb) (chunk >= numel / max_chunks) nor ceil(numel /
// kMinChunk), and both bounds times nb grow with nb.
inline int64_t workspace_ints_bound(int64_t numel, int64_t nb_max) {
  const int64_t hist = std::min((numel + kMinChunk - 1) / kMinChunk * nb_max,
                                std::max(nb_max, kMaxHistEntries));
  return hist + 2 * nb_max + 1;
}

// moe_permute sorts into n_local_expert + n_expert + 1 <= 2 * n_expert + 1 buckets.
inline int64_t permute_workspace_bytes(int64_t num_slots, int64_t n_expert) {
  return 4 * workspace_ints_bound(num_slots, 2 * n_expert + 1);
}

}  // namespace hopper_moe::sort_plan
