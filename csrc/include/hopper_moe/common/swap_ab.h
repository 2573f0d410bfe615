// The grouped-GEMM swap-AB contract shared by the CPU and CUDA implementations.
#pragma once

#include <cstdint>

namespace hopper_moe {

// vLLM's threshold: with at most this many (token, expert) slots, get_cutlass_moe_mm_data
// writes the problem sizes swapped, (N, M, K), and cutlass_moe_mm computes C^T = B^T . A^T.
constexpr int64_t kSwapAbMaxSlots = 64;

}  // namespace hopper_moe
