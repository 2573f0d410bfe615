// Python entry points of the CUTLASS grouped-GEMM peer (benchmarks/peer_cutlass.py).
#include <map>
#include <mutex>

#include "grouped_gemm.cuh"

namespace peer_cutlass {
namespace {

const std::map<std::string, Maker>& makers() {
  static const std::map<std::string, Maker> m = {
      {"fp8_coop", make_fp8_coop},         {"fp8_coop_promoted", make_fp8_coop_promoted},
      {"fp8_pingpong", make_fp8_pingpong}, {"bf16_coop", make_bf16_coop},
      {"bf16_pingpong", make_bf16_pingpong},
      {"fp8_engine_default", make_fp8_engine_default},
      {"fp8_engine_n8192", make_fp8_engine_n8192},
      {"fp8_engine_k8192", make_fp8_engine_k8192}};
  return m;
}

std::mutex plans_mutex;
std::map<int64_t, std::unique_ptr<Plan>> plans;
int64_t next_handle = 1;

std::vector<std::string> variants() {
  std::vector<std::string> names;
  for (const auto& kv : makers()) names.push_back(kv.first);
  return names;
}

// A plan for D = A * W^T over the experts' row groups; returns its handle.
int64_t prepare(const std::string& variant, const torch::Tensor& a, const torch::Tensor& w,
                const torch::Tensor& out, const std::vector<int64_t>& counts) {
  auto it = makers().find(variant);
  TORCH_CHECK(it != makers().end(), "peer_cutlass: unknown variant '", variant, "'");
  const bool fp8 = variant.rfind("fp8", 0) == 0;
  const auto want = fp8 ? torch::kFloat8_e4m3fn : torch::kBFloat16;
  TORCH_CHECK(a.scalar_type() == want && w.scalar_type() == want, "peer_cutlass: variant ",
              variant, " takes ", fp8 ? "float8_e4m3fn" : "bfloat16", " a and w");
  TORCH_CHECK(a.is_cuda() && w.is_cuda() && out.is_cuda() && a.device() == w.device() &&
                  a.device() == out.device(),
              "peer_cutlass: a, w and out must be on one CUDA device");
  TORCH_CHECK(w.dim() == 3, "peer_cutlass: w must be [E, N, K]");
  c10::cuda::CUDAGuard guard(a.device());
  auto plan = it->second(a, w, out, counts);
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans[next_handle] = std::move(plan);
  return next_handle++;
}

// Launches a plan on the current stream (capturable: no allocation, no copy).
void run(int64_t handle) {
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto it = plans.find(handle);
    TORCH_CHECK(it != plans.end(), "peer_cutlass: no plan ", handle);
    plan = it->second.get();
  }
  plan->run(at::cuda::getCurrentCUDAStream().stream());
}

void release(int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.erase(handle);
}

}  // namespace
}  // namespace peer_cutlass

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("variants", &peer_cutlass::variants, "the compiled kernel variants");
  m.def("prepare", &peer_cutlass::prepare, "plan D = A * W^T per expert; returns a handle");
  m.def("run", &peer_cutlass::run, "launch a plan on the current stream");
  m.def("release", &peer_cutlass::release, "free a plan");
}
