"""Does `auto` stay within 3% of the fastest backend? Reads bench_moe.py JSON results (rows of
torch / triton / cute / auto at the same shape, scheme and M, one run) and prints a markdown
table: per row the fastest backend (with several files, e.g. runs with the backends in
opposite orders, each backend's smallest time), what auto ran (bench_moe records it in the row's `how`),
auto's time over the fastest, and a verdict; the exit status is 1 if any row misses.

    python tools/auto_check.py benchmarks/results/h200_auto_check.json [--limit 1.03]
"""
from __future__ import annotations

import argparse
import json
import sys


NOT_CHOOSABLE = ("auto", "peer", "peer_default", "peer_swap", "read", "reference",
                 "cutlass_coop", "cutlass_coop_promoted", "cutlass_pingpong")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--limit", type=float, default=1.03)
    args = p.parse_args(argv)
    rows = []
    for path in args.files:
        with open(path) as f:
            rows += json.load(f)["rows"]
    # Several files (runs with the backends in different orders): each backend's best row.
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r.get("us"):
            by = groups.setdefault((r["shape"], r["dtype"], r["M"]), {})
            if r["backend"] not in by or r["us"] < by[r["backend"]]["us"]:
                by[r["backend"]] = r
    lines = ["| shape | scheme | M | fastest | µs | auto ran | auto µs | auto / fastest | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    misses = 0
    for (shape, scheme, m), by in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                         kv[0][2])):
        # Only what auto can choose: not the peer (the engine's pipeline), the read control
        # or the fp32 reference.
        others = {b: r["us"] for b, r in by.items() if b not in NOT_CHOOSABLE}
        if not others or "auto" not in by:
            continue
        best = min(others, key=others.get)
        auto = by["auto"]
        ratio = auto["us"] / others[best]
        ran = (auto.get("how") or "").removeprefix("auto: ") or "?"
        ok = ratio <= args.limit
        misses += not ok
        lines.append(f"| {shape} | {scheme} | {m} | {best} | {others[best]:.1f} | {ran} | "
                     f"{auto['us']:.1f} | {ratio:.3f} | {'yes' if ok else 'NO'} |")
    total = len(lines) - 2
    lines.append("")
    lines.append(f"{total - misses} of {total} rows within {args.limit:.2f}x of the fastest "
                 f"backend; {misses} miss.")
    print("\n".join(lines))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
