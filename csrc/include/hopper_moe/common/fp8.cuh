// FP8 (float8_e4m3fn) helpers shared by the CPU definitions and the CUDA kernels.
//
// Every quantizing op computes, in fp32,
//     v = x * (1 / scale)   or   v = x / scale      (which one depends on the op)
//     r = clamp(v)                                  (fminf/fmaxf: the order fixes where NaN goes)
//     q = e4m3(r)                                   (round to nearest even)
// with the same expressions on both devices. IEEE division, multiplication and fminf/fmaxf are
// exact operations. e4m3() is torch's own conversion (c10's fp8e4m3fn_from_fp32_value, which
// vLLM's kernels call too) written out for clamped values (e4m3_bits), the same code on both
// devices for the quantization ops (static, dynamic, per-token, per-token-group): they produce
// the bytes torch's cast `r.to(torch.float8_e4m3fn)` produces, on the CPU and the GPU alike.
// silu_and_mul_quant's kernel and the GEMM epilogues convert with the hardware instruction
// instead (e4m3_bits_hw, `cvt.rn.satfinite.e4m3x2.f32`, round to nearest even as well): there
// the integer version made ptxas spill around the slow path of the SiLU's division.
//
// Include from .cpp and .cu files alike; device-only parts are guarded by __CUDACC__.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp8.h>
#endif

#include "hopper_moe/common/math.cuh"

namespace hopper_moe::fp8 {

// Largest finite float8_e4m3fn.
constexpr float kE4M3Max = 448.0f;
// Smallest scale the dynamic quantizers produce: an all-zero (or tiny) tensor still gets a
// finite, non-zero scale, and x / scale stays finite.
constexpr float kMinScale = 1.0f / (kE4M3Max * 512.0f);

using math::bits_float;
using math::float_bits;

// Clamp of the scaled-quant family (static, dynamic, per-token, silu_and_mul_quant):
// fmaxf(-448, fminf(v, 448)). fminf(NaN, 448) is 448, so NaN maps to +448.
HM_HOST_DEVICE float clamp_e4m3(float v) { return fmaxf(-kE4M3Max, fminf(v, kE4M3Max)); }

// Clamp of per_token_group_fp8_quant: fminf(fmaxf(v, lo), hi). fmaxf(NaN, lo) is lo, so NaN
// maps to lo (fp8_min).
HM_HOST_DEVICE float clamp_range(float v, float lo, float hi) { return fminf(fmaxf(v, lo), hi); }

// Scale of one per_token_group_fp8_quant group: amax times the fp32 reciprocal of fp8_max,
// both products rounded to nearest. This is vLLM's result on CUDA (its test computes
// amax / fp8_max as torch does on CUDA for a Python divisor: a multiply by the reciprocal);
// a true division can differ by one ulp, enough to flip x / s across an e4m3 rounding tie.
HM_HOST_DEVICE float group_scale(float amax, float fp8_max) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(amax, __fdiv_rn(1.0f, fp8_max));
#else
  return amax * (1.0f / fp8_max);
#endif
}

// Smallest power of two >= max(s, 1e-10) for finite s >= 0, computed exactly from the bits
// (the UE8M0 scale format stores only an exponent). inf stays inf.
HM_HOST_DEVICE float ue8m0_round_up(float s) {
  const float t = fmaxf(fabsf(s), 1e-10f);  // >= 1e-10: always a normal float (or inf)
  const uint32_t bits = float_bits(t);
  const uint32_t exponent = bits >> 23;     // sign is 0
  const uint32_t mantissa = bits & 0x7fffffu;
  if (exponent == 0xffu || mantissa == 0u) return t;  // inf, or already a power of two
  return bits_float((exponent + 1u) << 23);           // 2^(e+1); exponent 0xff gives inf
}

// torch's conversion (c10::detail::fp8e4m3fn_from_fp32_value) of a clamped value, |r| <= 448
// and not NaN, returning the raw byte: the quantization ops on both devices. The same integer
// and float arithmetic as c10's, without its NaN and overflow branches (a clamped value never
// takes them; 448 itself is the code 0x7e). tests/test_quant.py compares it with torch's cast
// at every rounding boundary between two codes (the midpoint and the floats next to it) and at
// random values, on both devices.
HM_HOST_DEVICE uint8_t e4m3_bits(float r) {
  uint32_t bits = float_bits(r);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  // Below 2^-6 (e4m3's smallest normal): adding 2^14 leaves the subnormal code, rounded to
  // nearest even by the float addition, in the low bits.
  constexpr uint32_t kDenormMagic = 141u << 23;
  const uint32_t subnormal =
      float_bits(bits_float(bits) + bits_float(kDenormMagic)) - kDenormMagic;
  // Otherwise: rebias the exponent (127 -> 7), round the mantissa to 3 bits, ties to even.
  const uint32_t normal =
      (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t code = bits < (121u << 23) ? subnormal : normal;  // both computed: no branch
  return static_cast<uint8_t>(code | (sign >> 24));
}

#ifdef __CUDACC__
// The hardware converter (round to nearest even, saturating), returning the raw byte:
// silu_and_mul_quant's kernel and the GEMM epilogues.
__device__ __forceinline__ uint8_t e4m3_bits_hw(float r) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(r, __NV_SATFINITE, __NV_E4M3));
}

// Non-negative floats order like their bit patterns as signed ints, so a max over them is an
// integer atomicMax. *addr must already hold a non-negative float; v must be >= 0 and not NaN.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}
#endif

}  // namespace hopper_moe::fp8
