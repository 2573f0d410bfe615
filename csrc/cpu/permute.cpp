// CPU definitions of the permutation family (same semantics as vLLM's moe_align_block_size,
// moe_permute with its scratch forms, moe_unpermute and shuffle_rows). These loops ARE the
// specification the CUDA kernels (csrc/ops/permute.cu) are tested against, bit for bit.
//
// Common rule: a flat slot i = t * topk + k of topk_ids counts only when its id is in
// [0, num_experts) and, with an expert map, maps to a local expert; other slots are skipped
// (never an out-of-bounds access). Within an expert, slots keep ascending slot order (a stable
// sort), on both devices.
#include <algorithm>
#include <cstring>
#include <vector>

#include "hopper_moe/common/checks.h"
#include "ops.h"

namespace hopper_moe::cpu {
namespace {

int64_t read_index(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kInt ? static_cast<int64_t>(t.const_data_ptr<int32_t>()[i])
                                     : t.const_data_ptr<int64_t>()[i];
}

// Calls f(static_cast<T*>(nullptr)) with T the C++ type of a row dtype (HM_ROW_DTYPES).
template <typename F>
void dispatch_row_dtype(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: f(static_cast<float*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kFloat8_e4m3fn: f(static_cast<c10::Float8_e4m3fn*>(nullptr)); break;
    case at::kFloat8_e5m2: f(static_cast<c10::Float8_e5m2*>(nullptr)); break;
    default: TORCH_CHECK(false, "hopper_moe: unexpected row dtype ", c10::toString(st));
  }
}

// Row r of a 2-D row tensor (last dim contiguous), as bytes.
char* row_ptr(const at::Tensor& t, int64_t r) {
  return static_cast<char*>(t.data_ptr()) + r * t.stride(0) * t.element_size();
}

}  // namespace

void moe_align_block_size(const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size,
                          at::Tensor& sorted_token_ids, at::Tensor& experts_ids,
                          at::Tensor& num_tokens_post_pad, const OptTensor& maybe_expert_map,
                          const OptTensor& scatter_idx) {
  check::moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                              num_tokens_post_pad, maybe_expert_map, scatter_idx);
  const int64_t numel = topk_ids.numel();
  int32_t* sorted = sorted_token_ids.data_ptr<int32_t>();
  int32_t* blocks = experts_ids.data_ptr<int32_t>();
  // Padding slots and the unused tail hold numel; blocks past the last segment hold -1.
  std::fill(sorted, sorted + sorted_token_ids.numel(), static_cast<int32_t>(numel));
  std::fill(blocks, blocks + experts_ids.numel(), -1);
  if (numel == 0) {
    num_tokens_post_pad.data_ptr<int32_t>()[0] = 0;
    return;
  }

  // The (local) expert of each slot, or -1 when the slot is skipped.
  const int32_t* map = maybe_expert_map ? maybe_expert_map->const_data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> expert(numel);
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t id = read_index(topk_ids, i);
    int64_t e = -1;
    if (id >= 0 && id < num_experts) e = map ? map[id] : id;
    if (e < 0 || e >= num_experts) e = -1;
    expert[i] = e;
    if (e >= 0) ++count[e];
  }

  // Expert e owns sorted positions [seg[e], seg[e+1]), its count rounded up to block_size.
  std::vector<int64_t> seg(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) {
    seg[e + 1] = seg[e] + (count[e] + block_size - 1) / block_size * block_size;
  }

  int32_t* scatter = scatter_idx ? scatter_idx->data_ptr<int32_t>() : nullptr;
  std::vector<int64_t> cursor(seg.begin(), seg.end() - 1);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t e = expert[i];
    const int64_t pos = e >= 0 ? cursor[e]++ : -1;
    if (e >= 0) sorted[pos] = static_cast<int32_t>(i);
    // scatter_idx: the slot's own index where it is placed, -1 where it is skipped (vLLM's
    // masked identity of the routed rows).
    if (scatter) scatter[i] = e >= 0 ? static_cast<int32_t>(i) : -1;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t b = seg[e] / block_size; b < seg[e + 1] / block_size; ++b) {
      blocks[b] = static_cast<int32_t>(e);
    }
  }
  num_tokens_post_pad.data_ptr<int32_t>()[0] = static_cast<int32_t>(seg[num_experts]);
}

namespace {

// moe_permute's stable sort of the slots: expert_first_token_offset, inv (slot -> row: for
// every slot, also the skipped ones, which follow the valid rows) and perm (row -> slot for the
// perm_len rows; rows past the valid ones hold the slot count). Returns the valid row count.
int64_t sort_routing(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices,
                     const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert,
                     at::Tensor& expert_first_token_offset, at::Tensor& inv_idx, int32_t* perm,
                     int64_t perm_len) {
  const int64_t slots = topk_ids.numel();
  int64_t* offsets = expert_first_token_offset.data_ptr<int64_t>();
  if (slots == 0) {
    std::fill(offsets, offsets + n_local_expert + 1, 0);
    std::fill(perm, perm + perm_len, 0);
    return 0;
  }

  // Sort key of each slot (stable, ascending): its local expert when it has one; then the
  // slots of in-range ids that are not local, ordered by global id (vLLM sorts them by
  // id + n_expert); last the slots whose id is outside [0, n_expert).
  const int32_t* map = expert_map ? expert_map->const_data_ptr<int32_t>() : nullptr;
  const int64_t num_keys = n_local_expert + n_expert + 1;
  std::vector<int64_t> key(slots);
  std::vector<int64_t> start(num_keys + 1, 0);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t id = read_index(topk_ids, i);
    int64_t k = n_local_expert + n_expert;
    if (id >= 0 && id < n_expert) {
      const int64_t local = map ? map[id] : id;
      k = (local >= 0 && local < n_local_expert) ? local : n_local_expert + id;
    }
    key[i] = k;
    ++start[k + 1];
  }
  for (int64_t k = 0; k < num_keys; ++k) start[k + 1] += start[k];
  const int64_t num_valid = start[n_local_expert];

  // Slot i carries its expanded source row v = token_expert_indices[i] (callers pass
  // arange(T*topk), so v == i); destination row r gets source token v / topk.
  const int32_t* source = token_expert_indices.const_data_ptr<int32_t>();
  int32_t* inv = inv_idx.data_ptr<int32_t>();
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < slots; ++i) {
    const int64_t r = cursor[key[i]]++;
    const int32_t v = source[i];
    if (r < num_valid) perm[r] = v;
    if (v >= 0 && v < slots) inv[v] = static_cast<int32_t>(r);
  }
  for (int64_t r = num_valid; r < perm_len; ++r) perm[r] = static_cast<int32_t>(slots);
  for (int64_t e = 0; e <= n_local_expert; ++e) offsets[e] = start[e];
  return num_valid;
}

// moe_permute after its checks.
void permute_checked(const at::Tensor& input, const at::Tensor& topk_ids,
                     const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                     int64_t n_expert, int64_t n_local_expert, int64_t topk,
                     at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,
                     at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx) {
  const int64_t slots = input.size(0) * topk;
  int32_t* perm = permuted_idx.data_ptr<int32_t>();
  const int64_t num_valid =
      sort_routing(topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                   expert_first_token_offset, inv_permuted_idx, perm, permuted_idx.numel());

  // Rows [0, num_valid) of permuted_input are written; rows past them are left untouched.
  const int64_t row_bytes = input.size(1) * input.element_size();
  for (int64_t r = 0; r < num_valid; ++r) {
    const int32_t v = perm[r];
    if (v >= 0 && v < slots) {
      std::memcpy(row_ptr(permuted_input, r), row_ptr(input, v / topk), row_bytes);
    } else {
      std::memset(row_ptr(permuted_input, r), 0, row_bytes);
    }
  }
}

}  // namespace

void moe_permute(const at::Tensor& input, const at::Tensor& topk_ids,
                 const at::Tensor& token_expert_indices, const OptTensor& expert_map,
                 int64_t n_expert, int64_t n_local_expert, int64_t topk,
                 at::Tensor& permuted_input, at::Tensor& expert_first_token_offset,
                 at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx) {
  check::moe_permute(input, topk_ids, token_expert_indices, expert_map, n_expert,
                     n_local_expert, topk, permuted_input, expert_first_token_offset,
                     inv_permuted_idx, permuted_idx);
  permute_checked(input, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                  topk, permuted_input, expert_first_token_offset, inv_permuted_idx,
                  permuted_idx);
}

// The scratch buffers are the caller's; the CPU definition needs none of them.
void moe_permute_with_scratch(const at::Tensor& input, const at::Tensor& topk_ids,
                              const at::Tensor& token_expert_indices,
                              const OptTensor& expert_map, int64_t n_expert,
                              int64_t n_local_expert, int64_t topk, at::Tensor& permuted_input,
                              at::Tensor& expert_first_token_offset,
                              at::Tensor& inv_permuted_idx, at::Tensor& permuted_idx,
                              at::Tensor& sort_workspace, at::Tensor& permuted_experts_id,
                              at::Tensor& sorted_row_idx, at::Tensor& topk_ids_for_sort) {
  check::moe_permute_with_scratch(input, topk_ids, token_expert_indices, expert_map, n_expert,
                                  n_local_expert, topk, permuted_input,
                                  expert_first_token_offset, inv_permuted_idx, permuted_idx,
                                  sort_workspace, permuted_experts_id, sorted_row_idx,
                                  topk_ids_for_sort);
  permute_checked(input, topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
                  topk, permuted_input, expert_first_token_offset, inv_permuted_idx,
                  permuted_idx);
}

// moe_permute's routing half: the offsets and the slot -> row map (scatter_idx), no rows
// moved. sorted_rows receives moe_permute's permuted_idx (as on the GPU).
void moe_prepare_scatter(const at::Tensor& topk_ids, const at::Tensor& token_expert_indices,
                         const OptTensor& expert_map, int64_t n_expert, int64_t n_local_expert,
                         at::Tensor& expert_first_token_offset, at::Tensor& scatter_idx,
                         at::Tensor& sort_workspace, at::Tensor& sorted_experts,
                         at::Tensor& sorted_rows, at::Tensor& topk_ids_for_sort) {
  check::moe_prepare_scatter(topk_ids, token_expert_indices, expert_map, n_expert,
                             n_local_expert, expert_first_token_offset, scatter_idx,
                             sort_workspace, sorted_experts, sorted_rows, topk_ids_for_sort);
  sort_routing(topk_ids, token_expert_indices, expert_map, n_expert, n_local_expert,
               expert_first_token_offset, scatter_idx, sorted_rows.data_ptr<int32_t>(),
               topk_ids.numel());
}

void moe_unpermute(const at::Tensor& permuted_hidden_states, const at::Tensor& topk_weights,
                   const at::Tensor& inv_permuted_idx,
                   const OptTensor& expert_first_token_offset, int64_t topk,
                   at::Tensor& hidden_states) {
  check::moe_unpermute(permuted_hidden_states, topk_weights, inv_permuted_idx,
                       expert_first_token_offset, topk, hidden_states);
  const int64_t num_tokens = hidden_states.size(0);
  const int64_t hidden = hidden_states.size(1);
  if (num_tokens == 0 || hidden == 0) return;

  // A slot contributes only when its permuted row exists and, given the offsets, lies below
  // the valid count (rows of non-local experts are never computed).
  int64_t rows = permuted_hidden_states.size(0);
  if (expert_first_token_offset) {
    const auto& o = *expert_first_token_offset;
    rows = std::min(rows, o.const_data_ptr<int64_t>()[o.numel() - 1]);
  }
  const float* weights = topk_weights.const_data_ptr<float>();
  const int32_t* inv = inv_permuted_idx.const_data_ptr<int32_t>();
  dispatch_row_dtype(hidden_states.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    std::vector<float> acc(hidden);
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t r = inv[t * topk + k];
        if (r < 0 || r >= rows) continue;
        const float w = weights[t * topk + k];
        const T* x = reinterpret_cast<const T*>(row_ptr(permuted_hidden_states, r));
        for (int64_t h = 0; h < hidden; ++h) {
          // Rounded product, then rounded sum: the CUDA kernel does the same (no FMA).
          const float p = w * static_cast<float>(x[h]);
          acc[h] = acc[h] + p;
        }
      }
      T* y = reinterpret_cast<T*>(row_ptr(hidden_states, t));
      for (int64_t h = 0; h < hidden; ++h) y[h] = static_cast<T>(acc[h]);
    }
  });
}

void shuffle_rows(const at::Tensor& input_tensor, const at::Tensor& dst2src_map,
                  at::Tensor& output_tensor) {
  check::shuffle_rows(input_tensor, dst2src_map, output_tensor);
  const int64_t rows_out = output_tensor.size(0);
  const int64_t rows_in = input_tensor.size(0);
  const int64_t row_bytes = output_tensor.size(1) * output_tensor.element_size();
  if (rows_out == 0 || row_bytes == 0) return;

  // out[i] = in[map[i]]; an index outside [0, rows_in) gives a row of zeros.
  for (int64_t i = 0; i < rows_out; ++i) {
    const int64_t s = read_index(dst2src_map, i);
    if (s >= 0 && s < rows_in) {
      std::memcpy(row_ptr(output_tensor, i), row_ptr(input_tensor, s), row_bytes);
    } else {
      std::memset(row_ptr(output_tensor, i), 0, row_bytes);
    }
  }
}

}  // namespace hopper_moe::cpu
