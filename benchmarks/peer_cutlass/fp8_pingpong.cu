// The peer's FP8 kernel with fast accumulation, ping-pong: tile 128 x 128 x 128, cluster 2 x 1 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(fp8_pingpong,
                     cutlass::float_e4m3_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                     cute::Shape<cute::_128, cute::_128, cute::_128>,
                     cute::Shape<cute::_2, cute::_1, cute::_1>)
}  // namespace peer_cutlass
