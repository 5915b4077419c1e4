"""Where an adaptive-policy job spends time that plain AR decoding does not, phase by phase.

Decodes a held-out suite of the tiny world (or any world with ``bench/<suite>.jsonl``) with continuous batching,
AR and the adaptive policy side by side (alternating, ``--repeats`` each), with the engine's phase clock
(``generate(timings=...)``: prefill, draft, verify, compaction, commit; ``drafted_rounds``: rows that verified
drafts, ``drafter_rounds``: rounds in which the drafter ran, with their measured seconds). ``--no-probes`` turns off
the retry that newly admitted requests bring forward, to price it. ``--time-calls`` times each of the policy's calls
where the engine makes them (between two target passes a call runs several times slower than the same call in a
loop: its code and data are out of the caches), per job: seconds, calls, µs a call and share of the job. Kind
``plain`` is the adaptive engine with a policy that never drafts (a drafter attached, its caches, the target's
features and their backlog kept, every round plain): what the engine's plain path costs over AR's, exploring left
out. ``--keep-policy`` keeps each
kind's policy from repeat to repeat, as a bench cell does (what a policy learns in one job, the next starts from).
Where a kind's time goes against AR's, in measures the machine's
speed drifts move far less than tokens/s: each job's ``host_s``, its seconds outside the models' passes (the engine's
and the policy's code between them; on a CPU a pass's wall time is its compute), over ``engine_rounds``, the rounds
of the decode loop; and ``step_ms``, the median of its one-token target passes (every row's decoding step, plain
rounds' and AR's: a median over hundreds of passes is not moved by a few slow ones). The summary gives each kind's host
time a round over AR's, as µs and as a share of AR's job, and its median step over AR's, paired by repeat.
Besides each job's line, each kind's tokens/s over AR's in the same repeat (median and range over repeats: slow
drifts of the machine cancel within a repeat).

    python benchmarks/policy_overhead.py artifacts/tiny/world-f8d6f235a11e artifacts/tiny/drafter/sft \\
        artifacts/cb-bench/policy/<key>.json --suite dialogue --slots 32 --temperature 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from specdraft.pipeline.measure import load_job
from specdraft.runtime import rounds
from specdraft.runtime.decode import generate
from specdraft.runtime.policy import AdaptivePolicy


def policy_of(base: AdaptivePolicy, kind: str) -> AdaptivePolicy | None:
    """A fresh copy of ``base`` for ``adaptive`` and ``plain``, with one field set for
    ``adaptive@FIELD=VALUE`` (a number); None for AR and fixed."""
    if kind in ("adaptive", "plain"):
        return replace(base)
    if kind.startswith("adaptive@"):
        name, value = kind.removeprefix("adaptive@").split("=")
        return replace(base, **{name: type(getattr(base, name))(float(value))})
    return None


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("world", help="a world folder: target/ and bench/<suite>.jsonl")
    ap.add_argument("drafter")
    ap.add_argument("policy", help="the policy file a bench or decode run cached (<work_dir>/policy/<key>.json)")
    ap.add_argument("--suite", default="dialogue")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--spread", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-probes", action="store_true")
    ap.add_argument("--time-calls", action="store_true", help="time each policy call in place (see the module doc)")
    ap.add_argument("--keep-policy", action="store_true",
                    help="each kind keeps its policy from repeat to repeat, as a bench cell does (default: a fresh "
                         "copy each job)")
    ap.add_argument("--kinds", default="ar,adaptive",
                    help="comma-separated: ar, adaptive, fixed (the whole block), plain (adaptive, never drafting); "
                         "adaptive@FIELD=VALUE: adaptive with one policy field set (e.g. adaptive@explore_share=0)")
    args = ap.parse_args(argv)
    job = load_job(args.world, args.drafter, args.suite, args.num_prompts, args.max_new_tokens, args.spread,
                   args.temperature, args.policy)
    target, drafter, prompts, gen, base = job.target, job.drafter, job.prompts, job.gen, job.policy
    verify_round = rounds.verify_round
    passes = timed_passes(target, drafter)
    calls: dict[str, list] = {}  # policy method -> [seconds, calls] in the current job
    timed = (("at_context", "draft_this_round", "observe_seconds", "observe", "verify_len")
             if args.time_calls else ())
    originals = {name: getattr(AdaptivePolicy, name) for name in timed}
    for name, method in originals.items():
        setattr(AdaptivePolicy, name, _timed(method, calls.setdefault(name, [0.0, 0])))
    try:
        return _run(args, target, drafter, prompts, gen, base, calls, passes)
    finally:  # the class and the engine as they were, for a caller in the same process
        for name, method in originals.items():
            setattr(AdaptivePolicy, name, method)
        rounds.verify_round = verify_round


def _run(args, target, drafter, prompts, gen, base, calls: dict[str, list], passes: dict) -> list[dict]:
    """Decode the job once per kind and repeat (see :func:`main`); prints a line per job, returns the rows."""
    rows = []
    kinds = args.kinds.split(",")
    kept: dict[str, AdaptivePolicy | None] = {}  # --keep-policy: each kind's policy, from repeat to repeat
    for rep in range(args.repeats):
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            policy = kept.get(kind) or policy_of(base, kind)
            if args.keep_policy:
                kept[kind] = policy
            if kind == "plain":
                policy.draft_this_round = lambda rows, fresh=0: False
            if policy is not None and args.no_probes and "draft_this_round" not in vars(policy):  # wrapped once
                plain = policy.draft_this_round
                policy.draft_this_round = lambda rows, fresh=0, plain=plain: plain(rows, 0)
            drafter_rounds = {"rounds": 0, "seconds": 0.0}  # rounds in which the drafter ran, their measured seconds
            if policy is not None:
                seen = getattr(policy, "_unwrapped_observe_seconds", policy.observe_seconds)
                policy._unwrapped_observe_seconds = seen  # a kept policy is wrapped once, not once per repeat

                def observe_seconds(b, drafting, width, sec, flushed=0.0, seen=seen, tally=drafter_rounds):
                    if drafting:
                        tally["rounds"] += 1
                        tally["seconds"] += sec + flushed
                    seen(b, drafting, width, sec, flushed)
                policy.observe_seconds = observe_seconds
            timings: dict[str, float] = {}
            for tally in calls.values():
                tally[:] = [0.0, 0]
            passes["seconds"], passes["steps"], passes["rounds"] = 0.0, [], 0
            start = time.perf_counter()
            res = generate(target, prompts, gen, generator=torch.Generator().manual_seed(rep), slots=args.slots,
                           timings=timings, **({"drafter": drafter} if kind != "ar" else {}), policy=policy)
            seconds = time.perf_counter() - start
            tokens = sum(len(r.tokens) for r in res)
            drafted = sum(v > 0 for r in res for v in r.verified) if policy else 0
            rows.append({"kind": kind, "repeat": rep, "tokens_per_s": tokens / seconds, "seconds": seconds,
                         "host_s": seconds - passes["seconds"], "engine_rounds": passes["rounds"],
                         "step_ms": statistics.median(passes["steps"]) * 1e3 if passes["steps"] else float("nan"),
                         "rounds": sum(len(r.accept_lengths) for r in res), "drafted_rounds": drafted,
                         "drafter_rounds": drafter_rounds["rounds"], "drafter_rounds_s": drafter_rounds["seconds"],
                         **{f"{k}_s": v for k, v in sorted(timings.items())},
                         **({f"measured_{k}": policy.measured_ratio(k) for k in ("drafted", "plain")}
                            if policy else {})})
            print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()))
            for name, (sec, n) in calls.items():
                if n:
                    print(f"  {name}: {sec * 1e3:.1f} ms, {n} calls, {sec / n * 1e6:.1f} us a call, "
                          f"{sec / seconds:.2%} of the job")
    if "ar" in kinds:
        ar = {r["repeat"]: r["tokens_per_s"] for r in rows if r["kind"] == "ar"}
        for kind in (k for k in kinds if k != "ar"):
            ratios = sorted(r["tokens_per_s"] / ar[r["repeat"]] for r in rows if r["kind"] == kind)
            print(f"{kind} / ar over {len(ratios)} repeats: median {statistics.median(ratios):.3f}, "
                  f"{ratios[0]:.3f}-{ratios[-1]:.3f}")
        by_repeat = {r["repeat"]: r for r in rows if r["kind"] == "ar"}
        for kind in (k for k in kinds if k != "ar"):
            mine = [(r, by_repeat[r["repeat"]]) for r in rows if r["kind"] == kind]
            over = [(r["host_s"] / r["engine_rounds"] - a["host_s"] / a["engine_rounds"], a) for r, a in mine]
            extra = sorted(x * 1e6 for x, _ in over)  # µs a round
            share = sorted(x * a["engine_rounds"] / a["seconds"] for x, a in over)  # of AR's job
            step = sorted(x for x in (r["step_ms"] / a["step_ms"] for r, a in mine) if x == x)  # (no steps: NaN)
            steps = (f"{statistics.median(step):.3f}x ({step[0]:.3f}-{step[-1]:.3f})" if step else "n/a")
            print(f"{kind} over ar: host time a round {statistics.median(extra):+.1f} us (median; "
                  f"{extra[0]:+.1f} to {extra[-1]:+.1f}), {statistics.median(share):+.2%} of ar's job; one-token "
                  f"target pass {steps}")
    return rows


def timed_passes(target, drafter) -> dict:
    """Time every pass of ``target`` (``forward``) and of ``drafter`` (``draft_hidden``, ``logits``, ``ingest``,
    ``ingest_packed``; a call inside another counts once), and count the decode loop's rounds (its ``verify_round``
    calls). Returns the tally it adds to: ``seconds`` in passes, ``steps`` (each one-token target pass's seconds: a
    plain round's or AR's) and ``rounds`` (a caller resets them
    per job). On CUDA each outermost pass synchronises before and after (its kernels counted, not their launch)."""
    tally = {"seconds": 0.0, "steps": [], "rounds": 0}
    depth = [0]
    weight = getattr(getattr(target, "lm_head", None), "weight", None)
    cuda = weight is not None and weight.device.type == "cuda"  # a pass's seconds are its kernels' once synchronised

    def timed(method, step: bool = False):
        def call(*args, **kwargs):
            depth[0] += 1
            if cuda and depth[0] == 1:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    took = time.perf_counter() - start
                    tally["seconds"] += took
                    tokens = args[0] if args else kwargs.get("tokens")
                    if step and tokens is not None and tokens.shape[1] == 1:
                        tally["steps"].append(took)
        return call

    target.forward = timed(target.forward, step=True)
    for name in ("draft_hidden", "logits", "ingest", "ingest_packed"):
        setattr(drafter, name, timed(getattr(drafter, name)))
    verify_round = rounds.verify_round

    def counted(*args, **kwargs):
        tally["rounds"] += 1
        return verify_round(*args, **kwargs)
    rounds.verify_round = counted
    return tally


def _timed(method, tally: list):
    """``method`` adding its wall seconds and one call to ``tally`` ``[seconds, calls]`` each time it runs."""
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            tally[0] += time.perf_counter() - start
            tally[1] += 1
    return timed


if __name__ == "__main__":
    main()
