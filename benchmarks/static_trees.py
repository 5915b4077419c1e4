"""Trees on the static path against the eager engine: the same held-out prompts decoded by both, batch by batch (the
order alternating), for the DFlash chain, D²SD, a one-pass tree and a merged tree (D²SD's branches and the one-pass
tree, the best ``--nodes``). Reports per method and engine τ, tokens/s, and at T=0 how many requests' tokens and
accept lengths differ between the engines (none should: the static rounds are the eager ones). On a GPU the static
path replays CUDA graphs; on a CPU the same static rounds run eagerly, so there the tokens/s ratio is the static
bookkeeping's cost, not the graphs' gain.

    python benchmarks/static_trees.py configs/tiny.yaml [--prompts 16] [--nodes 24] [--out f.json]
        [key=value ...]     (decode.second_drafter=same: D²SD's second drafter is the first, re-drafting)
"""

from __future__ import annotations

import time

import torch

from specdraft.pipeline.config import load_config
from specdraft.pipeline.measure import Tally, config_models, held_out_suites, suite_parser, write_report
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.pipeline.trees import merged_drafting, one_pass_drafting, tree_drafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.static_decode import StaticEngine


def main(argv=None) -> dict:
    ap = suite_parser(__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2, help="D²SD branches")
    ap.add_argument("--nodes", type=int, default=24, help="the one-pass and merged trees' node budget")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    job = config_models(cfg)
    target, tok, first = job.target, job.tokenizer, job.drafter
    d2sd = tree_drafting(cfg, target, first, args.k)
    trees = {"dflash": None, f"d2sd{args.k}": d2sd,
             f"ddtree{args.nodes}": one_pass_drafting(cfg, first, args.nodes, "fixed"),
             f"merged{args.nodes}": merged_drafting(cfg, first, d2sd, args.nodes, "fixed")}
    suites = held_out_suites(cfg, job, args.suites, args.prompts)
    report = {"config": args.config, "device": str(target.lm_head.weight.device), "prompts": args.prompts,
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              **compare(target, first, trees, suites, [float(t) for t in args.temperatures.split(",")],
                        args.batch_size, args.max_new_tokens, stop_token_ids(tok), args.seed)}
    write_report(report, args.out, echo=False)
    return report


def compare(target, first, trees: dict, suites: dict[str, list[list[int]]], temperatures: list[float],
            batch_size: int, max_new_tokens: int, stop: tuple[int, ...] = (), seed: int = 0) -> dict:
    """Each method of ``trees`` (name -> tree, or None for the chain) on each suite's prompts at each temperature,
    through the eager engine and a :class:`StaticEngine`, batch by batch: ``{"graphs", "cells": [...]}``."""
    dev = target.lm_head.weight.device
    static = {m: StaticEngine(target, first, batch_size, tree=t) for m, t in trees.items()}
    cells = []
    for suite, prompts in suites.items():
        for temperature in temperatures:
            gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                   sampling=SamplingParams(temperature))
            for method, tree in trees.items():
                engines = {"eager": generate, "static": static[method]}
                tally = {e: Tally() for e in engines}
                for turn, i in enumerate(range(0, len(prompts), batch_size)):
                    for e in (list(engines) if turn % 2 else list(engines)[::-1]):
                        g = torch.Generator(device=dev).manual_seed(seed + turn)
                        t0 = time.perf_counter()
                        res = engines[e](target, prompts[i:i + batch_size], gen, drafter=first, generator=g,
                                         tree=tree)
                        tally[e].add(res, time.perf_counter() - t0)
                cell = {"suite": suite, "temperature": temperature, "method": method,
                        **{f"{e}_tau": t.tau for e, t in tally.items()},
                        **{f"{e}_tokens_per_s": t.tokens_per_s for e, t in tally.items()}}
                cell["static_over_eager"] = cell["static_tokens_per_s"] / cell["eager_tokens_per_s"]
                if temperature == 0:
                    cell["differing_requests"] = sum(x != y for x, y in zip(tally["eager"].rows, tally["static"].rows))
                cells.append(cell)
                print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in cell.items()),
                      flush=True)
    return {"graphs": any(s.decoder is not None and s.decoder.graphs for s in static.values()), "cells": cells}


if __name__ == "__main__":
    main()
