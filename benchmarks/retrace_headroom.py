"""How much could ReTrace gain? The information a rejected suffix carries, measured in serving.

ReTrace (rejected-trajectory conditioning) conditions the next block on the previous round's rejected suffix. The
most that conditioning can add is bounded by what that suffix knows about the next block's true tokens that the
fresh draft does not. This script decodes held-out prompts greedily (T=0, batch 1, the engine's own loop) with a
drafter, records every round's drafts, accepted count and the target's argmax at every verified slot, and for each
round that follows a rejection compares, slot by slot against the committed (target-greedy) continuation:

- ``fresh``: the round's own draft (what the engine accepted; checked to reproduce its accept count exactly);
- ``copy``: the previous round's rejected draft token at the aligned slot (old slot ``j + n + 1``);
- ``target``: the target's argmax at that aligned slot in the previous verify pass (conditioned on the rejected
  draft prefix; the "target token" correction signal ReTrace's refiner sees).

It reports, over the post-rejection rounds, the mean accepted drafts of the fresh draft, of two oracles that take a
slot's prior when it is right (``fresh|copy``, ``fresh|copy|target``: upper bounds of a perfect fusion), of two
oracles that need no prior (the true token among the fresh draft's top 2 / top 3: what "any of 2-3 guesses" is worth
by itself, the yardstick for the prior oracles), of two realisable rules that replace the fresh draft by the prior
wherever one exists (``copy``, ``target``), of two realisable rules that let the prior RERANK the drafter's own top 3
(take the target's aligned argmax if it is among them: ``rerank_target``; else the rejected draft token if it is:
``rerank_any``), of a realisable switch that takes the target's aligned argmax wherever the drafter's own top
probability is below a threshold (``switch_target@t``), and the
estimated serving tau ratio each would give (the extra accepted drafts committed in the same rounds; the later
trajectory is assumed unchanged, so this is an estimate, not a replay). It also splits the fresh draft's first wrong
slots by the target's probability of the rejected token, and says how often the rejected draft or the target's
aligned argmax holds the true token there.

    python benchmarks/retrace_headroom.py configs/tiny.yaml --drafter artifacts/tiny-chain1/drafter/sft \
        [--prompts 48] [--max-new-tokens 160] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from itertools import takewhile

import torch
from transformers import AutoTokenizer

from specdraft.pipeline.bench import suite_prompts, with_bench_prompts
from specdraft.pipeline.config import load_config
from specdraft.pipeline.stages import existing_world
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target

SWITCH_THRESHOLDS = (0.1, 0.2, 0.3, 0.5)  # drafter top-1 probabilities under which switch_target@t trusts the target
RULES = ("fresh", "copy", "target", "oracle_copy", "oracle_all", "oracle_fresh_top2", "oracle_fresh_top3",
         "rerank_target", "rerank_any", *(f"switch_target@{t:g}" for t in SWITCH_THRESHOLDS))


@dataclass
class Round:
    drafts: list[int]  # [K] drafted tokens
    accepted: int  # n
    target_argmax: list[int]  # [K + 1] the target's argmax at each verify position
    draft_top3: list[list[int]]  # [K, 3] the drafter's three likeliest tokens per slot
    target_p_draft: list[float]  # [K] the target's probability of each drafted token at its slot
    draft_p_top1: list[float] | None = None  # [K] the drafter's probability of its own top token


def record_rounds(target, drafter, prompt: list[int], gen) -> tuple[list[Round], list[int]]:
    """Greedy-decode one prompt with the engine, recording each round; returns (rounds, committed after anchor 0)."""
    rounds: list[Round] = []

    def record(r):  # one row: batch 1
        top3 = r.draft_logits[0].float().softmax(-1).topk(3, dim=-1)  # [K, 3]
        p_draft = r.target_logits[0, :-1].float().softmax(-1).gather(-1, r.draft_tokens[0, :, None])[:, 0]  # [K]
        rounds.append(Round(r.draft_tokens[0].tolist(), int(r.num_accepted[0]), r.target_logits[0].argmax(-1).tolist(),
                            top3.indices.tolist(), p_draft.tolist(), top3.values[:, 0].tolist()))

    generate(target, [prompt], gen, drafter=drafter, observer=record)
    committed = []
    for r in rounds:  # each round commits n drafts and the target's token at slot n + 1
        committed += r.drafts[: r.accepted] + [r.target_argmax[r.accepted]]
    return rounds, committed


def leading_run(ok: list[bool]) -> int:
    return sum(1 for _ in takewhile(bool, ok))


def round_headroom(prev: Round, cur: Round, truth: list[int]) -> dict[str, int]:
    """Accepted drafts of ``cur`` under each rule; ``truth[j-1]`` is the committed token at ``cur``'s slot ``j``.

    Alignment: ``cur``'s anchor is ``prev``'s slot ``n + 1``, so ``cur`` slot ``j`` is ``prev`` slot
    ``s = j + n + 1`` when ``s <= K``; the target's argmax for slot ``s`` is read at verify position ``s - 1``.
    """
    K, n = len(prev.drafts), prev.accepted
    ok = {rule: [] for rule in RULES}
    for j in range(1, min(K, len(truth)) + 1):
        y = truth[j - 1]
        s = j + n + 1
        has_prior = s <= K
        fresh = cur.drafts[j - 1] == y
        copy = has_prior and prev.drafts[s - 1] == y
        tgt = has_prior and prev.target_argmax[s - 1] == y
        ok["fresh"].append(fresh)
        ok["copy"].append(copy if has_prior else fresh)
        ok["target"].append(tgt if has_prior else fresh)
        ok["oracle_copy"].append(fresh or copy)
        ok["oracle_all"].append(fresh or copy or tgt)
        top = cur.draft_top3[j - 1]
        pick_t = prev.target_argmax[s - 1] if has_prior and prev.target_argmax[s - 1] in top else top[0]
        pick_a = pick_t if pick_t != top[0] else (
            prev.drafts[s - 1] if has_prior and prev.drafts[s - 1] in top else top[0])
        ok["rerank_target"].append(pick_t == y)
        ok["rerank_any"].append(pick_a == y)
        for t in SWITCH_THRESHOLDS:  # trust the target's aligned argmax where the drafter is unsure of itself
            unsure = has_prior and cur.draft_p_top1 is not None and cur.draft_p_top1[j - 1] < t
            ok[f"switch_target@{t:g}"].append(tgt if unsure else fresh)
        ok["oracle_fresh_top2"].append(y in cur.draft_top3[j - 1][:2])
        ok["oracle_fresh_top3"].append(y in cur.draft_top3[j - 1])
    return {rule: leading_run(v) for rule, v in ok.items()}


P_BINS = (0.05, 0.2, 0.5)  # buckets of the target's probability of the rejected draft token


def aggregate(decoded: list[tuple[list[Round], list[int]]]) -> dict:
    """Headroom over decoded prompts (each: its rounds and committed tokens, as :func:`record_rounds` returns)."""
    totals = {rule: 0 for rule in RULES}
    post_rounds = rounds_all = committed_all = 0
    # at the fresh draft's first wrong slot, when a prior exists: is the true token the rejected draft or the
    # target's aligned argmax, by how likely the target found the rejected token (a near-tie leaves the target's
    # continuation after it intact)
    first_fail = [0] * (len(P_BINS) + 1)
    rescued_copy = [0] * (len(P_BINS) + 1)
    rescued_target = [0] * (len(P_BINS) + 1)
    # ... and does the prior's own top 3 there hold the true token when the fresh top 3 does not (what the retained
    # hidden state could know beyond its argmax)
    beyond_fresh_top3 = 0
    for rounds, committed in decoded:
        rounds_all += len(rounds)
        committed_all += len(committed)
        pos = 0  # index into committed of the token after the current round's anchor
        for i, cur in enumerate(rounds):
            prev = rounds[i - 1] if i > 0 else None
            if prev is not None and prev.accepted < len(cur.drafts):
                truth = committed[pos: pos + len(cur.drafts)]
                got = round_headroom(prev, cur, truth)
                if got["fresh"] != cur.accepted:
                    raise AssertionError(f"replayed acceptance {got['fresh']} != engine's {cur.accepted}")
                post_rounds += 1
                for rule in RULES:
                    totals[rule] += got[rule]
                j = cur.accepted + 1  # the first wrong slot (if inside the block and the committed text)
                s = j + prev.accepted + 1
                if j <= min(len(cur.drafts), len(truth)) and s <= len(cur.drafts):
                    b = sum(prev.target_p_draft[prev.accepted] >= edge for edge in P_BINS)
                    first_fail[b] += 1
                    y = truth[j - 1]
                    rescued_copy[b] += y == prev.drafts[s - 1]
                    rescued_target[b] += y == prev.target_argmax[s - 1]
                    beyond_fresh_top3 += y in prev.draft_top3[s - 1] and y not in cur.draft_top3[j - 1]
            pos += cur.accepted + 1
    out = {"prompts": len(decoded), "rounds": rounds_all, "post_rejection_rounds": post_rounds,
           "tau": committed_all / max(rounds_all, 1),
           "first_fail_true_token_in_prior_top3_not_fresh_top3": beyond_fresh_top3 / max(sum(first_fail), 1)}
    edges = (0.0, *P_BINS, 1.0)
    out["first_fail_by_p_target_rejected"] = [
        {"p_range": [edges[b], edges[b + 1]], "slots": first_fail[b],
         "copy_right": rescued_copy[b] / max(first_fail[b], 1),
         "target_right": rescued_target[b] / max(first_fail[b], 1)}
        for b in range(len(first_fail))]
    for rule in RULES:  # a rule's extra accepted drafts, committed in the same rounds: tau' / tau
        extra = totals[rule] - totals["fresh"]
        out[f"mean_accepted_{rule}"] = totals[rule] / max(post_rounds, 1)
        out[f"tau_ratio_{rule}"] = (committed_all + extra) / max(committed_all, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--drafter", required=True, help="an exported drafter dir (DFlash or ReTrace)")
    ap.add_argument("--prompts", type=int, default=48, help="held-out prompts per suite")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the config's bench.max_new_tokens")
    ap.add_argument("--suites", default="", help="comma-separated (default: the config's bench.suites)")
    args, overrides = ap.parse_known_args()


    cfg = load_config(args.config, overrides)
    world = with_bench_prompts(cfg, existing_world(cfg))
    target = load_target(world.target_dir, dtype="float32", device="cpu")
    tok = AutoTokenizer.from_pretrained(str(world.target_dir))
    drafter = load_drafter(args.drafter, target)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens or cfg.bench.max_new_tokens,
                           stop_token_ids=stop_token_ids(tok))
    suites = args.suites.split(",") if args.suites else list(cfg.bench.suites)
    out = {"drafter": args.drafter, "block_size": drafter.block_size}
    with torch.inference_mode():
        for suite in suites:
            prompts = suite_prompts(world, suite, args.prompts, tok)
            out[suite] = aggregate([record_rounds(target, drafter, p, gen) for p in prompts])
            print(suite, json.dumps(out[suite]), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
