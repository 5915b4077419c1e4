"""ReTrace's per-round fusion overhead at a real Qwen3 shape (goal: <= 5% of a round).

The tiny world's drafter and target are so small (D = 256, a 1-layer drafter, a 6-layer target) that the fusion's
~6 D^2 parameters are a large share of the weights a round touches. This measures the same thing at a real model's
shapes with random weights (no checkpoint, nothing downloaded; the cost of a round does not depend on the weights):

1. ``fusion_ms``: ReTrace's extra work per round (ingest of the rejected rows' features, retaining the suffix,
   fusing it into the next block) minus the same DFlash steps, on a real round's tensors; median of interleaved pairs.
2. ``round_ms``: one DFlash speculative round (draft a block, verify it with the target, ingest), from ``generate``
   runs minus the prefill.
3. ``end_to_end``: the same ``generate`` with the ReTrace drafter (fusion active), per round, as a cross-check.

    python benchmarks/fusion_overhead.py --shape qwen3-1.7b                 # CPU, fp32 (about 10 GB of memory)
    python benchmarks/fusion_overhead.py --shape qwen3-8b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdraft.pipeline.measure import fusion_overhead_ms, write_report
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import build_drafter, convert_drafter, drafter_config_for_target
from specdraft.runtime.models.target import TargetArgs, TargetLM
from specdraft.runtime.phase_clock import wall_seconds

SHAPES = {  # the published config.json values of each model (architecture only)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
QWEN3_VOCAB, QWEN3_MASK = 151936, 151669


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--drafter-layers", type=int, default=5, help="z-lab's Qwen3 DFlash drafters have 5")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="new tokens per generate call (random weights: 1 per round)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fusion-steps", type=int, default=20, help="steps per timed fusion measurement")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="", help="also write the result here (JSON)")
    args = ap.parse_args()

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    targs = TargetArgs(model_type="qwen3", vocab_size=QWEN3_VOCAB, rope_theta=1e6, **SHAPES[args.shape])
    with torch.device(dev):
        target = TargetLM(targs).to(dtype).eval()
        dcfg = drafter_config_for_target(targs, QWEN3_MASK, num_layers=args.drafter_layers,
                                         block_size=args.block_size)
        drafter = build_drafter(dcfg).to(dtype).bind_target(target.model.embed_tokens, target.lm_head).eval()
        retrace = convert_drafter(drafter, "retrace").eval()
    torch.nn.init.normal_(retrace.retrace_gate_out.weight, std=0.02)  # fusion active
    fusion_params = sum(p.numel() for n, p in retrace.named_parameters() if n.startswith("retrace_"))
    out = {"shape": args.shape, "device": str(dev), "dtype": args.dtype, "threads": torch.get_num_threads(),
           "drafter_layers": args.drafter_layers, "block_size": args.block_size,
           "fusion_params": fusion_params, "target_params": sum(p.numel() for p in target.parameters()),
           "drafter_params": sum(p.numel() for p in drafter.parameters())}

    for bs in (int(b) for b in args.batch_sizes.split(",")):
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(0, 150000, (args.prompt_len,), generator=g).tolist() for _ in range(bs)]
        gen = GenerationConfig(max_new_tokens=args.rounds)

        def per_round(model) -> tuple[float, int]:  # (seconds for the generate call, rounds)
            res = []
            seconds = wall_seconds(lambda: res.extend(generate(target, prompts, gen, drafter=model)), dev)
            return seconds, max(len(r.accept_lengths) for r in res)

        per_round(drafter), per_round(retrace)  # warm-up
        cycles = []
        for i in range(args.repeats):  # interleaved, alternating which drafter runs first
            prefill = wall_seconds(lambda: generate(target, prompts, GenerationConfig(max_new_tokens=1)), dev)
            if i % 2 == 0:
                (d_s, d_r), (r_s, r_r) = per_round(drafter), per_round(retrace)
            else:
                (r_s, r_r), (d_s, d_r) = per_round(retrace), per_round(drafter)
            cycles.append({"round_ms": 1000 * (d_s - prefill) / d_r, "retrace_round_ms": 1000 * (r_s - prefill) / r_r})
        fusion = fusion_overhead_ms(drafter, retrace, target, bs, QWEN3_MASK, n_steps=args.fusion_steps,
                                    n_pairs=max(15, 2 * args.repeats))
        res = {k: statistics.median(c[k] for c in cycles) for k in cycles[0]}
        res["fusion_ms"] = statistics.median(fusion)
        res["fusion_ms_quartiles"] = statistics.quantiles(fusion, n=4)[::2]
        res["fusion_share_of_round"] = res["fusion_ms"] / (res["round_ms"] + res["fusion_ms"])
        shares = [(c["retrace_round_ms"] - c["round_ms"]) / c["retrace_round_ms"] for c in cycles]
        res["end_to_end_share"] = statistics.median(shares)  # per cycle, like engine_costs' ratios
        res["end_to_end_share_range"] = [min(shares), max(shares)]
        out[f"bs{bs}"] = res
        print(json.dumps({f"bs{bs}": res}), flush=True)
    write_report(out, args.out)


if __name__ == "__main__":
    main()
