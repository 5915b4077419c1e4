"""What keeping freed host memory (``specdraft.runtime.host_memory``) does to CPU decoding: tokens/s, minor page faults
and the spread of repeated jobs, with glibc's default allocator and with the setting, in alternating processes (the
setting is process-wide, so each process decodes with one of them).

Each process decodes a held-out suite of the tiny world with continuous batching, AR and the adaptive policy
alternating (``--repeats`` each), and prints one JSON line per job.

    python benchmarks/host_memory.py artifacts/tiny/world-f8d6f235a11e artifacts/tiny/drafter/sft \\
        artifacts/cb-bench/policy/<key>.json --suite dialogue --slots 32 --processes 4
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch

import specdraft.runtime.load as load
from specdraft.pipeline.measure import load_job
from specdraft.runtime.decode import GenerationConfig, generate


def decode_jobs(args) -> None:
    """One process: ``--repeats`` jobs per kind, alternating; one JSON line each."""
    if args.allocator == "default":
        load.keep_freed_memory = lambda: False  # glibc as it comes (load_target reads it from its module)
    job = load_job(args.world, args.drafter, args.suite, args.num_prompts, args.max_new_tokens, args.spread,
                   args.temperature, args.policy)
    target, drafter, prompts, gen, base = job.target, job.drafter, job.prompts, job.gen, job.policy
    generate(target, prompts[:8], GenerationConfig(max_new_tokens=8), drafter=drafter)  # warm-up
    for rep in range(args.repeats):
        for kind in ("ar", "adaptive") if rep % 2 == 0 else ("adaptive", "ar"):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            res = generate(target, prompts, gen, generator=torch.Generator().manual_seed(rep), slots=args.slots,
                           **({"drafter": drafter, "policy": replace(base)} if kind == "adaptive" else {}))
            seconds = time.perf_counter() - start
            print(json.dumps({"allocator": args.allocator, "kind": kind, "repeat": rep,
                              "tokens_per_s": sum(len(r.tokens) for r in res) / seconds,
                              "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}), flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("world")
    ap.add_argument("drafter")
    ap.add_argument("policy", help="the policy file a bench or decode run cached (<work_dir>/policy/<key>.json)")
    ap.add_argument("--suite", default="dialogue")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--spread", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3, help="jobs per kind in each process")
    ap.add_argument("--processes", type=int, default=4, help="processes per allocator, alternating")
    ap.add_argument("--allocator", choices=("default", "keep"), help=argparse.SUPPRESS)  # set in a child process
    args = ap.parse_args(argv)
    if args.allocator is not None:
        decode_jobs(args)
        return []
    rows = []
    for p in range(args.processes):
        for allocator in ("default", "keep") if p % 2 == 0 else ("keep", "default"):
            out = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                  "--allocator", allocator], capture_output=True, text=True, check=True).stdout
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for allocator in ("default", "keep"):
        for kind in ("ar", "adaptive"):
            sel = [r for r in rows if r["allocator"] == allocator and r["kind"] == kind]
            tps = [r["tokens_per_s"] for r in sel]
            print(f"{allocator:8s} {kind:9s} jobs {len(sel)}  tok/s median {statistics.median(tps):7.1f}  "
                  f"spread (max-min)/median {(max(tps) - min(tps)) / statistics.median(tps):.3f}  "
                  f"faults/job median {statistics.median(r['faults'] for r in sel):9.0f}")
        pairs = [{r["kind"]: r["tokens_per_s"] for r in rows[i:i + 2]} for i in range(0, len(rows), 2)
                 if rows[i]["allocator"] == allocator]  # a process's jobs come in (AR, adaptive) pairs per repeat
        ratios = [p["adaptive"] / p["ar"] for p in pairs]
        print(f"{allocator:8s} adaptive / AR (same process, same repeat): median {statistics.median(ratios):.3f}, "
              f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} pairs")
    return rows


if __name__ == "__main__":
    main()
