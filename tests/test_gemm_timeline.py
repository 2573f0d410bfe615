"""tools/gemm_timeline.py: the parser and the report on made-up timeline records (CPU)."""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gemm_timeline as T  # noqa: E402

MAX_CTAS = 4  # rows per launch record here (the extension's is 1024)


def record(n, silu, grid, start, units):
    """One launch's rows: CTA c starts at start + c us, its units 10 us apart; rows past the
    grid stay zero, as the extension leaves them."""
    rows = []
    for c in range(MAX_CTAS):
        if c >= grid:
            rows.append([0] * len(T.FIELDS))
            continue
        s = start + 1000 * c
        u = [s + 2000 + 10_000 * j for j in range(units[c])] + [0] * (T.UNITS - units[c])
        f = {"marker_p": 1, "n": n, "k": 4096, "silu": silu, "splits": 1, "grid": grid,
             "cta": c, "sm": c, "start": s, "ready": s + 500, "waited": s + 800,
             "issued": s + 9000, "marker_c": 1, "first": s + 1500 if units[c] else 0,
             "units": units[c], "end": s + 2000 + 10_000 * units[c]}
        f.update({f"u{j}": u[j] for j in range(T.UNITS)})
        rows.append([f[name] for name in T.FIELDS])
    return rows


def test_parse_and_report_order_and_values():
    gemm2 = record(4096, 0, 2, 50_000, [1, 1])
    gemm1 = record(28672, 1, 3, 10_000, [2, 1, 1])
    launches = T.parse([gemm2, gemm1])
    assert set(launches) == {(4096, 4096, 0, 1, 2), (28672, 4096, 1, 1, 3)}
    assert set(launches[(4096, 4096, 0, 1, 2)]) == {0, 1}, "rows past the grid are skipped"
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
    launch = record(64, 0, 2, 1000, [1, 0])
    launches = T.parse([launch])
    cta = launches[(64, 4096, 0, 1, 2)][1]
    assert "first" not in cta and cta["units"] == 0 and cta["end"] == 4000
    assert "| end | 3.0 | 7.5 | 12.0 |" in T.report(launches)


def test_a_producer_row_without_the_consumers_has_no_end():
    launch = record(64, 0, 1, 1000, [1])
    launch[0][T.FIELDS.index("marker_c")] = 0
    cta = T.parse([launch])[(64, 4096, 0, 1, 1)][0]
    assert cta["waited"] == 1800 and "end" not in cta and "units" not in cta


def test_report_without_records_says_how_to_build():
    assert "HOPPER_MOE_GEMM_TIMELINE" in T.report(T.parse([]))
    assert "HOPPER_MOE_GEMM_TIMELINE" in T.report(T.parse([[[0] * len(T.FIELDS)] * 2]))


def test_fields_match_the_header():
    """FIELDS in the order of gemm::TimelineField (csrc/include/hopper_moe/gemm/moe_gemm_sm90.h)."""
    with open(os.path.join(ROOT, "csrc", "include", "hopper_moe", "gemm", "moe_gemm_sm90.h")) as f:
        text = f.read()
    body = re.search(r"enum TimelineField : int \{(.*?)\};", text, re.S).group(1)
    names = [n.split("=")[0].strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    units = int(re.search(r"kTimelineUnits = (\d+);", text).group(1))
    assert units == T.UNITS
    cpp = []
    for name in names:
        if name == "kTlUnit0":
            cpp += [f"u{j}" for j in range(units)]
        elif name != "kTimelineFields":
            cpp.append(name)
    want = {"kTlProducer": "marker_p", "kTlN": "n", "kTlK": "k", "kTlSilu": "silu",
            "kTlSplits": "splits", "kTlGrid": "grid", "kTlCta": "cta", "kTlSm": "sm",
            "kTlStart": "start", "kTlReady": "ready", "kTlWaited": "waited",
            "kTlIssued": "issued", "kTlConsumer": "marker_c", "kTlFirst": "first",
            "kTlUnits": "units", "kTlEnd": "end"}
    assert [want.get(n, n) for n in cpp] == list(T.FIELDS)
