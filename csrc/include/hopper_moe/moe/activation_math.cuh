// SiLU arithmetic of the activation kernels.
//
// silu_and_mul_value<T>: the value silu_and_mul stores for one element, in vLLM's rounding
// order (which is also the order of torch's F.silu(gate) * up in the input dtype T):
//     s = gate / (1 + exp(-gate))   in fp32 (CUDA's expf, IEEE add and division), rounded to T
//     v = float(s) * up             in fp32, rounded to T
// For T = float neither rounding changes anything. The operations are written with the *_rn
// intrinsics, so nvcc never contracts them with a neighbour into an FMA. The CPU definition
// does not use this function: it calls ATen's CPU silu and mul (csrc/cpu/activation.cpp),
// whose exp differs from CUDA's by up to an ulp.
//
// The grouped GEMM epilogues (SiLU*mul of GEMM1's bf16-rounded outputs) store this value too.
// Callers must not build with fast-math.
#pragma once

#include <cmath>
#include <cstdint>

#include "hopper_moe/common/math.cuh"

namespace hopper_moe::act {

#ifdef __CUDACC__

// silu(g) in fp32 as torch's CUDA silu and vLLM's kernels evaluate it: g / (1 + expf(-g)).
__device__ __forceinline__ float silu_expf(float g) {
  return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
}

// silu_and_mul's value of one element (see above), as a float holding a value of T.
template <typename T>
__device__ __forceinline__ float silu_and_mul_value(float gate, float up) {
  const float s = static_cast<float>(static_cast<T>(silu_expf(gate)));
  return static_cast<float>(static_cast<T>(__fmul_rn(s, up)));
}

#endif  // __CUDACC__

}  // namespace hopper_moe::act
