// The one registration point of hopper_moe: every schema and every implementation.
//
// Schemas are vLLM's (torch.ops._moe_C / torch.ops._C), argument for argument, under the
// namespace `hopper_moe`; tests/test_schemas.py compares them with docs/OPS.md's strings.
// Fake (meta) implementations are registered from Python (python/hopper_moe/_fake.py).
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <limits>
#include <utility>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/moe/sort_plan.h"
#include "ops.h"

namespace hopper_moe {

bool cutlass_group_gemm_supported(int64_t cuda_device_capability) {
  // cutlass_moe_mm runs the hand-written SM90 grouped GEMM (sm_90a code: H100/H200 only). Its
  // GPU tests (tests/test_grouped_gemm.py: swapped and plain problem sizes, E up to 128) pass
  // on an H200. A build without the CUDA kernels supports no capability.
#ifdef HOPPER_MOE_WITH_CUDA
  return cuda_device_capability == 90;
#else
  (void)cuda_device_capability;
  return false;
#endif
}

bool moe_permute_unpermute_supported() { return true; }

int64_t moe_permute_sort_workspace_size(int64_t num_expanded_rows, int64_t n_expert) {
  constexpr const char* kOp = "moe_permute_sort_workspace_size";
  HM_CHECK(kOp,
           num_expanded_rows >= 0 && num_expanded_rows <= std::numeric_limits<int32_t>::max(),
           "num_expanded_rows must be in [0, 2^31-1] (got ", num_expanded_rows, ")");
  HM_CHECK(kOp, n_expert >= 1 && n_expert <= 65536, "n_expert must be in [1, 65536] (got ",
           n_expert, ")");
  return sort_plan::permute_workspace_bytes(num_expanded_rows, n_expert);
}

}  // namespace hopper_moe

TORCH_LIBRARY(hopper_moe, m) {
  // Routing
  m.def(
      "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
      "Tensor gating_output, bool renormalize, Tensor? bias, Tensor? is_padding) -> ()");
  m.def(
      "topk_sigmoid(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
      "Tensor gating_output, bool renormalize, Tensor? bias, float routed_scaling_factor, "
      "Tensor? is_padding) -> ()");
  m.def(
      "grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize, "
      "float routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)");

  // Permutation and reduction
  m.def(
      "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
      "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad, "
      "Tensor? maybe_expert_map, Tensor(a!)? scatter_idx=None) -> ()");
  m.def(
      "moe_permute(Tensor input, Tensor topk_ids, Tensor token_expert_indices, "
      "Tensor? expert_map, int n_expert, int n_local_expert, int topk, "
      "Tensor! permuted_input, Tensor! expert_first_token_offset, Tensor! inv_permuted_idx, "
      "Tensor! permuted_idx)->()");
  // moe_permute with the caller's scratch (vLLM's MoEPermuteScratch): sort_workspace of at
  // least moe_permute_sort_workspace_size bytes, the other three int32 with at least
  // num_tokens * topk elements; their contents are scratch. Results are moe_permute's.
  m.def(
      "moe_permute_with_scratch(Tensor input, Tensor topk_ids, Tensor token_expert_indices, "
      "Tensor? expert_map, int n_expert, int n_local_expert, int topk, "
      "Tensor! permuted_input, Tensor! expert_first_token_offset, Tensor! inv_permuted_idx, "
      "Tensor! permuted_idx, Tensor! sort_workspace, Tensor! permuted_experts_id, "
      "Tensor! sorted_row_idx, Tensor! topk_ids_for_sort)->()");
  // moe_permute's routing only: expert_first_token_offset and scatter_idx (= inv_permuted_idx).
  m.def(
      "moe_prepare_scatter(Tensor topk_ids, Tensor token_expert_indices, Tensor? expert_map, "
      "int n_expert, int n_local_expert, Tensor! expert_first_token_offset, "
      "Tensor! scatter_idx, Tensor! sort_workspace, Tensor! sorted_experts, "
      "Tensor! sorted_rows, Tensor! topk_ids_for_sort)->()");
  m.def(
      "moe_unpermute(Tensor permuted_hidden_states, Tensor topk_weights, "
      "Tensor inv_permuted_idx, Tensor? expert_first_token_offset, int topk, "
      "Tensor! hidden_states)->()");
  m.def("moe_permute_unpermute_supported() -> bool",
        &hopper_moe::moe_permute_unpermute_supported);
  m.def("moe_permute_sort_workspace_size(int num_expanded_rows, int n_expert) -> int",
        &hopper_moe::moe_permute_sort_workspace_size);
  m.def("shuffle_rows(Tensor input_tensor, Tensor dst2src_map, Tensor! output_tensor) -> ()");
  m.def(
      "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, "
      "Tensor? expert_map=None) -> ()");

  // Activation and FP8 quantization
  m.def("silu_and_mul(Tensor! result, Tensor input) -> ()");
  m.def("silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()");
  m.def(
      "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
      "int[]? group_shape=None) -> ()");
  // hopper_moe's own: FP8 quantization of the rows of a layer's intermediate [R, K] that
  // GEMM1 wrote; other rows (and their scales) are neither read nor written. kind:
  // "static_tensor" (scale [1], read: static_scaled_fp8_quant), "per_token" (scale [R, 1],
  // written: dynamic_per_token_scaled_fp8_quant without scale_ub) or "per_group" (scale
  // [R, K / group_size], written: per_token_group_fp8_quant's defaults); group_size is used
  // by "per_group" only. slot_ids (row r is slot r): a row counts when 0 <= slot_ids[r] <
  // num_experts and, with expert_map [num_experts] int32, expert_map[slot_ids[r]] >= 0.
  // row_end (int64, one element; rows sorted by expert): rows r < row_end[0] count. Exactly
  // one of the two.
  m.def(
      "fp8_quant_rows(Tensor! result, Tensor input, Tensor(a!) scale, str kind, "
      "int group_size, Tensor? slot_ids, Tensor? expert_map, int num_experts, "
      "Tensor? row_end) -> ()");
  m.def("dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()");
  m.def(
      "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
      "Tensor? scale_ub) -> ()");
  m.def(
      "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
      "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
      "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()");

  // Grouped-GEMM metadata
  m.def(
      "get_cutlass_moe_mm_data(Tensor topk_ids, Tensor! expert_offsets, "
      "Tensor! problem_sizes1, Tensor! problem_sizes2, Tensor! input_permutation, "
      "Tensor! output_permutation, int num_experts, int n, int k, "
      "Tensor? blockscale_offsets, bool is_gated) -> ()");
  m.def(
      "get_cutlass_moe_mm_problem_sizes_from_expert_offsets(Tensor expert_first_token_offset, "
      "Tensor! problem_sizes1, Tensor! problem_sizes2, int n, int k, bool swap_ab) -> ()");
  m.def("cutlass_group_gemm_supported(int cuda_device_capability) -> bool",
        &hopper_moe::cutlass_group_gemm_supported);
  // hopper_moe's own grouped GEMM entry: out[r] = a[r] . b[e]^T for the rows r of expert e.
  // offsets_ready: the kernel launched just before on the stream does not write
  // expert_offsets, so the CUDA kernel may read them, and start streaming weights, before that
  // kernel completes (programmatic dependent launch). No effect on the result or on the CPU.
  // config: "" for the heuristic's launch, or key=value pairs that force parts of it
  // (mapping=swap_ab|standard, pair=0|1, k_splits=1..8, pdl=0|1; ops.h); validated on both
  // devices, no effect on the CPU.
  m.def(
      "moe_grouped_gemm(Tensor! out, Tensor a, Tensor b, Tensor expert_offsets, "
      "Tensor? a_scales, Tensor? b_scales, bool offsets_ready=False, str config=\"\") -> ()");
  // The same GEMM over b = [gate; up] per expert, with SiLU*mul (and an optional static FP8
  // quantization) in its epilogue: out[r, j] = silu(g[r, j]) * u[r, j]. amax_scale (bf16 out):
  // updated to max(amax_scale, amax |out| / 448), a dynamic per-tensor FP8 scale of out.
  m.def(
      "moe_grouped_gemm_silu_mul(Tensor! out, Tensor a, Tensor b, Tensor expert_offsets, "
      "Tensor? a_scales, Tensor? b_scales, Tensor? out_scale, bool offsets_ready=False, "
      "Tensor(b!)? amax_scale=None, str config=\"\") -> ()");
  // GEMM1 then GEMM2 of a layer's experts: h = moe_grouped_gemm_silu_mul(a, w1, ...) (bf16, or
  // e4m3 with the static h_scale), out = moe_grouped_gemm(h, w2, ...) (h_scale and w2_scales
  // with FP8), as two dependent launches. offsets_ready as above, for the kernel before GEMM1;
  // config as above, for both GEMMs.
  m.def(
      "moe_grouped_gemm_chain(Tensor! out, Tensor! h, Tensor a, Tensor w1, Tensor w2, "
      "Tensor expert_offsets, Tensor? a_scales, Tensor? w1_scales, Tensor? h_scale, "
      "Tensor? w2_scales, bool offsets_ready=False, str config=\"\") -> ()");
  // The whole layer over that GEMM, vLLM's fused_experts semantics (silu; out[t] = sum_k
  // w[t,k] * expert_{id[t,k]}(x_t), accumulated in fp32): bf16 (fp16/fp32 inputs run in bf16)
  // or Float8_e4m3fn weights with per-tensor (static or dynamic) or per-token x per-channel
  // scales. Argument checks, buffers and launches in C++ (csrc/layer/fused_experts_sm90.cpp).
  m.def(
      "fused_experts_sm90(Tensor! out, Tensor hidden_states, Tensor w1, Tensor w2, "
      "Tensor topk_weights, Tensor topk_ids, bool apply_router_weight_on_input, "
      "int global_num_experts, Tensor? expert_map, Tensor? w1_scale, Tensor? w2_scale, "
      "Tensor? a1_scale, Tensor? a2_scale, bool per_act_token_quant, "
      "bool per_out_ch_quant) -> ()");
  // Grouped GEMM (vLLM's FP8 entry; the same kernel as moe_grouped_gemm)
  m.def(
      "cutlass_moe_mm(Tensor! out_tensors, Tensor a_tensors, Tensor b_tensors, "
      "Tensor a_scales, Tensor b_scales, Tensor expert_offsets, Tensor problem_sizes, "
      "Tensor a_strides, Tensor b_strides, Tensor c_strides, bool per_act_token, "
      "bool per_out_ch) -> ()");
}

// Every implementation runs with autograd off: the ops are kernels without a derivative,
// and a tensor that requires grad (a module's nn.Parameter weights outside no_grad) would
// otherwise make an internal out= call fail with autograd's message instead of computing.
// Outputs get no gradient (autograd's not-implemented fallback warns on backward).
template <auto F>
struct NoGrad;
template <class R, class... A, R (*F)(A...)>
struct NoGrad<F> {
  static R call(A... a) {
    const at::NoGradGuard no_grad;
    return F(std::forward<A>(a)...);
  }
};

#define HOPPER_MOE_IMPL(m, ns, name) m.impl(#name, &NoGrad<&ns::name>::call);
#define HOPPER_MOE_IMPL_ALL(m, ns)                                                              \
  HOPPER_MOE_IMPL(m, ns, topk_softmax)                                                          \
  HOPPER_MOE_IMPL(m, ns, topk_sigmoid)                                                          \
  HOPPER_MOE_IMPL(m, ns, grouped_topk)                                                          \
  HOPPER_MOE_IMPL(m, ns, moe_align_block_size)                                                  \
  HOPPER_MOE_IMPL(m, ns, moe_permute)                                                           \
  HOPPER_MOE_IMPL(m, ns, moe_permute_with_scratch)                                              \
  HOPPER_MOE_IMPL(m, ns, moe_prepare_scatter)                                                   \
  HOPPER_MOE_IMPL(m, ns, moe_unpermute)                                                         \
  HOPPER_MOE_IMPL(m, ns, shuffle_rows)                                                          \
  HOPPER_MOE_IMPL(m, ns, moe_sum)                                                               \
  HOPPER_MOE_IMPL(m, ns, silu_and_mul)                                                          \
  HOPPER_MOE_IMPL(m, ns, silu_and_mul_quant)                                                    \
  HOPPER_MOE_IMPL(m, ns, static_scaled_fp8_quant)                                               \
  HOPPER_MOE_IMPL(m, ns, fp8_quant_rows)                                                        \
  HOPPER_MOE_IMPL(m, ns, dynamic_scaled_fp8_quant)                                              \
  HOPPER_MOE_IMPL(m, ns, dynamic_per_token_scaled_fp8_quant)                                    \
  HOPPER_MOE_IMPL(m, ns, per_token_group_fp8_quant)                                             \
  HOPPER_MOE_IMPL(m, ns, get_cutlass_moe_mm_data)                                               \
  HOPPER_MOE_IMPL(m, ns, get_cutlass_moe_mm_problem_sizes_from_expert_offsets)                  \
  HOPPER_MOE_IMPL(m, ns, moe_grouped_gemm)                                                      \
  HOPPER_MOE_IMPL(m, ns, moe_grouped_gemm_silu_mul)                                             \
  HOPPER_MOE_IMPL(m, ns, moe_grouped_gemm_chain)                                                \
  HOPPER_MOE_IMPL(m, ns, cutlass_moe_mm)                                                        \
  HOPPER_MOE_IMPL(m, ns, fused_experts_sm90)

TORCH_LIBRARY_IMPL(hopper_moe, CPU, m) { HOPPER_MOE_IMPL_ALL(m, hopper_moe::cpu) }

#ifdef HOPPER_MOE_WITH_CUDA
TORCH_LIBRARY_IMPL(hopper_moe, CUDA, m) { HOPPER_MOE_IMPL_ALL(m, hopper_moe::cuda) }
#endif

#ifdef HOPPER_MOE_PYTHON_MODULE
// Lets `import hopper_moe._C` load this library as a Python extension module. Builds for C++
// consumers (CMake) leave it out: loading the library registers the ops by itself.
#include <Python.h>
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
#endif
