"""tools/gemm_timeline.py: the parser and the report on made-up stamp lines (CPU)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import gemm_timeline as T  # noqa: E402


def lines(n, silu, grid, start, units):
    """Stamps of a launch: CTA c starts at start + c ns * 1000, its units 10 us apart."""
    out = []
    for c in range(grid):
        s = start + 1000 * c
        u = [s + 2000 + 10_000 * j for j in range(units[c])] + [0] * (8 - units[c])
        out.append(f"HMTL P n={n} k=4096 silu={silu} splits=1 grid={grid} cta={c} sm={c} "
                   f"start={s} ready={s + 500} waited={s + 800} issued={s + 9000}")
        out.append(f"HMTL C n={n} k=4096 silu={silu} splits=1 grid={grid} cta={c} sm={c} "
                   f"first={s + 1500} units={units[c]} u={','.join(map(str, u))} "
                   f"end={s + 2000 + 10_000 * units[c]}")
    return out


def test_parse_and_report_order_and_values():
    gemm2 = lines(4096, 0, 2, 50_000, [1, 1])
    gemm1 = lines(28672, 1, 3, 10_000, [2, 1, 1])
    text = "\n".join(["noise"] + gemm2 + gemm1 + ["more noise"])
    launches = T.parse(text)
    assert set(launches) == {(4096, 4096, 0, 1, 2), (28672, 4096, 1, 1, 3)}
    cta = launches[(28672, 4096, 1, 1, 3)][0]
    assert cta["units"] == 2 and cta["u1"] == 10_000 + 12_000 and "u2" not in cta
    rep = T.report(launches)
    # GEMM1 starts first, so it comes first and is the time origin
    assert rep.index("n=28672") < rep.index("n=4096")
    assert "| start | 0.0 | 1.0 | 2.0 |" in rep
    assert "units per CTA: 1: 2 CTAs, 2: 1 CTAs" in rep
    assert "start -> first k-tile, us: min 1.5, median 1.5, max 1.5" in rep
    # GEMM2's first CTA starts 40 us after GEMM1's
    assert "| start | 40.0 | 40.5 | 41.0 |" in rep


def test_a_cta_without_units_has_no_first_stamp():
    text = ("HMTL C n=64 k=64 silu=0 splits=1 grid=2 cta=1 sm=1 first=0 units=0 "
            "u=0,0,0,0,0,0,0,0 end=5000\n"
            "HMTL P n=64 k=64 silu=0 splits=1 grid=2 cta=1 sm=1 start=1000 ready=2000 "
            "waited=3000 issued=4000")
    cta = T.parse(text)[(64, 64, 0, 1, 2)][1]
    assert "first" not in cta and cta["end"] == 5000 and cta["units"] == 0
    assert "| end | 4.0 | 4.0 | 4.0 |" in T.report(T.parse(text))


def test_report_without_lines_says_how_to_build():
    assert "HOPPER_MOE_GEMM_TIMELINE" in T.report(T.parse("nothing here"))
