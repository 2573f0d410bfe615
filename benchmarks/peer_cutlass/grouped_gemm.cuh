// A CUTLASS 3.x ptr-array grouped GEMM for measuring against: D[g] = A[g] * B[g]^T, tokens as
// the M operand (no swap-AB), one group per expert that has rows. Built only by
// benchmarks/peer_cutlass.py (torch.utils.cpp_extension), never part of the extension.
//
//   A[g]: rows of expert g, [m_g, K] row-major (fp8 e4m3 or bf16)
//   B[g]: the expert's weight, [N, K] row-major (K-major: CUTLASS's column-major K x N)
//   D[g]: [m_g, N] row-major bf16; alpha = 1, no C source
//
// A Plan holds everything a launch needs (device arrays of problem shapes, pointers and
// strides, the workspace, the initialized kernel object), so run() only launches: it can be
// captured in a CUDA graph.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

namespace peer_cutlass {

struct Plan {
  virtual ~Plan() = default;
  virtual void run(cudaStream_t stream) = 0;
};

inline void check_status(cutlass::Status status, const char* what) {
  TORCH_CHECK(status == cutlass::Status::kSuccess, "peer_cutlass: ", what, " failed: ",
              cutlassGetStatusString(status));
}

// Bytes of a host vector copied into a new uint8 CUDA tensor (kept alive by the plan).
template <class T>
torch::Tensor to_device(const std::vector<T>& host, const torch::Device& device) {
  auto t = torch::empty({static_cast<int64_t>(host.size() * sizeof(T))},
                        torch::dtype(torch::kUInt8).device(device));
  if (!host.empty()) {
    C10_CUDA_CHECK(cudaMemcpy(t.data_ptr(), host.data(), host.size() * sizeof(T),
                              cudaMemcpyHostToDevice));
  }
  return t;
}

template <class ElementAB, class KernelSchedule, class EpilogueSchedule, class TileShape,
          class ClusterShape>
struct GroupedGemm {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementD = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB,
      ElementAB, LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;

  struct PlanT : Plan {
    Gemm gemm;
    std::vector<Shape3> host_shapes;
    std::vector<torch::Tensor> keep;  // device arrays and the workspace
    void run(cudaStream_t stream) override { check_status(gemm.run(stream), "run"); }
  };

  // a [S, K], w [E, N, K], out [S, N]; rows of expert e are the counts[e] rows after those of
  // the experts before it.
  static std::unique_ptr<Plan> make(const torch::Tensor& a, const torch::Tensor& w,
                                    const torch::Tensor& out, const std::vector<int64_t>& counts) {
    const int64_t num_experts = w.size(0), n = w.size(1), k = w.size(2);
    TORCH_CHECK(static_cast<int64_t>(counts.size()) == num_experts,
                "peer_cutlass: counts must have one entry per expert (", num_experts, "), got ",
                counts.size());
    TORCH_CHECK(a.dim() == 2 && a.size(1) == k && a.is_contiguous(),
                "peer_cutlass: a must be a contiguous [rows, K] matrix with K = ", k);
    TORCH_CHECK(out.dim() == 2 && out.size(0) == a.size(0) && out.size(1) == n &&
                    out.is_contiguous() && out.scalar_type() == torch::kBFloat16,
                "peer_cutlass: out must be a contiguous bf16 [rows, N] matrix with N = ", n);
    TORCH_CHECK(w.is_contiguous(), "peer_cutlass: w must be contiguous [E, N, K]");
    TORCH_CHECK(k % kAlignAB == 0 && n % kAlignD == 0,
                "peer_cutlass: K and N must be multiples of 16 bytes of their element");
    auto plan = std::make_unique<PlanT>();
    std::vector<const ElementAB*> ptr_a, ptr_b;
    std::vector<ElementD*> ptr_d;
    std::vector<StrideA> stride_a;
    std::vector<StrideB> stride_b;
    std::vector<StrideD> stride_d;
    const auto* a_base = static_cast<const ElementAB*>(a.data_ptr());
    const auto* w_base = static_cast<const ElementAB*>(w.data_ptr());
    auto* d_base = static_cast<ElementD*>(out.data_ptr());
    int64_t row = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t m = counts[e];
      TORCH_CHECK(m >= 0, "peer_cutlass: negative row count for expert ", e);
      if (m > 0) {
        const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
        plan->host_shapes.push_back({mi, ni, ki});
        ptr_a.push_back(a_base + row * k);
        ptr_b.push_back(w_base + e * n * k);
        ptr_d.push_back(d_base + row * n);
        stride_a.push_back(cutlass::make_cute_packed_stride(StrideA{}, {mi, ki, 1}));
        stride_b.push_back(cutlass::make_cute_packed_stride(StrideB{}, {ni, ki, 1}));
        stride_d.push_back(cutlass::make_cute_packed_stride(StrideD{}, {mi, ni, 1}));
      }
      row += m;
    }
    TORCH_CHECK(row == a.size(0), "peer_cutlass: the counts sum to ", row, ", a has ",
                a.size(0), " rows");
    TORCH_CHECK(!plan->host_shapes.empty(), "peer_cutlass: no expert has rows");
    const auto device = a.device();
    auto shapes_d = to_device(plan->host_shapes, device);
    auto ptr_a_d = to_device(ptr_a, device), ptr_b_d = to_device(ptr_b, device);
    auto ptr_d_d = to_device(ptr_d, device);
    auto stride_a_d = to_device(stride_a, device), stride_b_d = to_device(stride_b, device);
    auto stride_d_d = to_device(stride_d, device);

    cutlass::KernelHardwareInfo hw;
    hw.device_id = device.index();
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(plan->host_shapes.size()),
                          reinterpret_cast<Shape3*>(shapes_d.data_ptr()),
                          plan->host_shapes.data()};
    args.mainloop = {reinterpret_cast<const ElementAB**>(ptr_a_d.data_ptr()),
                     reinterpret_cast<StrideA*>(stride_a_d.data_ptr()),
                     reinterpret_cast<const ElementAB**>(ptr_b_d.data_ptr()),
                     reinterpret_cast<StrideB*>(stride_b_d.data_ptr())};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = reinterpret_cast<StrideD*>(stride_d_d.data_ptr());
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(ptr_d_d.data_ptr());
    args.epilogue.dD = reinterpret_cast<StrideD*>(stride_d_d.data_ptr());
    args.hw_info = hw;

    check_status(plan->gemm.can_implement(args), "can_implement");
    auto workspace = torch::empty({static_cast<int64_t>(Gemm::get_workspace_size(args)) + 1},
                                  torch::dtype(torch::kUInt8).device(device));
    auto stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
    check_status(plan->gemm.initialize(args, workspace.data_ptr(), stream), "initialize");
    plan->keep = {shapes_d, ptr_a_d, ptr_b_d, ptr_d_d, stride_a_d, stride_b_d, stride_d_d,
                  workspace};
    return plan;
  }
};

using Maker = std::unique_ptr<Plan> (*)(const torch::Tensor&, const torch::Tensor&,
                                        const torch::Tensor&, const std::vector<int64_t>&);

// One per variant, each in a translation unit of its own (they compile in parallel), defined
// there by PEER_CUTLASS_VARIANT.
std::unique_ptr<Plan> make_fp8_coop(const torch::Tensor&, const torch::Tensor&,
                                    const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_fp8_coop_promoted(const torch::Tensor&, const torch::Tensor&,
                                             const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_fp8_pingpong(const torch::Tensor&, const torch::Tensor&,
                                        const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_fp8_engine_default(const torch::Tensor&, const torch::Tensor&,
                                              const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_fp8_engine_n8192(const torch::Tensor&, const torch::Tensor&,
                                            const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_fp8_engine_k8192(const torch::Tensor&, const torch::Tensor&,
                                            const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_bf16_coop(const torch::Tensor&, const torch::Tensor&,
                                     const torch::Tensor&, const std::vector<int64_t>&);
std::unique_ptr<Plan> make_bf16_pingpong(const torch::Tensor&, const torch::Tensor&,
                                         const torch::Tensor&, const std::vector<int64_t>&);

// make_<name>: the plan of GroupedGemm<...> (the arguments after the name, in its order).
#define PEER_CUTLASS_VARIANT(name, ...)                                                     \
  std::unique_ptr<Plan> make_##name(const torch::Tensor& a, const torch::Tensor& w,        \
                                    const torch::Tensor& out,                              \
                                    const std::vector<int64_t>& counts) {                  \
    return GroupedGemm<__VA_ARGS__>::make(a, w, out, counts);                              \
  }

}  // namespace peer_cutlass
