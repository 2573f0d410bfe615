// The peer's bf16 kernel, ping-pong: tile 128 x 128 x 64, cluster 2 x 1 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(bf16_pingpong,
                     cutlass::bfloat16_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                     cute::Shape<cute::_128, cute::_128, cute::_64>,
                     cute::Shape<cute::_2, cute::_1, cute::_1>)
}  // namespace peer_cutlass
