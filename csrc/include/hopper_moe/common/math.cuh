// Float arithmetic that rounds identically on the host (the CPU definitions, plain C++ built
// without FMA contraction: x86-64 has no FMA unless -mfma is given) and on the device (the *_rn
// intrinsics, which nvcc never contracts into FMAs). Ops whose CPU and CUDA results must agree
// bit for bit (routing weights and ids, SiLU) build on these.
//
// exp_f32: the host libm's expf and CUDA's expf are each within ~2 ulp of exp but not equal, so
// a comparison of two scores a few ulp apart (routing) or a rounding to bf16/fp8 (SiLU) could
// differ between the devices. This one is <= 1.01 ulp from exp in double over every normal
// float result (measured on the host for every 7th float) and the same on both devices.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HM_HOST_DEVICE inline
#endif

namespace hopper_moe::math {

HM_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

HM_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// Single IEEE round-to-nearest operations, never fused with a neighbour.
HM_HOST_DEVICE float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

HM_HOST_DEVICE float fadd_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

HM_HOST_DEVICE float fsub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

HM_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

HM_HOST_DEVICE float round_to_int_f32(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

HM_HOST_DEVICE float pow2_f32(int j) {  // 2^j for j in [-126, 127]
  return bits_float(static_cast<uint32_t>(j + 127) << 23);
}

// exp(x) in fp32: Cody-Waite reduction x = n*ln2 + r (|r| <= ln2/2), a degree-7 polynomial for
// exp(r) evaluated with FMAs, and 2^n applied as two exact power-of-two factors so that results
// in the subnormal range are rounded once. exp(NaN) = NaN, exp(-inf) = 0, exp(+inf) = +inf.
HM_HOST_DEVICE float exp_f32(float x) {
  if (x != x) return x;
  if (x > 88.72283935546875f) return bits_float(0x7f800000u);  // +inf: beyond FLT_MAX
  if (x < -103.972084045410156f) return 0.0f;                    // below half the least subnormal
  const float n = round_to_int_f32(fmul_rn(x, 1.44269502162933349609375f));
  // ln2 = kLn2Hi + kLn2Lo; kLn2Hi has 12 trailing zero bits, so n * kLn2Hi is exact.
  float r = fma_rn(n, -0.693145751953125f, x);
  r = fma_rn(n, -1.428606765330187045e-06f, r);
  float p = 1.9875691500e-4f;
  p = fma_rn(p, r, 1.3981999507e-3f);
  p = fma_rn(p, r, 8.3334519073e-3f);
  p = fma_rn(p, r, 4.1665795894e-2f);
  p = fma_rn(p, r, 1.6666665459e-1f);
  p = fma_rn(p, r, 5.0000001201e-1f);
  p = fma_rn(p, fmul_rn(r, r), r);
  p = fadd_rn(p, 1.0f);
  // n is in [-150, 128]; each half is in [-75, 64], a normal power of two.
  const int ni = static_cast<int>(n);
  const int n1 = ni / 2;
  const int n2 = ni - n1;
  return fmul_rn(fmul_rn(p, pow2_f32(n1)), pow2_f32(n2));
}

}  // namespace hopper_moe::math
