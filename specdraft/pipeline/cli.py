"""``specdraft`` command line: each subcommand is a thin call into an importable stage function.

    specdraft run CONFIG [key=value ...]        target -> data -> train -> bench (the main job)
    specdraft target CONFIG                     build/reuse the embedded tiny target (or check target.path)
    specdraft data CONFIG                       regenerate drafter training data with the target
    specdraft train CONFIG                      train the drafter (Lightning), export the best to HF format
    specdraft decode CONFIG --input I --output O   batch speculative decoding over JSONL (resumable)
    specdraft bench CONFIG                      AR vs drafters on held-out suites -> JSON, markdown, PNG, MLflow
    specdraft export CONFIG --to hf|onnx|trt    the drafter's deployment artifacts (ONNX graphs, TensorRT engines)
    specdraft init-drafter --target DIR --out DIR  write a freshly initialised drafter for a target
    specdraft merge --input I --output O        merge a sharded decode's O.rank* files into O, in I's order

User errors print one line (``error: ...``) and exit 2; ``--print-config`` prints the resolved config and exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path

from specdraft.errors import TRT_MISSING, SpecdraftError


def _config_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("config", help="YAML run config (e.g. configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--explain", metavar="KEY", help="print a config key's type, value and description and exit "
                   "(e.g. --explain decode.drafter; a section lists its keys)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Train, export and run lossless "
                                     "block-diffusion speculative-decoding drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    _config_parser(sub, "run", "the whole pipeline: target -> data -> train -> bench")
    _config_parser(sub, "target", "build (or reuse) the embedded tiny target, or check target.path")
    _config_parser(sub, "data", "regenerate drafter training data with the target (ShareGPT JSONL)")
    _config_parser(sub, "train", "train the drafter with Lightning and export the best checkpoint")
    p = _config_parser(sub, "decode", "batch speculative decoding over a JSONL file (resumable)")
    p.add_argument("--input", required=True, help="JSONL: {id, prompt} or {id, messages} per line")
    p.add_argument("--output", required=True, help="JSONL results, appended; a rerun resumes")
    _config_parser(sub, "bench", "benchmark AR vs drafters on held-out suites")
    p = _config_parser(sub, "export", "write the drafter's deployment artifacts next to it and log them to MLflow")
    p.add_argument("--to", choices=["hf", "onnx", "trt"], default="onnx",
                   help="hf: the training export; onnx: ONNX graphs (decomposed and fused); trt: those and TensorRT "
                        "engines (needs TensorRT and a GPU)")
    p = sub.add_parser("init-drafter", help="write a freshly initialised DFlash drafter for a target")
    p.add_argument("--target", required=True, help="local HF target checkpoint directory")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--layers", type=int, default=5, help="draft layers (default 5)")
    p.add_argument("--block-size", type=int, default=16, help="block size (default 16)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("merge", help="merge the per-rank outputs of a sharded decode (torchrun) into one file")
    p.add_argument("--input", required=True, help="the JSONL requests the job decoded (gives the order)")
    p.add_argument("--output", required=True, help="the job's --output: its .rank* files are merged into it")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides may stand before or after the options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def stop_on_sigterm() -> None:
    """SIGTERM (a scheduler ending the job) stops the command as Ctrl-C does: completed work is kept and the MLflow
    run is marked KILLED, not left RUNNING."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    try:
        return _dispatch(args)
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: completed work is kept; rerun the same command to resume", file=sys.stderr)
        return 130


def _preflight(args, cfg=None) -> None:
    """What a command needs that costs nothing to check: files, directories and extras, before the heavy imports
    (a mistake is answered in about two seconds, not after torch, Lightning and transformers load)."""
    def need_dir(path: str, what: str) -> None:
        if path and not Path(path).is_dir():
            raise SpecdraftError(f"{what} {path} does not exist")

    if args.command == "init-drafter":
        need_dir(args.target, "--target")
        return
    if args.command == "merge":
        if not Path(args.input).is_file():
            raise SpecdraftError(f"input file {args.input} not found")
        return
    if cfg is None:  # before the config module (it imports torch)
        if not Path(args.config).is_file():
            raise SpecdraftError(f"config file {args.config} not found")
        if getattr(args, "print_config", False) or getattr(args, "explain", None):
            return
        if args.command == "decode" and not Path(args.input).is_file():
            raise SpecdraftError(f"input file {args.input} not found")
        if args.command == "export" and args.to == "trt" and importlib.util.find_spec("tensorrt") is None:
            raise SpecdraftError(TRT_MISSING)
        return
    need_dir(cfg.target.path, "config key 'target.path':")
    if args.command == "decode" and cfg.decode.drafter and cfg.decode.method != "ar" and \
            not (cfg.named_drafter_dir(cfg.decode.drafter) / "config.json").is_file():
        raise SpecdraftError(f"config key 'decode.drafter': {cfg.named_drafter_dir(cfg.decode.drafter)} holds no "
                             "drafter (no config.json): a drafter directory or an export name")


def _dispatch(args) -> int:
    if args.command == "merge":
        _preflight(args)
        from specdraft.runtime.batch_job import merge_shards, warn_stderr  # noqa: PLC0415  (torch: deferred)

        stats = merge_shards(args.input, args.output, warn_stderr)
        print(f"merged {stats['rows']} rows from {stats['shards']} shard file(s) into {args.output}")
        return 0
    _preflight(args)
    if args.command == "init-drafter":
        from specdraft.pipeline.drafter_init import init_drafter  # noqa: PLC0415  (transformers: deferred)

        out = init_drafter(args.target, args.out, args.layers, args.block_size, args.mask_token_id, args.seed)
        print(f"wrote drafter to {out}")
        return 0
    # deferred: the config imports torch; the stages Lightning, transformers and MLflow (seconds), which --help,
    # usage errors and the checks above do not need
    from specdraft.pipeline.config import dump_yaml, explain, load_config  # noqa: PLC0415

    cfg = load_config(args.config, args.overrides)
    if args.explain:
        print(explain(cfg, args.explain))
        return 0
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    _preflight(args, cfg)
    from specdraft.pipeline import stages  # noqa: PLC0415

    if args.command == "decode":
        stages.decode(cfg, Path(args.input), Path(args.output))
    elif args.command == "export":
        stages.export(cfg, args.to)
    else:
        getattr(stages, args.command)(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
