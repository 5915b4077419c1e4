"""How far a `specdraft bench` cell moves between two runs: each method's tokens/s as a multiple of AR's in the same
cell (suite, temperature, batch size, batching), compared run against run.

    python benchmarks/bench_spread.py RUN1/bench.json RUN2/bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def speedups(path: str) -> dict[tuple, float]:
    """``(suite, temperature, batch_size, batching, method) -> tokens/s over AR's`` (method: fixed / adaptive)."""
    tps = {}
    for r in json.load(open(path))["results"]:
        method = "ar" if r["method"] == "ar" else r.get("policy", "fixed")
        tps[r["suite"], r["temperature"], r["batch_size"], r["batching"], method] = r["tokens_per_s"]
    return {k: v / tps[k[:4] + ("ar",)] for k, v in tps.items() if k[4] != "ar"}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run1")
    ap.add_argument("run2")
    args = ap.parse_args(argv)
    a, b = speedups(args.run1), speedups(args.run2)
    rows = []
    for method in sorted({k[4] for k in a}):
        for temp in sorted({k[1] for k in a}):
            diffs = [abs(a[k] - b[k]) for k in a if k[4] == method and k[1] == temp and k in b]
            rows.append({"method": method, "temperature": temp, "cells": len(diffs),
                         "median_abs_diff": statistics.median(diffs), "max_abs_diff": max(diffs)})
            print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()))
    return rows


if __name__ == "__main__":
    main()
