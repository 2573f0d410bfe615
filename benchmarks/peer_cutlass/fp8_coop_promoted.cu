// The peer's FP8 kernel with CUTLASS's fp32 promotion of the accumulator, cooperative:
// tile 256 x 128 x 128, cluster 1 x 2 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(fp8_coop_promoted,
                     cutlass::float_e4m3_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                     cute::Shape<cute::_256, cute::_128, cute::_128>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>)
}  // namespace peer_cutlass
