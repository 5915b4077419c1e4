"""``specdraft bench``: methods x held-out suites x temperatures x batch sizes, AR measured interleaved in-process.

Metrics: ``tau`` = mean tokens emitted per target verify round (bonus included; a round cut short by a stop token
or the length cap counts what it emitted), with a 95 % bootstrap interval over prompts;
``acceptance_rate`` = accepted drafts / drafted; ``per_position_acceptance[k]`` = share of rounds whose first
``k + 1`` drafts were all accepted; ``tokens_per_s``; ``speedup`` = tokens/s over AR's, from the same interleaved
run, with ``speedup_per_repeat`` and its ``speedup_ci95`` (each repeat's ratio to AR's in that repeat);
``target_distinct2`` = distinct-bigram ratio of AR outputs (flags degenerate loops that would inflate tau).
Writes ``bench.json``, ``bench.md`` and ``bench.png`` and logs them to MLflow.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from scipy import stats
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.pipeline.config import RunConfig
from specdraft.pipeline.exports import backend_models
from specdraft.pipeline.policy import adaptive_policy, heldin_prompts, machine_costs, policy_summary
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.pipeline.tracking import Tracker
from specdraft.pipeline.trees import FIRST_DRAFTERS, merged_drafting, one_pass_drafting, tree_drafting
from specdraft.runtime.batch_job import encode_requests, next_turn, read_requests, warn_stderr
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import check_made_for, load_drafter
from specdraft.runtime.load import load_target
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.suites import PACKAGED, packaged_path, parse_suite


def distinct2(seqs: list[list[int]]) -> float:
    bigrams = [(a, b) for s in seqs for a, b in zip(s, s[1:])]
    return len(set(bigrams)) / max(len(bigrams), 1)


def summarize(results, block_size: int) -> dict:
    """tau from the tokens each round emitted; acceptance rate and per-position acceptance from the drafts each round
    accepted (a round cut short by a stop token or the length cap still accepted what it accepted)."""
    lengths = [a for r in results for a in r.accept_lengths]
    accepted = [a for r in results for a in (getattr(r, "accepted", None) or [n - 1 for n in r.accept_lengths])]
    K = block_size - 1
    rounds = max(len(lengths), 1)
    out = {"tau": sum(lengths) / rounds, "rounds": len(lengths)}
    if K > 0:
        out["acceptance_rate"] = sum(accepted) / (rounds * K)
        out["per_position_acceptance"] = [sum(1 for a in accepted if a >= k) / rounds for k in range(1, K + 1)]
    else:
        out["acceptance_rate"], out["per_position_acceptance"] = 0.0, []
    return out


def tree_summary(results, tree) -> dict:
    """Tree rows: :func:`d2sd_summary` or :func:`one_pass_summary` (merged rows: with D²SD's branch count)."""
    if isinstance(tree, MergedDrafting):
        return {**one_pass_summary(results, tree), "tree_k": tree.num_branches}
    return one_pass_summary(results, tree) if isinstance(tree, OnePassDrafting) else d2sd_summary(results, tree)


def one_pass_summary(results, tree: OnePassDrafting | MergedDrafting) -> dict:
    """ddtree and merged rows: the node budget, real nodes verified per round, the share of rounds whose accepted path
    left the drafter's most likely tokens (a sibling or a branch won) and drafts accepted per round."""
    nodes = [n for r in results for n in r.nodes]
    rounds = max(len(nodes), 1)
    return {"tree_nodes": tree.nodes, "tree_budget": "fixed" if tree.budget is None else "measured",
            "nodes_per_round": sum(nodes) / rounds,
            "sibling_share": sum(w > 0 for r in results for w in r.winner) / rounds,
            "accepted_per_round": sum(a for r in results for a in r.accepted) / rounds}


def d2sd_summary(results, tree) -> dict:
    """D²SD rows: nodes verified per round, tree slots saved by deduplication per round (the candidates' tokens minus
    the nodes), the share of rounds each candidate won (index 0 = the first draft) and drafts accepted per round."""
    nodes = [n for r in results for n in r.nodes]
    winners = [w for r in results for w in r.winner]
    accepted = [a for r in results for a in r.accepted]
    rounds = max(len(nodes), 1)
    full = tree.max_nodes(tree.second.block_size)
    return {"tree_k": tree.num_branches, "placement": tree.placement, "distinct": tree.distinct,
            "nodes_per_round": sum(nodes) / rounds, "dedup_saved_per_round": sum(full - n for n in nodes) / rounds,
            "winner_share": [sum(w == j for w in winners) / rounds for j in range(tree.num_branches + 1)],
            "accepted_per_round": sum(accepted) / rounds}


def per_prompt_counts(results, num_prompts: int) -> list[list[int]]:
    """``[emitted tokens, rounds]`` per prompt, summed over repeats (``results`` lists each repeat's prompts in
    order)."""
    out = [[0, 0] for _ in range(num_prompts)]
    for i, r in enumerate(results):
        out[i % num_prompts][0] += sum(r.accept_lengths)
        out[i % num_prompts][1] += len(r.accept_lengths)
    return out


def _bootstrap(stat, n: int, n_boot: int, seed: int) -> np.ndarray:
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))  # prompts resampled with replacement
    return np.array([stat(i) for i in idx])


def tau_interval(per_prompt: list[list[int]], n_boot: int = 1000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of tau (emitted / rounds) over prompts."""
    a = np.asarray(per_prompt, dtype=float)  # [P, 2]
    if len(a) == 0 or a[:, 1].sum() == 0:
        return [float("nan"), float("nan")]
    taus = _bootstrap(lambda i: a[i, 0].sum() / max(a[i, 1].sum(), 1), len(a), n_boot, seed)
    return [float(v) for v in np.percentile(taus, [2.5, 97.5])]


def mean_ratio_interval(pairs: list[tuple[list[list[int]], list[list[int]]]], n_boot: int = 1000,
                        seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the mean over suites of tau(num) / tau(den): each suite's prompts are resampled,
    paired (both drafters decoded the same prompts)."""
    arrays = [(np.asarray(a, dtype=float), np.asarray(c, dtype=float)) for a, c in pairs]
    if not arrays or any(len(a) != len(c) or len(a) == 0 for a, c in arrays):
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    means = []
    for _ in range(n_boot):
        ratios = []
        for a, c in arrays:
            i = rng.integers(0, len(a), size=len(a))
            ratios.append((a[i, 0].sum() / max(a[i, 1].sum(), 1)) / (c[i, 0].sum() / max(c[i, 1].sum(), 1)))
        means.append(np.mean(ratios))
    return [float(v) for v in np.percentile(means, [2.5, 97.5])]


def ratio_interval(num: list[list[int]], den: list[list[int]], n_boot: int = 1000, seed: int = 0) -> list[float]:
    """95 % paired bootstrap interval of tau(num) / tau(den), both measured on the same prompts."""
    return mean_ratio_interval([(num, den)], n_boot, seed)


def speedup_repeats(repeats: list[list[float]], ar_tokens_per_s: list[float]) -> dict:
    """``speedup_per_repeat``: each repeat's tokens/s (``repeats``: ``[tokens, seconds]`` per repeat) over AR's in the
    same repeat (the two decoded side by side, so drifts of the machine's speed cancel), and ``speedup_ci95``: the
    95 % t-interval of their mean (Student, ``n - 1`` degrees of freedom; one repeat: no interval, ``nan``)."""
    ratios = [(t / s) / ar for (t, s), ar in zip(repeats, ar_tokens_per_s)]
    n = len(ratios)
    if n < 2:
        return {"speedup_per_repeat": ratios, "speedup_ci95": [float("nan"), float("nan")]}
    mean, sem = float(np.mean(ratios)), float(np.std(ratios, ddof=1)) / n ** 0.5
    half = float(stats.t.ppf(0.975, n - 1)) * sem
    return {"speedup_per_repeat": ratios, "speedup_ci95": [mean - half, mean + half]}


def with_bench_prompts(cfg: RunConfig, world):
    """``world`` with its held-out suites: the tiny world's own, else ``<work_dir>/bench_prompts/`` (where ``specdraft
    data`` copies ``data.bench_dir``), else ``data.bench_dir`` itself."""
    for candidate in (cfg.work_path / "bench_prompts", Path(cfg.data.bench_dir) if cfg.data.bench_dir else None):
        if world.bench_dir is None and candidate is not None and candidate.is_dir():
            world.bench_dir = candidate
    return world


def suite_prompts(world, suite: str, n: int, tokenizer, enable_thinking: bool = False,
                  context: int | None = None, answer: Callable[[list[list[int]]], list[str]] | None = None
                  ) -> list[list[int]]:
    """Token ids of the prompts of the first ``n`` requests of a held-out suite (a ``bench.suites`` entry, see
    :class:`~specdraft.runtime.suites.SuiteSpec`), encoded as decode encodes them (plain text for a tokenizer without
    a chat template; prompts that do not fit ``context`` left out). A multi-turn request gives a prompt per turn,
    the later ones after ``answer``'s answers (the target's, greedy) to the turns before; without ``answer``, its
    first turn only."""
    spec = parse_suite(suite)
    if spec.path is not None:
        path = spec.path
    elif spec.name in PACKAGED:
        try:
            path = packaged_path(spec.name)
        except ValueError as e:
            raise SpecdraftError(f"config key 'bench.suites': {e}") from None
    elif world.bench_dir is None:
        raise SpecdraftError("bench needs held-out suites: the tiny world writes them; for an external target "
                             "put <suite>.jsonl files under <work_dir>/bench_prompts/, or name suite files in "
                             "bench.suites")
    else:
        path = world.bench_dir / f"{spec.name}.jsonl"
        if not path.is_file():
            return []
    if spec.path is not None and not path.is_file():
        raise SpecdraftError(f"config key 'bench.suites': {path} not found")
    reqs = [r for r in read_requests(path, warn_stderr, spec.fmt) if spec.category in (None, r.category)][:n]
    if not reqs:
        raise SpecdraftError(f"config key 'bench.suites': {path} has no requests of category {spec.category!r}")
    prompts = []
    while reqs:
        encoded = encode_requests(reqs, tokenizer, context, enable_thinking, warn=lambda m: None)
        prompts += [ids for _, ids in encoded]
        later = [(r, ids) for r, ids in encoded if r.turn <= len(r.turns)] if answer is not None else []
        answers = answer([ids for _, ids in later]) if later else []
        reqs = [next_turn(r, a) for (r, _), a in zip(later, answers)]
    return prompts


@dataclass
class _Entry:
    """What one bench method decodes with."""

    drafter: object  # None for AR
    method: str  # ar, a drafter architecture, d2sd
    stage: str
    dir: str
    tree: object  # TreeDrafting or None
    target: object
    backend: str  # torch, onnx, trt
    policy: object = None  # temperature -> an AdaptivePolicy calibrated under it (copied fresh for each suite and
    #   batch size), or None


def run_bench(cfg: RunConfig, world, tracker: Tracker, log=print) -> dict:
    """Run the benchmark grid: AR and each (method, stage) drafter, interleaved on the same prompt batches."""

    b = cfg.bench
    world = with_bench_prompts(cfg, world)
    stages = b.stages or [cfg.train.export]
    dirs = {st: cfg.named_drafter_dir(cfg.decode.drafter) if cfg.decode.drafter and len(stages) == 1 else
            cfg.drafter_dir(st) for st in stages}
    second = cfg.second_drafter_dir() if b.tree_ks else None
    for d in [*dirs.values(), *([second] if second else [])]:  # before the target is loaded
        check_made_for(d, world.target_dir, cfg.decode.allow_other_target, log)
    tgt = load_target(world.target_dir, dtype=cfg.target.dtype, device=cfg.target.device)
    tok = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
    stops = stop_token_ids(tok)
    loaded = {"ar": _Entry(None, "ar", "", "", None, tgt, "torch")}  # label -> what a row decodes with
    for st, d in dirs.items():
        drafter = load_drafter(d, tgt)
        adaptive = "adaptive" in b.policies
        for backend in b.backends:
            if backend == "torch":
                if "fixed" in b.policies:
                    loaded[f"{drafter.arch_name}:{st}"] = _Entry(drafter, drafter.arch_name, st, str(d), None, tgt,
                                                                 backend)
                continue
            b_tgt, b_drafter = backend_models(backend, d, world)
            loaded.setdefault(f"ar@{backend}", _Entry(None, "ar", "", str(d), None, b_tgt, backend))
            loaded[f"{drafter.arch_name}:{st}@{backend}"] = _Entry(b_drafter, drafter.arch_name, st, str(d), None,
                                                                   b_tgt, backend)
        if adaptive:
            heldin = heldin_prompts(world, tok, cfg.data.enable_thinking)
            dec = cfg.decode
            policy = {temp: adaptive_policy(cfg.work_path, tgt, drafter, d, heldin, stops, tuple(b.batch_sizes), log,
                                            SamplingParams(temp, dec.top_k, dec.top_p), dec.draft_sampling)
                      for temp in b.temperatures}
            loaded[f"{drafter.arch_name}:{st}+adaptive"] = _Entry(drafter, drafter.arch_name, st, str(d), None, tgt,
                                                                  "torch", policy)
        prices = partial(machine_costs, cfg.work_path, tgt, drafter, d, tuple(b.batch_sizes), log=log)
        trees = {}  # the second drafter is loaded once per first drafter
        tree_rows = {}  # name -> (method, a fresh tree: a measured budget's record is each row's own)
        for k in b.tree_ks if drafter.arch_name in FIRST_DRAFTERS else []:
            trees[k] = replace(trees[min(trees)], num_branches=k) if trees else tree_drafting(cfg, tgt, drafter, k)
            trees[k].check(drafter)
            tree_rows[f"d2sd{k}:{st}"] = ("d2sd", partial(replace, trees[k]))
        for n in b.tree_nodes if drafter.arch_name in FIRST_DRAFTERS else []:
            for how in b.tree_budgets or [cfg.decode.tree_budget]:
                tree_rows[f"ddtree{n}:{st}" + ("+measured" if how == "measured" else "")] = (
                    "ddtree", partial(one_pass_drafting, cfg, drafter, n, how, prices))
        if b.merged_nodes and drafter.arch_name in FIRST_DRAFTERS:
            branches = trees.get(cfg.decode.tree_k) or tree_drafting(cfg, tgt, drafter)
            for n in b.merged_nodes:
                for how in b.tree_budgets or [cfg.decode.tree_budget]:
                    tree_rows[f"merged{n}:{st}" + ("+measured" if how == "measured" else "")] = (
                        "merged", partial(merged_drafting, cfg, drafter, branches, n, how, prices))
        for name, (method, tree) in tree_rows.items():
            if "fixed" in b.policies:
                loaded[name] = _Entry(drafter, method, st, str(d), tree(), tgt, "torch")
            if adaptive:  # the policy decides between a whole tree round and a plain one
                loaded[f"{name}+adaptive"] = _Entry(drafter, method, st, str(d), tree(), tgt, "torch",
                                                    {t: replace(p, whole_rounds=True) for t, p in policy.items()})

    d = cfg.decode
    settings = {"top_k": d.top_k, "top_p": d.top_p, "draft_sampling": d.draft_sampling, "repeats": b.repeats,
                "seed": b.seed}
    methods = list(loaded)
    context = tgt.args.max_position_embeddings
    answer_gen = GenerationConfig(max_new_tokens=b.max_new_tokens, stop_token_ids=stops)

    def answer(prompts: list[list[int]]) -> list[str]:  # a later turn's conversation: the target's greedy answers
        rows = [r for i in range(0, len(prompts), 8) for r in generate(tgt, prompts[i:i + 8], answer_gen)]
        return [tok.decode(r.tokens, skip_special_tokens=True) for r in rows]

    suites = {parse_suite(s).name: suite_prompts(world, s, b.num_prompts, tok, cfg.data.enable_thinking, context,
                                                 answer) for s in b.suites}
    for suite in [s for s, p in suites.items() if not p]:
        log(f"bench: no held-out prompts for suite {suite!r}; skipped")
    warm = next((p[:max(b.batch_sizes)] for p in suites.values() if p), None)
    for temp in b.temperatures if warm is not None else []:
        # one untimed run per method and sampling setting: first-call costs stay out of tokens/s
        gen = GenerationConfig(max_new_tokens=8, stop_token_ids=stops, sampling=SamplingParams(temp, d.top_k, d.top_p),
                               draft_sampling=d.draft_sampling)
        for method in methods:
            e = loaded[method]
            generate(e.target, warm, gen, drafter=e.drafter,
                     generator=torch.Generator(device=e.target.lm_head.weight.device).manual_seed(b.seed), tree=e.tree)
    rows = []
    turn = 0  # the order of methods alternates from one batch to the next across the whole grid
    for suite, prompts in suites.items():
        if not prompts:
            continue
        caps = length_caps(len(prompts), b.max_new_tokens, b.length_spread, b.seed)
        for temp in b.temperatures:
            for bs in b.batch_sizes:
                measured: dict[str, dict[str, float]] = {}  # batching -> method -> tokens/s
                modes = sorted(b.batching, key=lambda m: m != "static")  # static first: the ratios need it
                accs = {m: defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "results": [], "repeats": []})
                        for m in modes}
                policies = {mode: {m: {"policy": replace(e.policy[temp])} for m, e in loaded.items()
                                   if e.policy is not None} for mode in modes}
                for rep in range(b.repeats):
                    # the batchings take turns, whole suite by whole suite, so drifts in machine speed hit both
                    for mode in (modes if rep % 2 == 0 else modes[::-1]):
                        # static: one batch of bs prompts at a time; continuous: the whole suite through bs slots
                        groups = range(0, len(prompts), bs) if mode == "static" else [0]
                        for method in methods:
                            accs[mode][method]["repeats"].append([0, 0.0])  # this repeat's [tokens, seconds]
                        size = bs if mode == "static" else len(prompts)
                        batching = {"slots": bs, "prefill_chunk": d.prefill_chunk or None} if mode != "static" else {}
                        for i in groups:
                            batch = prompts[i:i + size]
                            gen = GenerationConfig(max_new_tokens=caps[i:i + size], stop_token_ids=stops,
                                                   sampling=SamplingParams(temp, d.top_k, d.top_p),
                                                   draft_sampling=d.draft_sampling)
                            # interleaved on the same batch, the order alternating so no method always runs first
                            turn += 1
                            for method in (methods if turn % 2 else methods[::-1]):
                                e = loaded[method]
                                g = torch.Generator(device=e.target.lm_head.weight.device).manual_seed(
                                    b.seed + 1000 * rep + i)
                                t0 = time.perf_counter()
                                res = generate(e.target, batch, gen, drafter=e.drafter, generator=g, tree=e.tree,
                                               **policies[mode].get(method, {}), **batching)
                                dt = time.perf_counter() - t0
                                a = accs[mode][method]
                                tokens = sum(len(r.tokens) for r in res)
                                a["seconds"] += dt
                                a["tokens"] += tokens
                                a["repeats"][-1][0] += tokens
                                a["repeats"][-1][1] += dt
                                a["results"].extend(res)
                for mode in modes:
                    acc = accs[mode]
                    measured[mode] = {m: a["tokens"] / a["seconds"] for m, a in acc.items()}
                    ar_tps = measured[mode]["ar"]
                    ar_reps = [t / s for t, s in acc["ar"]["repeats"]]
                    d2 = distinct2([r.tokens for r in acc["ar"]["results"]])
                    for method in methods:
                        a = acc[method]
                        e = loaded[method]
                        block = e.drafter.block_size if e.drafter is not None else 1
                        tps = measured[mode][method]
                        m_name, stage, ddir, tree = e.method, e.stage, e.dir, e.tree
                        per_prompt = per_prompt_counts(a["results"], len(prompts))
                        row = {"method": m_name, "backend": e.backend, "drafter": ddir, "stage": stage, "suite": suite,
                               "temperature": temp, "batch_size": bs, "batching": mode,
                               **summarize(a["results"], block),
                               "tau_ci95": tau_interval(per_prompt, seed=b.seed), "tokens_per_s": tps,
                               "speedup": tps / ar_tps, **speedup_repeats(a["repeats"], ar_reps),
                               "target_distinct2": d2, "num_prompts": len(prompts),
                               "tokens": a["tokens"], **settings, "length_spread": b.length_spread,
                               "per_prompt": per_prompt,
                               **(tree_summary(a["results"], tree) if tree is not None else {}),
                               "policy": "adaptive" if e.policy is not None else "fixed",
                               **(policy_summary(a["results"]) if e.policy is not None else {})}
                        if "static" in measured:  # side by side with the static batches of this very run
                            row["vs_static"] = tps / measured["static"][method]
                            row["vs_ar_static"] = tps / measured["static"]["ar"]
                        rows.append(row)
                        log(f"bench: {suite:9s} T={temp:g} bs={bs} {mode}: {method} tau {row['tau']:.2f}, "
                            f"speedup {row['speedup']:.2f}x ({tps:.0f} vs AR {ar_tps:.0f} tok/s)"
                            + (f", {row['vs_static']:.2f}x static" if mode != "static" and "vs_static" in row else ""))
    if not rows:
        raise SpecdraftError("bench produced no rows (no suites with prompts)")
    out_dir = cfg.work_path / "bench"
    report = write_reports(rows, out_dir)
    for r in rows:
        if r["method"] != "ar":
            backend = f"_{r['backend']}" if r.get("backend", "torch") != "torch" else ""
            cont = "_continuous" if r["batching"] == "continuous" else ""
            key = (f"bench/{r['method']}{backend}_{r['stage']}_{r['suite']}_T{r['temperature']:g}"
                   f"_bs{r['batch_size']}{cont}")
            tracker.log_metrics({f"{key}_tau": r["tau"], f"{key}_speedup": r["speedup"],
                                 f"{key}_acceptance_rate": r["acceptance_rate"]})
    tracker.log_artifact(out_dir, "bench")
    log(report["markdown"])
    return report


def length_caps(n: int, max_new_tokens: int, spread: float, seed: int) -> list[int]:
    """``n`` request caps drawn log-uniformly from ``[max_new_tokens / spread, max_new_tokens]`` (seeded)."""
    if spread <= 1:
        return [max_new_tokens] * n
    g = np.random.default_rng(seed)
    lo = max(np.log(max_new_tokens / spread), 0.0)
    return [max(1, round(float(np.exp(x)))) for x in g.uniform(lo, np.log(max_new_tokens), n)]


def write_reports(rows: list[dict], out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps({"results": rows}, indent=2))
    lines = ["| method | stage | suite | T | bs | prompts x repeats | tau (95% CI) | accept rate | tok/s "
             "| speedup (95% CI over repeats) | distinct2 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["tau_ci95"]
        method = (f"d2sd K={r['tree_k']}" + (f" {r['placement']}" if r["placement"] != "confidence" else "")
                  + (" distinct" if r.get("distinct") else "")) \
            if r["method"] == "d2sd" else r["method"]
        if r["method"] in ("ddtree", "merged"):
            method = f"{r['method']} N={r['tree_nodes']}" + (" measured" if r.get("tree_budget") == "measured" else "")
        if r.get("backend", "torch") != "torch":
            method += f" @{r['backend']}"
        if r.get("policy") == "adaptive":
            method += " adaptive"
        if r.get("batching") == "continuous":
            method += " continuous" + (f" ({r['vs_static']:.2f}x static)" if "vs_static" in r else "")
        s_lo, s_hi = r.get("speedup_ci95", [float("nan")] * 2)
        ci = f" ({s_lo:.2f}-{s_hi:.2f})" if r["method"] != "ar" and s_lo == s_lo else ""
        lines.append(f"| {method} | {r['stage'] or '-'} | {r['suite']} | {r['temperature']:g} | {r['batch_size']} "
                     f"| {r['num_prompts']} x {r['repeats']} | {r['tau']:.2f} ({lo:.2f}-{hi:.2f}) "
                     f"| {r['acceptance_rate']:.3f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{ci} "
                     f"| {r['target_distinct2']:.2f} |")
    md = "\n".join(lines)
    (out_dir / "bench.md").write_text(md + "\n")
    _plot(rows, out_dir / "bench.png")
    if len({r["batch_size"] for r in rows}) > 1:
        _plot_batch_sizes(rows, out_dir / "bench_batch_sizes.png")
    if any(r["method"] in ("ddtree", "merged") for r in rows):
        _plot_tree_nodes(rows, out_dir / "bench_tree_nodes.png")
    return {"results": rows, "markdown": md, "dir": str(out_dir)}


def _plot(rows: list[dict], path: Path) -> None:
    # deferred: pyplot is slow to import and must be imported after the headless backend is chosen
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    drafted = [r for r in rows if r["method"] != "ar"]
    if not drafted:
        return
    labels = [f"{_label(r)}\n{r['suite']} T={r['temperature']:g}" for r in drafted]
    trees = [r for r in drafted if r["method"] == "d2sd"]
    fig, axes = plt.subplots(1, 3 if trees else 2, figsize=(max(6, 1.2 * len(drafted) * (1.5 if trees else 1)), 4))
    axes[0].bar(range(len(drafted)), [r["tau"] for r in drafted], color="tab:blue")
    axes[0].set_title("tau (tokens per target forward)")
    axes[1].bar(range(len(drafted)), [r["speedup"] for r in drafted], color="tab:green")
    axes[1].axhline(1.0, color="gray", lw=1, ls="--")
    axes[1].set_title("speedup vs AR (same process)")
    for ax in axes[:2]:
        ax.set_xticks(range(len(drafted)), labels, rotation=45, ha="right", fontsize=7)
    if trees:  # per D²SD row: nodes verified per round, and the share of rounds a second-drafter branch won
        x = range(len(trees))
        axes[2].bar(x, [r["nodes_per_round"] for r in trees], color="tab:orange", label="nodes / round")
        axes[2].bar(x, [r["dedup_saved_per_round"] for r in trees], bottom=[r["nodes_per_round"] for r in trees],
                    color="tab:gray", label="saved by dedup")
        twin = axes[2].twinx()
        twin.plot(x, [1 - r["winner_share"][0] for r in trees], "k.", label="branch won")
        twin.set_ylim(0, 1)
        axes[2].set_title("D²SD trees")
        axes[2].set_xticks(x, [f"K={r['tree_k']} {r['suite']} T={r['temperature']:g}" for r in trees],
                           rotation=45, ha="right", fontsize=7)
        axes[2].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(r: dict) -> str:
    """A drafted row's method as plots name it (``dflash:sft``, ``d2sd2:sft``, ``ddtree32:sft``,
    ``dflash:sft+adaptive``)."""
    backend = f"@{r['backend']}" if r.get("backend", "torch") != "torch" else ""
    policy = "+adaptive" if r.get("policy") == "adaptive" else ""
    batching = " (continuous)" if r.get("batching") == "continuous" else ""
    size = r.get("tree_nodes") if r["method"] == "merged" else r.get("tree_k", r.get("tree_nodes", ""))
    name = "ar" if r["method"] == "ar" else f"{r['method']}{size}:{r['stage']}"
    name += "+measured" if r.get("tree_budget") == "measured" else ""
    return f"{name}{backend}{policy}{batching}"


def _plot_tree_nodes(rows: list[dict], path: Path) -> None:
    """tau and speedup over AR against the node budget, a line per tree method (ddtree, merged), suite, temperature
    and batch size, the fixed DFlash chain of the same stage drawn at its block's nodes (the picture to choose a
    method and a budget by)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    trees = [r for r in rows if r["method"] in ("ddtree", "merged") and r["batching"] == "static"
             and r.get("tree_budget") != "measured" and r.get("policy", "fixed") == "fixed"]
    chains = {(r["stage"], r["suite"], r["temperature"], r["batch_size"]): r for r in rows
              if r["method"] in FIRST_DRAFTERS and r.get("policy") == "fixed" and r["batching"] == "static"
              and r.get("backend", "torch") == "torch"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for method, *key in sorted({(r["method"], r["stage"], r["suite"], r["temperature"], r["batch_size"])
                                for r in trees}):
        pts = sorted((r["tree_nodes"], r["tau"], r["speedup"]) for r in trees
                     if [r["method"], r["stage"], r["suite"], r["temperature"], r["batch_size"]] == [method, *key])
        chain = chains.get(tuple(key))
        if chain is not None:  # the chain verifies its block: K drafts and the anchor
            pts = sorted([*pts, (len(chain["per_position_acceptance"]) + 1, chain["tau"], chain["speedup"])])
        label = f"{method} {key[1]} T={key[2]:g} bs={key[3]}"
        for ax, i in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[i] for p in pts], marker="o", label=label)
    axes[0].set_title("tau against the node budget")
    axes[1].set_title("speedup vs AR against the node budget")
    axes[1].axhline(1.0, color="gray", lw=1, ls="--")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes verified per row and round (chain: its block)")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_batch_sizes(rows: list[dict], path: Path) -> None:
    """Speedup over AR against batch size, a line per method, a panel per suite and temperature (the picture to
    choose a batch size by). With static and continuous rows, every line (AR under continuous batching too) is over
    AR in static batches, so the two batchings share one axis."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    both = any("vs_ar_static" in r for r in rows)
    key = "vs_ar_static" if both else "speedup"
    drafted = [r for r in rows if (r["method"] != "ar" or both and r["batching"] != "static") and key in r]
    panels = sorted({(r["suite"], r["temperature"]) for r in drafted})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3), squeeze=False)
    for ax, (suite, temp) in zip(axes[0], panels):
        for label in sorted({_label(r) for r in drafted}):
            pts = sorted((r["batch_size"], r[key]) for r in drafted
                         if _label(r) == label and r["suite"] == suite and r["temperature"] == temp)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{suite} T={temp:g}", fontsize=9)
        ax.set_xlabel("batch size")
    axes[0][0].set_ylabel("speedup vs AR (static batches)" if both else "speedup vs AR")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
