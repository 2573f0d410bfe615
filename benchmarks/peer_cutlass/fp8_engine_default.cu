// vLLM's cutlass_moe_mm FP8 kernel on SM90 (its grouped_mm_c3x_sm90.cu) for
// more than 64 rows, N < 8192 and K < 8192: ping-pong with fast accumulation,
// tile 64 x 256 x 128, cluster 1 x 2 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(fp8_engine_default,
                     cutlass::float_e4m3_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                     cute::Shape<cute::_64, cute::_256, cute::_128>,
                     cute::Shape<cute::_1, cute::_2, cute::_1>)
}  // namespace peer_cutlass
