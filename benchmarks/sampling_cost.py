"""What sampling a block of drafts costs: the engine's inverse-CDF sampler against the exponential race (gpt-fast's,
which the engine used before), side by side over the same probabilities, interleaved, median of ``--repeats``.

    python benchmarks/sampling_cost.py [--rows 1,8,32,64] [--drafts 15] [--vocab 2048] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdraft.runtime.phase_clock import wall_seconds
from specdraft.runtime.sampling import sample_from_probs


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``argmax(p / E)`` with ``E ~ Exp(1)`` per entry: one exponential per vocabulary entry."""
    return (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(-1)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--drafts", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    g = torch.Generator(device=args.device).manual_seed(0)
    out = []
    for b in (int(r) for r in args.rows.split(",")):
        probs = torch.randn(b, args.drafts, args.vocab, generator=g, device=args.device).softmax(-1)  # [b, K, V]
        times = {"inverse_cdf": [], "exponential_race": []}
        for _ in range(args.repeats + 1):  # the first cycle warms up
            for name, fn in (("inverse_cdf", sample_from_probs), ("exponential_race", exponential_race)):
                times[name].append(wall_seconds(lambda fn=fn: fn(probs, g), args.device))
        row = {"rows": b, **{f"{k}_ms": 1e3 * statistics.median(v[1:]) for k, v in times.items()}}
        row["race_over_cdf"] = row["exponential_race_ms"] / row["inverse_cdf_ms"]
        out.append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return out


if __name__ == "__main__":
    main()
