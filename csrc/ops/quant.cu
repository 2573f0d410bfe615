// CUDA launchers of the FP8 quantization ops (kernels in hopper_moe/moe/fp8_quant_kernels.cuh).
// Results equal the CPU definitions (csrc/cpu/quant.cpp) bit for bit. No launcher reads device
// memory on the host or synchronizes, so every op can be captured in a CUDA graph.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "hopper_moe/common/pdl.cuh"
#include "hopper_moe/moe/fp8_quant_kernels.cuh"
#include "hopper_moe/moe/fp8_quant_layout.cuh"
#include "ops.h"

namespace hopper_moe::cuda {
namespace {

using quant::kQuantThreads;

// Dynamic per-tensor quantization of at most this many elements runs in one block (a decode
// step's activations: mixtral's 2 x 14336 at one token, qwen3_30b's 32 x 768 at four); larger
// tensors use three kernels: past 2^15 elements the one block is slower than the three
// launches, below it saves their fill and drain.
constexpr int64_t kSmallDynamicElems = int64_t{1} << 15;

// 2-D grid of the row-wise elementwise kernels: x over vector units of a row, y over rows.
dim3 rows_grid(int64_t num_rows, int64_t units_per_row, int64_t max_blocks_y) {
  const int64_t bx = std::min<int64_t>((units_per_row + kQuantThreads - 1) / kQuantThreads, 1024);
  const int64_t by = std::min<int64_t>(num_rows, max_blocks_y);
  return dim3(static_cast<unsigned>(std::max<int64_t>(bx, 1)),
              static_cast<unsigned>(std::max<int64_t>(by, 1)));
}

// Vector path allowed for rows of `input` (T) and `out` (e4m3 bytes): base pointers and row
// strides aligned for 16-byte loads and kVecElems<T>-byte stores, and `len` (k or group_size)
// a multiple of kVecElems<T>.
template <typename T>
bool can_vectorize(const void* in, int64_t in_rs, const void* out, int64_t out_rs, int64_t len) {
  constexpr int kN = quant::kVecElems<T>;
  return len % kN == 0 && quant::rows_aligned(in, in_rs, sizeof(T), 16) &&
         quant::rows_aligned(out, out_rs, 1, kN);
}

template <typename T, bool kPerTensor, class Rows = quant::AllRows>
void launch_scaled_quant(uint8_t* out, const T* in, const float* scale,
                         const quant::RowsView& in_rows, int64_t out_rs,
                         const quant::StaticScaleGroups& g, bool vec, cudaStream_t stream,
                         Rows rows = Rows{}) {
  const int64_t units = vec ? in_rows.row_len / quant::kVecElems<T> : in_rows.row_len;
  const dim3 grid = rows_grid(in_rows.num_rows, units, 65535);
  // A programmatic dependent launch: it waits for the kernel before it.
  C10_CUDA_CHECK(pdl::launch(vec ? quant::scaled_quant_kernel<T, true, kPerTensor, Rows>
                                 : quant::scaled_quant_kernel<T, false, kPerTensor, Rows>,
                             grid, dim3(kQuantThreads), 0, stream, out, in, scale,
                             in_rows.num_rows, in_rows.row_len, in_rows.row_stride, out_rs,
                             g.group_m, g.group_n, g.stride_m, g.stride_n, rows));
}

}  // namespace

void static_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                             const at::Tensor& scale, std::optional<at::IntArrayRef> group_shape) {
  constexpr const char* kOp = "static_scaled_fp8_quant";
  check::static_scaled_fp8_quant(result, input, scale, group_shape);
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  const auto groups =
      quant::resolve_static_groups(kOp, in_rows.num_rows, in_rows.row_len, scale, group_shape);
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  const float* s = scale.const_data_ptr<float>();
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    bool vec = can_vectorize<scalar_t>(in, in_rows.row_stride, out, out_rows.row_stride,
                                       in_rows.row_len);
    if (groups.per_tensor()) {
      launch_scaled_quant<scalar_t, true>(out, in, s, in_rows, out_rows.row_stride, groups, vec,
                                          stream);
    } else {
      vec = vec && groups.group_n % quant::kVecElems<scalar_t> == 0;
      launch_scaled_quant<scalar_t, false>(out, in, s, in_rows, out_rows.row_stride, groups, vec,
                                           stream);
    }
  });
}

void fp8_quant_rows(at::Tensor& result, const at::Tensor& input, at::Tensor& scale,
                    c10::string_view kind, int64_t group_size, const OptTensor& slot_ids,
                    const OptTensor& expert_map, int64_t num_experts, const OptTensor& row_end) {
  constexpr const char* kOp = "fp8_quant_rows";
  check::fp8_quant_rows(result, input, scale, kind, group_size, slot_ids, expert_map,
                        num_experts, row_end);
  const auto q = quant::parse_rows_quant(kOp, kind);
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const int64_t vec_len = q == quant::RowsQuant::kPerGroup ? group_size : in_rows.row_len;
    const bool vec = can_vectorize<scalar_t>(in, in_rows.row_stride, out, out_rows.row_stride,
                                             vec_len);
    // One launch with the row filter the arguments name.
    auto run = [&](auto rows) {
      using Rows = decltype(rows);
      if (q == quant::RowsQuant::kStaticTensor) {
        const quant::StaticScaleGroups per_tensor;  // scale[0] for every element
        launch_scaled_quant<scalar_t, true>(out, in, scale.const_data_ptr<float>(), in_rows,
                                            out_rows.row_stride, per_tensor, vec, stream, rows);
      } else if (q == quant::RowsQuant::kPerToken) {
        const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(in_rows.num_rows, 1 << 20));
        auto kernel = vec ? quant::per_token_quant_kernel<scalar_t, true, Rows>
                          : quant::per_token_quant_kernel<scalar_t, false, Rows>;
        kernel<<<blocks, kQuantThreads, 0, stream>>>(out, scale.data_ptr<float>(), in, nullptr,
                                                     in_rows.num_rows, in_rows.row_len,
                                                     in_rows.row_stride, out_rows.row_stride,
                                                     rows);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      } else {
        const int64_t groups_per_row = in_rows.row_len / group_size;
        const int64_t num_groups = in_rows.num_rows * groups_per_row;
        const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(
            (num_groups + quant::kGroupsPerBlock - 1) / quant::kGroupsPerBlock, 1 << 20));
        auto kernel = vec ? quant::per_token_group_quant_kernel<scalar_t, true, false, Rows>
                          : quant::per_token_group_quant_kernel<scalar_t, false, false, Rows>;
        kernel<<<blocks, kQuantThreads, 0, stream>>>(
            out, scale.data_ptr<float>(), in, num_groups, groups_per_row, group_size,
            in_rows.row_stride, out_rows.row_stride, groups_per_row, 1, quant::kRowsGroupEps,
            -fp8::kE4M3Max, fp8::kE4M3Max, rows);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    quant::visit_row_filter(slot_ids, expert_map, num_experts, row_end, run);
  });
}

void dynamic_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input, at::Tensor& scale) {
  constexpr const char* kOp = "dynamic_scaled_fp8_quant";
  check::dynamic_scaled_fp8_quant(result, input, scale);
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  float* s = scale.data_ptr<float>();
  const quant::StaticScaleGroups per_tensor;  // scale[0] for every element
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const bool vec = can_vectorize<scalar_t>(in, in_rows.row_stride, out, out_rows.row_stride,
                                             in_rows.row_len);
    // Small tensors (decode activations): one block does all of it, one launch instead of 3.
    if (in_rows.num_rows * in_rows.row_len <= kSmallDynamicElems) {
      // A programmatic dependent launch: it waits for the kernel before it.
      C10_CUDA_CHECK(pdl::launch(vec ? quant::dynamic_quant_one_block_kernel<scalar_t, true>
                                     : quant::dynamic_quant_one_block_kernel<scalar_t, false>,
                                 dim3(1), dim3(quant::kOneBlockThreads), 0, stream, out, s, in,
                                 in_rows.num_rows, in_rows.row_len, in_rows.row_stride,
                                 out_rows.row_stride));
      return;
    }
    // 1) scale = floor, 2) scale = max(scale, amax / 448), 3) quantize with it; stream-ordered.
    quant::init_dynamic_scale_kernel<<<1, 1, 0, stream>>>(s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t units = vec ? in_rows.row_len / quant::kVecElems<scalar_t> : in_rows.row_len;
    // About one resident wave of blocks: each block ends in one atomic on the same word.
    const dim3 grid = rows_grid(in_rows.num_rows, units, 2048);
    const int64_t by = std::max<int64_t>(2048 / static_cast<int64_t>(grid.x), 1);
    const dim3 amax_grid(grid.x, static_cast<unsigned>(std::min<int64_t>(grid.y, by)));
    if (vec) {
      quant::amax_scale_kernel<scalar_t, true><<<amax_grid, kQuantThreads, 0, stream>>>(
          s, in, in_rows.num_rows, in_rows.row_len, in_rows.row_stride);
    } else {
      quant::amax_scale_kernel<scalar_t, false><<<amax_grid, kQuantThreads, 0, stream>>>(
          s, in, in_rows.num_rows, in_rows.row_len, in_rows.row_stride);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_scaled_quant<scalar_t, true>(out, in, s, in_rows, out_rows.row_stride, per_tensor,
                                        vec, stream);
  });
}

void dynamic_per_token_scaled_fp8_quant(at::Tensor& result, const at::Tensor& input,
                                        at::Tensor& scale, const OptTensor& scale_ub) {
  constexpr const char* kOp = "dynamic_per_token_scaled_fp8_quant";
  check::dynamic_per_token_scaled_fp8_quant(result, input, scale, scale_ub);
  // K = 0: each row is empty, and an empty row's amax is 0, so its scale is the floor
  // 1/(448*512), as for a row of zeros (scale_ub cannot lower it: max(min(0, ub)/448, floor)).
  if (input.numel() == 0) {
    if (scale.numel() > 0) scale.fill_(fp8::kMinScale);
    return;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto out_rows = quant::rows_view(kOp, result, "result");
  uint8_t* out = static_cast<uint8_t*>(result.data_ptr());
  float* scales = scale.data_ptr<float>();
  const float* ub = scale_ub.has_value() ? scale_ub->const_data_ptr<float>() : nullptr;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(in_rows.num_rows, 1 << 20));
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const bool vec = can_vectorize<scalar_t>(in, in_rows.row_stride, out, out_rows.row_stride,
                                             in_rows.row_len);
    if (vec) {
      quant::per_token_quant_kernel<scalar_t, true><<<blocks, kQuantThreads, 0, stream>>>(
          out, scales, in, ub, in_rows.num_rows, in_rows.row_len, in_rows.row_stride,
          out_rows.row_stride);
    } else {
      quant::per_token_quant_kernel<scalar_t, false><<<blocks, kQuantThreads, 0, stream>>>(
          out, scales, in, ub, in_rows.num_rows, in_rows.row_len, in_rows.row_stride,
          out_rows.row_stride);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void per_token_group_fp8_quant(const at::Tensor& input, at::Tensor& output_q,
                               at::Tensor& output_s, int64_t group_size, double eps,
                               double fp8_min, double fp8_max, bool scale_ue8m0,
                               bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) {
  constexpr const char* kOp = "per_token_group_fp8_quant";
  check::per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
                                   scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned);
  if (input.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(input.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto in_rows = quant::rows_view(kOp, input, "input");
  const auto q_rows = quant::rows_view(kOp, output_q, "output_q");
  const auto s_rows = quant::rows_view(kOp, output_s, "output_s", /*any_last_stride=*/true);
  const int64_t groups_per_row = in_rows.row_len / group_size;
  const int64_t num_groups = in_rows.num_rows * groups_per_row;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(
      (num_groups + quant::kGroupsPerBlock - 1) / quant::kGroupsPerBlock, 1 << 20));
  uint8_t* out = static_cast<uint8_t*>(output_q.data_ptr());
  float* scales = output_s.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  const float lo = static_cast<float>(fp8_min);
  const float hi = static_cast<float>(fp8_max);
  HM_QUANT_DISPATCH_INPUT(input, kOp, [&] {
    const scalar_t* in = input.const_data_ptr<scalar_t>();
    const bool vec = can_vectorize<scalar_t>(in, in_rows.row_stride, out, q_rows.row_stride,
                                             group_size);
    auto launch = [&](auto vec_tag, auto ue8m0_tag) {
      quant::per_token_group_quant_kernel<scalar_t, decltype(vec_tag)::value,
                                          decltype(ue8m0_tag)::value>
          <<<blocks, kQuantThreads, 0, stream>>>(out, scales, in, num_groups, groups_per_row,
                                                 group_size, in_rows.row_stride,
                                                 q_rows.row_stride, s_rows.row_stride,
                                                 s_rows.col_stride, eps_f, lo, hi);
    };
    if (vec) {
      if (scale_ue8m0) {
        launch(std::true_type{}, std::true_type{});
      } else {
        launch(std::true_type{}, std::false_type{});
      }
    } else {
      if (scale_ue8m0) {
        launch(std::false_type{}, std::true_type{});
      } else {
        launch(std::false_type{}, std::false_type{});
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace hopper_moe::cuda
