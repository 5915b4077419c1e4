"""The tree rows of a ``specdraft bench`` report (D²SD, one-pass ddtree and merged trees at a fixed or a measured node
budget) against the DFlash row with the same first drafter: the τ ratio per suite with a paired 95 % bootstrap
interval over prompts, its mean over suites, the tokens/s ratio, and the tree statistics (nodes per round, share of
rounds a second-drafter branch or a sibling won).

    python benchmarks/tree_table.py artifacts/tiny/bench/bench.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from specdraft.pipeline.bench import mean_ratio_interval, ratio_interval
from specdraft.pipeline.trees import FIRST_DRAFTERS


def variant(r: dict) -> str:
    if r["method"] in ("ddtree", "merged"):
        return f"{r['method']} N={r['tree_nodes']}" + (" measured" if r.get("tree_budget") == "measured" else "")
    return (f"d2sd K={r['tree_k']} {r['placement']}" + (" distinct" if r.get("distinct") else "")
            + (f" +{r['siblings']} siblings" if r.get("siblings") else ""))  # reports before tree_siblings went


def won(r: dict) -> float:
    """Share of rounds whose accepted path left the first draft (a second-drafter branch or a sibling won)."""
    return r["sibling_share"] if r["method"] in ("ddtree", "merged") else 1 - r["winner_share"][0]


def table(rows: list[dict]) -> str:
    def key(r):  # one baseline per batching and backend: the fixed-policy chain drafter
        return (r["stage"], r["suite"], r["temperature"], r["batch_size"], r.get("batching", "static"),
                r.get("backend", "torch"))
    base = {key(r): r for r in rows if r["method"] in FIRST_DRAFTERS and r.get("policy", "fixed") == "fixed"}
    lines = ["| variant | T | bs | suite | τ DFlash | τ tree | ratio (95 % CI) | tok/s ratio | nodes/round "
             "| won off the first draft |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups = defaultdict(list)
    for r in rows:
        if r["method"] not in ("d2sd", "ddtree", "merged"):
            continue
        b = base[key(r)]
        groups[(variant(r), r["temperature"], r["batch_size"])].append((r, b))
        lo, hi = ratio_interval(r["per_prompt"], b["per_prompt"])
        lines.append(f"| {variant(r)} | {r['temperature']:g} | {r['batch_size']} | {r['suite']} | {b['tau']:.2f} "
                     f"| {r['tau']:.2f} | {r['tau'] / b['tau']:.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {r['speedup'] / b['speedup']:.2f} | {r['nodes_per_round']:.1f} | {won(r):.2f} |")
    lines += ["", "| variant | T | bs | mean τ ratio over suites (95 % CI) | worst suite | mean tok/s ratio |",
              "|---|---|---|---|---|---|"]
    for (name, temp, bs), pairs in sorted(groups.items()):
        ratios = [r["tau"] / b["tau"] for r, b in pairs]
        lo, hi = mean_ratio_interval([(r["per_prompt"], b["per_prompt"]) for r, b in pairs])
        worst = min(pairs, key=lambda p: p[0]["tau"] / p[1]["tau"])
        speed = sum(r["speedup"] / b["speedup"] for r, b in pairs) / len(pairs)
        lines.append(f"| {name} | {temp:g} | {bs} | {sum(ratios) / len(ratios):.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {worst[0]['suite']} {worst[0]['tau'] / worst[1]['tau']:.3f} | {speed:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    args = ap.parse_args(argv)
    out = table(json.loads(open(args.bench_json).read())["results"])
    print(out)
    return out


if __name__ == "__main__":
    main()
