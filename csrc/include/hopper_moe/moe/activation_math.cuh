// SiLU in fp32, bit-identical on the host (CPU definition) and the device (CUDA kernels).
//
// silu(g) = g / (1 + exp(-g)) (same semantics as vLLM's silu_and_mul). The library expf
// differs between glibc and CUDA by up to 2 ulp, so both sides use exp_f32 below: Cody-Waite range
// reduction and a degree-6 polynomial, written only with fmaf, exact multiplications by powers
// of two and IEEE division, so every step rounds identically on both devices (max error about
// 1 ulp against the true exp). Callers must not build with fast-math. nvcc's default
// contraction cannot change the result: every multiply-add is an explicit fmaf, and the one
// multiply whose product feeds an addition (the final 2^k scaling, added to 1 in silu) is
// __fmul_rn on the device, which is never fused. The host build (no FMA in the baseline x86-64
// target) does not contract either.
#pragma once

#include <cmath>
#include <cstdint>

#include "hopper_moe/common/fp8.cuh"  // HM_HOST_DEVICE, bits_float

namespace hopper_moe::act {

HM_HOST_DEVICE float exp_f32(float x) {
  if (x != x) return x;                     // NaN
  if (x > 88.72283935546875f) return INFINITY;   // exp(x) > FLT_MAX
  if (x < -103.97208404541015625f) return 0.0f;  // exp(x) < half the smallest subnormal
  // x = k*ln2 + r, |r| <= ln2/2; ln2 split in a high part with trailing zeros and a low part.
  const float k = rintf(x * 1.44269502162933349609375f);
  float r = fmaf(k, -0.693145751953125f, x);
  r = fmaf(k, -1.428606765330187045e-06f, r);
  // exp(r) = 1 + r + r^2 * P(r)
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float y = fmaf(p, r * r, r) + 1.0f;
  // y * 2^k with k in [-150, 128], as two exact power-of-two factors in the normal range.
  const int ki = static_cast<int>(k);
  const int k1 = ki / 2;
  const int k2 = ki - k1;
  const float s1 = fp8::bits_float(static_cast<uint32_t>(k1 + 127) << 23);
  const float s2 = fp8::bits_float(static_cast<uint32_t>(k2 + 127) << 23);
#ifdef __CUDA_ARCH__
  return __fmul_rn(__fmul_rn(y, s1), s2);
#else
  return (y * s1) * s2;
#endif
}

HM_HOST_DEVICE float silu_f32(float g) { return g / (1.0f + exp_f32(-g)); }

// silu(gate) * up in fp32: the value silu_and_mul rounds once to the output dtype and
// silu_and_mul_quant quantizes.
HM_HOST_DEVICE float silu_mul_f32(float gate, float up) { return silu_f32(gate) * up; }

}  // namespace hopper_moe::act
