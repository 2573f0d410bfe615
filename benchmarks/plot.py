"""Plots of bench_moe results: one PNG per shape x dtype, latency vs M and % of floor vs M,
one line per backend (the floor drawn on the latency plot).

    python benchmarks/plot.py benchmarks/results/h200_moe.json [--out DIR]

bench_moe.py --plot calls plot_moe() on the run it just made. Needs matplotlib; without it,
says so and does nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def plot_moe(payload: dict[str, Any], out_dir: str, stem: str) -> tuple[list[str], str]:
    """Writes <out_dir>/<stem>_<shape>_<dtype>.png per shape x dtype; returns (paths, message)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return [], f"plot skipped: matplotlib is not installed ({type(exc).__name__})"
    rows = [r for r in payload.get("rows", []) if r.get("us")]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"]), []).append(r)
    env = payload.get("env", {})
    title_tail = env.get("gpu", "")
    gemm_only = bool(payload.get("args", {}).get("gemm_only"))
    paths = []
    os.makedirs(out_dir, exist_ok=True)
    for (shape, dtype), rs in groups.items():
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.5))
        backends = list(dict.fromkeys(r["backend"] for r in rs))
        for b in backends:
            pts = sorted((r["M"], r["us"], r["pct_floor"]) for r in rs if r["backend"] == b)
            ms = [p[0] for p in pts]
            ax_t.plot(ms, [p[1] for p in pts], marker="o", label=b)
            ax_e.plot(ms, [p[2] for p in pts], marker="o", label=b)
        floor = sorted({(r["M"], r["floor_us"]) for r in rs})
        ax_t.plot([f[0] for f in floor], [f[1] for f in floor], "k--", label="floor")
        ax_t.set_xscale("log", base=2)
        ax_t.set_yscale("log")
        ax_t.set_xlabel("M (tokens)")
        ax_t.set_ylabel("median µs")
        ax_t.set_title("latency")
        ax_e.set_xscale("log", base=2)
        ax_e.axhline(100, color="k", ls="--", lw=0.8)
        ax_e.set_xlabel("M (tokens)")
        ax_e.set_ylabel("% of floor (floor / time)")
        ax_e.set_ylim(0, max(105, max((r["pct_floor"] for r in rs), default=100) * 1.05))
        ax_e.set_title("efficiency")
        for ax in (ax_t, ax_e):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        what = "GEMM-only" if gemm_only else "whole layer"
        fig.suptitle(f"{shape} {dtype} {what} - {title_tail}")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{stem}_{shape}_{dtype}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, f"plots: wrote {len(paths)} PNG(s) to {out_dir}" if paths else \
        "plots: no timed rows to plot"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="plot bench_moe JSON results")
    p.add_argument("json", help="a bench_moe results .json")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        payload = json.load(f)
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    stem = os.path.splitext(os.path.basename(args.json))[0]
    paths, msg = plot_moe(payload, out, stem)
    print(msg)
    for pth in paths:
        print("  " + pth)
    return 0


if __name__ == "__main__":
    sys.exit(main())
