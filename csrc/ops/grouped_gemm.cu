// CUDA launchers of moe_grouped_gemm, moe_grouped_gemm_silu_mul and moe_grouped_gemm_chain:
// the SM90 grouped GEMM (csrc/include/hopper_moe/gemm), its mapping (swap-AB or standard),
// token tile and K split chosen per launch from the shapes (heuristics/sm90.h; the expert row
// counts stay on the device). The kernel is sm_90a code (wgmma, TMA): other GPUs get a clear
// error instead of a launch failure. Validated on an H200 against the CPU definition and the
// fp32 reference (tests/test_grouped_gemm*.py). The ops' `config` argument (parsed by
// check::grouped_gemm_config, the same on both devices) forces parts of the launch.
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/common/settings.h"
#include "hopper_moe/gemm/cutlass_moe_mm_args.h"
#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"
#include "ops.h"

namespace hopper_moe::cuda {

namespace {

// The launch shared by the ops (arguments checked by the caller): the config from the
// heuristic and `force`, the K split's workspace, the kernel.
void launch_grouped_gemm(const char* kOp, at::Tensor& out, const at::Tensor& a,
                         const at::Tensor& b, const at::Tensor& expert_offsets,
                         const OptTensor& a_scales, const OptTensor& b_scales, bool silu_mul,
                         const OptTensor& out_scale, bool offsets_ready,
                         const OptTensor& amax_scale,
                         const heuristics::GroupedGemmOverride& force,
                         const RowGather* gather = nullptr) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(a.device().index());
  HM_CHECK(kOp, prop->major == 9 && prop->minor == 0,
           "the CUDA kernel needs an SM90 GPU (H100/H200, compute capability 9.0); device ",
           a.device().index(), " has ", prop->major, ".", prop->minor);
  // The GEMM's rows: a's, or with a gather out's (a is then x, read through the gather).
  const int64_t m_total = gather != nullptr ? out.size(0) : a.size(0);
  if (m_total == 0 || b.size(0) == 0 || b.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const heuristics::GroupedGemmConfig config = heuristics::choose_grouped_gemm_sm90(
      a.scalar_type() == at::kBFloat16 ? heuristics::GemmDtype::kBf16
                                       : heuristics::GemmDtype::kE4m3,
      m_total, int(b.size(0)), int(b.size(1)), int(a.size(1)), prop->multiProcessorCount,
      force);
  // The K split's fp32 partial sums (stream-ordered from the caching allocator, so a CUDA
  // graph capture keeps its own).
  at::Tensor partial;
  if (config.k_splits > 1) {
    partial = at::empty({config.k_splits, m_total, b.size(1)},
                        a.options().dtype(at::kFloat));
  }

  gemm::MoeGemmArgs args;
  args.x = a.data_ptr();
  args.w = b.data_ptr();
  args.out = out.data_ptr();
  args.offsets = expert_offsets.data_ptr<int64_t>();
  args.num_experts = int(b.size(0));
  args.n = int(b.size(1));
  args.k = int(a.size(1));
  args.m_total = m_total;
  args.ldx = a.stride(0);
  args.ldo = out.stride(0);
  args.max_rows_per_expert = m_total;  // static bound: no read of the offsets on the host
  args.k_splits = config.k_splits;
  args.partial = config.k_splits > 1 ? partial.data_ptr<float>() : nullptr;
  args.grid = config.grid;
  if (a_scales) {
    args.a_scale = a_scales->data_ptr<float>();
    args.a_mode = a_scales->numel() == 1 ? gemm::ScaleMode::kPerTensor : gemm::ScaleMode::kPerRow;
    args.b_scale = b_scales->data_ptr<float>();
    args.b_mode = b_scales->numel() == b.size(0) ? gemm::ScaleMode::kPerTensor
                                                  : gemm::ScaleMode::kPerRow;
  }
  args.out_fp16 = !silu_mul && out.scalar_type() == at::kHalf;
  args.silu_mul = silu_mul;
  args.act_n = silu_mul ? int(b.size(1) / 2) : 0;
  args.out_scale = out_scale ? out_scale->data_ptr<float>() : nullptr;
  args.amax_scale = amax_scale ? amax_scale->data_ptr<float>() : nullptr;
  args.pdl = force.pdl >= 0 ? force.pdl == 1 : settings::pdl_enabled();
  args.offsets_ready = offsets_ready;
  args.evict_first_weights = config.evict_first;
  if (gather != nullptr) {
    args.gather = gather->perm.const_data_ptr<int32_t>();
    args.gather_div = int(gather->topk);
    args.x_rows = a.size(0);
  }
  const cudaError_t err = gemm::moe_gemm_sm90(args, config, stream);
  HM_CHECK(kOp, err == cudaSuccess, "kernel launch failed (", config.to_string(), "): ",
           cudaGetErrorString(err));
}

}  // namespace

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& expert_offsets, const OptTensor& a_scales,
                      const OptTensor& b_scales, bool offsets_ready, c10::string_view config) {
  constexpr const char* kOp = "moe_grouped_gemm";
  check::moe_grouped_gemm(out, a, b, expert_offsets, a_scales, b_scales, offsets_ready, config);
  launch_grouped_gemm(kOp, out, a, b, expert_offsets, a_scales, b_scales, /*silu_mul=*/false,
                      std::nullopt, offsets_ready, std::nullopt,
                      check::grouped_gemm_config(kOp, config));
}

void moe_grouped_gemm_silu_mul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& expert_offsets, const OptTensor& a_scales,
                               const OptTensor& b_scales, const OptTensor& out_scale,
                               bool offsets_ready, const OptTensor& amax_scale,
                               c10::string_view config) {
  constexpr const char* kOp = "moe_grouped_gemm_silu_mul";
  check::moe_grouped_gemm_silu_mul(out, a, b, expert_offsets, a_scales, b_scales, out_scale,
                                   offsets_ready, amax_scale, config);
  launch_grouped_gemm(kOp, out, a, b, expert_offsets, a_scales, b_scales, /*silu_mul=*/true,
                      out_scale, offsets_ready, amax_scale,
                      check::grouped_gemm_config(kOp, config));
}

// GEMM1 with SiLU*mul into h, then GEMM2 over h: two launches, GEMM2 a dependent launch that
// starts streaming its weights while GEMM1 finishes.
void moe_grouped_gemm_chain(at::Tensor& out, at::Tensor& h, const at::Tensor& a,
                            const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& expert_offsets, const OptTensor& a_scales,
                            const OptTensor& w1_scales, const OptTensor& h_scale,
                            const OptTensor& w2_scales, bool offsets_ready,
                            c10::string_view config) {
  constexpr const char* kOp = "moe_grouped_gemm_chain";
  check::moe_grouped_gemm_chain(out, h, a, w1, w2, expert_offsets, a_scales, w1_scales, h_scale,
                                w2_scales, offsets_ready, config);
  const heuristics::GroupedGemmOverride force = check::grouped_gemm_config(kOp, config);
  launch_grouped_gemm(kOp, h, a, w1, expert_offsets, a_scales, w1_scales, /*silu_mul=*/true,
                      h_scale, offsets_ready, std::nullopt, force);
  // GEMM2 follows GEMM1, which lets it start at once: it may read the offsets early only when
  // the kernel before GEMM1 does not write them either.
  launch_grouped_gemm(kOp, out, h, w2, expert_offsets, h_scale, w2_scales, /*silu_mul=*/false,
                      std::nullopt, offsets_ready, std::nullopt, force);
}

// The layer's gathered GEMM1 (ops.h, RowGather): the kernels above with the rows of a.x read
// through a.perm by the producer. The layer checked the arguments (check::fused_experts_sm90):
// x's rows are 16-byte aligned, perm holds a row index for every valid row.
void moe_grouped_gemm_silu_mul_gathered(at::Tensor& out, const RowGather& a, const at::Tensor& b,
                                        const at::Tensor& expert_offsets,
                                        const OptTensor& a_scales, const OptTensor& b_scales,
                                        const OptTensor& out_scale, bool offsets_ready,
                                        const OptTensor& amax_scale) {
  launch_grouped_gemm("fused_experts_sm90", out, a.x, b, expert_offsets, a_scales, b_scales,
                      /*silu_mul=*/true, out_scale, offsets_ready, amax_scale, {}, &a);
}

void moe_grouped_gemm_chain_gathered(at::Tensor& out, at::Tensor& h, const RowGather& a,
                                     const at::Tensor& w1, const at::Tensor& w2,
                                     const at::Tensor& expert_offsets, const OptTensor& a_scales,
                                     const OptTensor& w1_scales, const OptTensor& h_scale,
                                     const OptTensor& w2_scales, bool offsets_ready) {
  constexpr const char* kOp = "fused_experts_sm90";
  launch_grouped_gemm(kOp, h, a.x, w1, expert_offsets, a_scales, w1_scales, /*silu_mul=*/true,
                      h_scale, offsets_ready, std::nullopt, {}, &a);
  launch_grouped_gemm(kOp, out, h, w2, expert_offsets, h_scale, w2_scales, /*silu_mul=*/false,
                      std::nullopt, offsets_ready, std::nullopt, {});
}

// cutlass_moe_mm: the same kernel over the row ranges of gemm/cutlass_moe_mm_args.h (built on
// the device). The kernel's mapping follows the rows per expert (heuristics/sm90.h): with
// M_tot <= 64 the fullest expert's expected rows fit a swap-AB tile, so those launches always
// map swap-AB, and the swapped problem sizes of M_tot <= 64 decide where the last expert's row
// count is read.
void cutlass_moe_mm(at::Tensor& out_tensors, const at::Tensor& a_tensors,
                    const at::Tensor& b_tensors, const at::Tensor& a_scales,
                    const at::Tensor& b_scales, const at::Tensor& expert_offsets,
                    const at::Tensor& problem_sizes, const at::Tensor& a_strides,
                    const at::Tensor& b_strides, const at::Tensor& c_strides,
                    bool per_act_token, bool per_out_ch) {
  check::cutlass_moe_mm(out_tensors, a_tensors, b_tensors, a_scales, b_scales, expert_offsets,
                        problem_sizes, a_strides, b_strides, c_strides, per_act_token,
                        per_out_ch);
  const c10::cuda::CUDAGuard guard(a_tensors.device());
  const at::Tensor offsets = gemm::cutlass_moe_mm_row_offsets(
      expert_offsets, problem_sizes, gemm::cutlass_moe_mm_swapped(a_tensors));
  moe_grouped_gemm(out_tensors, a_tensors, b_tensors, offsets, a_scales, b_scales,
                   /*offsets_ready=*/false, /*config=*/"");
}

}  // namespace hopper_moe::cuda
