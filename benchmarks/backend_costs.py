"""Per-pass cost of each engine backend against PyTorch, side by side: drafter ingest (a round's committed features),
drafter draft (one block), target verify (anchor + drafts), at batch 1 and 8 over a context of ``--context`` tokens,
on the run's target and exported drafter (``specdraft export CONFIG --to onnx`` first). Median of ``--repeats``
interleaved pairs; the ratio is backend / torch.

    python benchmarks/backend_costs.py configs/tiny.yaml [--backend onnx] [--context 256] [--out costs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specdraft.pipeline.config import load_config
from specdraft.pipeline.exports import backend_models, export_dirs
from specdraft.pipeline.measure import write_report
from specdraft.pipeline.stages import default_drafter_dir, existing_world
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target
from specdraft.runtime.phase_clock import wall_seconds


def _fill(target, drafter, B: int, context: int, seed: int, dev):
    """Caches of ``B`` rows holding ``context`` committed tokens, on any backend."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.args.vocab_size - 1, (B, context), generator=g).to(dev)
    tc, dc = target.new_cache(B, context + 64), drafter.new_cache(B, context + 64)
    out = target(tokens, cache=tc, feature_layers=drafter.target_layer_ids)
    tc.crop(torch.full((B,), context, device=dev))
    drafter.ingest(dc, out.features, torch.full((B,), context, device=dev))
    return tc, dc


def passes(target, drafter, tc, dc, B: int, Bk: int, mask_id: int, dev):
    """The three passes of a round, each leaving the caches as it found them."""
    blk = torch.full((B, Bk), mask_id, device=dev)
    feats = torch.randn(B, Bk, len(drafter.target_layer_ids) * target.args.hidden_size, device=dev)

    def ingest():
        before = dc.lengths.clone()
        drafter.ingest(dc, feats, torch.full((B,), Bk, device=dev))
        dc.crop(before)

    def draft():
        hidden = drafter.draft_hidden(dc, drafter.block_embeds(blk, None))
        drafter.logits(hidden[:, 1:])

    def verify():
        before = tc.lengths.clone()
        target(blk, cache=tc, feature_layers=drafter.target_layer_ids)
        tc.crop(before)

    return {"drafter_ingest": ingest, "drafter_draft": draft, "target_verify": verify}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--backend", default="onnx", choices=["onnx", "trt"])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cpu", help="where the torch side runs (the trt backend runs on cuda)")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    world = existing_world(cfg)
    drafter_dir = default_drafter_dir(cfg)
    dev = torch.device(args.device)
    torch_target = load_target(world.target_dir, dtype="float32", device=args.device)
    torch_drafter = load_drafter(drafter_dir, torch_target)
    b_target, b_drafter = backend_models(args.backend, drafter_dir, world)
    Bk, mask_id = torch_drafter.block_size, torch_drafter.config.mask_token_id
    report = {"config": args.config, "backend": args.backend, "device": args.device, "context": args.context,
              "block_size": Bk,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "export": str(export_dirs(drafter_dir)),
              "rows": []}
    with torch.inference_mode():
        for B in (int(b) for b in args.batch_sizes.split(",")):
            runs = {}
            for name, (tm, dm) in {"torch": (torch_target, torch_drafter), args.backend: (b_target, b_drafter)}.items():
                d = dev if name == "torch" else tm.device
                tc, dc = _fill(tm, dm, B, args.context, B, d)
                runs[name] = passes(tm, dm, tc, dc, B, Bk, mask_id, d)
            for kind in runs["torch"]:
                times = {name: [] for name in runs}
                for name in runs:  # warm-up
                    runs[name][kind]()
                for i in range(args.repeats):
                    for name in (list(runs) if i % 2 else list(runs)[::-1]):
                        times[name].append(wall_seconds(runs[name][kind], dev if name == "torch" else
                                                    torch.device("cuda" if args.backend == "trt" else "cpu")))
                med = {name: statistics.median(t) * 1000 for name, t in times.items()}
                row = {"batch": B, "pass": kind, "torch_ms": med["torch"], f"{args.backend}_ms": med[args.backend],
                       "ratio": med[args.backend] / med["torch"]}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    write_report(report, args.out, echo=False)
    return report


if __name__ == "__main__":
    main()
