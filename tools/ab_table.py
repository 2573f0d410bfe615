"""Ratio table of tools/gpu_ab.sh's passes: for each row (kind, shape, dtype, M, backend) the
baseline's and the new tree's times (µs) per round, new / base of the medians, and the
baseline's own spread between its rounds (a difference inside that spread is noise).

    python tools/ab_table.py DIR     (DIR holds <gpu>_<kind>_<label>.json from bench_moe.py)
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict


def load(folder: str):
    times = defaultdict(lambda: defaultdict(list))  # row -> tree -> [us per round]
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        m = re.search(r"_(gemm|layer)_(base|new)(\d+)\.json$", path)
        if not m:
            continue
        kind, tree = m.group(1), m.group(2)
        with open(path) as f:
            for r in json.load(f)["rows"]:
                if r.get("us") is None or r.get("error"):
                    continue
                key = (kind, r["shape"], r["dtype"], r["M"], r["backend"])
                times[key][tree].append(r["us"])
    return times


def main(folder: str) -> int:
    times = load(folder)
    print("| kind | shape | dtype | M | backend | base µs | new µs | new/base | base spread |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for key in sorted(times, key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
        base, new = times[key]["base"], times[key]["new"]
        if not base or not new:
            continue
        ratio = statistics.median(new) / statistics.median(base)
        spread = (max(base) - min(base)) / min(base) if len(base) > 1 else float("nan")
        worst = max(worst, abs(ratio - 1.0))
        fmt = lambda v: "/".join(f"{x:.1f}" for x in v)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {fmt(base)} | "
              f"{fmt(new)} | {ratio:.3f} | {spread * 100:.1f}% |")
    print(f"\nlargest |new/base - 1|: {worst * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
