"""Pipeline stages behind the CLI. Each logs to MLflow (its own run, nested under ``run`` when called from it)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.pipeline.bench import run_bench
from specdraft.pipeline.config import RunConfig, dump_yaml, to_flat_dict
from specdraft.pipeline.data import regenerate
from specdraft.pipeline.decoding import build_decoding, default_drafter_dir, worker_decoding
from specdraft.pipeline.exports import run_export
from specdraft.pipeline.tracking import Tracker, make_tracker
from specdraft.pipeline.train import train_drafter
from specdraft.pipeline.trees import FIRST_DRAFTERS
from specdraft.pipeline.world import build_or_load_world, cached_world, external_world, world_dir
from specdraft.runtime.batch_job import claim_output, read_requests, run_batch_job, shard_for_rank, warn_stderr
from specdraft.runtime.drafter_io import check_compatible, check_made_for, read_drafter_config
from specdraft.runtime.load import read_target_args, target_fingerprint


def log(msg: str) -> None:
    print(msg, flush=True)


_ACTIVE: list[Tracker] = []


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_note(load: float, cores: int) -> str | None:
    """A warning when the machine is busier than its cores (a bench's ratios are then unreliable)."""
    if load <= cores:
        return None
    return (f"the machine's load ({load:.1f}) is above its {cores} cores: other processes share them, so speeds and "
            "ratios measured now are unreliable (wait, or set target.threads lower)")


@contextlib.contextmanager
def tracked(cfg: RunConfig, stage: str):
    """An MLflow run for ``stage`` (nested in the active one, if any) with the resolved config logged; torch uses
    ``target.threads`` threads inside it."""
    torch.set_num_threads(cfg.target.threads or machine_cores())
    parent = _ACTIVE[-1] if _ACTIVE else None
    tracking = cfg.tracking
    if stage == "decode" or stage == "target" and cfg.target.path:  # jobs and checks keep their own experiment
        tracking = dataclasses.replace(tracking, experiment=tracking.jobs_experiment or f"{tracking.experiment}-jobs")
    tracker = parent or make_tracker(tracking)
    with tracker.run(f"{cfg.name}-{stage}", tags={"stage": stage, "config_name": cfg.name}):
        tracker.log_params(to_flat_dict(cfg))
        cfg_file = cfg.work_path / f"config-{stage}.yaml"
        cfg.work_path.mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(dump_yaml(cfg))
        tracker.log_artifact(cfg_file, "config")
        _ACTIVE.append(tracker)
        try:
            yield tracker
        finally:
            _ACTIVE.pop()


def target(cfg: RunConfig):
    with tracked(cfg, "target") as tr:
        world = build_or_load_world(cfg, tr, log)
        rep = world.report
        if cfg.target.path:
            log(f"target: {world.target_dir} passes: {rep['model_type']}, {rep['layers']} layers, vocab "
                f"{rep['vocab_size']}; safetensors weights and tokenizer files present (its weights are read by "
                "data, train and decode)")
        if "samples" in rep:
            for dom, s in rep["samples"].items():
                log(f"--- sample ({dom}) ---\n{s['completion'][:400]}")
        return world


def existing_world(cfg: RunConfig):
    """The target this config points at, without building anything."""
    if cfg.target.path:
        return external_world(cfg)
    world = cached_world(cfg)
    if world is None:
        raise SpecdraftError(f"no tiny target built for this config yet in {world_dir(cfg)}; "
                             "run `specdraft target CONFIG` first")
    return world


def data(cfg: RunConfig, world=None):
    with tracked(cfg, "data") as tr:
        world = world or target(cfg)
        return regenerate(cfg, world, tr, log)


def train(cfg: RunConfig, world=None):
    with tracked(cfg, "train") as tr:
        world = world or existing_world(cfg)
        data_file = cfg.work_path / "data" / "train.jsonl"
        if not data_file.is_file():
            data_file = data(cfg, world)
        return train_drafter(cfg, world, data_file, tr, log)


def decode(cfg: RunConfig, input_path: Path, output_path: Path):
    world = existing_world(cfg)
    d = cfg.decode
    if d.runner == "ray" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SpecdraftError("config key 'decode.runner': ray runs one driver for the whole cluster; start it "
                             "once, not under torchrun")
    bad: list[str] = []
    requests = read_requests(input_path, lambda m: (bad.append(m), warn_stderr(m)))
    requests, output_path = shard_for_rank(requests, output_path)
    drafter_dir = None
    if d.method != "ar":
        drafter_dir = default_drafter_dir(cfg)
        arch, dcfg = read_drafter_config(drafter_dir)  # checked against the target before loading any weights
        if arch != d.method and not (d.method in ("d2sd", "ddtree", "merged") and arch in FIRST_DRAFTERS):
            raise SpecdraftError(f"config key 'decode.method': {d.method!r} but the drafter in {drafter_dir} is "
                                 f"a {arch!r} drafter")
        check_compatible(dcfg, read_target_args(world.target_dir))
        check_made_for(drafter_dir, world.target_dir, d.allow_other_target, log)
        if d.method in ("d2sd", "merged") and (second := cfg.second_drafter_dir()) is not None:
            check_made_for(second, world.target_dir, d.allow_other_target, log)
    settings = {"target": target_fingerprint(world.target_dir), "method": d.method,
                "drafter": str(drafter_dir.resolve()) if drafter_dir else None, "temperature": d.temperature,
                "top_k": d.top_k, "top_p": d.top_p, "draft_sampling": d.draft_sampling,
                "max_new_tokens": d.max_new_tokens, "seed": d.seed, "enable_thinking": cfg.data.enable_thinking}
    with claim_output(output_path, settings):  # one writer; a resume keeps the rows' settings
        run = _decode_on_ray if d.runner == "ray" else _decode_here
        stats = run(cfg, world, requests, output_path, drafter_dir)
    if not stats["requests"]:
        log(f"decode: nothing left to do: {output_path} holds every request ({stats['skipped_done']} done, "
            f"{stats['rejected']} skipped, {len(bad)} bad lines)")
        return stats
    tps = stats["tokens"] / stats["seconds"] if stats["seconds"] else 0.0
    where = f" on {d.ray_actors} Ray actors" if d.runner == "ray" else ""
    order = "; rows in the order requests finished" if d.batching == "continuous" or d.runner == "ray" else ""
    log(f"decode: {stats['requests']} requests{where} ({stats['skipped_done']} already done, {stats['rejected']} "
        f"skipped, {len(bad)} bad lines) -> {output_path}{order}; tau {stats['tau']:.2f}, "
        f"{tps:.1f} tok/s")
    return stats


def _decode_here(cfg: RunConfig, world, requests, output_path: Path, drafter_dir: Path | None):
    d = cfg.decode
    with tracked(cfg, "decode") as tr:
        tok = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
        decoding = build_decoding(cfg, world, drafter_dir, tok, log=log)
        bar = tqdm(total=sum(1 + len(r.turns) for r in requests), desc=f"decode ({d.method})", unit="req",
                   file=sys.stderr)
        stats = run_batch_job(requests, output_path, tok, decoding, enable_thinking=cfg.data.enable_thinking,
                              progress=lambda n, s: bar.update(n))
        bar.update(stats["skipped_done"] + stats["rejected"])
        bar.close()
        tps = stats["tokens"] / stats["seconds"] if stats["seconds"] else 0.0
        tr.log_metrics({"decode/tau": stats["tau"], "decode/tokens_per_s": tps, "decode/requests": stats["requests"]})
        return stats


def _decode_on_ray(cfg: RunConfig, world, requests, output_path: Path, drafter_dir: Path | None):
    """``decode.runner=ray``: the same job on a pool of Ray Data actors (:mod:`specdraft.runtime.ray_job`), each
    decoding as the local job does (:func:`~specdraft.pipeline.decoding.build_decoding`)."""
    from specdraft.runtime.ray_job import ActorSpec, run_ray_job  # noqa: PLC0415 (Ray is an optional extra)

    d = cfg.decode
    with tracked(cfg, "decode") as tr:
        tok = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
        here = dataclasses.replace(cfg, work_dir=str(cfg.work_path.resolve()))  # a worker's directory may differ
        build = functools.partial(worker_decoding, here, world, str(drafter_dir.resolve()) if drafter_dir else None)
        spec = ActorSpec(build, cfg.target.device, d.seed, with_verified=d.policy == "adaptive")
        bar = tqdm(total=sum(1 + len(r.turns) for r in requests), desc=f"decode ({d.method}, ray)", unit="req",
                   file=sys.stderr)
        stats = run_ray_job(requests, output_path, tok, spec, d.ray_actors, 4 * d.batch_size, d.max_new_tokens,
                            read_target_args(world.target_dir).max_position_embeddings, cfg.data.enable_thinking,
                            d.ray_address, progress=lambda n, s: bar.update(n))
        bar.update(stats["skipped_done"] + stats["rejected"])
        bar.close()
        tps = stats["tokens"] / stats["seconds"] if stats["seconds"] else 0.0
        tr.log_metrics({"decode/tau": stats["tau"], "decode/tokens_per_s": tps, "decode/requests": stats["requests"]})
        return stats


def export(cfg: RunConfig, to: str = "onnx"):
    """Write the drafter's deployment artifacts (``hf``: the training export itself; ``onnx``: both ONNX
    flavours; ``trt``: those and the TensorRT engines) and log them to MLflow. With ``decode.method=d2sd`` (or
    merged) the second drafter is exported too (a tree on an engine backend drafts with both)."""
    world = existing_world(cfg)
    drafters = [default_drafter_dir(cfg)]
    if cfg.decode.method in ("d2sd", "merged") and (second := cfg.second_drafter_dir()) is not None:
        drafters.append(second)
    for drafter_dir in drafters:  # every drafter checked before any export
        if not (drafter_dir / "config.json").is_file():
            raise SpecdraftError(f"no drafter in {drafter_dir}: train one (specdraft train CONFIG) or set "
                                 f"{'decode.drafter' if drafter_dir == drafters[0] else 'decode.second_drafter'}")
        check_made_for(drafter_dir, world.target_dir, cfg.decode.allow_other_target, log)
    written = []
    for drafter_dir in drafters:  # a run each: its artifacts, metrics and registered version apart
        with tracked(cfg, "export") as tr:
            written.append(run_export(cfg, world, drafter_dir, to, tr, log))
    return written[0]


def bench(cfg: RunConfig, world=None):
    note = load_note(os.getloadavg()[0], machine_cores()) if hasattr(os, "getloadavg") else None
    if note:
        log(f"bench: warning: {note}")
    with tracked(cfg, "bench") as tr:
        world = world or existing_world(cfg)
        return run_bench(cfg, world, tr, log)


def run(cfg: RunConfig):
    """The main job: target -> data -> train -> bench, one parent MLflow run with a child per stage."""
    tracker = make_tracker(cfg.tracking)
    with tracker.run(f"{cfg.name}-run", tags={"stage": "run"}):
        _ACTIVE.append(tracker)
        try:
            world = target(cfg)
            data(cfg, world)
            train(cfg, world)
            return bench(cfg, world)
        finally:
            _ACTIVE.pop()
