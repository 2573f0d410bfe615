// The epilogues of the SM90 grouped GEMM, as compile-time types, and the driver that runs one
// on a unit's fp32 tile.
//
// An epilogue type names which weight rows a unit's tile holds (the producer loads them as
// two boxes of kBlockN / 2 rows: weight_box_row), which output column each tile column is
// (weight_row, column_valid), and how the staged bf16 tile is stored (store):
//   EpilogueStore<Config>:   out[row, n] = bf16(scaled sum), or fp16 with p.out_fp16 (a runtime
//     flag: both output dtypes share the instantiation), 16-byte row vectors.
//   EpilogueSiluMul<Config>: GEMM1 over b = [gate; up]: tile columns j and j + kBlockN / 2
//     are the gate and up rows of output column n0 + j; out[row, j] = silu(g) * u of the
//     bf16-rounded products, as bf16 (optionally folding amax |out| / 448 into amax_scale) or
//     as e4m3 with the static out_scale.
// The driver (epilogue_moe_gemm) scales the accumulators (per-tensor, per-row, per-channel),
// then either writes the scaled fp32 partial tile of a K split straight from registers
// (reduce_splitk_sm90.cuh adds the splits and applies the same epilogue), or stages 16-bit
// values (bf16; fp16 for EpilogueStore with p.out_fp16) into the shared tile c[t][n]
// ([kBlockT][kEpilogueLd], transposed for swap-AB) and lets the
// epilogue type's store phase write it: the 256 consumer threads store whole rows, consecutive
// threads consecutive columns (coalesced), masking token rows past the expert's count and
// columns past N (element stores where N or the row stride is not a multiple of 8).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "hopper_moe/common/fp8.cuh"
#include "hopper_moe/gemm/config_moe_gemm_sm90.cuh"
#include "hopper_moe/moe/activation_math.cuh"

namespace hopper_moe::gemm {

// The tile coordinates of an accumulator element: weight row n and token row t of the unit.
struct TileCoord {
  int n;
  int t;
};

// The bits of v rounded to the plain store's 16-bit output: fp16 when `fp16`, else bf16
// (round to nearest even, as at::Tensor::to rounds on the CPU).
CUTLASS_DEVICE uint16_t out16_bits(float v, bool fp16) {
  return fp16 ? cutlass::half_t(v).raw() : cutlass::bfloat16_t(v).raw();
}

// Stores 8 SiLU*mul outputs at element offset `at` of out (min(valid, 8) of them): bf16, or
// e4m3 as clamp(v * (1 / out_scale)) (silu_and_mul_quant's expression), as one 16- or 8-byte
// vector when p.vector_out. Returns the largest |stored bf16 value| (0 for e4m3; NaN skipped
// as fmaxf does), for amax_scale.
CUTLASS_DEVICE float store_act_row(const MoeGemmParams& p, int64_t at, int valid,
                                   const float (&act)[8]) {
  if (p.out_scale != nullptr) {
    const float inv_scale = 1.0f / *p.out_scale;
    uint8_t q[8];
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) q[e] = fp8::e4m3_bits_hw(fp8::clamp_e4m3(act[e] * inv_scale));
    uint8_t* dst = static_cast<uint8_t*>(p.out) + at;
    if (p.vector_out && valid >= 8) {
      uint2 packed;
      memcpy(&packed, q, 8);
      *reinterpret_cast<uint2*>(dst) = packed;
    } else {
      for (int e = 0; e < 8 && e < valid; ++e) dst[e] = q[e];
    }
    return 0.0f;
  }
  cutlass::bfloat16_t b[8];
  float amax = 0.0f;
  CUTE_UNROLL
  for (int e = 0; e < 8; ++e) {
    b[e] = cutlass::bfloat16_t(act[e]);
    if (e < valid) amax = fmaxf(amax, fabsf(float(b[e])));
  }
  cutlass::bfloat16_t* dst = static_cast<cutlass::bfloat16_t*>(p.out) + at;
  if (p.vector_out && valid >= 8) {
    uint4 packed;
    memcpy(&packed, b, 16);
    *reinterpret_cast<uint4*>(dst) = packed;
  } else {
    for (int e = 0; e < 8 && e < valid; ++e) dst[e] = b[e];
  }
  return amax;
}

// Folds a warp's amax values into *p.amax_scale as max(*amax_scale, amax / 448) (the dynamic
// per-tensor scale's expression: division is monotonic, so the max of the quotients is the
// quotient of the max). Every lane of the warp must call it.
CUTLASS_DEVICE void fold_amax_scale(const MoeGemmParams& p, float amax) {
  CUTE_UNROLL
  for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  if (threadIdx.x % 32 == 0 && amax > 0.0f) {
    fp8::atomic_max_nonneg(p.amax_scale, amax / fp8::kE4M3Max);
  }
}

template <class Config>
struct EpilogueStore {
  static constexpr bool kSiluMul = false;
  // Weight box h of the unit: rows [n0 + h * kBlockN / 2, ...) of the expert.
  CUTLASS_DEVICE static int weight_box_row(const MoeGemmParams&, int n0, int h) {
    return n0 + h * Config::kWeightBox;
  }
  CUTLASS_DEVICE static int weight_row(const MoeGemmParams&, int n0, int nl) { return n0 + nl; }
  CUTLASS_DEVICE static bool column_valid(const MoeGemmParams& p, int n0, int nl) {
    return n0 + nl < p.n;
  }

  // Copies the staged 16-bit values (bf16 or fp16 bits, whichever out holds) as they are.
  CUTLASS_DEVICE static void store(const MoeGemmParams& p, const MoeGemmUnit& u,
                                   const cutlass::bfloat16_t* staged, int ct) {
    constexpr int kBlockN = Config::kBlockN;
    auto* out = static_cast<uint16_t*>(p.out);
    const auto* c = reinterpret_cast<const uint16_t*>(staged);
    constexpr int kVectors = Config::kBlockT * kBlockN / 8;  // 8 x 16 bits = 16 bytes
    CUTE_UNROLL
    for (int v = ct; v < kVectors; v += Config::kConsumerThreads) {
      const int tl = v / (kBlockN / 8);
      const int nl = (v % (kBlockN / 8)) * 8;
      const int t = u.t0 + tl;
      const int n = u.n0 + nl;
      if (t >= u.rows || n >= p.n) continue;
      const uint16_t* src = &c[tl * Config::kEpilogueLd + nl];
      uint16_t* dst = out + (u.row_begin + t) * p.ldo + n;
      if (p.vector_out) {
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int j = 0; j < 8 && n + j < p.n; ++j) dst[j] = src[j];
      }
    }
  }
};

template <class Config>
struct EpilogueSiluMul {
  static constexpr bool kSiluMul = true;
  static constexpr int kHalf = Config::kBlockN / 2;
  // Box 0 holds the gate rows n0.. of the output columns, box 1 the up rows act_n + n0...
  CUTLASS_DEVICE static int weight_box_row(const MoeGemmParams& p, int n0, int h) {
    return h == 0 ? n0 : p.act_n + n0;
  }
  CUTLASS_DEVICE static int weight_row(const MoeGemmParams& p, int n0, int nl) {
    return nl < kHalf ? n0 + nl : p.act_n + n0 + nl - kHalf;
  }
  CUTLASS_DEVICE static bool column_valid(const MoeGemmParams& p, int n0, int nl) {
    return n0 + (nl < kHalf ? nl : nl - kHalf) < p.act_n;
  }

  // silu_and_mul's value of the bf16-rounded GEMM outputs (silu rounded to bf16, times up,
  // rounded to bf16: what a separate silu_and_mul over a bf16 GEMM output stores), then bf16 or
  // e4m3 (static scale) of that value, as silu_and_mul_quant.
  CUTLASS_DEVICE static void store(const MoeGemmParams& p, const MoeGemmUnit& u,
                                   const cutlass::bfloat16_t* c, int ct) {
    constexpr int kActVectors = Config::kBlockT * kHalf / 8;
    float amax = 0.0f;
    CUTE_UNROLL
    for (int v = ct; v < kActVectors; v += Config::kConsumerThreads) {
      const int tl = v / (kHalf / 8);
      const int nl = (v % (kHalf / 8)) * 8;
      const int t = u.t0 + tl;
      const int j = u.n0 + nl;
      if (t >= u.rows || j >= p.act_n) continue;
      const cutlass::bfloat16_t* src = &c[tl * Config::kEpilogueLd + nl];
      cutlass::bfloat16_t gate[8], up[8];
      const uint4 gate_bits = *reinterpret_cast<const uint4*>(src);
      const uint4 up_bits = *reinterpret_cast<const uint4*>(src + kHalf);
      memcpy(gate, &gate_bits, 16);
      memcpy(up, &up_bits, 16);
      float act[8];
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) {
        act[e] = act::silu_and_mul_value<cutlass::bfloat16_t>(float(gate[e]), float(up[e]));
      }
      amax = fmaxf(amax, store_act_row(p, (u.row_begin + t) * p.ldo + j, p.act_n - j, act));
    }
    if (p.amax_scale != nullptr) fold_amax_scale(p, amax);
  }
};

// Runs Epilogue on unit u's fp32 tile `total` (accumulator fragment; tile_nt(i) gives element
// i's coordinates; only threads with holds_tile hold the tile) through the shared tile c.
template <class Config, class Epilogue, class Fragment, class TileNt>
CUTLASS_DEVICE void epilogue_moe_gemm(const MoeGemmParams& p, const MoeGemmUnit& u,
                                      const Fragment& total, const TileNt& tile_nt,
                                      bool holds_tile, cutlass::bfloat16_t* c, int ct) {
  const float tensor_scale = (p.a_mode == ScaleMode::kPerTensor ? p.a_scale[0] : 1.0f) *
                             (p.b_mode == ScaleMode::kPerTensor ? p.b_scale[u.expert] : 1.0f);
  const auto scaled = [&](int i, int wr, int64_t row) {
    float v = total(i) * tensor_scale;
    if (p.b_mode == ScaleMode::kPerRow) v *= p.b_scale[int64_t(u.expert) * p.n + wr];
    if (p.a_mode == ScaleMode::kPerRow) {
      const int64_t src = x_source_row(p, row);  // the token's scale under a gather
      v *= src >= 0 ? p.a_scale[src] : 0.0f;
    }
    return v;
  };
  if (p.k_splits > 1) {
    // The split's scaled fp32 partial tile [row, weight row], straight from registers (the
    // scales are the same for every split, so the reduce kernel only adds, then applies the
    // epilogue).
    float* partial = p.partial + int64_t(u.split) * p.m_total * p.n;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(total); ++i) {
      const TileCoord tc = tile_nt(i);
      const int t = u.t0 + tc.t;
      if (holds_tile && Epilogue::column_valid(p, u.n0, tc.n) && t < u.rows) {
        const int64_t row = u.row_begin + t;
        const int wr = Epilogue::weight_row(p, u.n0, tc.n);
        partial[row * p.n + wr] = scaled(i, wr, row);
      }
    }
    return;
  }
  // Staged: registers -> shared tile c[t][n] (16-bit: bf16, or fp16 bits for a plain fp16
  // store) -> the epilogue's stores. The first barrier keeps this unit's writes behind the
  // previous unit's reads of c (a pair's: behind the first warpgroup's reads of the sums).
  const bool fp16 = !Epilogue::kSiluMul && p.out_fp16;
  cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, Config::kEpilogueBarrier);
  if (holds_tile) {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(total); ++i) {
      const TileCoord tc = tile_nt(i);
      const int t = u.t0 + tc.t;
      const bool valid = Epilogue::column_valid(p, u.n0, tc.n) && t < u.rows;
      const float v =
          valid ? scaled(i, Epilogue::weight_row(p, u.n0, tc.n), u.row_begin + t) : 0.0f;
      c[tc.t * Config::kEpilogueLd + tc.n] = cutlass::bfloat16_t::bitcast(out16_bits(v, fp16));
    }
  }
  cutlass::arch::NamedBarrier::sync(Config::kConsumerThreads, Config::kEpilogueBarrier);
  Epilogue::store(p, u, c, ct);
}

}  // namespace hopper_moe::gemm
