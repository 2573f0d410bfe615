// Float arithmetic of the routing ops, shared bit for bit by their CPU definitions
// (csrc/cpu/routing.cpp, compiled by the host compiler) and their CUDA kernels.
//
// Why a shared exp (common/math.cuh): the routing ops pick experts by comparing scores, so two
// scores a few ulps apart decide an id; with each device's own expf, about one compared pair in
// a million would pick different experts on the two devices.
//
// Divisions go through div_f32 below (the CUDA '/' is IEEE too, but it calls a subroutine).
// Sums are defined in the kernel's order too (warp_order_sum in the CPU code): element i goes
// to partial i % 32, partials are added in fp64 and combined by a butterfly, as the warp does.
#pragma once

#include <cmath>
#include <cstdint>

#include "hopper_moe/common/math.cuh"

#define HM_ROUTING_HD HM_HOST_DEVICE

namespace hopper_moe::routing {

using math::exp_f32;
using math::fadd_rn;
using math::fma_rn;
using math::fmul_rn;
using math::fsub_rn;
using math::pow2_f32;
using math::round_to_int_f32;
HM_ROUTING_HD float bits_to_f32(uint32_t u) { return math::bits_float(u); }
HM_ROUTING_HD uint32_t f32_to_bits(float f) { return math::float_bits(f); }

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

// Neither NaN nor +-inf.
HM_ROUTING_HD bool finite_f32(float x) { return (f32_to_bits(x) & 0x7f800000u) != 0x7f800000u; }

// grouped_topk's sigmoid, 0.5 * tanh(x / 2) + 0.5, from t = tanh(x / 2): the form vLLM's
// grouped-top-k kernels and its tests' references compute. The tanh is each device's own
// (torch's CPU tanh, CUDA's tanhf: what torch.tanh computes there), so the score equals
// 0.5 * torch.tanh(0.5 * x) + 0.5 on the same device bit for bit; the two devices may differ by
// an ulp of the tanh. 0.5 * t is exact, so the one rounding is the add's.
HM_ROUTING_HD float grouped_sigmoid(float t) { return fadd_rn(fmul_rn(0.5f, t), 0.5f); }

#ifdef __CUDACC__
__device__ __forceinline__ float grouped_sigmoid_of_logit(float x) {
  return grouped_sigmoid(tanhf(fmul_rn(0.5f, x)));
}
#endif

// topk_sigmoid's sigmoid, 1 / (1 + exp(-x)): sigmoid(-inf) = 0, sigmoid(+inf) = 1,
// sigmoid(NaN) = NaN.
HM_ROUTING_HD float sigmoid_f32(float x) {
  return div_f32(1.0f, fadd_rn(1.0f, exp_f32(-x)));
}

}  // namespace hopper_moe::routing
