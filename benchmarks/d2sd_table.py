"""D²SD's rows of a ``specdraft bench`` report against the DFlash row with the same first drafter: the τ ratio per
suite with a paired 95 % bootstrap interval over prompts, its mean over suites, the speedup ratio, and the tree
statistics (nodes per round, slots saved by deduplication, share of rounds a second-drafter branch won).

    python benchmarks/d2sd_table.py artifacts/tiny/bench/bench.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from specdraft.pipeline.bench import mean_ratio_interval, ratio_interval


def table(rows: list[dict]) -> str:
    def key(r):  # one baseline per batching and backend: the fixed-policy chain drafter
        return (r["stage"], r["suite"], r["temperature"], r["batch_size"], r.get("batching", "static"),
                r.get("backend", "torch"))
    base = {key(r): r for r in rows if r["method"] not in ("ar", "d2sd") and r.get("policy", "fixed") == "fixed"}
    lines = ["| variant | T | suite | τ DFlash | τ D²SD | ratio (95 % CI) | speedup ratio | nodes/round | saved by "
             "dedup | branch won |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups = defaultdict(list)
    for r in rows:
        if r["method"] != "d2sd":
            continue
        b = base[key(r)]
        groups[(r["tree_k"], r["placement"], r["temperature"])].append((r, b))
        lo, hi = ratio_interval(r["per_prompt"], b["per_prompt"])
        lines.append(f"| K={r['tree_k']} {r['placement']} | {r['temperature']:g} | {r['suite']} | {b['tau']:.2f} "
                     f"| {r['tau']:.2f} | {r['tau'] / b['tau']:.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {r['speedup'] / b['speedup']:.2f} | {r['nodes_per_round']:.1f} "
                     f"| {r['dedup_saved_per_round']:.1f} | {1 - r['winner_share'][0]:.2f} |")
    lines += ["", "| variant | T | mean τ ratio over suites (95 % CI) | worst suite |", "|---|---|---|---|"]
    for (k, placement, temp), pairs in sorted(groups.items()):
        ratios = [r["tau"] / b["tau"] for r, b in pairs]
        lo, hi = mean_ratio_interval([(r["per_prompt"], b["per_prompt"]) for r, b in pairs])
        worst = min(pairs, key=lambda p: p[0]["tau"] / p[1]["tau"])
        lines.append(f"| K={k} {placement} | {temp:g} | {sum(ratios) / len(ratios):.3f} ({lo:.3f}–{hi:.3f}) "
                     f"| {worst[0]['suite']} {worst[0]['tau'] / worst[1]['tau']:.3f} |")
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
