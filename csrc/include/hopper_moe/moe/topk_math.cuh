// Float arithmetic of the routing ops, shared bit for bit by their CPU definitions
// (csrc/cpu/routing.cpp, compiled by the host compiler) and their CUDA kernels.
//
// Why a shared exp: the routing ops pick experts by comparing scores, so two scores a few ulps
// apart decide an id. CUDA's expf and the host libm's expf are both within ~2 ulp of exp, but not
// equal: on random data about one compared pair in a million would then pick different experts
// on the two devices. exp_f32 below uses only IEEE operations that round the same on both (the
// device side through the *_rn intrinsics, which nvcc never contracts into FMAs; the host side
// is plain C++, built without FMA contraction: x86-64 has no FMA unless -mfma is given), so the
// CPU op and the kernel produce identical weights and ids. Accuracy: <= 1.01 ulp against exp in
// double over every normal float result (measured on the host for every 7th float).
//
// Divisions go through div_f32 below (the CUDA '/' is IEEE too, but it calls a subroutine).
// Sums are defined in the kernel's order too (warp_order_sum in the CPU code): element i goes
// to partial i % 32, partials are added in fp64 and combined by a butterfly, as the warp does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HM_ROUTING_HD __host__ __device__ __forceinline__
#else
#define HM_ROUTING_HD inline
#endif

namespace hopper_moe::routing {

HM_ROUTING_HD float bits_to_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

HM_ROUTING_HD uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// Single IEEE round-to-nearest operations, never fused with a neighbour.
HM_ROUTING_HD float fmul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

HM_ROUTING_HD float fadd_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

HM_ROUTING_HD float fsub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

HM_ROUTING_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

HM_ROUTING_HD float round_to_int_f32(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

HM_ROUTING_HD float pow2_f32(int j) {  // 2^j for j in [-126, 127]
  return bits_to_f32(static_cast<uint32_t>(j + 127) << 23);
}

// exp(x) in fp32: Cody-Waite reduction x = n*ln2 + r (|r| <= ln2/2), a degree-7 polynomial for
// exp(r) evaluated with FMAs, and 2^n applied as two exact power-of-two factors so that results
// in the subnormal range are rounded once. exp(NaN) = NaN, exp(-inf) = 0, exp(+inf) = +inf.
HM_ROUTING_HD float exp_f32(float x) {
  if (x != x) return x;
  if (x > 88.72283935546875f) return bits_to_f32(0x7f800000u);  // +inf: beyond FLT_MAX
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

// a / b with multiplies and FMAs only. (CUDA's IEEE division calls a slow-path subroutine, whose
// calling convention makes ptxas spill in these kernels.) Results in the normal range are the
// correctly rounded quotient (no difference from IEEE a / b on 2e8 random pairs); subnormal
// results may be one subnormal ulp off (rounded twice); zeros, infinities and NaN as IEEE.
HM_ROUTING_HD float div_f32(float a, float b) {
  if (a != a || b != b) return fadd_rn(a, b);  // NaN
  const uint32_t ua = f32_to_bits(a);
  const uint32_t ub = f32_to_bits(b);
  const uint32_t sign = (ua ^ ub) & 0x80000000u;
  uint32_t xa = ua & 0x7fffffffu;
  uint32_t xb = ub & 0x7fffffffu;
  constexpr uint32_t kInf = 0x7f800000u;
  constexpr uint32_t kNaN = 0x7fc00000u;
  if (xb == 0u) return bits_to_f32(xa == 0u ? kNaN : (sign | kInf));
  if (xb == kInf) return bits_to_f32(xa == kInf ? kNaN : sign);
  if (xa == kInf) return bits_to_f32(sign | kInf);
  if (xa == 0u) return bits_to_f32(sign);
  // |a| = ma * 2^ea, |b| = mb * 2^eb with ma, mb in [1, 2); subnormals are scaled by 2^24 first.
  int ea = static_cast<int>(xa >> 23);
  int eb = static_cast<int>(xb >> 23);
  if (ea == 0) {
    xa = f32_to_bits(fmul_rn(bits_to_f32(xa), 16777216.0f));
    ea = static_cast<int>(xa >> 23) - 24;
  }
  if (eb == 0) {
    xb = f32_to_bits(fmul_rn(bits_to_f32(xb), 16777216.0f));
    eb = static_cast<int>(xb >> 23) - 24;
  }
  const float ma = bits_to_f32((xa & 0x007fffffu) | 0x3f800000u);
  const float mb = bits_to_f32((xb & 0x007fffffu) | 0x3f800000u);
  // 1 / mb: linear start 24/17 - 8/17 mb (relative error <= 1/17), then Newton steps, each
  // squaring the error: 1/17 -> 3.5e-3 -> 1.2e-5 -> 1.5e-10 -> rounding.
  float y = fma_rn(mb, -0.470588235294117647f, 1.41176470588235294f);
  for (int i = 0; i < 4; ++i) {
    const float e = fma_rn(-mb, y, 1.0f);
    y = fma_rn(e, y, y);
  }
  // Quotient with one remainder correction (the remainder ma - q * mb is exact in an FMA).
  float q = fmul_rn(ma, y);
  q = fma_rn(fma_rn(-q, mb, ma), y, q);
  // * 2^(ea - eb), |ea - eb| <= 277, as three normal powers of two.
  const int k = ea - eb;
  const int k1 = k / 3;
  const int k2 = (k - k1) / 2;
  const int k3 = k - k1 - k2;
  q = fmul_rn(fmul_rn(fmul_rn(q, pow2_f32(k1)), pow2_f32(k2)), pow2_f32(k3));
  return bits_to_f32(f32_to_bits(q) | sign);
}

// 1 / (1 + exp(-x)): sigmoid(-inf) = 0, sigmoid(+inf) = 1, sigmoid(NaN) = NaN.
HM_ROUTING_HD float sigmoid_f32(float x) {
  return div_f32(1.0f, fadd_rn(1.0f, exp_f32(-x)));
}

}  // namespace hopper_moe::routing
