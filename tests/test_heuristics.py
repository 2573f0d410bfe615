"""heuristics/sm90.h: the grouped GEMM's token tile, stage count and K split, compiled with the
system C++ compiler into a small driver and held to the rule recomputed here in Python.

The rule: the fullest expert is expected to get mean + 2.5 sqrt(mean) rows (mean = m_total /
num_experts); the mapping is swap-AB while they fit the largest swap-AB token tile, whose
token tile is then the smallest candidate that holds them; beyond, the standard mapping with
128 token rows and 256 (bf16) / 128 (FP8) weight rows;
each tile gets the most stages (<= 12) whose shared memory fits 227 KB. K split: a launch has
about u = ceil(N / 128) * max(A, ceil(m_total / tile)) full-K units, A = round(E (1 - (1 -
1/E)^m_total)) the experts expected to have rows, which the persistent grid runs in
ceil(u * s / sm_count) / s waves when each is cut s ways; from 2 waves of units up, no split;
below, the fewest splits within 3% of the best s, capped at 8 and at one split per 32 k-tiles.
Warpgroup pair (swap-AB token tiles 16 and 32): 64-row units, never split, u2 = ceil(N / 64) *
max(A, token tiles) of them, taking ceil(u2 / sm_count) / 2 waves: chosen only where the full
units need a K split, u2 needs none, and those waves are no longer than the full units' with
their split; up to 24 stages.
Grid: a swap-AB launch's expected units u (pair units, or full units times the split) on
ceil(u / ceil(u / sm_count)) CTAs when 4 <= ceil(u / sm_count) <= 8 waves, else sm_count. Weight
copies are evict-first in the swap-AB mapping only.
"""
from __future__ import annotations

import importlib.util
import math
from fractions import Fraction
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADER_DIR = ROOT / "csrc" / "include"

TILES = {"bf16": (16, 32, 64, 128), "e4m3": (16, 32, 64)}  # swap-AB token tiles
BLOCK_N = 128                                            # swap-AB weight tile
STANDARD = {"bf16": (256, 128), "e4m3": (128, 128)}      # standard (block_n, block_t)
BLOCK_K = {"bf16": 64, "e4m3": 128}
ELEMENT_BYTES = {"bf16": 2, "e4m3": 1}
SMEM_MAX = 227 * 1024
MAX_STAGES = 12
H200_SMS = 132
PAIR_TILES = (16, 32)   # swap-AB token tiles with a warpgroup pair
PAIR_BLOCK_N = 64
MAX_STAGES_PAIR = 24


def expected_max_rows(m_total: int, num_experts: int) -> float:
    mean = m_total / max(num_experts, 1)
    return mean + 2.5 * math.sqrt(mean)


def rule_swap_ab(dtype: str, m_total: int, num_experts: int) -> bool:
    return expected_max_rows(m_total, num_experts) <= TILES[dtype][-1]


def rule_token_tile(dtype: str, m_total: int, num_experts: int) -> int:
    """The token tile the rule gives, computed independently of the header."""
    if not rule_swap_ab(dtype, m_total, num_experts):
        return STANDARD[dtype][1]
    rows = expected_max_rows(m_total, num_experts)
    return next(t for t in TILES[dtype] if rows <= t)


def rule_block_n(dtype: str, m_total: int, num_experts: int, n: int | None = None,
                 k: int | None = None, sm_count: int = H200_SMS) -> int:
    """The weight tile: with n and k also the warpgroup pair's."""
    if not rule_swap_ab(dtype, m_total, num_experts):
        return STANDARD[dtype][0]
    if n is not None and rule_pair(dtype, m_total, num_experts, n, k, sm_count):
        return PAIR_BLOCK_N
    return BLOCK_N


def waves(units: int, splits: int, sm_count: int) -> Fraction:
    """Full-K units' time on the persistent grid when each is cut `splits` ways."""
    return Fraction(-(-units * splits // sm_count), splits)


def rule_active_experts(m_total: int, num_experts: int) -> int:
    if m_total <= 0 or num_experts <= 0:
        return 0
    return max(1, int(num_experts * (1 - (1 - 1 / num_experts) ** m_total) + 0.5))


def rule_token_tiles(dtype: str, m_total: int, num_experts: int) -> int:
    token_tiles = -(-m_total // rule_token_tile(dtype, m_total, num_experts))
    return max(rule_active_experts(m_total, num_experts), token_tiles)


def rule_units(dtype: str, m_total: int, num_experts: int, n: int) -> int:
    """Full-K units of the 128-row (or standard) weight tile."""
    return -(-n // rule_block_n(dtype, m_total, num_experts)) * rule_token_tiles(
        dtype, m_total, num_experts)


def split_rule(units: int, k_tiles: int, sm_count: int) -> int:
    cap = min(8, k_tiles // 32)
    if units <= 0 or units >= 2 * sm_count or cap <= 1:
        return 1
    best = min(waves(units, s, sm_count) for s in range(1, cap + 1))
    return next(s for s in range(1, cap + 1)
                if waves(units, s, sm_count) <= best * Fraction(103, 100))


def rule_pair(dtype: str, m_total: int, num_experts: int, n: int, k: int,
              sm_count: int = H200_SMS) -> bool:
    """The warpgroup pair the rule gives, computed independently of the header."""
    if (not rule_swap_ab(dtype, m_total, num_experts)
            or rule_token_tile(dtype, m_total, num_experts) not in PAIR_TILES):
        return False
    units = rule_units(dtype, m_total, num_experts, n)
    pair_units = -(-n // PAIR_BLOCK_N) * rule_token_tiles(dtype, m_total, num_experts)
    k_tiles = -(-k // BLOCK_K[dtype])
    if units <= 0 or pair_units <= 0 or split_rule(pair_units, k_tiles, sm_count) != 1:
        return False
    splits = split_rule(units, k_tiles, sm_count)
    return splits > 1 and Fraction(-(-pair_units // sm_count), 2) <= waves(units, splits,
                                                                            sm_count)


def rule_k_splits(dtype: str, m_total: int, num_experts: int, n: int, k: int,
                  sm_count: int = H200_SMS, allow_pair: bool = True) -> int:
    """The K split the rule gives, computed independently of the header (allow_pair=False:
    the rule without warpgroup pairs, as a launch with config "pair=0" applies it)."""
    if allow_pair and rule_pair(dtype, m_total, num_experts, n, k, sm_count):
        return 1
    return split_rule(rule_units(dtype, m_total, num_experts, n), -(-k // BLOCK_K[dtype]),
                      sm_count)


def rule_smem_bytes(dtype: str, block_n: int, block_t: int, stages: int,
                    pair: bool = False) -> int:
    """Two 1024-byte aligned rings (weights, tokens), the bf16 epilogue tile (block_t rows of
    block_n + 8 elements; a pair's at least its block_n x block_t fp32 sums), 2 mbarriers of
    8 bytes per stage, the prefix table of 1024 + 1 ints."""
    def align(x):
        return -(-x // 1024) * 1024
    per_row = BLOCK_K[dtype] * ELEMENT_BYTES[dtype]
    epilogue = max(block_t * (block_n + 8) * 2, block_n * block_t * 4 if pair else 0)
    return align(align(stages * block_n * per_row) + align(stages * block_t * per_row)
                 + epilogue + 16 * stages + (1024 + 1) * 4)


def rule_grid(dtype: str, m_total: int, num_experts: int, n: int, k: int,
              sm_count: int = H200_SMS) -> int:
    """The persistent grid the rule gives, computed independently of the header."""
    if rule_pair(dtype, m_total, num_experts, n, k, sm_count):
        units = -(-n // PAIR_BLOCK_N) * rule_token_tiles(dtype, m_total, num_experts)
    else:
        units = rule_units(dtype, m_total, num_experts, n) * rule_k_splits(
            dtype, m_total, num_experts, n, k, sm_count)
    w = -(-units // sm_count)
    if not rule_swap_ab(dtype, m_total, num_experts) or units <= 0 or not 4 <= w <= 8:
        return sm_count
    return -(-units // w)


DRIVER = r"""
#include "hopper_moe/heuristics/sm90.h"

#include <cstdio>
#include <cstring>

using namespace hopper_moe::heuristics;

// "tiles": the config of every candidate tile, one line each. Otherwise one query per stdin
// line, "<bf16|e4m3> <m_total> <num_experts> <n> <k> <sm_count>", answered by the chosen config.
int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "tiles") == 0) {
    for (int t : kTokenTilesBf16) std::puts(swapab_config(GemmDtype::kBf16, t).to_string().c_str());
    for (int t : kTokenTilesE4m3) std::puts(swapab_config(GemmDtype::kE4m3, t).to_string().c_str());
    for (int t : kPairTokenTiles) std::puts(swapab_pair_config(GemmDtype::kBf16, t).to_string().c_str());
    for (int t : kPairTokenTiles) std::puts(swapab_pair_config(GemmDtype::kE4m3, t).to_string().c_str());
    std::puts(standard_config(GemmDtype::kBf16).to_string().c_str());
    std::puts(standard_config(GemmDtype::kE4m3).to_string().c_str());
    return 0;
  }
  // "force": each query line ends with the override's swap_ab, pair and k_splits fields.
  const bool forced = argc > 1 && std::strcmp(argv[1], "force") == 0;
  char dtype[8];
  long long m_total;
  int num_experts, n, k, sm_count;
  while (std::scanf("%7s %lld %d %d %d %d", dtype, &m_total, &num_experts, &n, &k,
                    &sm_count) == 6) {
    const GemmDtype d = std::strcmp(dtype, "bf16") == 0 ? GemmDtype::kBf16 : GemmDtype::kE4m3;
    GroupedGemmOverride force;
    if (forced && std::scanf("%d %d %d", &force.swap_ab, &force.pair, &force.k_splits) != 3) {
      return 1;
    }
    std::puts(choose_grouped_gemm_sm90(d, m_total, num_experts, n, k, sm_count, force)
                  .to_string()
                  .c_str());
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cxx = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None:
        pytest.skip("no C++ compiler (c++, g++ or clang++) on PATH to build the driver")
    d = tmp_path_factory.mktemp("heuristics")
    (d / "driver.cpp").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-I",
                    str(HEADER_DIR), str(d / "driver.cpp"), "-o", str(exe)], check=True)
    return exe


def parse(line: str) -> dict:
    name, dtype, *fields = line.split()
    assert name == "grouped_gemm_sm90", line
    return {"dtype": dtype, **{k: int(v) for k, v in (f.split("=") for f in fields)}}


def choose(driver, queries, sm_count=H200_SMS):
    """queries: (dtype, m_total, num_experts, n, k) -> the parsed configs, in order."""
    stdin = "".join(" ".join(map(str, (*q, sm_count))) + "\n" for q in queries)
    out = subprocess.run([str(driver)], input=stdin, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(queries)
    return [parse(line) for line in lines]


def choose_forced(driver, queries, sm_count=H200_SMS):
    """queries: (dtype, m_total, num_experts, n, k, swap_ab, pair, k_splits), the last three
    the override's fields (-1 / -1 / 0: unset) -> the parsed configs, in order."""
    stdin = "".join(" ".join(map(str, (*q[:5], sm_count, *q[5:]))) + "\n" for q in queries)
    out = subprocess.run([str(driver), "force"], input=stdin, capture_output=True, text=True,
                         check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == len(queries)
    return [parse(line) for line in lines]


def tiles(driver):
    out = subprocess.run([str(driver), "tiles"], capture_output=True, text=True, check=True)
    return [parse(line) for line in out.stdout.splitlines()]


# (dtype, m_total, num_experts) -> (swap-AB?, token tile); m_total = num_tokens * top_k.
S, N = 1, 0  # swap-AB, standard
REPRESENTATIVE = [
    # mixtral: E = 8, top-2 (m_total = 2 M)
    ("bf16", 2, 8, S, 16), ("bf16", 32, 8, S, 16), ("bf16", 128, 8, S, 32),
    ("bf16", 256, 8, S, 64), ("bf16", 512, 8, S, 128), ("bf16", 1024, 8, N, 128),
    ("bf16", 8192, 8, N, 128),
    ("e4m3", 2, 8, S, 16), ("e4m3", 32, 8, S, 16), ("e4m3", 128, 8, S, 32),
    ("e4m3", 256, 8, S, 64), ("e4m3", 512, 8, N, 128), ("e4m3", 8192, 8, N, 128),
    # qwen3_30b: E = 128, top-8 (m_total = 8 M)
    ("bf16", 8, 128, S, 16), ("bf16", 512, 128, S, 16), ("bf16", 2048, 128, S, 32),
    ("bf16", 4096, 128, S, 64), ("bf16", 8192, 128, S, 128), ("bf16", 16384, 128, N, 128),
    ("e4m3", 4096, 128, S, 64), ("e4m3", 8192, 128, N, 128),
    # edges: no rows, no experts, one expert
    ("bf16", 0, 8, S, 16), ("bf16", 5, 0, S, 16), ("bf16", 64, 1, S, 128),
    ("e4m3", 64, 1, N, 128), ("e4m3", 40, 1, S, 64),
]


def test_representative_points(driver):
    got = choose(driver, [(d, m, e, 4096, 4096) for d, m, e, _, _ in REPRESENTATIVE])
    for (dtype, m, e, swap, want), cfg in zip(REPRESENTATIVE, got):
        assert rule_token_tile(dtype, m, e) == want, (dtype, m, e)  # the table itself
        assert rule_swap_ab(dtype, m, e) == bool(swap), (dtype, m, e)
        assert cfg["block_t"] == want, f"{dtype} m_total={m} E={e}: {cfg}"
        assert cfg["swap_ab"] == swap, f"{dtype} m_total={m} E={e}: {cfg}"
        assert cfg["block_n"] == rule_block_n(dtype, m, e, 4096, 4096), cfg
        assert cfg["pair"] == int(rule_pair(dtype, m, e, 4096, 4096)), cfg
        assert cfg["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["bf16", "e4m3"])
@pytest.mark.parametrize("num_experts", [1, 8, 16, 64, 128, 256])
def test_matches_rule_and_is_monotonic(driver, dtype, num_experts):
    """Every m_total up to 64 rows per expert plus a geometric tail: the rule's tile (so both
    sides of every boundary), never smaller for more rows, and independent of N and K."""
    ms = list(range(0, 64 * num_experts + 1, max(1, num_experts // 8)))
    ms += [int(64 * num_experts * 1.5 ** i) for i in range(1, 20)]
    queries = [(dtype, m, num_experts, n, k) for m in ms for n, k in ((4096, 14336), (64, 128))]
    configs = choose(driver, queries)
    got = [c["block_t"] for c in configs]
    want = [rule_token_tile(dtype, m, num_experts) for m in ms for _ in range(2)]
    assert got == want
    assert [c["swap_ab"] for c in configs] == \
        [int(rule_swap_ab(dtype, m, num_experts)) for m in ms for _ in range(2)]
    by_m = got[::2]
    assert by_m == got[1::2], "N and K do not change the token tile"
    assert all(a <= b for a, b in zip(by_m, by_m[1:])), "token tile shrinks as m_total grows"
    swaps = [c["swap_ab"] for c in configs[::2]]
    assert all(a >= b for a, b in zip(swaps, swaps[1:])), "swap-AB once past the standard"
    assert set(by_m) == set(TILES[dtype]) | {STANDARD[dtype][1]}, \
        "every candidate tile is chosen somewhere"
    assert 0 in swaps, "the standard mapping is chosen somewhere"


# (dtype, m_total, num_experts, n, k) -> K splits, warpgroup pair on 132 SMs.
K_SPLIT_POINTS = [
    ("bf16", 2, 8, 4096, 14336, 1, 1),   # mixtral GEMM2 at one token: 2 experts x 32 tiles
    ("e4m3", 2, 8, 4096, 14336, 1, 1),   # (split 2 ways: 0.5 waves; 128 pairs: 0.5 unsplit)
    ("bf16", 8, 8, 4096, 14336, 4, 0),   # at four tokens: 5 experts, 160 units, 1.25 waves
    ("e4m3", 8, 8, 4096, 14336, 3, 0),   # FP8: 112 k-tiles, at most 3 ways (pairs: 1.5)
    ("bf16", 2, 8, 28672, 4096, 1, 0),   # its GEMM1: 448 units, 4 waves, unsplit: no pair
    ("e4m3", 4, 8, 28672, 4096, 1, 0),   # at two tokens: 672 units, 6 waves; pairs 5.5
    ("bf16", 32, 8, 4096, 14336, 1, 0),  # 256 units: 2 waves, and pairs too
    ("bf16", 8, 128, 1536, 2048, 1, 0),  # qwen3_30b GEMM1 at one token: 32 k-tiles, one split
    ("bf16", 2, 8, 512, 8192, 4, 0),     # 8 units, 128 k-tiles: 4 ways (pairs would split)
    ("bf16", 2, 8, 512, 4104, 2, 0),     # 65 k-tiles: 2 ways
    ("e4m3", 1, 8, 1024, 640, 1, 0),     # 5 k-tiles: too few to split, so no pair either
    ("bf16", 0, 8, 4096, 14336, 1, 0),   # no rows
    ("bf16", 10000, 1, 128, 32768, 5, 0),  # one expert of 10000 rows: 79 units, 5 ways
    ("bf16", 300, 1, 128, 4096, 2, 0),   # 3 token tiles of 128 (standard), 64 k-tiles
]


def test_k_split_points(driver):
    got = choose(driver, [q[:5] for q in K_SPLIT_POINTS])
    for q, cfg in zip(K_SPLIT_POINTS, got):
        assert rule_k_splits(*q[:5]) == q[5], q  # the table itself
        assert int(rule_pair(*q[:5])) == q[6], q
        assert cfg["k_splits"] == q[5], f"{q}: {cfg}"
        assert cfg["pair"] == q[6], f"{q}: {cfg}"
        assert cfg["block_n"] == (PAIR_BLOCK_N if q[6] else rule_block_n(*q[:3])), cfg


# (dtype, m_total, num_experts, n, k) -> the persistent grid on 132 SMs.
GRID_POINTS = [
    ("e4m3", 2, 8, 28672, 4096, 112),  # mixtral GEMM1, 1 token: 448 units, 4 x 112
    ("bf16", 2, 8, 28672, 4096, 112),
    ("e4m3", 4, 8, 28672, 4096, 112),  # GEMM1, 2 tokens: 3 experts expected, 672 units, 6 x 112
    ("e4m3", 6, 8, 28672, 4096, 128),  # GEMM1, 3 tokens: 4 experts, 896 units, 7 x 128
    ("e4m3", 8, 8, 28672, 4096, 132),  # GEMM1, 4 tokens: 5 experts, 1120 units, 9 waves
    ("e4m3", 32, 8, 28672, 4096, 132),  # GEMM1, 16 tokens: 1792 units, 14 waves
    ("e4m3", 2, 8, 4096, 14336, 132),  # mixtral GEMM2, 1 token: 128 pair units, one wave
    ("bf16", 8, 8, 4096, 14336, 128),  # GEMM2, 4 tokens: 160 units split 4 ways, 5 x 128
    ("bf16", 8, 128, 1536, 2048, 132),  # qwen3_30b GEMM1, 1 token: 96 units, one wave
    ("bf16", 16, 128, 1536, 2048, 132),  # 2 tokens: 15 experts expected, 16 may come
    ("bf16", 1024, 8, 28672, 4096, 132),  # mixtral GEMM1, 512 tokens: standard, 7 waves
    ("bf16", 0, 8, 4096, 14336, 132),  # no rows
    ("bf16", 2, 8, 128, 128, 132),     # 2 units: one wave
]


def test_grid_points(driver):
    got = choose(driver, [q[:5] for q in GRID_POINTS])
    for q, cfg in zip(GRID_POINTS, got):
        assert rule_grid(*q[:5]) == q[5], q  # the table itself
        assert cfg["grid"] == q[5], f"{q}: {cfg}"


@pytest.mark.parametrize("sm_count", [78, 132])
def test_k_splits_match_rule(driver, sm_count):
    queries = [(d, m, e, n, k) for d in ("bf16", "e4m3") for m in (0, 1, 2, 3, 5, 16, 300)
               for e in (1, 8, 128) for n in (64, 200, 1024, 4096, 28672)
               for k in (64, 640, 4096, 14336)]
    got = choose(driver, queries, sm_count)
    for q, cfg in zip(queries, got):
        assert cfg["k_splits"] == rule_k_splits(*q, sm_count=sm_count), f"{q}: {cfg}"
        assert cfg["pair"] == int(rule_pair(*q, sm_count=sm_count)), f"{q}: {cfg}"
        assert cfg["block_t"] == rule_token_tile(*q[:3]), f"{q}: {cfg}"
        assert cfg["grid"] == rule_grid(*q, sm_count=sm_count), f"{q}: {cfg}"
        assert 0 < cfg["grid"] <= sm_count, f"{q}: {cfg}"
        assert cfg["evict_first"] == cfg["swap_ab"], f"{q}: {cfg}"
        units = rule_units(*q[:4])
        if 0 < units < 2 * sm_count and not cfg["pair"]:
            s = cfg["k_splits"]
            assert all(waves(units, s, sm_count) <= waves(units, t, sm_count) * Fraction(103, 100)
                       for t in range(1, min(8, -(-q[4] // BLOCK_K[q[0]]) // 32) + 1)), \
                f"{q}: {s} splits are more than 3% slower than another count"


def test_candidate_configs_fit_shared_memory(driver):
    configs = tiles(driver)
    assert [(c["dtype"], c["swap_ab"], c["block_n"], c["block_t"], c["pair"])
            for c in configs] == \
        [(d, 1, BLOCK_N, t, 0) for d in ("bf16", "e4m3") for t in TILES[d]] + \
        [(d, 1, PAIR_BLOCK_N, t, 1) for d in ("bf16", "e4m3") for t in PAIR_TILES] + \
        [(d, 0, *STANDARD[d], 0) for d in ("bf16", "e4m3")]
    for c in configs:
        d, n, t, s, pair = c["dtype"], c["block_n"], c["block_t"], c["stages"], bool(c["pair"])
        cap = MAX_STAGES_PAIR if pair else MAX_STAGES
        assert c["block_k"] == BLOCK_K[d], c
        assert c["promote_interval"] == (0 if d == "bf16" else 4), c
        assert c["smem_bytes"] == rule_smem_bytes(d, n, t, s, pair), c
        assert c["smem_bytes"] <= SMEM_MAX, c
        assert 2 <= s <= cap, c
        assert s == cap or rule_smem_bytes(d, n, t, s + 1, pair) > SMEM_MAX, \
            f"{c}: one more stage would still fit"
        assert t * BLOCK_K[d] * ELEMENT_BYTES[d] % 1024 == 0, "token slots stay 1024-byte aligned"
        acc = n * t // (128 if pair else 256) * (2 if d == "e4m3" else 1)
        assert acc <= 128, f"{c}: {acc} accumulator registers per consumer thread"
    stages = {(c["dtype"], c["swap_ab"], c["pair"], c["block_t"]): c["stages"] for c in configs}
    assert stages == {("bf16", 1, 0, 16): 12, ("bf16", 1, 0, 32): 10, ("bf16", 1, 0, 64): 8,
                      ("bf16", 1, 0, 128): 5, ("e4m3", 1, 0, 16): 12, ("e4m3", 1, 0, 32): 10,
                      ("e4m3", 1, 0, 64): 8, ("bf16", 0, 0, 128): 3, ("e4m3", 0, 0, 128): 5,
                      ("bf16", 1, 1, 16): 21, ("bf16", 1, 1, 32): 17, ("e4m3", 1, 1, 16): 21,
                      ("e4m3", 1, 1, 32): 17}


def _generator():
    spec = importlib.util.spec_from_file_location(
        "generate_instantiations", ROOT / "tools" / "generate_instantiations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_instantiations_cover_the_candidates(driver):
    """Every tile the heuristic can return has an instantiation and a dispatch case, and the
    committed csrc/instantiations/ is the generator's output."""
    gen = _generator()
    header = {d: tuple(c["block_t"] for c in tiles(driver)
                       if c["dtype"] == d and c["swap_ab"] and not c["pair"]) for d in TILES}
    assert {d: tiles_ for d, (_, tiles_) in gen.TOKEN_TILES.items()} == header
    for d in TILES:
        assert tuple(c["block_t"] for c in tiles(driver)
                     if c["dtype"] == d and c["pair"]) == gen.PAIR_TILES
    files = gen.render()
    on_disk = {p.name: p.read_text() for p in gen.OUT.glob("*.cu")}
    assert on_disk == files, "csrc/instantiations/ is stale: run tools/generate_instantiations.py"
    dispatch = files["moe_gemm_sm90_dispatch.cu"]
    for d, (enum, tiles_) in gen.TOKEN_TILES.items():
        assert f"moe_gemm_standard_sm90<GemmDtype::{enum}>" in dispatch
        assert f"moe_gemm_standard_sm90_{d}.cu" in files
        for t in tiles_:
            assert f"moe_gemm_swapab_sm90<GemmDtype::{enum}, {t}>" in dispatch
            assert f"moe_gemm_swapab_sm90_{d}_t{t}.cu" in files
        for t in gen.PAIR_TILES:
            assert f"moe_gemm_swapab_pair_sm90<GemmDtype::{enum}, {t}>" in dispatch
            assert f"moe_gemm_swapab_pair_sm90_{d}_t{t}.cu" in files


def test_forced_configs(driver):
    """The ops' `config` argument as the heuristic applies it: an unset override is the
    heuristic's choice; a forced mapping, pair or K split replaces that part only, and a
    forced pair or split recomputes the grid."""
    # mixtral GEMM2 (N = 4096, K = 14336) at one token: the heuristic pairs it.
    base_q = ("bf16", 2, 8, 4096, 14336)
    (plain,) = choose(driver, [base_q])
    assert plain["pair"] == 1 and plain["swap_ab"] == 1
    unset, standard, no_pair, split3 = choose_forced(driver, [
        (*base_q, -1, -1, 0), (*base_q, 0, -1, 0), (*base_q, -1, 0, 0), (*base_q, -1, 0, 3)])
    assert unset == plain
    assert standard["swap_ab"] == 0 and standard["block_t"] == STANDARD["bf16"][1]
    assert standard["block_n"] == STANDARD["bf16"][0] and standard["pair"] == 0
    assert no_pair["pair"] == 0 and no_pair["block_n"] == BLOCK_N
    assert no_pair["k_splits"] == rule_k_splits("bf16", 2, 8, 4096, 14336, H200_SMS,
                                                allow_pair=False)
    assert split3["pair"] == 0 and split3["k_splits"] == 3
    # qwen3_30b GEMM1 (N = 1536, K = 2048) at 4 tokens: no pair by the rule; forced, the pair
    # keeps the heuristic's K split; on the standard mapping a forced pair is no pair.
    q = ("e4m3", 32, 128, 1536, 2048)
    (plain,) = choose(driver, [q])
    assert plain["pair"] == 0 and plain["block_t"] == 16
    pair, std_pair = choose_forced(driver, [(*q, -1, 1, 0), (*q, 0, 1, 0)])
    assert pair["pair"] == 1 and pair["block_n"] == PAIR_BLOCK_N
    assert pair["k_splits"] == plain["k_splits"] and pair["block_t"] == plain["block_t"]
    assert std_pair["pair"] == 0 and std_pair["swap_ab"] == 0
