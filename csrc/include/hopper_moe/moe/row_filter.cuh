// Which rows of a layer's intermediate [slots, I] were written by GEMM1, for the quantization
// pass that follows it (static_scaled_fp8_quant_rows): rows that do not count were never
// written and must not be read. Host and device code (the CPU definition uses the same rules).
//
//   AllRows           every row
//   SlotRows<IdT>     row r is slot r of topk_ids (flattened): it counts when
//                     0 <= ids[r] < num_experts and, with expert_map, expert_map[ids[r]] >= 0
//   LeadingRows       rows sorted by expert: row r counts when r < *end (the expert offsets'
//                     last entry; a negative end counts no row)
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HM_ROWS_HD __host__ __device__ __forceinline__
#else
#define HM_ROWS_HD inline
#endif

namespace hopper_moe::quant {

struct AllRows {
  HM_ROWS_HD bool operator()(int64_t) const { return true; }
};

template <typename IdT>
struct SlotRows {
  const IdT* ids;
  const int32_t* map;  // nullptr: no expert map
  int64_t num_experts;
  HM_ROWS_HD bool operator()(int64_t r) const {
    const int64_t id = static_cast<int64_t>(ids[r]);
    if (id < 0 || id >= num_experts) return false;
    return map == nullptr || map[id] >= 0;
  }
};

struct LeadingRows {
  const int64_t* end;
  HM_ROWS_HD bool operator()(int64_t r) const { return r < *end; }
};

}  // namespace hopper_moe::quant

#undef HM_ROWS_HD
