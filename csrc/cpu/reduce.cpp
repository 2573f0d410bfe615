// CPU definition of moe_sum: the semantics the CUDA kernel is tested against, bit for bit.
//
//   output[t, h] = round_to_dtype( sum_{k = 0..K-1, slot (t,k) counts} float(input[t, k, h]) )
//
// Input and topk_ids may have any strides (the hidden dimension of input too). The sum runs in
// fp32, in increasing k, starting from +0.0f, with one rounding at the end; a slot that does
// not count contributes nothing (its data is never read, so NaN/garbage in padded slots does
// not leak). Without topk_ids every slot counts. With topk_ids, slot (t,k)
// counts iff id = topk_ids[t,k] >= 0 and, when expert_map is given, id < expert_map.size(0)
// and expert_map[id] >= 0. A token whose slots all fail to count gets 0.
#include "ops.h"

#include <ATen/Dispatch.h>

namespace hopper_moe::cpu {
namespace {

// ids points at topk_ids[t, k] (topk_ids may have any strides).
template <typename id_t>
bool slot_counts(const id_t* ids, const int32_t* map, int64_t map_size) {
  const int64_t id = static_cast<int64_t>(*ids);
  if (id < 0) return false;
  if (map == nullptr) return true;
  return id < map_size && map[id] >= 0;
}

// Input and topk_ids are read through their strides (any strides).
template <typename scalar_t, typename id_t>
void moe_sum_loops(const at::Tensor& input, at::Tensor& output, const OptTensor& topk_ids,
                   const int32_t* map, int64_t map_size) {
  const int64_t num_tokens = input.size(0), top_k = input.size(1), hidden = input.size(2);
  const int64_t s_in_t = input.stride(0), s_in_k = input.stride(1), s_in_h = input.stride(2);
  const int64_t s_out_t = output.stride(0);
  const id_t* ids = topk_ids ? topk_ids->const_data_ptr<id_t>() : nullptr;
  const int64_t s_ids_t = topk_ids ? topk_ids->stride(0) : 0;
  const int64_t s_ids_k = topk_ids ? topk_ids->stride(1) : 0;
  const scalar_t* in = input.const_data_ptr<scalar_t>();
  scalar_t* out = output.mutable_data_ptr<scalar_t>();
  std::vector<float> acc(hidden);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < top_k; ++k) {
      if (ids != nullptr && !slot_counts(ids + t * s_ids_t + k * s_ids_k, map, map_size)) {
        continue;
      }
      const scalar_t* row = in + t * s_in_t + k * s_in_k;
      for (int64_t h = 0; h < hidden; ++h) acc[h] += static_cast<float>(row[h * s_in_h]);
    }
    scalar_t* dst = out + t * s_out_t;
    for (int64_t h = 0; h < hidden; ++h) dst[h] = static_cast<scalar_t>(acc[h]);
  }
}

}  // namespace

void moe_sum(const at::Tensor& input, at::Tensor& output, const OptTensor& topk_ids,
             const OptTensor& expert_map) {
  check::moe_sum(input, output, topk_ids, expert_map);
  if (input.size(0) == 0 || input.size(2) == 0) return;

  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  const int64_t map_size = expert_map ? expert_map->size(0) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "moe_sum", [&] {
    if (!topk_ids || topk_ids->scalar_type() == at::kInt) {
      moe_sum_loops<scalar_t, int32_t>(input, output, topk_ids, map, map_size);
    } else {
      moe_sum_loops<scalar_t, int64_t>(input, output, topk_ids, map, map_size);
    }
  });
}

}  // namespace hopper_moe::cpu
