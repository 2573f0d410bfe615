// fused_experts_sm90: the whole MoE layer over hopper_moe's SM90 grouped GEMM behind one op,
// so that an eager call costs one dispatch: argument checks, buffers (the caching allocator)
// and launches are all here, in C++.
//
//   (FP8 quant of x) -> moe_permute (rows in expert order, expert offsets int64 [E + 1]) ->
//   GEMM1 with SiLU*mul in its epilogue (+ static FP8 quant, or the amax of a dynamic scale) ->
//   (FP8 quant of the rows GEMM1 wrote: dynamic per tensor / per token) ->
//   GEMM2 -> moe_unpermute (weighted sum over k in fp32, rounded once to bf16)
//
// Where heuristics::layer_gathers_gemm1_rows says so (many experts, few rows each), the first
// steps are instead moe_permute's sort alone -> (FP8 quant of x) -> GEMM1 reading x's rows
// through the sort's permutation (RowGather: its producer gathers them; no permuted copy).
//
// One composition for both devices: `run_layer<Ops>` over the cpu:: or cuda:: ops (ops.h),
// so the CPU definition tests every step CI can run. The precision model is
// python/hopper_moe/backends/sm90.py's (its docstring); the steps are the ones that module ran
// in Python before this op existed, in the same order with the same arguments.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/common/fp8.cuh"
#include "ops.h"

#ifdef HOPPER_MOE_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <mutex>
#include <vector>
#endif

namespace hopper_moe {
namespace {

constexpr const char* kOp = "fused_experts_sm90";

#define HM_LAYER_FORWARD(ns, fn)                   \
  template <typename... A>                        \
  static void fn(A&&... a) {                      \
    ns::fn(std::forward<A>(a)...);                \
  }
#define HM_LAYER_OPS(ns)                                       \
  HM_LAYER_FORWARD(ns, static_scaled_fp8_quant)                \
  HM_LAYER_FORWARD(ns, dynamic_scaled_fp8_quant)               \
  HM_LAYER_FORWARD(ns, dynamic_per_token_scaled_fp8_quant)     \
  HM_LAYER_FORWARD(ns, fp8_quant_rows)                         \
  HM_LAYER_FORWARD(ns, moe_permute)                            \
  HM_LAYER_FORWARD(ns, moe_unpermute)                          \
  HM_LAYER_FORWARD(ns, moe_grouped_gemm)                       \
  HM_LAYER_FORWARD(ns, moe_grouped_gemm_silu_mul)              \
  HM_LAYER_FORWARD(ns, moe_grouped_gemm_chain)                 \
  HM_LAYER_FORWARD(ns, moe_grouped_gemm_silu_mul_gathered)     \
  HM_LAYER_FORWARD(ns, moe_grouped_gemm_chain_gathered)

// A contiguous tensor of `sizes` and `dtype` over the bytes of `base` from `byte_offset` on,
// holding a reference to base: built directly, without the dispatcher calls of narrow / view
// (host time per layer call).
at::Tensor alias(const at::Tensor& base, int64_t byte_offset, at::IntArrayRef sizes,
                 at::ScalarType dtype) {
  at::Tensor keep = base;
  return at::from_blob(static_cast<char*>(base.data_ptr()) + byte_offset, sizes,
                       [keep](void*) {}, base.options().dtype(dtype), base.device());
}

struct CpuOps {
  HM_LAYER_OPS(cpu)
  struct DeviceScope {
    explicit DeviceScope(const at::Tensor&) {}
  };
  // arange(rows) int32 as [num_tokens, topk]: moe_permute's token_expert_indices (slot r is
  // its own index).
  static at::Tensor slot_indices(int64_t num_tokens, int64_t topk, const at::Tensor& like) {
    return at::arange(num_tokens * topk, like.options().dtype(at::kInt)).view({num_tokens, topk});
  }
};

#ifdef HOPPER_MOE_WITH_CUDA
struct CudaOps {
  HM_LAYER_OPS(cuda)
  // The kernels are sm_90a code: another GPU gets a clear error before any launch. Then the
  // tensors' device is the current one for the call.
  struct DeviceScope {
    c10::cuda::CUDAGuard guard;
    explicit DeviceScope(const at::Tensor& t) : guard(sm90_device(t)) {}
  };
  static at::Device sm90_device(const at::Tensor& t) {
    const int index = t.device().index();
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
    HM_CHECK(kOp, prop->major == 9 && prop->minor == 0,
             "the SM90 layer needs an SM90 GPU (H100/H200, compute capability 9.0); device ",
             index, " has ", prop->major, ".", prop->minor);
    return t.device();
  }
  // A view of a cached arange per device, grown by doubling, so that a layer call launches no
  // fill for it. Every tensor ever made stays referenced (CUDA graphs captured earlier may
  // read views of it); the cache grows only outside graph capture (a capture gets a plain
  // arange), and a new one is synchronized once, so that any stream may read it.
  static at::Tensor slot_indices(int64_t num_tokens, int64_t topk, const at::Tensor& like) {
    const int64_t rows = num_tokens * topk;
    static std::mutex lock;
    static std::vector<std::vector<at::Tensor>> held;
    const int index = like.device().index();
    {
      const std::lock_guard<std::mutex> guard(lock);
      if (static_cast<size_t>(index) < held.size() && !held[index].empty() &&
          held[index].back().numel() >= rows) {
        return alias(held[index].back(), 0, {num_tokens, topk}, at::kInt);
      }
    }
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() !=
        c10::cuda::CaptureStatus::None) {
      return at::arange(rows, like.options().dtype(at::kInt)).view({num_tokens, topk});
    }
    const std::lock_guard<std::mutex> guard(lock);
    if (static_cast<size_t>(index) >= held.size()) held.resize(index + 1);
    auto& list = held[index];
    if (list.empty() || list.back().numel() < rows) {
      int64_t capacity = 4096;
      while (capacity < rows) capacity *= 2;
      at::Tensor grown = at::arange(capacity, like.options().dtype(at::kInt));
      c10::cuda::getCurrentCUDAStream(index).synchronize();
      list.push_back(std::move(grown));
    }
    return alias(list.back(), 0, {num_tokens, topk}, at::kInt);
  }
};
#endif

// Every temporary buffer of one call carved from one allocation of the caching allocator
// (each 256-byte aligned): one allocator round trip and no dispatcher call per buffer. Each
// carved tensor holds a reference to the allocation, so it lives as long as any of them; all
// are used on the current stream only, where the allocator reuses the memory in order.
class Workspace {
 public:
  // Reserves a buffer of `numel` elements of `dtype`; returns its handle (an offset).
  int64_t reserve(int64_t numel, at::ScalarType dtype) {
    const int64_t offset = bytes_;
    bytes_ += (numel * static_cast<int64_t>(c10::elementSize(dtype)) + 255) / 256 * 256;
    return offset;
  }
  void allocate(const at::TensorOptions& options) {
    buffer_ = at::empty({std::max<int64_t>(bytes_, 1)}, options.dtype(at::kByte));
  }
  at::Tensor take(int64_t offset, at::IntArrayRef sizes, at::ScalarType dtype) const {
    return alias(buffer_, offset, sizes, dtype);
  }

 private:
  int64_t bytes_ = 0;
  at::Tensor buffer_;
};

at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

template <typename Ops>
void run_layer HOPPER_MOE_LAYER_ARGS {
  const LayerScheme s = check::fused_experts_sm90(
      out, hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,
      global_num_experts, expert_map, w1_scale, w2_scale, a1_scale, a2_scale,
      per_act_token_quant, per_out_ch_quant);
  const typename Ops::DeviceScope scope(hidden_states);
  const int64_t num_tokens = hidden_states.size(0), hidden = hidden_states.size(1);
  const int64_t num_experts = w1.size(0), inter = w1.size(1) / 2, topk = topk_ids.size(1);
  const int64_t slots = num_tokens * topk;
  if (num_tokens == 0 || hidden == 0) {
    if (out.numel() > 0) out.zero_();
    return;
  }
  constexpr auto kF32 = at::kFloat, kE4m3 = at::kFloat8_e4m3fn, kBf16 = at::kBFloat16;
  const at::ScalarType gemm_dtype = s.fp8 ? kE4m3 : kBf16;

  // GEMM2's input: written by GEMM1's epilogue itself (unquantized, or with a static a2 scale)
  // or quantized between the GEMMs (dynamic per tensor, with the scale GEMM1's epilogue maxes
  // the amax of its rows into from the dynamic floor; per token).
  const bool dynamic_tensor_a2 = s.fp8 && !s.per_act_token && !a2_scale;
  const bool gemm1_writes_a2 = !s.fp8 || (!s.per_act_token && a2_scale);
  const bool direct_out = out.scalar_type() == kBf16;

  // GEMM1 reads x's rows through the sort's permutation (its producer gathers them) or from
  // moe_permute's copy in expert order: heuristics::layer_gathers_gemm1_rows, measured.
  const bool gather = heuristics::layer_gathers_gemm1_rows(slots, num_experts);

  Workspace ws;
  const int64_t xq_at = s.fp8 ? ws.reserve(num_tokens * hidden, kE4m3) : -1;
  const int64_t x_scale_at =
      s.fp8 && (s.per_act_token || !a1_scale) ? ws.reserve(s.per_act_token ? num_tokens : 1, kF32)
                                              : -1;
  const int64_t a2_floor_at = dynamic_tensor_a2 ? ws.reserve(1, kF32) : -1;
  const int64_t a1_at = gather ? -1 : ws.reserve(slots * hidden, gemm_dtype);
  const int64_t offsets_at = ws.reserve(num_experts + 1, at::kLong);
  const int64_t inv_at = ws.reserve(slots, at::kInt);
  const int64_t perm_at = ws.reserve(slots, at::kInt);
  const int64_t y_at = ws.reserve(slots * hidden, kBf16);
  const int64_t h_at = ws.reserve(slots * inter, gemm1_writes_a2 ? gemm_dtype : kBf16);
  const int64_t a2_at = gemm1_writes_a2 ? -1 : ws.reserve(slots * inter, kE4m3);
  const int64_t a2_scale_at = s.per_act_token ? ws.reserve(slots, kF32) : -1;
  const int64_t sum_at = direct_out ? -1 : ws.reserve(num_tokens * hidden, kBf16);
  ws.allocate(hidden_states.options());

  OptTensor a2s;
  if (dynamic_tensor_a2) {
    // Started at the floor first (a fill kernel), so that no kernel of ours waits on it.
    a2s = ws.take(a2_floor_at, {1}, kF32);
    a2s->fill_(fp8::kMinScale);
  } else if (s.fp8 && !s.per_act_token) {
    a2s = *a2_scale;
  }

  // GEMM1's input rows, quantized once per token. Returns whether a kernel ran.
  at::Tensor xq, w1g;
  OptTensor x_scale, w1s;
  const auto prepare_x = [&]() {
    bool kernel = false;
    at::Tensor x = hidden_states;
    if (apply_router_weight_on_input) {
      x = as_dtype(hidden_states, kF32).mul(as_dtype(topk_weights, kF32));
      kernel = true;
    }
    if (!s.fp8) {
      kernel = kernel || x.scalar_type() != kBf16;
      xq = as_dtype(x, kBf16);
      w1g = as_dtype(w1, kBf16).contiguous();
    } else {
      x = x.contiguous();
      xq = ws.take(xq_at, {num_tokens, hidden}, kE4m3);
      if (s.per_act_token) {
        x_scale = ws.take(x_scale_at, {num_tokens, 1}, kF32);
        Ops::dynamic_per_token_scaled_fp8_quant(xq, x, *x_scale, std::nullopt);
      } else if (a1_scale) {
        x_scale = *a1_scale;
        Ops::static_scaled_fp8_quant(xq, x, *x_scale, std::nullopt);
      } else {
        x_scale = ws.take(x_scale_at, {1}, kF32);
        Ops::dynamic_scaled_fp8_quant(xq, x, *x_scale);
      }
      kernel = true;
      // The GEMM takes weight scales [E] or [E, N] / [E, N, 1] (checked shapes) as they are.
      w1g = w1.contiguous();
      w1s = w1_scale->contiguous();
    }
    // The gather copies whole 16-byte pieces of x's rows (hidden is a multiple: checked).
    if (gather && (xq.stride(1) != 1 || (xq.stride(0) * xq.element_size()) % 16 != 0 ||
                   reinterpret_cast<uintptr_t>(xq.data_ptr()) % 16 != 0)) {
      xq = xq.is_contiguous() ? xq.clone() : xq.contiguous();
      kernel = true;
    }
    return kernel;
  };

  // Rows in expert order: offsets, inv_idx and perm; slots that do not count sort after
  // offsets[E], where no GEMM reads or writes. With the gather, moe_permute's sort alone (an
  // input of width 0: no row is copied), then x's quantization, so that the kernel just before
  // GEMM1 (when there is one) does not write the offsets; without it, x quantized first and
  // its rows copied in expert order (a1).
  const at::Tensor ids = topk_ids.contiguous();
  OptTensor map;
  int64_t permute_experts = s.num_global;  // moe_permute's n_expert, >= its n_local_expert
  if (expert_map) {
    // Entries outside [0, E) are non-local; an int64 one is clamped to [-1, E] before it is
    // narrowed, so that no entry wraps into a local expert's id.
    map = expert_map->scalar_type() == at::kInt
              ? expert_map->contiguous()
              : expert_map->clamp(-1, num_experts).to(at::kInt).contiguous();
    if (s.num_global < num_experts) {
      // A map shorter than the local experts (ids past it count for nothing, as in the other
      // backends): padded with non-local entries up to them.
      map = at::cat({*map, at::full({num_experts - s.num_global}, -1, map->options())});
      permute_experts = num_experts;
    }
  }
  at::Tensor slot_ids = Ops::slot_indices(num_tokens, topk, hidden_states);
  at::Tensor offsets = ws.take(offsets_at, {num_experts + 1}, at::kLong);
  at::Tensor inv_idx = ws.take(inv_at, {num_tokens, topk}, at::kInt);
  at::Tensor perm = ws.take(perm_at, {slots}, at::kInt);
  at::Tensor a1;
  OptTensor a1s;
  // GEMM1 may read the offsets before the kernel just before it completes only when that
  // kernel does not write them: the quantization, a conversion or moe_permute's row copy
  // (which runs after its sort) do not; the sort does. (Kernels before that one have
  // completed: common/pdl.cuh's rule, or plain launches.)
  bool offsets_ready = true;
  if (gather) {
    const at::Tensor no_cols = ws.take(perm_at, {num_tokens, 0}, hidden_states.scalar_type());
    at::Tensor no_rows = ws.take(perm_at, {slots, 0}, hidden_states.scalar_type());
    Ops::moe_permute(no_cols, ids, slot_ids, map, permute_experts, num_experts, topk, no_rows,
                     offsets, inv_idx, perm);
    offsets_ready = prepare_x();
  } else {
    prepare_x();
    a1 = ws.take(a1_at, {slots, hidden}, gemm_dtype);
    Ops::moe_permute(xq, ids, slot_ids, map, permute_experts, num_experts, topk, a1, offsets,
                     inv_idx, perm);
    a1s = x_scale;
    if (s.per_act_token) {
      // Each row's scale follows it: row r holds token perm[r] / topk (rows past the counted
      // ones hold the slot count; clamped, they are never read).
      a1s = x_scale->index_select(0, perm.clamp_max(slots - 1).div(topk, "floor"));
    }
  }
  const RowGather rows{xq, perm, topk};

  at::Tensor w2g;
  OptTensor w2s;
  if (!s.fp8) {
    w2g = as_dtype(w2, kBf16).contiguous();
  } else {
    w2g = w2.contiguous();
    w2s = w2_scale->contiguous();
  }
  at::Tensor y = ws.take(y_at, {slots, hidden}, kBf16);
  if (gemm1_writes_a2) {
    at::Tensor h = ws.take(h_at, {slots, inter}, gemm_dtype);
    if (gather) {
      Ops::moe_grouped_gemm_chain_gathered(y, h, rows, w1g, w2g, offsets, x_scale, w1s, a2s,
                                           w2s, offsets_ready);
    } else {
      Ops::moe_grouped_gemm_chain(y, h, a1, w1g, w2g, offsets, a1s, w1s, a2s, w2s,
                                  offsets_ready, "");
    }
  } else {
    at::Tensor h = ws.take(h_at, {slots, inter}, kBf16);
    if (gather) {
      Ops::moe_grouped_gemm_silu_mul_gathered(h, rows, w1g, offsets, x_scale, w1s,
                                              std::nullopt, offsets_ready, a2s);
    } else {
      Ops::moe_grouped_gemm_silu_mul(h, a1, w1g, offsets, a1s, w1s, std::nullopt,
                                     offsets_ready, a2s, "");
    }
    // Only the rows before offsets[E] (those GEMM1 wrote) are read and quantized.
    const at::Tensor row_end =
        ws.take(offsets_at + num_experts * int64_t{sizeof(int64_t)}, {1}, at::kLong);
    at::Tensor a2 = ws.take(a2_at, {slots, inter}, kE4m3);
    at::Tensor a2_scales = dynamic_tensor_a2 ? *a2s : ws.take(a2_scale_at, {slots, 1}, kF32);
    Ops::fp8_quant_rows(a2, h, a2_scales, dynamic_tensor_a2 ? "static_tensor" : "per_token", 0,
                        std::nullopt, std::nullopt, 0, row_end);
    // The quantization kernel between the GEMMs does not write the offsets.
    Ops::moe_grouped_gemm(y, a2, w2g, offsets, a2_scales, w2s, true, "");
  }

  // Weighted sum over k in fp32 (rows past offsets[E] are skipped), written in bf16: straight
  // into `out` when that is bf16.
  const at::Tensor weights = apply_router_weight_on_input
                                 ? at::ones({num_tokens, topk}, hidden_states.options().dtype(kF32))
                                 : as_dtype(topk_weights, kF32).contiguous();
  if (direct_out) {
    Ops::moe_unpermute(y, weights, inv_idx, offsets, topk, out);
  } else {
    at::Tensor summed = ws.take(sum_at, {num_tokens, hidden}, kBf16);
    Ops::moe_unpermute(y, weights, inv_idx, offsets, topk, summed);
    out.copy_(summed);
  }
}

}  // namespace

#define HM_LAYER_ARG_NAMES                                                                      \
  out, hidden_states, w1, w2, topk_weights, topk_ids, apply_router_weight_on_input,            \
      global_num_experts, expert_map, w1_scale, w2_scale, a1_scale, a2_scale,                  \
      per_act_token_quant, per_out_ch_quant

namespace cpu {
void fused_experts_sm90 HOPPER_MOE_LAYER_ARGS { run_layer<CpuOps>(HM_LAYER_ARG_NAMES); }
}  // namespace cpu

#ifdef HOPPER_MOE_WITH_CUDA
namespace cuda {
void fused_experts_sm90 HOPPER_MOE_LAYER_ARGS { run_layer<CudaOps>(HM_LAYER_ARG_NAMES); }
}  // namespace cuda
#endif

}  // namespace hopper_moe
