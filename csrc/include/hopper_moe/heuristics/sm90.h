// Config choice of the SM90 grouped expert GEMM (gemm/kernel_moe_gemm_sm90.cuh). The
// measurements behind each rule: benchmarks/notes/sm90_gemm.md.
//
// Pure and host-only: plain C++ with no CUDA or CuTe include, so a unit test compiles it with
// the system compiler (tests/test_heuristics.py). The choice uses only what the host knows
// without reading device memory: the dtype, the rows of x and the problem's N, K and expert
// count. The per-expert row counts live on the device (and change under CUDA-graph replay).
//
// Token tile: the fullest expert streams its weights ceil(rows / kBlockT) times, so the tile
// is sized to the rows the fullest expert is expected to get under uniform routing,
// mean + 2.5 sqrt(mean) with mean = m_total / num_experts (exceeded by ~0.6% of experts; the
// rule of the Triton backend's `expected_max_rows`), rounded up to a candidate.
// Mapping: swap-AB (weights on wgmma's 64-row A side, tokens the N side) while those rows fit
// a swap-AB token tile; beyond the largest, the standard mapping (128 token rows on the A
// side, 256 bf16 / 128 FP8 weight rows on the N side), whose k-tile does more math per byte of
// shared memory than the 128 x 128 swap-AB tile.
// The candidates stop at bf16 128 and FP8 64 tokens: a 128 x kBlockT tile is kBlockT / 2
// fp32 accumulator registers per consumer thread (twice for FP8's promotion), and larger
// tiles would fit but have no instantiation yet.
// Stages: as many as fit the 227 KB of shared memory a CTA can have, at most 12. One CTA per
// SM streams a decode launch's weights, so the bytes it keeps in flight bound its bandwidth;
// the small token tiles get 10-12 stages.
// K split: E (1 - (1 - 1/E)^m_total) experts are expected to have rows (uniform routing) and
// at least ceil(m_total / block_t) token tiles are needed, so a launch has about
// ceil(N / block_n) * max(active experts, ceil(m_total / block_t)) full-K units. The persistent
// grid (one CTA per SM) runs them in ceil(units / sm_count) waves, the last one partial:
// mixtral's GEMM2 at four tokens has 5 x 32 = 160 units for 132 SMs, 1.21 waves of work in 2.
// Cutting each unit's K range s ways makes the waves ceil(units * s / sm_count) / s (160 units,
// s = 4: 1.25). Measured per GEMM (benchmarks/notes/sm90_gemm.md), the waves count where a
// launch has under two waves of units; past that the SMs of the last wave stream faster and
// the split buys nothing or loses the reduction's launch. So: no split from kKSplitMaxWaves
// waves up; below, the fewest splits within 3% of the best s <= kMaxKSplits, keeping >=
// kMinKTilesPerSplit k-tiles (4 KB of each weight row) per split: below that the reduction
// launch costs more than the waves save.
// Warpgroup pair: swap-AB with 64-row units (token tiles 16 and 32), never split, only where
// their waves replace a K split at no loss (use_warpgroup_pair: pairs of an unsplit launch
// with a short last wave lose in FP8).
// Grid: swap-AB launches of kBalanceMinWaves to kBalanceMaxWaves waves of expected units get
// the fewest CTAs that keep the waves (persistent_grid), so that no CTA carries one unit
// more than the others while the rest of the grid idles, and the SMs left over start the next
// launch. Swap-AB reads each weight tile once (one token tile per expert is expected), so its
// weights are copied evict-first, which keeps the tokens and outputs in L2.
#pragma once

#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>

namespace hopper_moe::heuristics {

enum class GemmDtype : int { kBf16 = 0, kE4m3 = 1 };

inline const char* to_string(GemmDtype dtype) {
  return dtype == GemmDtype::kBf16 ? "bf16" : "e4m3";
}

// Token tiles with an instantiation (tools/generate_instantiations.py), in increasing order.
inline constexpr int kTokenTilesBf16[] = {16, 32, 64, 128};
inline constexpr int kTokenTilesE4m3[] = {16, 32, 64};

// Token tiles with a warpgroup-pair instantiation (swap-AB, kPairBlockN weight rows per unit).
inline constexpr int kPairTokenTiles[] = {16, 32};

inline constexpr int kSmemBytesMax = 227 * 1024;  // dynamic shared memory of one SM90 CTA
inline constexpr int kMaxStages = 12;
inline constexpr int kMaxStagesPair = 24;  // half-size slots: the same bytes in flight
inline constexpr int kPairBlockN = 64;     // weight rows of a warpgroup-pair unit
inline constexpr int kMaxKSplits = 8;
inline constexpr int kMinKTilesPerSplit = 32;
inline constexpr int kKSplitMaxWaves = 2;  // launches with more units never split
inline constexpr int kKSplitSlackPct = 3;  // a split must buy more than this much time
inline constexpr int kBalanceMinWaves = 4;  // launches with fewer waves keep every SM,
inline constexpr int kBalanceMaxWaves = 8;  // and so do those with more

// One instantiation of the swap-AB kernel: its template arguments and shared memory.
struct GroupedGemmConfig {
  GemmDtype dtype = GemmDtype::kBf16;
  int block_n = 0;           // weight rows per unit (swap-AB: wgmma's A side, 2 x 64)
  int block_t = 0;           // token rows per unit (swap-AB: the wgmma N)
  int block_k = 0;           // one 128-byte swizzle row of K
  int stages = 0;            // shared-memory ring depth
  int promote_interval = 0;  // k-tiles between FP8 promotions to fp32 (0: bf16, none)
  int smem_bytes = 0;
  int k_splits = 1;          // K ranges per CTA's work (a launch-time choice, not a template)
  bool swap_ab = true;       // weights on wgmma's A side (else the tokens)
  int grid = 0;              // CTAs of the persistent grid, at most (persistent_grid)
  bool evict_first = false;  // weight copies evict-first in L2 (each is read once: swap-AB)
  // Swap-AB with block_n = kPairBlockN: the two consumer warpgroups share one 64-row weight
  // tile and take alternate k-tiles, adding their sums in the epilogue (warpgroup_pair()).
  constexpr bool pair() const { return swap_ab && block_n == kPairBlockN; }

  std::string to_string() const {
    return std::string("grouped_gemm_sm90 ") + heuristics::to_string(dtype) +
           " swap_ab=" + std::to_string(int(swap_ab)) + " block_n=" + std::to_string(block_n) + " block_t=" + std::to_string(block_t) +
           " block_k=" + std::to_string(block_k) + " stages=" + std::to_string(stages) +
           " promote_interval=" + std::to_string(promote_interval) +
           " pair=" + std::to_string(int(pair())) +
           " smem_bytes=" + std::to_string(smem_bytes) + " k_splits=" + std::to_string(k_splits) +
           " grid=" + std::to_string(grid) + " evict_first=" + std::to_string(int(evict_first));
  }
};

constexpr int element_bytes(GemmDtype dtype) { return dtype == GemmDtype::kBf16 ? 2 : 1; }

// The kernel's SharedStorage: weight ring and token ring, each 1024-byte aligned; the
// epilogue's bf16 tile (block_t rows of block_n + kEpiloguePad elements); a full and an empty
// barrier per stage; the per-expert token-tile prefix table (kMaxExperts + 1 ints); the whole
// rounded up to its 1024-byte alignment. The kernel static_asserts that this equals
// sizeof(SharedStorage).
inline constexpr int kMaxExperts = 1024;   // the prefix table's capacity (the op checks E)
inline constexpr int kEpiloguePad = 8;     // bf16 elements after each epilogue row: 16 bytes
// A warpgroup pair's epilogue tile also holds the second warpgroup's fp32 sums (64 x block_t)
// before the first adds them, so it is the larger of the two.
constexpr int epilogue_bytes(bool pair, int block_n, int block_t) {
  const int staged = block_t * (block_n + kEpiloguePad) * 2;
  const int sums = pair ? block_n * block_t * 4 : 0;
  return staged > sums ? staged : sums;
}
constexpr int gemm_smem_bytes(GemmDtype dtype, bool pair, int block_n, int block_t,
                              int block_k, int stages) {
  const auto align = [](int bytes) { return (bytes + 1023) / 1024 * 1024; };
  const int w = align(stages * block_n * block_k * element_bytes(dtype));
  const int x = align(stages * block_t * block_k * element_bytes(dtype));
  const int c = epilogue_bytes(pair, block_n, block_t);
  return align(w + x + c + 2 * stages * 8 + (kMaxExperts + 1) * 4);
}

// The full config of an instantiation: its tiles and mapping, then the stages that fit.
constexpr GroupedGemmConfig gemm_config(GemmDtype dtype, bool swap_ab, int block_n,
                                        int block_t) {
  GroupedGemmConfig c;
  c.dtype = dtype;
  c.swap_ab = swap_ab;
  c.block_n = block_n;
  c.block_t = block_t;
  c.block_k = 128 / element_bytes(dtype);
  c.promote_interval = dtype == GemmDtype::kBf16 ? 0 : 4;  // every 512 of K
  const bool pair = c.pair();
  c.stages = pair ? kMaxStagesPair : kMaxStages;
  while (c.stages > 2 && gemm_smem_bytes(dtype, pair, c.block_n, block_t, c.block_k,
                                         c.stages) > kSmemBytesMax) {
    --c.stages;
  }
  c.smem_bytes = gemm_smem_bytes(dtype, pair, c.block_n, block_t, c.block_k, c.stages);
  return c;
}

// Swap-AB with a token tile of kTokenTilesBf16 / kTokenTilesE4m3.
constexpr GroupedGemmConfig swapab_config(GemmDtype dtype, int block_t) {
  return gemm_config(dtype, true, 128, block_t);
}

// Swap-AB with a warpgroup pair (kPairBlockN weight rows) and a token tile of
// kPairTokenTiles.
constexpr GroupedGemmConfig swapab_pair_config(GemmDtype dtype, int block_t) {
  return gemm_config(dtype, true, kPairBlockN, block_t);
}

inline bool has_pair_tile(int block_t) {
  for (int t : kPairTokenTiles) {
    if (t == block_t) return true;
  }
  return false;
}

// The standard mapping: 128 token rows x 256 (bf16) or 128 (FP8, whose promoted accumulator
// is twice the registers) weight rows.
constexpr GroupedGemmConfig standard_config(GemmDtype dtype) {
  return gemm_config(dtype, false, dtype == GemmDtype::kBf16 ? 256 : 128, 128);
}

// Rows the fullest of num_experts experts is expected to get when m_total rows are routed
// uniformly.
inline double expected_max_rows(int64_t m_total, int num_experts) {
  const double mean = double(m_total) / double(num_experts > 1 ? num_experts : 1);
  return mean + 2.5 * std::sqrt(mean);
}

// Waves of full-K units when `units` units run on `sm_count` SMs, each cut `splits` ways: the
// persistent grid's time is ceil(units * splits / sm_count) split units, 1 / splits of a
// full-K unit each. Kept as the fraction (numerator, denominator) so the comparison is exact.
struct Waves {
  int64_t num;
  int64_t den;
};
inline Waves k_split_waves(int64_t units, int64_t splits, int sm_count) {
  return {(units * splits + sm_count - 1) / sm_count, splits};
}

// K ranges per unit for a launch of about `units` full-K units (see the header comment): none
// when the units fill at least kKSplitMaxWaves waves; otherwise the fewest splits whose waves
// are within kKSplitSlackPct of the best count up to the caps.
inline int choose_k_splits(int64_t units, int k_tiles, int sm_count) {
  if (units <= 0 || sm_count <= 0 || units >= kKSplitMaxWaves * int64_t(sm_count)) return 1;
  int64_t max_splits = kMaxKSplits;
  if (max_splits > k_tiles / kMinKTilesPerSplit) max_splits = k_tiles / kMinKTilesPerSplit;
  if (max_splits <= 1) return 1;
  Waves best = k_split_waves(units, 1, sm_count);
  for (int64_t s = 2; s <= max_splits; ++s) {
    const Waves w = k_split_waves(units, s, sm_count);
    if (w.num * best.den < best.num * w.den) best = w;
  }
  for (int64_t s = 1; s <= max_splits; ++s) {
    const Waves w = k_split_waves(units, s, sm_count);
    if (100 * w.num * best.den <= (100 + kKSplitSlackPct) * best.num * w.den) return int(s);
  }
  return 1;  // not reached: the best count is within its own slack
}

// Warpgroup pairs (kPairBlockN-row units, half the bytes of a 128-row one) for a launch of
// about `units` full-K 128-row units, whose K split is `splits` (choose_k_splits), and
// `pair_units` pair units, which a pair never splits: only where that split is needed and the
// unsplit pairs' waves (half units) are no longer, so the reduction goes away (mixtral GEMM2
// at one token: 64 units split 2 ways, 0.5 waves; 128 pair units, 0.5). Not for an unsplit
// launch whose last wave is short (mixtral GEMM1 at one token: 448 units, 4 waves; 896 pairs,
// 3.5): its free SMs already run the next launch's prefetch, and the pairs lost 1 us there in
// FP8.
inline bool use_warpgroup_pair(int64_t units, int splits, int64_t pair_units, int k_tiles,
                               int sm_count) {
  if (splits <= 1 || units <= 0 || pair_units <= 0 || sm_count <= 0) return false;
  if (choose_k_splits(pair_units, k_tiles, sm_count) != 1) return false;
  const Waves full = k_split_waves(units, splits, sm_count);  // in full units
  const int64_t pair = k_split_waves(pair_units, 1, sm_count).num;  // in half units
  return pair * full.den <= 2 * full.num;
}

// Experts expected to have rows when m_total rows are routed uniformly over num_experts:
// E (1 - (1 - 1/E)^m_total), rounded to the nearest whole expert.
inline int64_t expected_active_experts(int64_t m_total, int num_experts) {
  if (m_total <= 0 || num_experts <= 0) return 0;
  const double e = double(num_experts);
  const double active = e * (1.0 - std::pow(1.0 - 1.0 / e, double(m_total)));
  const int64_t rounded = int64_t(active + 0.5);
  return rounded < 1 ? 1 : rounded;
}

// Units a launch of config c is expected to have (uniform routing, as the K split's estimate):
// ceil(N / block_n) weight tiles x max(active experts, ceil(m_total / block_t)) token tiles x
// the K split.
inline int64_t expected_units(const GroupedGemmConfig& c, int64_t m_total, int num_experts,
                              int n) {
  const int64_t active_experts = expected_active_experts(m_total, num_experts);
  const int64_t min_token_tiles = (m_total + c.block_t - 1) / c.block_t;
  const int64_t token_tiles =
      active_experts > min_token_tiles ? active_experts : min_token_tiles;
  return int64_t((n + c.block_n - 1) / c.block_n) * token_tiles * c.k_splits;
}

// The fewest CTAs that run `units` units in as many waves as sm_count CTAs do:
// ceil(units / ceil(units / sm_count)). Every CTA then gets the same number of units (when
// the estimate holds) and the SMs left over are free for the next launch from the start
// (mixtral GEMM1 at one token: 448 units on 112 CTAs, 4 each, instead of 132 CTAs with 3 or 4).
inline int balanced_grid(int64_t units, int sm_count) {
  if (units <= 0 || sm_count <= 0) return sm_count;
  const int64_t waves = (units + sm_count - 1) / sm_count;
  return int((units + waves - 1) / waves);
}

// The persistent grid of a launch of config c: balanced (balanced_grid of its expected units)
// from kBalanceMinWaves to kBalanceMaxWaves waves, every SM otherwise. Around 4 waves the
// short last wave of a full grid costs the most; past 8 it costs little. Below 4 the balanced grid can drop to half the SMs (133 units: 67 CTAs),
// too few to pull HBM's bandwidth, and to one wave of exactly the expected units, where one
// more expert than expected would take a second wave; from 4 waves up it keeps at least 3/4
// of the SMs. Swap-AB only: the standard mapping's launches (prefill) with 4-8 waves have not
// been measured balanced, and keep every SM.
inline int persistent_grid(const GroupedGemmConfig& c, int64_t m_total, int num_experts, int n,
                           int sm_count) {
  const int64_t units = expected_units(c, m_total, num_experts, n);
  if (!c.swap_ab || units <= 0 || sm_count <= 0) return sm_count;
  const int64_t waves = (units + sm_count - 1) / sm_count;
  if (waves < kBalanceMinWaves || waves > kBalanceMaxWaves) return sm_count;
  return balanced_grid(units, sm_count);
}

// The launch-time parts of config c that follow from its mapping, tiles and K split: the
// persistent grid and the weights' cache policy (evict-first where each tile is read once).
inline void set_grid_and_policy(GroupedGemmConfig& c, int64_t m_total, int num_experts, int n,
                                int sm_count) {
  c.grid = persistent_grid(c, m_total, num_experts, n, sm_count);
  c.evict_first = c.swap_ab;
}

// The config for one launch in the given mapping: the token tile (swap-AB: the rule's,
// capped at the largest candidate; standard: 128) and the K split. n and k do not enter the
// token tile: whatever the weight shape, a second token tile of an expert streams all of its
// weights again. They, and the GPU's SM count, decide the K split.
inline GroupedGemmConfig grouped_gemm_config_sm90(GemmDtype dtype, bool swap_ab,
                                                  int64_t m_total, int num_experts, int n,
                                                  int k, int sm_count, bool allow_pair = true) {
  GroupedGemmConfig c;
  if (swap_ab) {
    const double rows = expected_max_rows(m_total, num_experts);
    const int* tiles = dtype == GemmDtype::kBf16 ? kTokenTilesBf16 : kTokenTilesE4m3;
    const int count = dtype == GemmDtype::kBf16 ? int(std::size(kTokenTilesBf16))
                                                : int(std::size(kTokenTilesE4m3));
    int block_t = tiles[count - 1];
    for (int i = 0; i < count; ++i) {
      if (rows <= double(tiles[i])) {
        block_t = tiles[i];
        break;
      }
    }
    c = swapab_config(dtype, block_t);
  } else {
    c = standard_config(dtype);
  }
  const int64_t units = expected_units(c, m_total, num_experts, n);  // c.k_splits = 1
  const int k_tiles = (k + c.block_k - 1) / c.block_k;
  c.k_splits = choose_k_splits(units, k_tiles, sm_count);
  if (allow_pair && swap_ab && has_pair_tile(c.block_t)) {
    const int64_t pair_units =
        expected_units(swapab_pair_config(c.dtype, c.block_t), m_total, num_experts, n);
    if (use_warpgroup_pair(units, c.k_splits, pair_units, k_tiles, sm_count)) {
      c = swapab_pair_config(c.dtype, c.block_t);  // k_splits = 1
    }
  }
  set_grid_and_policy(c, m_total, num_experts, n, sm_count);
  return c;
}

// Swap-AB while the fullest expert's expected rows fit its largest token tile.
inline bool use_swap_ab(GemmDtype dtype, int64_t m_total, int num_experts) {
  const int largest = dtype == GemmDtype::kBf16 ? kTokenTilesBf16[std::size(kTokenTilesBf16) - 1]
                                                : kTokenTilesE4m3[std::size(kTokenTilesE4m3) - 1];
  return expected_max_rows(m_total, num_experts) <= double(largest);
}

// The sm90 layer's GEMM1 gathers x's rows in its producer (no moe_permute copy, one launch
// less) when the experts are many (so small) and the sort leaves at most a quarter of a row
// per expert on average. Measured on an H100, the layer op against the same layer with the
// copy, one run each (benchmarks/notes/next.md, "The gather in GEMM1's producer"): qwen3_30b
// (E = 128) and deepseek_v3_tp8 (E = 256) gain 0.9-7.3 us at M = 1-4 (but deepseek FP8 M = 1
// lost 4.7 us, unexplained); at M = 16 (0.5-1 row per expert) bf16 lost 1-3%; mixtral (E = 8)
// lost 0.5-2% at decode and up to 20% at FP8 prefill, where the producer's cp.async rows cost
// more than the copy they save.
inline constexpr int kGatherMinExperts = 64;
inline bool layer_gathers_gemm1_rows(int64_t slots, int64_t num_experts) {
  return num_experts >= kGatherMinExperts && 4 * slots <= num_experts;
}

// An explicit choice that replaces part of the heuristic's, for tests and measurements (the
// grouped-GEMM ops' `config` argument). Unset fields keep the heuristic's choice.
struct GroupedGemmOverride {
  int swap_ab = -1;  // 1: swap-AB, 0: the standard mapping
  int pair = -1;     // 0: no warpgroup pair; 1: the pair wherever the launch has its token tile
  int k_splits = 0;  // 1..kMaxKSplits
  int pdl = -1;      // 0 / 1: the launches without / with programmatic dependent launch
};

// The mapping, token tile and K split for one launch, with the parts `force` sets replaced.
// A forced pair keeps the K split chosen for 128-row units; a forced pair or split moves the
// grid and cache policy with it.
inline GroupedGemmConfig choose_grouped_gemm_sm90(GemmDtype dtype, int64_t m_total,
                                                  int num_experts, int n, int k, int sm_count,
                                                  const GroupedGemmOverride& force = {}) {
  const bool swap_ab =
      force.swap_ab >= 0 ? force.swap_ab == 1 : use_swap_ab(dtype, m_total, num_experts);
  GroupedGemmConfig c = grouped_gemm_config_sm90(dtype, swap_ab, m_total, num_experts, n, k,
                                                 sm_count, /*allow_pair=*/force.pair != 0);
  bool regrid = false;
  if (force.pair == 1 && !c.pair() && c.swap_ab && has_pair_tile(c.block_t)) {
    const int splits = c.k_splits;
    c = swapab_pair_config(dtype, c.block_t);
    c.k_splits = splits;
    regrid = true;
  }
  if (force.k_splits > 0) {
    c.k_splits = force.k_splits;
    regrid = true;
  }
  if (regrid) set_grid_and_policy(c, m_total, num_experts, n, sm_count);
  return c;
}

}  // namespace hopper_moe::heuristics
