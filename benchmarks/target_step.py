"""Seconds of one training step of the embedded world's target under each transformers attention implementation.

The step is the world's (``specdraft.pipeline.world``): a ``Qwen3ForCausalLM`` of ``target.tiny``'s shape on a packed
batch of random tokens, bf16 autocast where the CPU runs bf16 natively (else fp32), AdamW and gradient clipping. The
implementations alternate within each repeat, so a drift of the machine's speed falls on both; the report gives each
one's median step per repeat and the paired ratio of each to the first.

    python benchmarks/target_step.py configs/tiny.yaml --attention sdpa,eager --repeats 3
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdraft.lit_modules.lm import CausalLMModule
from specdraft.pipeline.config import load_config
from specdraft.pipeline.lightning_utils import resolve_precision
from specdraft.pipeline.measure import median_seconds, write_report
from specdraft.pipeline.world import target_config


def step_fn(tiny, attention: str, precision: str):
    """One training step of a fresh target with ``attention`` (its weights seeded alike for every implementation)."""
    torch.manual_seed(0)
    module = CausalLMModule(target_config(tiny, tiny.vocab_size), tiny.lr, tiny.warmup_steps, tiny.max_steps, attention)
    opt = torch.optim.AdamW(module.parameters(), lr=tiny.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, tiny.vocab_size, (tiny.batch_size, tiny.seq_len + 1))  # [B, T + 1]
    autocast = precision.startswith("bf16")

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = module._loss(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return step


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. target.tiny.seq_len=128")
    ap.add_argument("--attention", default="sdpa,eager", help="comma-separated transformers implementations")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps a repeat (after two untimed ones)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tiny = load_config(args.config, args.overrides).target.tiny
    precision = resolve_precision(tiny.precision)
    names = args.attention.split(",")
    steps = {name: step_fn(tiny, name, precision) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            seconds[name].append(median_seconds(steps[name], repeats=args.steps, warmup=2))
    first = names[0]
    ratios = {name: [s / f for s, f in zip(seconds[name], seconds[first])] for name in names}
    return write_report({
        "precision": precision, "threads": torch.get_num_threads(), "repeats": args.repeats, "steps": args.steps,
        "step_s": {name: [round(s, 6) for s in v] for name, v in seconds.items()},
        f"ratio_to_{first}": {name: {"median": round(statistics.median(r), 3), "min": round(min(r), 3),
                                     "max": round(max(r), 3)} for name, r in ratios.items()},
    }, args.out)


if __name__ == "__main__":
    main()
