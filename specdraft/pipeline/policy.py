"""``decode.policy=adaptive``: the speculation policy's costs for this machine and these models, and its calibration
for each sampling setting a job decodes with, measured once and cached under ``<work_dir>/policy/`` (keyed by device,
threads, dtype, torch, the target and the drafter), then reused by ``decode`` and ``bench``. A measured node budget
(``decode.tree_budget=measured``) prices its trees from the same costs (:func:`machine_costs`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from specdraft.runtime.batch_job import encode_requests, read_requests
from specdraft.runtime.calibration import Calibration
from specdraft.runtime.cost_model import CostModel, extend_costs, measure_costs
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.rounds import draft_confidence
from specdraft.runtime.sampling import SamplingParams, logits_to_probs

CALIBRATION_PROMPTS = 16


def _key(target, drafter, drafter_dir: str | Path | None) -> dict:
    dev = target.lm_head.weight.device
    weights = Path(drafter_dir) / "model.safetensors" if drafter_dir else None
    return {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "dtype": str(target.lm_head.weight.dtype), "torch": torch.__version__,
            "target": json.dumps(vars(target.args), sort_keys=True, default=str),
            "drafter": hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights and weights.is_file() else "",
            **({} if isinstance(target, TargetLM) else _engine_key(target))}


def _engine_key(target) -> dict:
    """What tells an engine's costs apart: the backend, the export's graphs and dtype, and ONNX Runtime's providers
    (an export run by the CPU provider and by the CUDA provider are two machines)."""
    m = getattr(target, "manifest", None) or {}
    verify = getattr(target, "verify", None)
    providers = getattr(getattr(verify, "session", None), "get_providers", lambda: [])()
    return {"backend": type(target).__name__, "export": json.dumps(m.get("graphs", {}), sort_keys=True),
            "export_dtype": m.get("dtype", ""), "providers": list(providers)}


def calibrate(target, drafter, prompts: list[list[int]], stop_token_ids=(), max_new_tokens: int = 64,
              sampling: SamplingParams | None = None, draft_sampling: str = "sample", seed: int = 0) -> Calibration:
    """Fit the confidence -> acceptance map on rounds of ``prompts`` decoded with the whole block under ``sampling``
    (default greedy) and ``draft_sampling``, the confidences taken as the engine takes them (its probability of its
    draft under the distribution the draft was drawn from): how often a draft is accepted depends on the sampling
    (greedy verification accepts the target's argmax, speculative sampling ``min(1, p / q)``), so a job is priced on
    rounds decoded as it decodes."""
    sampling = sampling or SamplingParams()
    sampled = not sampling.greedy and draft_sampling != "greedy"
    conf, acc = [], []

    def observe(rec):
        q = logits_to_probs(rec.draft_logits, sampling) if sampled else None
        conf.append(draft_confidence(rec.draft_logits, rec.draft_tokens, q).cpu())
        acc.append(rec.num_accepted.cpu())

    g = torch.Generator(device=target.lm_head.weight.device).manual_seed(seed)
    for i in range(0, len(prompts), 8):
        generate(target, prompts[i:i + 8], GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling,
                                                            stop_token_ids=tuple(stop_token_ids),
                                                            draft_sampling=draft_sampling),
                 drafter=drafter, observer=observe, generator=g)
    return Calibration.fit(torch.cat(conf), torch.cat(acc)) if conf else Calibration()


def sampling_key(sampling: SamplingParams, draft_sampling: str = "sample") -> str:
    """The name a calibration is cached under: ``greedy``, or the sampling settings and how drafts are drawn."""
    if sampling.greedy:
        return "greedy"
    return f"T={sampling.temperature:g},top_k={sampling.top_k},top_p={sampling.top_p:g},drafts={draft_sampling}"


def _cached(work_dir: Path, target, drafter, drafter_dir, log) -> tuple[Path, dict]:
    """The cache file of ``target`` and ``drafter`` on this machine and what it holds (only the key where it is
    missing, or unreadable: then measured again)."""
    key = _key(target, drafter, drafter_dir)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = work_dir / "policy" / f"{name}.json"
    if path.is_file():
        try:
            return path, json.loads(path.read_text())
        except ValueError:
            log(f"policy: {path} is not a readable cache; measuring again")
    return path, {"key": key}


def _costs(saved: dict, path: Path, target, drafter, batch_sizes, tokens, log) -> tuple[CostModel, bool]:
    """The cached costs in ``saved`` holding ``batch_sizes`` (and one row) and target passes of ``tokens`` new tokens
    (what is missing measured first, and put into ``saved``), and whether ``saved`` changed."""
    rows = sorted({1, *batch_sizes})
    changed = "context" not in saved.get("costs", {})
    if not changed:
        costs = CostModel.from_dict(saved["costs"])
    else:  # none yet, or measured at one context before costs were priced by the context
        log(f"policy: measuring target and drafter costs for {rows} rows on this machine (cached in {path})")
        costs = measure_costs(target, drafter, rows=rows)
    more_rows, more_tokens = sorted(set(rows) - set(costs.rows)), sorted(set(tokens) - set(costs.tokens))
    if more_rows or more_tokens:
        what = [f"{more_rows} rows"] * bool(more_rows) + [f"passes of {more_tokens} new tokens"] * bool(more_tokens)
        log(f"policy: measuring {' and '.join(what)} on this machine (cached in {path})")
        costs, changed = extend_costs(costs, target, drafter, more_rows, more_tokens), True
    if changed:
        saved["costs"] = asdict(costs)
    return costs, changed


def _write(path: Path, saved: dict) -> None:
    """Whole files only: Ray actors of one job may measure and write at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(saved))
    os.replace(tmp, path)


def machine_costs(work_dir: Path, target, drafter, drafter_dir, batch_sizes=(1, 8, 32, 64), tokens=(),
                  log=print) -> CostModel:
    """This machine's :class:`CostModel` for ``target`` and ``drafter`` from the cache the adaptive policy keeps,
    holding ``batch_sizes`` and target passes of ``tokens`` new tokens (a node budget's choices); what is missing is
    measured once and added to the cache."""
    path, saved = _cached(work_dir, target, drafter, drafter_dir, log)
    costs, changed = _costs(saved, path, target, drafter, batch_sizes, tokens, log)
    if changed:
        _write(path, saved)
    return costs


def adaptive_policy(work_dir: Path, target, drafter, drafter_dir, calibration_prompts: list[list[int]],
                    stop_token_ids=(), batch_sizes=(1, 8, 32, 64), log=print, sampling: SamplingParams | None = None,
                    draft_sampling: str = "sample") -> AdaptivePolicy:
    """A fresh :class:`AdaptivePolicy` from the cached costs (holding ``batch_sizes``) and the calibration for
    ``sampling`` (default greedy) and ``draft_sampling`` (each measured first when missing, and added to the cache)."""
    sampling = sampling or SamplingParams()
    path, saved = _cached(work_dir, target, drafter, drafter_dir, log)
    costs, changed = _costs(saved, path, target, drafter, batch_sizes, (), log)
    calibrations = saved.setdefault("calibrations", {})
    if "calibration" in saved:  # a cache written before calibrations were kept per sampling: its one is greedy's
        calibrations.setdefault("greedy", saved.pop("calibration"))
    name = sampling_key(sampling, draft_sampling)
    if name in calibrations:
        calibration = Calibration(**calibrations[name])
    else:
        changed = True
        prompts = calibration_prompts[:CALIBRATION_PROMPTS]
        if prompts:
            log(f"policy: calibrating drafter confidences on {len(prompts)} held-in prompts ({name})")
            calibration = calibrate(target, drafter, prompts, stop_token_ids, sampling=sampling,
                                    draft_sampling=draft_sampling)
        else:
            calibration = Calibration()
            log("policy: no held-in prompts to calibrate on; drafter confidences are used as acceptance probabilities")
        calibrations[name] = asdict(calibration)
    if changed:
        _write(path, saved)
    return AdaptivePolicy(costs.up_to(drafter.block_size), calibration)


def heldin_prompts(world, tokenizer, enable_thinking: bool = False, context: int | None = None) -> list[list[int]]:
    """Token ids of the world's held-in prompts (empty for an external target without them)."""
    if world.heldin_prompts is None or not Path(world.heldin_prompts).is_file():
        return []
    reqs = read_requests(world.heldin_prompts, lambda m: None)[:CALIBRATION_PROMPTS]
    return [ids for _, ids in encode_requests(reqs, tokenizer, context, enable_thinking, warn=lambda m: None)]


def policy_summary(results) -> dict:
    """Bench/stats fields of an adaptive row: drafts verified per round and the share of plain rounds."""
    verified = [v for r in results for v in r.verified]
    rounds = max(len(verified), 1)
    return {"verified_per_round": sum(verified) / rounds, "plain_round_share": sum(v == 0 for v in verified) / rounds}
