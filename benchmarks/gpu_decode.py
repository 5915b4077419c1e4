"""Decode cost at a real Qwen3 shape with random weights (no checkpoint; a round's cost does not depend on the
weights): one speculative round (draft a block, verify it, commit) over one autoregressive step, both through the
static-shape path with CUDA graphs (goal at Qwen3-8B, batch 1: round / AR step <= 1.2), and the eager engine's
round and step beside them.

Each figure is ``(time of a generate call - time of its prefill alone) / rounds``, median over ``--repeats`` runs,
the four methods interleaved per repeat. Random weights accept almost nothing, so a call of ``N`` new tokens runs
about ``N`` rounds.

    python benchmarks/gpu_decode.py --shape qwen3-8b --device cuda --dtype bfloat16 --out decode.json
    python benchmarks/gpu_decode.py --shape tiny                     # the CPU smoke run (no graphs)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdraft.pipeline.measure import write_report
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import build_drafter, drafter_config_for_target
from specdraft.runtime.models.target import TargetArgs, TargetLM
from specdraft.runtime.phase_clock import wall_seconds
from specdraft.runtime.static_decode import StaticDecoder

SHAPES = {  # published config.json values (architecture only), and a tiny one for the CPU smoke run
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=512),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--drafter-layers", type=int, default=5, help="z-lab's Qwen3 DFlash drafters have 5")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = dict(SHAPES[args.shape])
    vocab = shape.pop("vocab_size")
    targs = TargetArgs(model_type="qwen3", vocab_size=vocab, rope_theta=1e6, **shape)
    torch.manual_seed(0)
    with torch.device(dev):
        target = TargetLM(targs).to(dtype).eval()
        dcfg = drafter_config_for_target(targs, vocab - 1, num_layers=args.drafter_layers,
                                         block_size=args.block_size)
        drafter = build_drafter(dcfg).to(dtype).bind_target(target.model.embed_tokens, target.lm_head).eval()
    graphs = dev.type == "cuda"
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(dev) if graphs else "cpu",
              "dtype": args.dtype, "graphs": graphs, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "block_size": args.block_size, "drafter_layers": args.drafter_layers, "repeats": args.repeats,
              "rows": []}
    max_len = args.prompt_len + args.new_tokens + 2 * args.block_size + 1
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(bs)]
        gen, prefill_only = GenerationConfig(max_new_tokens=args.new_tokens), GenerationConfig(max_new_tokens=1)
        static_ar = StaticDecoder(target, None, bs, max_len, buckets=(bs,), graphs=graphs)
        static_spec = StaticDecoder(target, drafter, bs, max_len, buckets=(bs,), graphs=graphs)
        methods = {
            "ar_static": (lambda c: static_ar.generate(prompts, c)),
            "spec_static": (lambda c: static_spec.generate(prompts, c)),
            "ar_eager": (lambda c: generate(target, prompts, c)),
            "spec_eager": (lambda c: generate(target, prompts, c, drafter=drafter)),
        }
        for fn in methods.values():  # warm up: graphs captured, kernels compiled, allocator primed
            fn(gen)
        per_round: dict[str, list[float]] = {m: [] for m in methods}
        rounds: dict[str, int] = {}
        for _ in range(args.repeats):
            for name, fn in methods.items():
                res: list = []
                total = wall_seconds(lambda: res.extend(fn(gen)), dev)
                prefill = wall_seconds(lambda: fn(prefill_only), dev)
                rounds[name] = max(len(r.accept_lengths) for r in res)
                per_round[name].append((total - prefill) / max(rounds[name], 1))
        row = {"batch": bs, **{f"{m}_ms": 1000 * statistics.median(v) for m, v in per_round.items()},
               **{f"{m}_rounds": r for m, r in rounds.items()}}
        row["round_over_ar_step_static"] = row["spec_static_ms"] / row["ar_static_ms"]
        row["round_over_ar_step_eager"] = row["spec_eager_ms"] / row["ar_eager_ms"]
        row["graph_speedup_round"] = row["spec_eager_ms"] / row["spec_static_ms"]
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_report(report, args.out, echo=False)
    return report


if __name__ == "__main__":
    main()
