"""Training-stage comparison at the same data and step budget, measured by `specdraft bench` in one run.

The variants are data: one YAML file each under ``configs/experiments/`` (``specdraft.pipeline.experiments``), naming
its stage, the export it starts from (``sft``: the base run's), the run config it changes and the baselines it is
compared with. From the base run's ``sft`` export, each variant trains for the same number of steps on the same data
into ``drafter/<variant>``; then all of them (plus AR) are benched on the held-out suites at T=0 and T=1 and each
variant's tau over its baselines' is printed with a paired 95 % bootstrap interval. Files marked ``ablation: true``
(the ReTrace ablations) train only with ``--ablations`` or when named.

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

from specdraft.pipeline import stages
from specdraft.pipeline.bench import mean_ratio_interval, ratio_interval
from specdraft.pipeline.config import load_config
from specdraft.pipeline.experiments import load_experiments, training_order

EXPERIMENTS = Path(__file__).resolve().parents[1] / "configs" / "experiments"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--experiments", default=str(EXPERIMENTS), help="folder of variant files (default: %(default)s)")
    ap.add_argument("--variants", default="", help="comma-separated variant names (default: every non-ablation)")
    ap.add_argument("--ablations", action="store_true", help="also train the ablations")
    ap.add_argument("--out", default="", help="work dir (default: <work_dir>-compare)")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--train-only", action="store_true", help="train the variants, bench later with --bench-only")
    ap.add_argument("--retrain", action="store_true", help="retrain variants that already have an export")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="bench batch size (tau does not depend on it; a larger one benches more prompts per minute)")
    args, overrides = ap.parse_known_args()

    known = load_experiments(args.experiments)
    wanted = [k for k in args.variants.split(",") if k] or [k for k, e in known.items() if not e.ablation]
    unknown = [k for k in wanted if k not in known]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    if args.ablations:
        wanted += [k for k, e in known.items() if e.ablation and k not in wanted]
    todo = {k: known[k] for k in training_order({k: known[k] for k in wanted})}

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
    out_cfg = load_config(args.config, common)
    timings = {}
    for name, exp in todo.items():
        start = base if exp.start == "sft" else out_cfg.drafter_dir(exp.start)
        cfg = load_config(args.config, [*common, f"train.stage={exp.stage}", f"train.export_name={name}",
                                        f"drafter.init_from={start}", *exp.overrides()])
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
    rows = stages.bench(cfg, world)["results"]

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
    pairs = [(a, b, t) for a, exp in todo.items() for b, t in exp.compare]
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
