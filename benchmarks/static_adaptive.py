"""The adaptive policy on the static path: AR, fixed DFlash and adaptive DFlash, all three through
:class:`~specdraft.runtime.static_decode.StaticEngine` (CUDA graphs on a GPU, the same static rounds eagerly on a CPU),
on the same held-out prompts batch by batch, the order of the three rotating from batch to batch, after one untimed
batch each (caches sized, first-call costs paid; the adaptive policy starts each suite from the cached one and learns
through the untimed batch as a job's first batch would). Reports per suite
and temperature each one's τ and tokens/s, the two drafted ones' tokens/s over AR's, the adaptive job's share of
plain rounds, and at T=0 how many requests' tokens differ from AR's (none should).

    python benchmarks/static_adaptive.py configs/tiny.yaml [--prompts 16] [--batch-size 8] [--out f.json]
        [key=value ...]
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from specdraft.pipeline.config import load_config
from specdraft.pipeline.measure import Tally, config_models, held_out_suites, suite_parser, write_report
from specdraft.pipeline.policy import adaptive_policy, heldin_prompts
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.runtime.decode import GenerationConfig
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.static_decode import StaticEngine


def main(argv=None) -> dict:
    args, overrides = suite_parser(__doc__.splitlines()[0]).parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    job = config_models(cfg)
    target, tok, drafter = job.target, job.tokenizer, job.drafter
    stops = stop_token_ids(tok)
    drafter_dir = cfg.decode.drafter or cfg.drafter_dir(cfg.train.export)
    heldin = heldin_prompts(job.world, tok, cfg.data.enable_thinking)
    suites = held_out_suites(cfg, job, args.suites, args.prompts)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    policies = {}
    for temperature in temperatures:
        params = SamplingParams(temperature, cfg.decode.top_k, cfg.decode.top_p)
        policies[temperature] = adaptive_policy(cfg.work_path, target, drafter, drafter_dir, heldin, stops,
                                                (1, args.batch_size), sampling=params,
                                                draft_sampling=cfg.decode.draft_sampling)
    report = {"config": args.config, "device": str(target.lm_head.weight.device), "prompts": args.prompts,
              "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              **compare(target, drafter, policies, suites, args.batch_size, args.max_new_tokens, stops, args.seed,
                        cfg.decode.top_k, cfg.decode.top_p, cfg.decode.draft_sampling)}
    write_report(report, args.out, echo=False)
    return report


def compare(target, drafter, policies: dict[float, AdaptivePolicy], suites: dict[str, list[list[int]]],
            batch_size: int, max_new_tokens: int, stop: tuple[int, ...] = (), seed: int = 0, top_k: int = 0,
            top_p: float = 1.0, draft_sampling: str = "sample") -> dict:
    """AR, fixed and adaptive (``policies``: temperature -> policy, made to price whole rounds) on each suite's prompts
    at each temperature through static engines, batch by batch: ``{"graphs", "cells": [...]}``."""
    dev = target.lm_head.weight.device
    cells, engines = [], {}
    for temperature, policy in policies.items():
        params = SamplingParams(temperature, top_k, top_p)
        greedy = temperature == 0
        gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=stop, sampling=params,
                               draft_sampling=draft_sampling)
        for suite, prompts in suites.items():
            fresh = replace(policy, whole_rounds=True)  # each suite's policy starts from the cached one
            engines = {"ar": (StaticEngine(target, None, batch_size, argmax_heads=greedy), None),
                       "fixed": (StaticEngine(target, drafter, batch_size, argmax_heads=greedy), None),
                       "adaptive": (StaticEngine(target, drafter, batch_size, argmax_heads=greedy, policy=fresh),
                                    fresh)}
            for engine, p in engines.values():  # untimed: caches sized, first-call costs paid
                engine(target, prompts[:batch_size], gen, drafter=engine.drafter,
                       generator=torch.Generator(device=dev).manual_seed(seed), policy=p)
            tally = {e: Tally() for e in engines}
            for turn, i in enumerate(range(0, len(prompts), batch_size)):
                for e in list(engines)[turn % 3:] + list(engines)[:turn % 3]:  # the order rotates
                    engine, p = engines[e]
                    g = torch.Generator(device=dev).manual_seed(seed + turn)
                    t0 = time.perf_counter()
                    res = engine(target, prompts[i:i + batch_size], gen, drafter=engine.drafter, generator=g,
                                 policy=p)
                    tally[e].add(res, time.perf_counter() - t0)
            cell = {"suite": suite, "temperature": temperature,
                    **{f"{e}_tau": t.tau for e, t in tally.items() if e != "ar"},
                    **{f"{e}_tokens_per_s": t.tokens_per_s for e, t in tally.items()},
                    "adaptive_plain_share": tally["adaptive"].plain / max(tally["adaptive"].rounds, 1)}
            for e in ("fixed", "adaptive"):
                cell[f"{e}_over_ar"] = cell[f"{e}_tokens_per_s"] / cell["ar_tokens_per_s"]
            if greedy:
                cell["differing_requests"] = sum(sum(x[0] != y[0] for x, y in zip(tally[e].rows, tally["ar"].rows))
                                                 for e in ("fixed", "adaptive"))
            cells.append(cell)
            print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in cell.items()),
                  flush=True)
    graphs = any(e.decoder is not None and e.decoder.graphs for e, _ in engines.values())
    return {"graphs": graphs, "cells": cells}


if __name__ == "__main__":
    main()
