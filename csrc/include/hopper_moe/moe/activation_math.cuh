// SiLU in fp32, bit-identical on the host (CPU definition) and the device (CUDA kernels).
//
// silu(g) = g / (1 + exp(-g)) (same semantics as vLLM's silu_and_mul). The library expf
// differs between glibc and CUDA by up to 2 ulp, so both sides use math::exp_f32
// (common/math.cuh), which rounds identically on both. Callers must not build with fast-math.
#pragma once

#include <cmath>
#include <cstdint>

#include "hopper_moe/common/math.cuh"

namespace hopper_moe::act {

HM_HOST_DEVICE float silu_f32(float g) { return g / (1.0f + math::exp_f32(-g)); }

// silu(gate) * up in fp32: the value silu_and_mul rounds once to the output dtype and
// silu_and_mul_quant quantizes.
HM_HOST_DEVICE float silu_mul_f32(float gate, float up) { return silu_f32(gate) * up; }

}  // namespace hopper_moe::act
