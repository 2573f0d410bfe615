// The peer's bf16 kernel, cooperative: tile 256 x 128 x 64, cluster 1 x 2 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(bf16_coop,
                     cutlass::bfloat16_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                     cute::Shape<cute::_256, cute::_128, cute::_64>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>)
}  // namespace peer_cutlass
