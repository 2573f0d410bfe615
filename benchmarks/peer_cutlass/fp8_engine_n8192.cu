// vLLM's cutlass_moe_mm FP8 kernel on SM90 (its grouped_mm_c3x_sm90.cu) for
// more than 64 rows and N >= 8192: ping-pong with fast accumulation,
// tile 64 x 128 x 256, cluster 1 x 8 x 1.
#include "grouped_gemm.cuh"

namespace peer_cutlass {
PEER_CUTLASS_VARIANT(fp8_engine_n8192,
                     cutlass::float_e4m3_t,
                     cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum,
                     cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                     cute::Shape<cute::_64, cute::_128, cute::_256>,
                     cute::Shape<cute::_1, cute::_8, cute::_1>)
}  // namespace peer_cutlass
