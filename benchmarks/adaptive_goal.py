"""Where `specdraft bench` runs stand against the adaptive policy's goal (never below AR: at least 0.97x in every
cell): per cell, the mean of the per-repeat speedups over AR and their 95 % interval, run beside run; then each run's
pooled speedup over the cells where drafting is not expected to pay (``--paying`` excluded), by batch size, the cells
at or above ``--goal`` and the cells whose interval lies wholly below it.

    python benchmarks/adaptive_goal.py NAME1 RUN1/bench.json NAME2 RUN2/bench.json [--paying math:0]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics


def cells(path: str) -> dict[tuple, dict]:
    """``(suite, temperature, batch_size, batching) -> row`` of the adaptive rows of a bench run."""
    rows = json.load(open(path))["results"]
    return {(r["suite"], r["temperature"], r["batch_size"], r["batching"]): r for r in rows
            if r["method"] != "ar" and r.get("policy") == "adaptive"}


def summary(run: dict[tuple, dict], goal: float, paying: set[tuple[str, float]]) -> dict:
    """Pooled mean speedup (± 1.96 standard errors) over the per-repeat ratios of the cells not in ``paying``, by batch
    size, and the counts of cells at or above ``goal`` and with intervals wholly below it (off ``paying`` / all)."""
    out = {}
    for name, keep in (("off_paying", lambda k: k[:2] not in paying), ("all", lambda k: True)):
        rows = [r for k, r in run.items() if keep(k)]
        reps = [v for r in rows for v in r["speedup_per_repeat"]]
        out[name] = {
            "cells": len(rows),
            "pooled": statistics.mean(reps),
            "pooled_ci95": 1.96 * statistics.stdev(reps) / len(reps) ** 0.5 if len(reps) > 1 else float("nan"),
            "by_batch_size": {bs: statistics.mean([v for k, r in run.items() if keep(k) and k[2] == bs
                                                   for v in r["speedup_per_repeat"]])
                              for bs in sorted({k[2] for k in run if keep(k)})},
            "at_goal": sum(statistics.mean(r["speedup_per_repeat"]) >= goal for r in rows),
            "wholly_below": sum(r["speedup_ci95"][1] < goal for r in rows),
        }
    return out


def _speedup(row: dict) -> str:
    """A cell's mean speedup over AR, with its 95 % interval where it has one (a run of one repeat has none)."""
    lo, hi = row["speedup_ci95"]
    mean = f"{statistics.mean(row['speedup_per_repeat']):.2f}"
    return mean if math.isnan(lo) or math.isnan(hi) else f"{mean} ({lo:.2f}–{hi:.2f})"


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="pairs: a name, then its bench.json")
    ap.add_argument("--goal", type=float, default=0.97)
    ap.add_argument("--paying", nargs="*", default=["math:0"], help="suite:temperature cells where drafting pays")
    args = ap.parse_args(argv)
    if len(args.runs) % 2:
        ap.error("runs come in pairs: NAME PATH")
    names, runs = args.runs[::2], [cells(p) for p in args.runs[1::2]]
    paying = {(s, float(t)) for s, t in (x.split(":") for x in args.paying)}
    print("| suite | T | bs | batching | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for key in runs[0]:
        parts = []
        for run in runs:
            r = run.get(key)
            parts.append("-" if r is None else _speedup(r))
        print(f"| {key[0]} | {key[1]:g} | {key[2]} | {key[3]} | " + " | ".join(parts) + " |")
    out = {name: summary(run, args.goal, paying) for name, run in zip(names, runs)}
    for name, s in out.items():
        for part, x in s.items():
            print(f"{name} {part}: pooled {x['pooled']:.3f} ± {x['pooled_ci95']:.3f}; by batch size "
                  + " / ".join(f"{v:.3f}" for v in x["by_batch_size"].values())
                  + f"; cells >= {args.goal:g}: {x['at_goal']} of {x['cells']}; "
                  f"interval wholly below: {x['wholly_below']}")
    return out


if __name__ == "__main__":
    main()
