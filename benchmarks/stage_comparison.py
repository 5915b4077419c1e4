"""Training-stage comparison at the same data and step budget, measured by `specdraft bench` in one run.

From one base drafter (the run's ``sft`` export), train each variant for the same number of steps on the same data:

    sft      decayed CE, continued (the CE baseline and ReTrace's own DFlash backbone at equal budget)
    kl       forward KL to the target at T (the KL baseline for WTV)
    eal      expected accepted length, greedy            -> compare with sft at T=0
    eal-mix  EAL with the CE warm-up mix (lambda = exp(-3 mean q)) -> compare with sft at T=0
    eal-len  EAL as -log E (slot 1 keeps the full CE gradient) -> compare with sft at T=0
    eal-greedy  EAL's gradient at the hard greedy outcomes (train.eal_variant=greedy) -> compare with sft at T=0
    wtv      window total variation at T                  -> compare with kl at T=1
    wtv-len  WTV as -log E_T                               -> compare with kl at T=1
    wtv-sg   WTV's stop-gradient weighting sum_k W_k (1 - alpha_k) -> compare with kl at T=1
    eal-len-mix  -log E with the same CE warm-up mix       -> compare with sft at T=0
    grpo     from eal-mix, reward = simulated acceptance  -> compare with eal-mix (its start)
    grpo-len the same GRPO from eal-len                    -> compare with eal-len (its start) and with sft
    grpo-t1  the same, groups sampled at drafter temperature 1 (the default samples at 0.5)
    grpo-wtv sampling GRPO (reward: speculative sampling's acceptance at T) from wtv-len -> compare with wtv-len at T=1
    retrace-main  ReTrace on the DFlash backbone          -> compare with sft (plus the ablations below)
    opd      Draft-OPD from sft: greedy rollouts refreshed every 10 steps -> compare with sft (continued) at T=0
    opd-offline / opd-rej / opd-rej-exact / opd-sampled / opd-rawkl  its ablations: no refresh (offline replay), the
             rejected-draft stream on (first rejected slot; every rejected slot scored on the drafted prefix), the
             sampled-token response KL, the response KL to the raw T=1 target -> compare with opd
    opd-t1   Draft-OPD with T=1 rollouts                   -> compare with sft at T=1
    opd-eal  Draft-OPD from the eal-len export             -> compare with eal-len (its start) and with opd

Each variant exports to ``drafter/<variant>`` (``train.export_name``); its stage is the longest stage-table name
that the variant's name starts with.

then bench all of them (plus AR) on the held-out suites at T=0 and T=1 and print the ratios.

    python benchmarks/stage_comparison.py configs/tiny.yaml --steps 150 [--variants sft,eal,...] [--ablations]

``work_dir=<run>`` among the overrides picks another base run (its ``data/train.jsonl`` and ``drafter/sft``), e.g. one
whose data was regenerated at T=1 for the sampling losses; the variants still go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from specdraft.lit_modules.stage_table import STAGES
from specdraft.pipeline import stages
from specdraft.pipeline.bench import mean_ratio_interval, ratio_interval
from specdraft.pipeline.config import load_config

VARIANTS = {
    "sft": [],
    "kl": ["train.features=online"],
    "eal": ["train.acceptance_form=log"],  # -log(1+E), the form first measured
    "eal-mix": ["train.acceptance_form=log", "train.ce_mix_eta=3.0"],  # EAL with the CE warm-up mix
    "eal-len": ["train.acceptance_form=log_len"],
    "eal-greedy": ["train.acceptance_form=log", "train.eal_variant=greedy"],
    "eal-len-mix": ["train.acceptance_form=log_len", "train.ce_mix_eta=3.0"],
    # trained at verified anchors (a + n + 1 after a no-grad greedy round), where serving anchors its blocks
    "sft-v": ["train.anchors=verified"],
    "eal-len-v": ["train.anchors=verified", "train.acceptance_form=log_len"],
    "eal-greedy-v": ["train.anchors=verified", "train.acceptance_form=log", "train.eal_variant=greedy"],
    "wtv": ["train.features=online", "train.acceptance_form=log"],
    "wtv-len": ["train.features=online", "train.acceptance_form=log_len"],
    "wtv-sg": ["train.features=online", "train.wtv_variant=stopgrad"],
    "grpo": ["train.features=online"],  # starts from the eal-mix export (STARTS); groups sampled at T_d 0.5
    "grpo-t1": ["train.features=online", "train.grpo.draft_temperature=1.0"],  # groups sampled at T_d 1
    "grpo-len": ["train.features=online"],  # starts from the eal-len export
    # sampling GRPO (reward: the min(1, p/q) test at T) from the wtv-len export; train it on data sampled at T
    "grpo-wtv": ["train.features=online", "train.grpo.mode=sampling"],
    "retrace-main": ["train.features=online"],  # hard alignment, correction signals, mask slots only
    "opd": ["train.features=online"],
    "opd-offline": ["train.features=online", "train.opd.refresh_every=0"],
    # the rejected-draft stream on, at the published weight: the first rejected slot (cheap) or every one (exact)
    "opd-rej": ["train.features=online", "train.opd.rejected_weight=1"],
    "opd-rej-exact": ["train.features=online", "train.opd.rejected_weight=1", "train.opd.rejected_teacher=exact"],
    "opd-sampled": ["train.features=online", "train.opd.response_loss=sampled"],
    # the response stream's KL to the raw T=1 target under greedy rollouts, with the rejected stream on
    "opd-rawkl": ["train.features=online", "train.opd.response_teacher=raw", "train.opd.rejected_weight=1"],
    "opd-t1": ["train.features=online", "train.opd.rollout_temperature=1.0"],
    "opd-eal": ["train.features=online"],  # starts from the eal-len export (STARTS)
}
# the variants that do not start from sft: their start export
STARTS = {"grpo": "eal-mix", "grpo-t1": "eal-mix", "grpo-len": "eal-len", "grpo-wtv": "wtv-len", "opd-eal": "eal-len"}
ABLATIONS = {  # ReTrace ablations, each its own export dir
    "retrace-soft": ["train.features=online", "drafter.retrace.alignment=soft"],
    "retrace-nocorr": ["train.features=online", "drafter.retrace.use_correction=false"],
    "retrace-anchor": ["train.features=online", "drafter.retrace.gate_anchor=true"],
    "retrace-cheap": ["train.features=online", "train.retrace.signals=cheap"],  # teacher-forced correction signals
    # the first round's random-anchor blocks trained with CE too (the backbone keeps SFT's anchors)
    "retrace-mix": ["train.features=online", "train.retrace.first_round_ce=1.0"],
    # a slim fusion: refiner of width D/2 fed [h; LN(c)] (0.42x the parameters)
    "retrace-slim": ["train.features=online", "drafter.retrace.refiner_width=128",
                     "drafter.retrace.embed_drafted=false"],
}


def stage_of(variant: str) -> str:
    """The training stage a variant runs: the longest stage name it equals or starts with (``eal-len`` -> eal)."""
    names = [s for s in STAGES if variant == s or variant.startswith(s + "-")]
    if not names:
        raise SystemExit(f"variant {variant!r} names no training stage ({', '.join(STAGES)})")
    return max(names, key=len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="any of the variants and ablations below")
    ap.add_argument("--ablations", action="store_true", help="also train the ReTrace ablations")
    ap.add_argument("--out", default="", help="work dir (default: <work_dir>-compare)")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--train-only", action="store_true", help="train the variants, bench later with --bench-only")
    ap.add_argument("--retrain", action="store_true", help="retrain variants that already have an export")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="bench batch size (tau does not depend on it; a larger one benches more prompts per minute)")
    args, overrides = ap.parse_known_args()

    base_cfg = load_config(args.config, overrides)
    world = stages.existing_world(base_cfg)
    base = base_cfg.drafter_dir("sft")
    if not (base / "config.json").is_file():
        raise SystemExit(f"no base drafter at {base}: run `specdraft run {args.config}` first")
    out = Path(args.out or f"{base_cfg.work_dir}-compare")
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "sampling.json"):  # the data and, if recorded, the temperature it was sampled at
        if name == "train.jsonl" or (base_cfg.work_path / "data" / name).is_file():
            shutil.copy(base_cfg.work_path / "data" / name, out / "data" / name)
    if world.bench_dir is not None and not (out / "bench_prompts").is_dir():
        shutil.copytree(world.bench_dir, out / "bench_prompts")
    # the overrides' work_dir (if any) names the base run; the variants always train and bench under --out
    common = [f"target.path={world.target_dir}", f"train.max_steps={args.steps}", "train.max_minutes=0",
              f"train.eval_every={max(args.steps // 2, 1)}", "train.warmup_ratio=0.0", *overrides, f"work_dir={out}"]
    known = {**VARIANTS, **ABLATIONS}
    unknown = [k for k in args.variants.split(",") if k not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    todo = {k: known[k] for k in args.variants.split(",")}
    if args.ablations:
        todo.update(ABLATIONS)
    out_cfg = load_config(args.config, common)
    timings = {}
    for name, extra in todo.items():
        stage = stage_of(name)
        start = out_cfg.drafter_dir(STARTS[name]) if name in STARTS else base
        cfg = load_config(args.config, [*common, f"train.stage={stage}", f"train.export_name={name}",
                                        f"drafter.init_from={start}", *extra])
        if args.bench_only or ((cfg.drafter_dir(name) / "config.json").is_file() and not args.retrain):
            continue
        if not (start / "config.json").is_file():
            raise SystemExit(f"variant {name!r} starts from {start}, which does not exist: train {start.name} first")
        if args.retrain:  # otherwise an interrupted variant resumes from its own checkpoints
            shutil.rmtree(cfg.checkpoint_dir(name), ignore_errors=True)
        t0 = time.perf_counter()
        stages.train(cfg, world)
        timings[name] = time.perf_counter() - t0
        seconds_file = out / "train_seconds.json"
        seen = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
        seconds_file.write_text(json.dumps({**seen, name: timings[name]}, indent=2))
        shutil.rmtree(cfg.checkpoint_dir(name), ignore_errors=True)
    if args.train_only:
        print(f"trained {', '.join(timings) or 'nothing new'}: {timings}")
        return

    names = [n for n in todo if (out_cfg.drafter_dir(n) / "config.json").is_file()]
    cfg = load_config(args.config, [*common, f"bench.stages={json.dumps(names)}",
                                    f"bench.batch_sizes=[{args.batch_size}]"])
    report = stages.bench(cfg, world)
    rows = report["results"]

    def row(stage, suite, temp):
        for r in rows:
            if (r["stage"] == stage and r["suite"] == suite and r["temperature"] == temp
                    and r["batch_size"] == args.batch_size):
                return r
        return None

    def tau(stage, suite, temp):
        r = row(stage, suite, temp)
        return r["tau"] if r else None

    suites = sorted({r["suite"] for r in rows})
    pairs = [(a, "sft", 0.0) for a in ("eal", "eal-mix", "eal-len", "eal-greedy", "eal-len-mix")]
    pairs += [("grpo-len", "eal-len", 0.0), ("grpo-len", "sft", 0.0)]
    pairs += [("sft-v", "sft", 0.0), ("sft-v", "sft", 1.0), ("eal-len-v", "sft-v", 0.0), ("eal-greedy-v", "sft-v", 0.0)]
    pairs += [(a, "kl", 1.0) for a in ("wtv", "wtv-len", "wtv-sg")]
    pairs += [("grpo-wtv", "wtv-len", 1.0)]
    pairs += [(a, "eal-mix", t) for a in ("grpo", "grpo-t1") for t in (0.0, 1.0)]
    pairs += [("retrace-main", "sft", 0.0), ("retrace-main", "sft", 1.0)]
    pairs += [(a, "sft", t) for a in ABLATIONS for t in (0.0, 1.0)]
    pairs += [("opd", "sft", 0.0), ("opd", "sft", 1.0), ("opd-t1", "sft", 1.0), ("opd-t1", "opd", 1.0)]
    pairs += [(a, "opd", 0.0) for a in ("opd-offline", "opd-rej", "opd-rej-exact", "opd-sampled", "opd-eal",
                                         "opd-rawkl")]
    pairs += [("opd-rej-exact", "opd-rej", 0.0), ("opd-rawkl", "opd-rej", 0.0)]
    pairs += [("opd-eal", "eal-len", 0.0)]
    if (out / "train_seconds.json").is_file():
        timings = json.loads((out / "train_seconds.json").read_text())
    summary = {"steps": args.steps, "bench_batch_size": args.batch_size, "train_seconds": timings, "ratios": {}}
    for a, b, t in pairs:
        if a in names and b in names:
            per = {s: (tau(a, s, t) / tau(b, s, t)) for s in suites if tau(a, s, t) and tau(b, s, t)}
            # paired bootstrap over the suite's prompts: both drafters decoded the same ones
            pp = {s: (row(a, s, t)["per_prompt"], row(b, s, t)["per_prompt"]) for s in per}
            ci = {s: ratio_interval(*pp[s]) for s in per}
            mean, mean_ci = sum(per.values()) / max(len(per), 1), mean_ratio_interval(list(pp.values()))
            summary["ratios"][f"{a}/{b} T={t:g}"] = {"per_suite": per, "per_suite_ci95": ci, "mean": mean,
                                                     "mean_ci95": mean_ci}
            per_suite = ", ".join(f"{s} {v:.3f} ({ci[s][0]:.3f}-{ci[s][1]:.3f})" for s, v in per.items())
            print(f"tau {a}/{b} at T={t:g}: {per_suite} (mean {mean:.3f}, {mean_ci[0]:.3f}-{mean_ci[1]:.3f})")
    (out / "stage_comparison.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'stage_comparison.json'} and {out / 'bench'}")


if __name__ == "__main__":
    main()
