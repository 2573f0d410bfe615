// Validation of the reduction op (moe_sum), shared by its CPU and CUDA implementations.
#include "ops.h"

#include "hopper_moe/common/checks.h"

namespace hopper_moe::check {

// input [T, K, H] f32/f16/bf16 with any strides (a strided hidden dimension too, as vLLM's
// moe_sum accepts), output [T, H] of the same dtype with a unit last stride and any row stride
// (vLLM's needs a contiguous output; this accepts more), optional topk_ids [T, K] int32/int64
// with any strides, optional expert_map [E_global] int32 contiguous (only together with
// topk_ids).
void moe_sum(const at::Tensor& input, at::Tensor& output, const OptTensor& topk_ids,
             const OptTensor& expert_map) {
  constexpr const char* kOp = "moe_sum";
  HM_CHECK_DIM(kOp, input, 3);
  HM_CHECK_DIM(kOp, output, 2);
  HM_CHECK_DTYPE(kOp, input, HM_FLOAT_DTYPES);
  HM_CHECK(kOp, output.scalar_type() == input.scalar_type(),
           "output must have the dtype of input (", c10::toString(input.scalar_type()),
           "), got ", c10::toString(output.scalar_type()));
  HM_CHECK_SAME_DEVICE(kOp, output, input);
  HM_CHECK_SIZE(kOp, output, 0, input.size(0), "num_tokens = input.size(0)");
  HM_CHECK_SIZE(kOp, output, 1, input.size(2), "hidden_size = input.size(2)");
  HM_CHECK_LAST_DIM_CONTIGUOUS(kOp, output);
  HM_CHECK_OUTPUT_DISTINCT(kOp, output);
  HM_CHECK_NO_OVERLAP(kOp, output, input);

  if (topk_ids) {
    const at::Tensor& ids = *topk_ids;
    check_dim_named(kOp, ids, "topk_ids", 2);
    check_dtype_named(kOp, ids, "topk_ids", HM_INDEX_DTYPES);
    check_same_device_named(kOp, ids, "topk_ids", input, "input");
    check_size_named(kOp, ids, "topk_ids", 0, input.size(0), "num_tokens = input.size(0)");
    check_size_named(kOp, ids, "topk_ids", 1, input.size(1), "topk = input.size(1)");
  }
  if (expert_map) {
    const at::Tensor& map = *expert_map;
    HM_CHECK(kOp, topk_ids.has_value(),
             "expert_map needs topk_ids (the slots' global expert ids) to be given too");
    check_dim_named(kOp, map, "expert_map", 1);
    check_dtype_named(kOp, map, "expert_map", at::kInt);
    check_same_device_named(kOp, map, "expert_map", input, "input");
    check_contiguous_named(kOp, map, "expert_map");
    // An empty map would read as none at all in the kernels (its data pointer is null).
    HM_CHECK(kOp, map.numel() >= 1,
             "expert_map must have one entry per global expert (at least one), got 0");
  }
  check_outputs_disjoint(kOp, {{output, "output"}},
                         {{topk_ids, "topk_ids"}, {expert_map, "expert_map"}});
}

}  // namespace hopper_moe::check
