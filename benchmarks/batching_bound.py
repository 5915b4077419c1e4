"""What continuous batching can gain over static batching for plain decoding, from a machine's measured costs.

Simulates a job of requests whose lengths vary ``--spread``-fold (the caps ``specdraft bench`` draws with
``bench.length_spread``) decoded in static batches of ``bs`` (each until its longest request ends, finished rows
compacted) and through ``bs`` continuously refilled slots, pricing each round by the target-pass cost of its rows
(``T(rows, 1)`` of an adaptive-policy cost file, ``<work_dir>/policy/*.json``), and by a flat cost (a GPU far from
saturation). Prefill is left out of both. The ratio is the bound an engine without admission overhead would reach.

    python benchmarks/batching_bound.py artifacts/cb-bench/policy/<key>.json --requests 60,600
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from specdraft.pipeline.bench import length_caps
from specdraft.runtime.cost_model import CostModel


def static_seconds(lengths: list[int], bs: int, cost: Callable[[int], float]) -> float:
    """Batches of ``bs`` requests in order; each round costs ``cost(rows still running)``."""
    total = 0.0
    for i in range(0, len(lengths), bs):
        batch = lengths[i:i + bs]
        total += sum(cost(sum(n >= r for n in batch)) for r in range(1, max(batch) + 1))
    return total


def continuous_seconds(lengths: list[int], bs: int, cost: Callable[[int], float]) -> float:
    """``bs`` slots, a freed slot taking the next request before the next round."""
    total, queue, running = 0.0, list(lengths), []
    while queue or running:
        while queue and len(running) < bs:
            running.append(queue.pop(0))
        total += cost(len(running))
        running = [n - 1 for n in running if n > 1]
    return total


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("costs", help="an adaptive-policy cost file (<work_dir>/policy/<key>.json)")
    ap.add_argument("--requests", default="60,600", help="job sizes, comma-separated")
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--spread", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    costs = CostModel.from_dict(json.loads(open(args.costs).read())["costs"])
    rows = []
    for n in map(int, args.requests.split(",")):
        lengths = length_caps(n, args.max_new_tokens, args.spread, args.seed)
        for bs in map(int, args.batch_sizes.split(",")):
            measured = (static_seconds(lengths, bs, lambda b: costs.target(b, 1))
                        / continuous_seconds(lengths, bs, lambda b: costs.target(b, 1)))
            flat = static_seconds(lengths, bs, lambda b: 1.0) / continuous_seconds(lengths, bs, lambda b: 1.0)
            rows.append({"requests": n, "batch_size": bs, "measured_costs": round(measured, 3),
                         "flat_cost": round(flat, 3)})
            print(f"requests {n:4d}  bs {bs:3d}  continuous / static tokens/s: measured costs {measured:.2f}, "
                  f"flat round cost {flat:.2f}")
    return rows


if __name__ == "__main__":
    main()
