// CUDA launchers of moe_grouped_gemm, moe_grouped_gemm_silu_mul and moe_grouped_gemm_chain:
// the SM90 grouped GEMM (csrc/include/hopper_moe/gemm), its mapping (swap-AB or standard),
// token tile and K split chosen per launch from the shapes (heuristics/sm90.h; the expert row
// counts stay on the device). The kernel is sm_90a code (wgmma, TMA): other GPUs get a clear
// error instead of a launch failure. Validated on an H200 against the CPU definition and the
// fp32 reference (tests/test_grouped_gemm.py: bf16, FP8 per-tensor and per-token x
// per-channel, every token tile and both mappings, K splits, K = 14336, CUDA-graph replay
// with new offsets; tests/test_grouped_gemm_chain.py: the chain against the two ops).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <string>

#include "hopper_moe/common/checks.h"
#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/gemm/cutlass_moe_mm_args.h"
#include "hopper_moe/gemm/moe_gemm_sm90.h"
#include "hopper_moe/heuristics/sm90.h"
#include "ops.h"

#ifdef HOPPER_MOE_GEMM_TIMELINE
#include <torch/library.h>
#endif

namespace hopper_moe::cuda {

namespace {

// The integer in environment variable `name`, which must lie in [lo, hi]; `fallback` when it
// is unset or empty.
int env_int(const char* kOp, const char* name, long lo, long hi, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  HM_CHECK(kOp, end != env && *end == '\0' && v >= lo && v <= hi, name,
           " must be an integer in [", lo, ", ", hi, "] (got '", env, "')");
  return int(v);
}

#ifdef HOPPER_MOE_GEMM_TIMELINE
// Diagnosis builds: the timeline records of the launches (gemm::TimelineField rows, one per
// CTA), kTimelineSlots launches deep from the last read; hopper_moe::_gemm_timeline returns
// them and clears them (tools/gemm_timeline.py). Launches past the last slot are not recorded.
constexpr int kTimelineSlots = 8;
constexpr int kTimelineMaxCtas = 1024;
struct TimelineRecords {
  at::Tensor rows;  // [kTimelineSlots, kTimelineMaxCtas, kTimelineFields] int64 (device)
  int used = 0;
};
TimelineRecords& timeline_records() {
  static auto* records = new TimelineRecords();  // never destroyed: no CUDA call at exit
  return *records;
}
int64_t* timeline_slot(const at::Tensor& like, int grid) {
  TimelineRecords& r = timeline_records();
  if (!r.rows.defined() || r.rows.device() != like.device()) {
    r.rows = at::zeros({kTimelineSlots, kTimelineMaxCtas, gemm::kTimelineFields},
                       like.options().dtype(at::kLong));
    r.used = 0;
  }
  if (grid > kTimelineMaxCtas || r.used >= kTimelineSlots) return nullptr;
  return r.rows[r.used++].data_ptr<int64_t>();
}
at::Tensor gemm_timeline() {
  TimelineRecords& r = timeline_records();
  if (!r.rows.defined()) return at::zeros({0, kTimelineMaxCtas, gemm::kTimelineFields}, at::kLong);
  at::Tensor out = r.rows.narrow(0, 0, r.used).cpu();  // after the stream's work so far
  r.rows.zero_();
  r.used = 0;
  return out;
}
#endif

// moe_grouped_gemm_chain's two launches (gemm::MoeGemmArgs::handoff_signal/handoff_wait):
// GEMM1's launch sets `counters` ([E] int64 zeros) when it signals, which an unsplit GEMM1
// does with HOPPER_MOE_CUTE_CHAIN=1; GEMM2's launch waits on them when they are set. Off by
// default: the counters' fill kernel before GEMM1 costs the layer more than GEMM2's early
// start gains (benchmarks/NOTES.md, v29).
struct Chain {
  enum class Role { kGemm1, kGemm2 } role = Role::kGemm1;
  at::Tensor counters;
};

// The launch shared by the ops (arguments checked by the caller): the config from the
// heuristic and the overrides, the K split's workspace, the kernel; chain: the launch's part
// in moe_grouped_gemm_chain (or null).
void launch_grouped_gemm(const char* kOp, at::Tensor& out, const at::Tensor& a,
                         const at::Tensor& b, const at::Tensor& expert_offsets,
                         const OptTensor& a_scales, const OptTensor& b_scales, bool silu_mul,
                         const OptTensor& out_scale, bool offsets_ready,
                         const OptTensor& amax_scale, Chain* chain = nullptr) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(a.device().index());
  HM_CHECK(kOp, prop->major == 9 && prop->minor == 0,
           "the CUDA kernel needs an SM90 GPU (H100/H200, compute capability 9.0); device ",
           a.device().index(), " has ", prop->major, ".", prop->minor);
  HM_CHECK(kOp, b.size(0) <= heuristics::kMaxExperts,
           "the CUDA kernel takes at most ", heuristics::kMaxExperts,
           " experts (b.size(0)); got ", b.size(0));
  if (a.size(0) == 0 || b.size(0) == 0 || b.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  heuristics::GroupedGemmConfig config = heuristics::choose_grouped_gemm_sm90(
      a.scalar_type() == at::kBFloat16 ? heuristics::GemmDtype::kBf16
                                       : heuristics::GemmDtype::kE4m3,
      a.size(0), int(b.size(0)), int(b.size(1)), int(a.size(1)), prop->multiProcessorCount);
  bool regrid = false;  // an override below edited the config's tiles or K split
  // HOPPER_MOE_CUTE_MAPPING=swap_ab|standard and HOPPER_MOE_CUTE_K_SPLITS=s (1..8) replace
  // the heuristic's mapping and K split, for measuring them.
  if (const char* env = std::getenv("HOPPER_MOE_CUTE_MAPPING"); env != nullptr && *env) {
    const std::string mapping(env);
    HM_CHECK(kOp, mapping == "swap_ab" || mapping == "standard",
             "HOPPER_MOE_CUTE_MAPPING must be swap_ab or standard (got '", mapping, "')");
    config = heuristics::grouped_gemm_config_sm90(
        config.dtype, mapping == "swap_ab", a.size(0), int(b.size(0)), int(b.size(1)),
        int(a.size(1)), prop->multiProcessorCount);
  }
  // HOPPER_MOE_CUTE_PAIR=0 gives the heuristic's config without the swap-AB warpgroup pair;
  // =1 the pair wherever the launch has one (swap-AB with a token tile of
  // heuristics::kPairTokenTiles), with the K split chosen for the 128-row units.
  if (const char* env = std::getenv("HOPPER_MOE_CUTE_PAIR"); env != nullptr && *env) {
    const std::string pair(env);
    HM_CHECK(kOp, pair == "0" || pair == "1",
             "HOPPER_MOE_CUTE_PAIR must be 0 or 1 (got '", pair, "')");
    if (pair == "0") {  // the config the heuristic chooses without pairs
      config = heuristics::grouped_gemm_config_sm90(
          config.dtype, config.swap_ab, a.size(0), int(b.size(0)), int(b.size(1)),
          int(a.size(1)), prop->multiProcessorCount, /*allow_pair=*/false);
    } else if (!config.pair() && config.swap_ab && heuristics::has_pair_tile(config.block_t)) {
      const int splits = config.k_splits;
      config = heuristics::swapab_pair_config(config.dtype, config.block_t);
      config.k_splits = splits;
      regrid = true;
    }
  }
  if (const int s = env_int(kOp, "HOPPER_MOE_CUTE_K_SPLITS", 1, heuristics::kMaxKSplits, 0);
      s > 0) {
    config.k_splits = s;
    regrid = true;
  }
  // HOPPER_MOE_CUTE_CHAIN_K_SPLITS=s: the K split of a chain's GEMM2 alone, for measuring.
  if (chain != nullptr && chain->role == Chain::Role::kGemm2) {
    if (const int s = env_int(kOp, "HOPPER_MOE_CUTE_CHAIN_K_SPLITS", 1, heuristics::kMaxKSplits,
                              0);
        s > 0) {
      config.k_splits = s;
      regrid = true;
    }
  }
  // An override that edited the config's tiles or split also moves its grid and cache policy.
  const int sm_count = prop->multiProcessorCount;
  if (regrid) {
    heuristics::set_grid_and_policy(config, a.size(0), int(b.size(0)), int(b.size(1)), sm_count);
  }
  // For measuring: HOPPER_MOE_CUTE_BALANCE=0 gives the launch every SM, =1 the balanced grid
  // (heuristics::balanced_grid) at any wave count, HOPPER_MOE_CUTE_EVICT_FIRST=0/1 sets the
  // weights' policy, and HOPPER_MOE_CUTE_STAGGER_NS=t (0..2000) makes CTA b's producer issue
  // its first copies ~b x t ns late (gemm::MoeGemmArgs::start_stagger_ns).
  switch (env_int(kOp, "HOPPER_MOE_CUTE_BALANCE", 0, 1, -1)) {
    case 0: config.grid = sm_count; break;
    case 1:
      config.grid = heuristics::balanced_grid(
          heuristics::expected_units(config, a.size(0), int(b.size(0)), int(b.size(1))),
          sm_count);
      break;
    default: break;  // unset: the heuristic's
  }
  // HOPPER_MOE_CUTE_CHAIN_GRID=g: the CTAs of a chain's GEMM2, for measuring (more than the
  // SMs: the CTAs after the first wave start as SMs free up, one unit each when g >= units).
  if (chain != nullptr && chain->role == Chain::Role::kGemm2) {
    if (const int g = env_int(kOp, "HOPPER_MOE_CUTE_CHAIN_GRID", 1, 65536, 0); g > 0) {
      config.grid = g;
    }
  }
  config.evict_first =
      env_int(kOp, "HOPPER_MOE_CUTE_EVICT_FIRST", 0, 1, int(config.evict_first)) == 1;
  const int start_stagger_ns = env_int(kOp, "HOPPER_MOE_CUTE_STAGGER_NS", 0, 2000, 0);
  // The K split's fp32 partial sums (stream-ordered from the caching allocator, so a CUDA
  // graph capture keeps its own).
  at::Tensor partial;
  if (config.k_splits > 1) {
    partial = at::empty({config.k_splits, a.size(0), b.size(1)},
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
  args.m_total = a.size(0);
  args.ldx = a.stride(0);
  args.ldo = out.stride(0);
  args.max_rows_per_expert = a.size(0);  // static bound: no read of the offsets on the host
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
  args.silu_mul = silu_mul;
  args.act_n = silu_mul ? int(b.size(1) / 2) : 0;
  args.out_scale = out_scale ? out_scale->data_ptr<float>() : nullptr;
  args.amax_scale = amax_scale ? amax_scale->data_ptr<float>() : nullptr;
  args.pdl = pdl::enabled_by_env();
  args.offsets_ready = offsets_ready;
  args.start_stagger_ns = start_stagger_ns;
  args.evict_first_weights = config.evict_first;
  if (chain != nullptr && chain->role == Chain::Role::kGemm1 && config.k_splits == 1 &&
      env_int(kOp, "HOPPER_MOE_CUTE_CHAIN", 0, 1, 0) == 1) {
    chain->counters = at::zeros({b.size(0)}, a.options().dtype(at::kLong));
    args.handoff_signal =
        reinterpret_cast<unsigned long long*>(chain->counters.data_ptr<int64_t>());
  }
  if (chain != nullptr && chain->role == Chain::Role::kGemm2 && chain->counters.defined()) {
    args.handoff_wait =
        reinterpret_cast<const unsigned long long*>(chain->counters.data_ptr<int64_t>());
  }
#ifdef HOPPER_MOE_GEMM_TIMELINE
  args.timeline = timeline_slot(a, config.grid);
#endif
  const cudaError_t err = gemm::moe_gemm_sm90(args, config, stream);
  HM_CHECK(kOp, err == cudaSuccess, "kernel launch failed (", config.to_string(), "): ",
           cudaGetErrorString(err));
}

}  // namespace

void moe_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& expert_offsets, const OptTensor& a_scales,
                      const OptTensor& b_scales, bool offsets_ready) {
  check::moe_grouped_gemm(out, a, b, expert_offsets, a_scales, b_scales, offsets_ready);
  launch_grouped_gemm("moe_grouped_gemm", out, a, b, expert_offsets, a_scales, b_scales,
                      /*silu_mul=*/false, std::nullopt, offsets_ready, std::nullopt);
}

void moe_grouped_gemm_silu_mul(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                               const at::Tensor& expert_offsets, const OptTensor& a_scales,
                               const OptTensor& b_scales, const OptTensor& out_scale,
                               bool offsets_ready, const OptTensor& amax_scale) {
  check::moe_grouped_gemm_silu_mul(out, a, b, expert_offsets, a_scales, b_scales, out_scale,
                                   offsets_ready, amax_scale);
  launch_grouped_gemm("moe_grouped_gemm_silu_mul", out, a, b, expert_offsets, a_scales,
                      b_scales, /*silu_mul=*/true, out_scale, offsets_ready, amax_scale);
}

// GEMM1 with SiLU*mul into h, then GEMM2 over h. Chained (HOPPER_MOE_CUTE_CHAIN=1 and GEMM1
// not split over K), GEMM2 (a dependent launch) starts each expert's rows once GEMM1 has
// written them (gemm::MoeGemmArgs::handoff_*); unchained, these are the two launches of
// moe_grouped_gemm_silu_mul and moe_grouped_gemm.
void moe_grouped_gemm_chain(at::Tensor& out, at::Tensor& h, const at::Tensor& a,
                            const at::Tensor& w1, const at::Tensor& w2,
                            const at::Tensor& expert_offsets, const OptTensor& a_scales,
                            const OptTensor& w1_scales, const OptTensor& h_scale,
                            const OptTensor& w2_scales, bool offsets_ready) {
  check::moe_grouped_gemm_chain(out, h, a, w1, w2, expert_offsets, a_scales, w1_scales, h_scale,
                                w2_scales, offsets_ready);
  constexpr const char* kOp = "moe_grouped_gemm_chain";
  Chain chain;
  launch_grouped_gemm(kOp, h, a, w1, expert_offsets, a_scales, w1_scales, /*silu_mul=*/true,
                      h_scale, offsets_ready, std::nullopt, &chain);
  // GEMM2 follows GEMM1, which lets it start at once: it may read the offsets early only when
  // the kernel before GEMM1 does not write them either.
  chain.role = Chain::Role::kGemm2;
  launch_grouped_gemm(kOp, out, h, w2, expert_offsets, h_scale, w2_scales, /*silu_mul=*/false,
                      std::nullopt, offsets_ready, std::nullopt, &chain);
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
                   /*offsets_ready=*/false);
}

}  // namespace hopper_moe::cuda

#ifdef HOPPER_MOE_GEMM_TIMELINE
TORCH_LIBRARY_FRAGMENT(hopper_moe, m) {
  m.def("_gemm_timeline() -> Tensor", &hopper_moe::cuda::gemm_timeline);
}
#endif
