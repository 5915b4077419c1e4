"""D²SD in serving: end-to-end tokens/s against DFlash and the target alone at batch 1 and 8, each round's cost split
into phases, and how calibrated the first drafter's confidences are; with ``--nodes`` the one-pass and merged trees of
that node budget (``--budget measured``: the budget each round picks up to it) beside them.

All methods decode the same held-out prompts in one process, interleaved batch by batch (the order alternating), at
T=0 or ``--temperature``. Phases (wall time, summed over rounds; :class:`~specdraft.runtime.phase_clock.PhaseClock`):
``draft`` (the first drafter's block), ``second_draft`` (the batched VP pass), ``tree`` (posterior, placement, tree
build, sampled siblings' draws), ``budget`` (a measured budget's choice, priced by the machine's cost model:
measured once, before the timed jobs, and cached under ``<work_dir>/policy/``), ``verify`` (the target's pass over the
chain or the tree; a chain's acceptance too), ``walk`` (the walk down a tree), ``compaction`` (moving the accepted
path's K/V, gathering its features) and ``commit`` (the drafters' context updates and the engine's bookkeeping). The
reliability table bins the first drafter's per-slot confidence ``c_k = max_v q_k(v)`` over the DFlash rounds and
reports the empirical acceptance of slot ``k`` among rounds that reached it (calibrated: equal columns).

    python benchmarks/d2sd_cost.py configs/tiny.yaml [--prompts 16] [--k 4] [--nodes 48 [--budget measured]]
        [--out cost.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from specdraft.pipeline.bench import suite_prompts
from specdraft.pipeline.config import load_config
from specdraft.pipeline.measure import config_models, write_report
from specdraft.pipeline.policy import machine_costs
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.pipeline.trees import merged_drafting, one_pass_drafting, tree_drafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.sampling import SamplingParams

BINS = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.01)


def reliability(records) -> list[dict]:
    """Per confidence bin: rounds where the slot was reached, mean confidence, empirical acceptance."""
    conf, hit = [], []
    for probs, n_acc in records:  # probs [b, K] confidences, n_acc [b]
        K = probs.shape[1]
        reached = torch.arange(K)[None, :] <= n_acc[:, None]  # slot k reached iff the k drafts before it were accepted
        conf.append(probs[reached])
        hit.append((torch.arange(K)[None, :] < n_acc[:, None])[reached])
    conf, hit = torch.cat(conf), torch.cat(hit).float()
    rows = []
    for lo, hi in zip(BINS, BINS[1:]):
        m = (conf >= lo) & (conf < hi)
        if m.any():
            rows.append({"bin": f"[{lo:.2f}, {min(hi, 1):.2f})", "slots": int(m.sum()),
                         "mean_confidence": float(conf[m].mean()), "acceptance": float(hit[m].mean())})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--prompts", type=int, default=16, help="math held-out prompts")
    ap.add_argument("--k", type=int, default=4, help="D²SD branches")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--suite", default="math")
    ap.add_argument("--nodes", type=int, default=0, help="one-pass and merged trees of this many nodes (0: none)")
    ap.add_argument("--budget", default="fixed", choices=["fixed", "measured"])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default="")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    torch.manual_seed(0)
    job = config_models(cfg)
    world, target, tok, first = job.world, job.target, job.tokenizer, job.drafter
    tree = tree_drafting(cfg, target, first, args.k)
    prompts = suite_prompts(world, args.suite, args.prompts, tok, cfg.data.enable_thinking,
                            target.args.max_position_embeddings)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=stop_token_ids(tok),
                           sampling=SamplingParams(temperature=args.temperature))
    methods = {"ar": {}, "dflash": {"drafter": first}, f"d2sd{args.k}": {"drafter": first, "tree": tree}}
    if args.nodes:  # a measured budget's prices: the machine's cost model, measured once (cached under work_dir)
        prices = partial(machine_costs, cfg.work_path, target, first, cfg.decode.drafter or
                         cfg.drafter_dir(cfg.train.export), [int(x) for x in args.batch_sizes.split(",")])
        name = f"{args.nodes}" + ("+measured" if args.budget == "measured" else "")
        methods[f"ddtree{name}"] = {"drafter": first, "tree": one_pass_drafting(cfg, first, args.nodes, args.budget,
                                                                                prices)}
        methods[f"merged{name}"] = {"drafter": first, "tree": merged_drafting(cfg, first, tree, args.nodes,
                                                                              args.budget, prices)}
    generate(target, prompts[:2], GenerationConfig(max_new_tokens=8), **methods[f"d2sd{args.k}"])  # warm-up
    report = {"config": args.config, "suite": args.suite, "prompts": len(prompts), "k": args.k,
              "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "by_batch_size": {}}
    records = []

    def observe(rec):
        if rec.nodes is None and rec.draft_logits is not None:
            records.append((rec.draft_logits.float().softmax(-1).amax(-1).cpu(), rec.num_accepted.cpu()))

    for bs in [int(x) for x in args.batch_sizes.split(",")]:
        acc = {m: {"tokens": 0, "emitted": 0, "seconds": 0.0, "rounds": 0, "phases": {}} for m in methods}
        for turn, i in enumerate(range(0, len(prompts), bs)):
            order = list(methods) if turn % 2 else list(methods)[::-1]
            for m in order:
                a = acc[m]
                t0 = time.perf_counter()
                res = generate(target, prompts[i:i + bs], gen, timings=a["phases"],
                               observer=observe if m == "dflash" and bs == 1 else None, **methods[m])
                a["seconds"] += time.perf_counter() - t0
                a["tokens"] += sum(len(r.tokens) for r in res)
                a["rounds"] += sum(len(r.accept_lengths) for r in res)
                a["emitted"] += sum(sum(r.accept_lengths) for r in res)
        ar_tps = acc["ar"]["tokens"] / acc["ar"]["seconds"]
        report["by_batch_size"][bs] = {m: {"tokens_per_s": a["tokens"] / a["seconds"],
                                           "speedup_vs_ar": a["tokens"] / a["seconds"] / ar_tps,
                                           "tau": a["emitted"] / max(a["rounds"], 1),
                                           "ms_per_round": {k: 1000 * v / max(a["rounds"], 1)
                                                            for k, v in a["phases"].items()}}
                                       for m, a in acc.items()}
    report["reliability"] = reliability(records)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
