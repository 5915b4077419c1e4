"""What the scripts under ``benchmarks/`` share: a timer (warm-up, then the median of repeats), a JSON report, a
suite job loaded from a world, and the ReTrace fusion's cost per round."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.runtime.phase_clock import wall_seconds


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued kernels (nothing on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device | str = "cpu", repeats: int = 5, warmup: int = 1) -> float:
    """The median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones; on CUDA each call is
    timed by CUDA events (the device's own time, launch queue included)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        return statistics.median(wall_seconds(fn, device) for _ in range(repeats))
    sync(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def write_report(report: dict, path: str | Path | None = None, echo: bool = True) -> dict:
    """Print ``report`` as indented JSON (``echo``) and write it to ``path`` (when given, its folder made)."""
    text = json.dumps(report, indent=2)
    if echo:
        print(text, flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    return report


@dataclass
class SuiteJob:
    """A held-out suite's decode job: the models, the encoded prompts, the generation config and, when a policy file
    was given, the adaptive policy it holds for the job's sampling."""

    target: object
    drafter: object
    prompts: list[list[int]]
    gen: object
    policy: object | None


def load_job(world: str | Path, drafter: str | Path, suite: str, num_prompts: int, max_new_tokens: int,
             spread: float = 1.0, temperature: float = 0.0, policy: str | Path | None = None) -> SuiteJob:
    """The first ``num_prompts`` prompts of ``<world>/bench/<suite>.jsonl`` with their length caps (spread
    ``spread``-fold, as the bench draws them), the world's target and ``drafter``, and the adaptive policy a bench or
    decode run cached in ``policy`` (``<work_dir>/policy/<key>.json``)."""
    # deferred: the runtime's models and the tokenizer are what a script's --help should not wait for
    from transformers import AutoTokenizer  # noqa: PLC0415

    from specdraft.errors import SpecdraftError  # noqa: PLC0415
    from specdraft.pipeline.bench import length_caps  # noqa: PLC0415
    from specdraft.pipeline.policy import sampling_key  # noqa: PLC0415
    from specdraft.pipeline.tokenizer import stop_token_ids  # noqa: PLC0415
    from specdraft.runtime.batch_job import encode_requests, read_requests  # noqa: PLC0415
    from specdraft.runtime.calibration import Calibration  # noqa: PLC0415
    from specdraft.runtime.cost_model import CostModel  # noqa: PLC0415
    from specdraft.runtime.decode import GenerationConfig  # noqa: PLC0415
    from specdraft.runtime.drafter_io import load_drafter  # noqa: PLC0415
    from specdraft.runtime.load import load_target  # noqa: PLC0415
    from specdraft.runtime.policy import AdaptivePolicy  # noqa: PLC0415
    from specdraft.runtime.sampling import SamplingParams  # noqa: PLC0415

    target = load_target(f"{world}/target")
    tok = AutoTokenizer.from_pretrained(f"{world}/target")
    reqs = read_requests(f"{world}/bench/{suite}.jsonl", print)[:num_prompts]
    prompts = [ids for _, ids in encode_requests(reqs, tok, None, warn=print)]
    gen = GenerationConfig(max_new_tokens=length_caps(len(prompts), max_new_tokens, spread, 0),
                           stop_token_ids=stop_token_ids(tok), sampling=SamplingParams(temperature))
    adaptive, loaded = None, load_drafter(drafter, target)
    if policy:
        saved = json.loads(Path(policy).read_text())
        calibrations = saved.get("calibrations", {"greedy": saved.get("calibration", {})})
        name = sampling_key(gen.sampling)
        if name not in calibrations:
            raise SpecdraftError(f"{policy} holds no calibration for {name} (a bench or decode run at it adds one)")
        adaptive = AdaptivePolicy(CostModel.from_dict(saved["costs"]).up_to(loaded.block_size),
                                  Calibration(**calibrations[name]))
    return SuiteJob(target, loaded, prompts, gen, adaptive)


@dataclass
class ConfigModels:
    """What a run config decodes with: its world (held-out suites included), target, tokenizer and drafter."""

    world: object
    target: object
    tokenizer: object
    drafter: object


def config_models(cfg) -> ConfigModels:
    """The world ``cfg`` points at (nothing built), its target on ``target.device`` in ``target.dtype``, its
    tokenizer and the drafter ``decode.drafter`` names (default the training export's)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from specdraft.pipeline.bench import with_bench_prompts  # noqa: PLC0415
    from specdraft.pipeline.stages import existing_world  # noqa: PLC0415
    from specdraft.runtime.drafter_io import load_drafter  # noqa: PLC0415
    from specdraft.runtime.load import load_target  # noqa: PLC0415

    world = with_bench_prompts(cfg, existing_world(cfg))
    target = load_target(world.target_dir, dtype=cfg.target.dtype, device=cfg.target.device)
    tokenizer = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
    drafter = load_drafter(cfg.decode.drafter or cfg.drafter_dir(cfg.train.export), target)
    return ConfigModels(world, target, tokenizer, drafter)


@dataclass
class Tally:
    """Decode results summed over batches: tokens, verify rounds, tokens those rounds emitted, plain rounds (an
    adaptive policy's), wall seconds, and each request's tokens and accept lengths."""

    tokens: int = 0
    rounds: int = 0
    emitted: int = 0
    plain: int = 0
    seconds: float = 0.0
    rows: list = field(default_factory=list)

    def add(self, results, seconds: float) -> None:
        self.seconds += seconds
        self.tokens += sum(len(r.tokens) for r in results)
        self.rounds += sum(len(r.accept_lengths) for r in results)
        self.emitted += sum(sum(r.accept_lengths) for r in results)
        self.plain += sum(v == 0 for r in results for v in r.verified)
        self.rows += [(r.tokens, r.accept_lengths) for r in results]

    @property
    def tau(self) -> float:
        return self.emitted / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def suite_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every benchmark over a config's held-out suites takes (``key=value`` overrides of the config
    follow them): the config, prompts per suite, suites, temperatures, batch size, new tokens, seed and ``--out``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("config")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per suite")
    ap.add_argument("--suites", default="math,code,dialogue")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    return ap


def held_out_suites(cfg, job: ConfigModels, suites: str, prompts: int) -> dict[str, list[list[int]]]:
    """The first ``prompts`` held-out prompts of each of the comma-separated ``suites``, encoded for the target."""
    from specdraft.pipeline.bench import suite_prompts  # noqa: PLC0415

    return {suite: suite_prompts(job.world, suite, prompts, job.tokenizer, cfg.data.enable_thinking,
                                 job.target.args.max_position_embeddings) for suite in suites.split(",")}


def fusion_overhead_ms(drafter, retrace, target, bs: int, mask_token_id: int, n_steps: int = 100,
                       n_pairs: int = 15, accepted: int = 2) -> list[float]:
    """Per-round extra cost of ReTrace over its DFlash backbone (ms), one value per interleaved pair.

    Both run ingest + next_round_state + block_embeds on a round's tensors with ``accepted`` drafts accepted; only
    ReTrace fuses all verified rows' features, retains the rejected suffix and fuses it into the next block.
    """
    dev = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    Bk, V = retrace.block_size, target.args.vocab_size
    hid = torch.randn(bs, Bk, target.args.hidden_size, device=dev, dtype=dtype)  # [B, Bk, D]
    drafts = torch.randint(0, V, (bs, Bk - 1), device=dev)  # [B, Bk-1]
    n_acc = torch.full((bs,), accepted, device=dev)  # [B]
    t_logits = torch.randn(bs, Bk, V, device=dev, dtype=dtype)  # [B, Bk, V]
    t_feats = torch.randn(bs, Bk, retrace.fc.in_features, device=dev, dtype=dtype)  # [B, Bk, F*D]
    blk = torch.full((bs, Bk), mask_token_id, device=dev)  # [B, Bk]
    caches = {id(m): m.new_cache(bs, 64) for m in (drafter, retrace)}
    zero = torch.zeros(bs, dtype=torch.long, device=dev)  # [B]

    def steps(model):
        def run():
            with torch.inference_mode():
                cache = caches[id(model)]
                fused = model.ingest(cache, t_feats, n_acc + 1)
                cache.crop(zero)
                model.block_embeds(blk, model.next_round_state(None, hid, drafts, n_acc, t_logits, fused))
        return run

    def timed(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n_steps):
            fn()
        sync(dev)
        return (time.perf_counter() - t0) / n_steps

    dflash_steps, retrace_steps = steps(drafter), steps(retrace)
    for _ in range(20):  # warm both paths (allocator, caches) before timing
        retrace_steps(), dflash_steps()
    return [1000 * (timed(retrace_steps) - timed(dflash_steps)) for _ in range(n_pairs)]
