// CUDA launcher of moe_grouped_gemm: the SM90 swap-AB grouped GEMM (csrc/include/hopper_moe/gemm).
//
// The kernel is built and its SASS checked (HGMMA / QGMMA, TMA, no local memory), but it has
// not been validated against the CPU definition on a GPU yet. Until it has, the CUDA op refuses
// to run unless HOPPER_MOE_ENABLE_UNVALIDATED_SM90_GEMM=1 (the GPU tests set it): no caller can
// get numbers from it by accident.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "ops.h"

namespace hopper_moe::cuda {

namespace {
bool unvalidated_gemm_enabled() {
  const char* v = std::getenv("HOPPER_MOE_ENABLE_UNVALIDATED_SM90_GEMM");
  return v != nullptr && std::strcmp(v, "1") == 0;
}
}  // namespace

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& expert_offsets, const OptTensor& a_scales,
                      const OptTensor& b_scales) {
  constexpr const char* kOp = "moe_grouped_gemm";
  check::moe_grouped_gemm(out, a, b, expert_offsets, a_scales, b_scales);
  HM_CHECK(kOp, unvalidated_gemm_enabled(),
           "the SM90 grouped GEMM kernel has not been validated on a GPU yet; set "
           "HOPPER_MOE_ENABLE_UNVALIDATED_SM90_GEMM=1 to run it (for validation only)");
  if (a.size(0) == 0 || b.size(0) == 0 || b.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  gemm::MoeGemmArgs args;
  args.x = a.data_ptr();
  args.w = b.data_ptr();
  args.out = out.data_ptr();
  args.offsets = expert_offsets.data_ptr<int64_t>();
  args.num_experts = int(b.size(0));
  args.n = int(b.size(1));
  args.k = int(a.size(1));
  args.m_total = a.size(0);
  args.ldx = a.stride(0);
  args.ldo = out.stride(0);
  args.max_rows_per_expert = a.size(0);  // static bound: no read of the offsets on the host
  if (a_scales) {
    args.a_scale = a_scales->data_ptr<float>();
    args.a_mode = a_scales->numel() == 1 ? gemm::ScaleMode::kPerTensor : gemm::ScaleMode::kPerRow;
    args.b_scale = b_scales->data_ptr<float>();
    args.b_mode = b_scales->numel() == b.size(0) ? gemm::ScaleMode::kPerTensor
                                                  : gemm::ScaleMode::kPerRow;
  }
  const cudaError_t err = a.scalar_type() == at::kBFloat16
                              ? gemm::moe_gemm_swapab_sm90_bf16(args, stream)
                              : gemm::moe_gemm_swapab_sm90_e4m3(args, stream);
  HM_CHECK(kOp, err == cudaSuccess, "kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace hopper_moe::cuda
