"""How a drafter's acceptance depends on how far into its answer a request is: the drafts accepted per round by the
request's round index (its opening round, the first after the prompt, then later ones), decoding a held-out suite
with the whole block (fixed DFlash) through the continuous-batching engine.

An adaptive policy that prices every request from the acceptance averaged over drafted rounds prices an opening
from the long requests' middles and tails (they make most of the rounds, and end last): this shows how far apart the
two are, per suite and temperature. A bucket holds only the requests that reached it (with length caps, the later
buckets are the long requests').

    python benchmarks/opening_acceptance.py artifacts/tiny/world-f8d6f235a11e artifacts/tiny/drafter/sft \\
        --suites math,code,dialogue --temperatures 0,1
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoTokenizer

from specdraft.pipeline.bench import length_caps
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.runtime.batch_job import encode_requests, read_requests
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target
from specdraft.runtime.sampling import SamplingParams

BUCKETS = ((0, 1), (1, 2), (2, 4), (4, 8), (8, None))
"""Round indices of a request, ``[start, end)`` (None: to its end)."""


def by_round(accepted: list[list[int]], slots: int = 3) -> list[dict]:
    """Per bucket of :data:`BUCKETS`: rounds, drafts accepted per round, and the chance slot ``j`` (1..``slots``) is
    accepted given the slots before it were, from each request's accepted drafts per round ``accepted``."""
    out = []
    for lo, hi in BUCKETS:
        n = np.array([a for row in accepted for a in row[lo:hi]], dtype=np.int64)  # [rounds]
        cond = [float((n >= j).sum() / r) if (r := (n >= j - 1).sum()) else float("nan") for j in range(1, slots + 1)]
        out.append({"rounds": f"{lo}-{hi - 1}" if hi else f"{lo}+", "count": len(n),
                    "accepted": float(n.mean()) if len(n) else float("nan"), "slots": cond})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("world", help="a world folder: target/ and bench/<suite>.jsonl")
    ap.add_argument("drafter")
    ap.add_argument("--suites", default="math,code,dialogue")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--spread", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    target = load_target(f"{args.world}/target")
    drafter = load_drafter(args.drafter, target)
    tok = AutoTokenizer.from_pretrained(f"{args.world}/target")
    results = {}
    print("| suite | T | rounds of a request | rounds | drafts accepted a round | slot 1 / 2 / 3 given those before |")
    print("|---|---|---|---|---|---|")
    for suite in args.suites.split(","):
        reqs = read_requests(f"{args.world}/bench/{suite}.jsonl", print)[: args.num_prompts]
        prompts = [ids for _, ids in encode_requests(reqs, tok, None, warn=print)]
        caps = length_caps(len(prompts), args.max_new_tokens, args.spread, 0)
        for temperature in (float(t) for t in args.temperatures.split(",")):
            gen = GenerationConfig(max_new_tokens=caps, stop_token_ids=stop_token_ids(tok),
                                   sampling=SamplingParams(temperature))
            res = generate(target, prompts, gen, drafter=drafter, slots=args.slots,
                           generator=torch.Generator().manual_seed(args.seed))
            rows = by_round([r.accepted for r in res])
            results[suite, temperature] = rows
            for row in rows:
                print(f"| {suite} | {temperature:g} | {row['rounds']} | {row['count']} | {row['accepted']:.2f} | "
                      + " / ".join(f"{p:.2f}" for p in row["slots"]) + " |")
    return results


if __name__ == "__main__":
    main()
