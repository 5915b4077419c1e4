"""``specdraft train``: Lightning SFT of a DFlash drafter; checkpoints (-last / -best by eval/sim_tau, or by
eval/sim_tau_sampled for the sampling stages) with full resume; export of the best to the HF-format directory the
runtime loads; MLflow logging and model registration."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import lightning as L
import torch
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.export.hf import export_checkpoint
from specdraft.lit_modules.data import ShareGPTDataModule
from specdraft.lit_modules.drafter_module import DrafterModule
from specdraft.lit_modules.features import OfflineFeatures, build_offline_cache
from specdraft.lit_modules.opd import rollout_share
from specdraft.lit_modules.opd_data import RolloutDataModule, make_rollout_fn
from specdraft.lit_modules.stage_table import STAGES, Objective
from specdraft.pipeline.config import RunConfig, to_flat_dict
from specdraft.pipeline.data import regenerated_temperature
from specdraft.pipeline.lightning_utils import TrackerCallback, quiet_lightning, resolve_precision
from specdraft.pipeline.tokenizer import stop_token_ids
from specdraft.pipeline.tracking import Tracker
from specdraft.runtime.batch_job import encode_requests, read_requests
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import (
    PROVENANCE,
    build_drafter,
    check_compatible,
    convert_drafter,
    drafter_config_for_target,
    load_drafter,
    record_target,
)
from specdraft.runtime.load import load_target, target_fingerprint, weights_fingerprint
from specdraft.runtime.sampling import SamplingParams


class DecodeEvalCallback(L.Callback):
    """After each validation, decode prompts through the runtime and log their acceptance as ``metric`` (committed
    tokens per verify round): ``eval/tau`` on a few held-out prompts; the opd stage's ``eval/opd_tau`` on held-in
    validation prompts at its rollout temperature (a fixed sampling seed, so evaluations compare drafters, not
    draws)."""

    def __init__(self, prompts: list[list[int]], stop_ids: tuple[int, ...], max_new_tokens: int = 64,
                 metric: str = "eval/tau", temperature: float = 0.0, seed: int = 0):
        self.prompts, self.stop_ids, self.max_new_tokens = prompts, stop_ids, max_new_tokens
        self.metric, self.temperature, self.seed = metric, temperature, seed

    def on_validation_epoch_end(self, trainer, pl_module):
        if not self.prompts or trainer.sanity_checking:
            return
        was_training = pl_module.drafter.training
        pl_module.drafter.eval()
        g = torch.Generator(device=pl_module.target.lm_head.weight.device).manual_seed(self.seed)
        res = generate(pl_module.target, self.prompts, GenerationConfig(
            max_new_tokens=self.max_new_tokens, stop_token_ids=self.stop_ids,
            sampling=SamplingParams(self.temperature)), drafter=pl_module.drafter, generator=g)
        pl_module.drafter.train(was_training)
        rounds = [a for r in res for a in r.accept_lengths]
        pl_module.log(self.metric, sum(rounds) / max(len(rounds), 1), prog_bar=True, sync_dist=True)


def warm_start_dir(cfg: RunConfig) -> Path | None:
    """``drafter.init_from``, else the export of ``train.init_stage`` or of the stage table's warm start."""
    if cfg.drafter.init_from:
        return Path(cfg.drafter.init_from)
    prev = cfg.train.init_stage or STAGES[cfg.train.stage].warm_start
    if not prev or prev == "none":
        return None
    d = cfg.drafter_dir(prev)
    if not (d / "config.json").is_file():
        raise SpecdraftError(f"config key 'train.init_stage': stage {cfg.train.stage!r} warm-starts from the "
                             f"{prev!r} drafter, but {d} does not exist; train that stage first or set "
                             "drafter.init_from")
    return d


def _check_init_conflicts(cfg: RunConfig, init: Path, made) -> None:
    """A warm start keeps its own shape: refuse a ``drafter.*`` key the config sets to another value than the
    drafter in ``init`` has (it would be ignored silently)."""
    dc = cfg.drafter
    given = {"block_size": (dc.block_size, made.block_size), "num_layers": (dc.num_layers, made.num_hidden_layers),
             "mask_token_id": (dc.mask_token_id, made.mask_token_id),
             "target_layer_ids": (list(dc.target_layer_ids), list(made.target_layer_ids)),
             "num_features": (dc.num_features, len(made.target_layer_ids))}
    for key, (want, has) in given.items():
        if f"drafter.{key}" in cfg.explicit and want != has and not (key == "mask_token_id" and want < 0):
            raise SpecdraftError(f"config key 'drafter.{key}': the config sets {want}, but the warm start in {init} "
                                 f"has {has} (a warm start keeps its shape): drop the key, or train from scratch")


def _build_drafter(cfg: RunConfig, target, tokenizer):
    dc = cfg.drafter
    arch = STAGES[cfg.train.stage].arch
    init = warm_start_dir(cfg)
    if init is not None:
        drafter = load_drafter(init, target)
        _check_init_conflicts(cfg, init, drafter.config)
        if arch is not None and drafter.arch_name != arch:  # e.g. a DFlash backbone grows a zero-init fusion
            drafter = convert_drafter(drafter, arch, dc.options_for(arch))
        return drafter.train().requires_grad_(True)
    mask_id = dc.mask_token_id if dc.mask_token_id >= 0 else tokenizer.mask_token_id
    if mask_id is None:
        raise SpecdraftError("config key 'drafter.mask_token_id': the tokenizer has no mask token; set one")
    dcfg = drafter_config_for_target(target.args, int(mask_id), dc.num_layers, dc.block_size,
                                     dc.target_layer_ids or None, dc.num_features or None)
    check_compatible(dcfg, target.args)
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(dcfg, arch or dc.arch, dc.options_for(arch or dc.arch))
    return drafter.to(target.lm_head.weight.device)


def train_drafter(cfg: RunConfig, world, data_file: Path, tracker: Tracker, log=print,
                  callbacks: list[L.Callback] | None = None) -> Path:
    """Train, checkpoint (resuming from ``<work_dir>/checkpoints/<export>/drafter-last.ckpt`` when present), export the
    best checkpoint to ``<work_dir>/drafter/<export>`` and register it (``<export>`` = ``train.export_name`` or the
    stage). ``callbacks`` are added to the Lightning trainer."""
    t = cfg.train
    objective = t  # TrainConfig extends Objective: the stage's options are train's own fields
    if t.features == "offline" and objective.online_reason:
        why = f" (kl_weight={t.kl_weight})" if objective.needs_target_logits else ""
        raise SpecdraftError(f"config key 'train.features': stage {t.stage!r}{why} {objective.online_reason}; use "
                             "train.features=online")
    if t.strategy.startswith("fsdp") and not torch.cuda.is_available():
        raise SpecdraftError(f"config key 'train.strategy': {t.strategy!r} needs CUDA GPUs (Lightning's FSDP runs on "
                             "GPUs only); on CPUs use train.strategy=ddp")
    data_temperature = regenerated_temperature(data_file)
    note = data_temperature_note(objective, data_temperature)
    if note:
        log(f"train: warning: {note}")
    L.seed_everything(t.seed, workers=True, verbose=False)
    target = load_target(world.target_dir, dtype="float32", device=cfg.target.device)
    tokenizer = AutoTokenizer.from_pretrained(str(world.target_dir), trust_remote_code=False)
    drafter = _build_drafter(cfg, target, tokenizer)
    init = warm_start_dir(cfg)
    tags = {"stage": t.stage, "export_name": t.export, "warm_start": str(init or "")}
    if data_temperature is not None:
        tags["data_temperature"] = f"{data_temperature:g}"
    if init is not None and (init / PROVENANCE).is_file():
        tags["warm_start_run_id"] = json.loads((init / PROVENANCE).read_text()).get("run_id", "")
    tracker.set_tags(tags)
    opd = t.stage == "opd"
    if opd and t.opd.buffer_prompts > t.opd.refresh_every * t.batch_size * t.accumulate_grad_batches > 0:
        raise SpecdraftError(f"config key 'train.opd.buffer_prompts': {t.opd.buffer_prompts} prompts per refresh, but "
                             f"the {t.opd.refresh_every} steps between refreshes replay only "
                             f"{t.opd.refresh_every * t.batch_size * t.accumulate_grad_batches}")
    if opd and drafter.arch_name != "dflash":
        raise SpecdraftError(f"config key 'train.stage': opd replays DFlash blocks; the warm start is a "
                             f"{drafter.arch_name!r} drafter (set drafter.init_from to a dflash export)")
    data_args = (str(data_file), tokenizer, t.batch_size, t.max_seq_len, drafter.block_size, t.seed)
    dm = (RolloutDataModule(*data_args, opd=t.opd, total_steps=0, accumulate=t.accumulate_grad_batches,
                            max_rounds=t.num_anchors, enable_thinking=cfg.data.enable_thinking) if opd else
          ShareGPTDataModule(*data_args, enable_thinking=cfg.data.enable_thinking))
    dm.setup()
    log(f"train: {len(dm.train_items)} train / {len(dm.val_items)} val conversations "
        f"({dm.dropped} dropped: < {2 * drafter.block_size} supervised tokens)"
        + (f"; {len(dm.prompts)} rollout prompts ({dm.too_long} longer than train.max_seq_len leaves room for "
           f"train.opd.max_new_tokens)" if opd else ""))
    ranks = (int(t.devices) if t.devices != "auto" else max(1, torch.cuda.device_count())) * t.num_nodes
    steps_per_epoch = max(1, len(dm.train_items) // (t.batch_size * ranks) // t.accumulate_grad_batches)
    total = t.max_steps if t.max_steps > 0 else steps_per_epoch * t.epochs

    offline = None
    if t.features == "offline":
        cache = build_offline_cache(target, world.target_dir, {"train": dm.train_items, "val": dm.val_items},
                                    drafter.target_layer_ids, cfg.work_path / "features")
        offline = OfflineFeatures(cache)
    module = DrafterModule(drafter, target, t.lr, t.warmup_ratio, total, t.num_anchors, objective, t.weight_decay,
                           offline, t.seed)

    eval_prompts = []
    if world.bench_dir is not None and (world.bench_dir / "math.jsonl").is_file():
        reqs = read_requests(world.bench_dir / "math.jsonl", lambda m: None)[: t.eval_prompts]
        eval_prompts = [ids for _, ids in encode_requests(reqs, tokenizer, target.args.max_position_embeddings,
                                                          cfg.data.enable_thinking, warn=lambda m: None)]
    stop_ids = stop_token_ids(tokenizer)
    evals = [DecodeEvalCallback(eval_prompts, stop_ids)]
    if opd:  # serving-style acceptance on held-in prompts at the rollout temperature picks the export
        dm.total_steps = total
        evals.append(DecodeEvalCallback(dm.eval_prompts(), stop_ids, t.opd.max_new_tokens, "eval/opd_tau",
                                        t.opd.rollout_temperature, t.seed))
    ckpt_dir = cfg.checkpoint_dir(t.export)
    best_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="drafter-best",
                                                  monitor=objective.selection_metric, mode="max", save_last=False,
                                                  save_top_k=1,
                                                  enable_version_counter=False)
    last_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, filename="drafter-last", every_n_train_steps=
                                                  max(1, min(t.eval_every, 50)), save_top_k=1,
                                                  enable_version_counter=False)
    precision = resolve_precision(t.precision)
    quiet_lightning()
    trainer = L.Trainer(
        max_steps=total, max_epochs=-1 if t.max_steps > 0 else t.epochs,
        max_time={"minutes": t.max_minutes} if t.max_minutes else None,
        accelerator="auto", devices=t.devices if t.devices == "auto" else int(t.devices),
        num_nodes=t.num_nodes, strategy=t.strategy, precision=precision, gradient_clip_val=t.grad_clip,
        # every eval_every optimizer steps counted across epochs (an epoch shorter than eval_every must not hide
        # the evaluations, and so the best checkpoint, of the steps after its end)
        accumulate_grad_batches=t.accumulate_grad_batches, val_check_interval=t.eval_every * t.accumulate_grad_batches,
        check_val_every_n_epoch=None, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the length-grouped sampler shards global batches over the ranks itself
        callbacks=[best_cb, last_cb, *evals,
                   TrackerCallback(tracker, every=t.log_every),
                   L.pytorch.callbacks.TQDMProgressBar(refresh_rate=10), *(callbacks or [])],
        log_every_n_steps=t.log_every)
    # the data stream is a function of the optimizer step alone, so resuming (even mid-epoch) replays nothing
    dm.position_fn = lambda per_epoch: divmod(trainer.global_step * t.accumulate_grad_batches, per_epoch)
    if opd:
        dm.attach(make_rollout_fn(module, t.opd, stop_ids, t.seed),
                  lambda: trainer.global_step * t.accumulate_grad_batches)
    resume = ckpt_dir / "drafter-last.ckpt"
    if t.restart and ckpt_dir.is_dir():
        shutil.rmtree(ckpt_dir)
        log(f"train: train.restart: deleted {ckpt_dir}; starting over")
    check_resumable(ckpt_dir, {"target": target_fingerprint(world.target_dir),
                               "data": hashlib.sha256(Path(data_file).read_bytes()).hexdigest()[:16]},
                    training_settings(cfg))
    start_step = resumed_step(resume)
    plan = "train.max_steps" if t.max_steps > 0 else f"{t.epochs} epochs of {steps_per_epoch} steps"
    if start_step is None:
        log(f"train: {total} steps ({plan})")
    elif start_step >= total:
        log(f"train: {resume} is at step {start_step} of {total} ({plan}): nothing left to train")
    else:
        log(f"train: resuming from step {start_step} of {total} ({plan}) from {resume}")
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=str(resume) if resume.is_file() else None, weights_only=True)
    # full state, so a rerun resumes (and finds nothing left to do)
    trainer.save_checkpoint(str(resume), weights_only=False)
    train_s = time.perf_counter() - t0
    trainer.validate(module, datamodule=dm, verbose=False, weights_only=True)  # final numbers (every rank takes part)
    best, best_score = _best_including_final(trainer, best_cb, ckpt_dir, objective.selection_metric)  # collective
    if trainer.global_rank != 0:  # one export, one run, one registered version: the first process's
        return cfg.drafter_dir(t.export)

    before = _weights_digest(cfg.drafter_dir(t.export))
    out = export_checkpoint(best, drafter, cfg.drafter_dir(t.export))
    record_target(out, world.target_dir, stage=t.stage, export_name=t.export, run_id=tracker.run_id,
                  sim_tau=best_score, selected_by=objective.selection_metric, warm_start=str(init or ""))
    export_checkpoint(resume, drafter, cfg.drafter_dir(t.export + "-last"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval/")}
    tps = module._tokens_seen / train_s if train_s > 0 else 0.0
    tracker.log_metrics({"train/wall_s": train_s, "train/final_tokens_per_s": tps,
                         **{f"final/{k.replace('/', '_')}": v for k, v in metrics.items()}})
    tracker.log_artifact(out, "drafter")
    unchanged = before is not None and before == _weights_digest(out)
    version = None if unchanged else tracker.register_model(
        "drafter", f"{cfg.name}-{drafter.arch_name}",
        tags={"target": str(world.target_dir), "target_fingerprint": weights_fingerprint(world.target_dir),
              "export_name": t.export, "stage": t.stage, "sim_tau": round(best_score, 3),
              "selected_by": objective.selection_metric})
    share = rollout_share(module)
    ran = trainer.global_step - (start_step or 0)
    log(f"train: {ran} steps" + (f" (to step {trainer.global_step})" if start_step else "")
        + (f" in {train_s:.0f}s ({tps:.0f} tokens/s)" if ran else "") + f"; best "
        f"{objective.selection_metric} {best_score:.2f}; exported {out}"
        + (f"; registered model version {version}" if version else "")
        + ("; its weights are unchanged, so no new model version" if unchanged else "")
        + (f"; rollouts took {share:.0%} of the training time" if share is not None else ""))
    return out


RESUMABLE_CHANGES = {"train.max_steps", "train.epochs", "train.max_minutes", "train.eval_every", "train.log_every",
                     "train.eval_prompts", "train.restart"}
"""Keys a resume may change: how long to train, and how often to evaluate and log."""


def training_settings(cfg: RunConfig) -> dict:
    """The ``train.*`` and ``drafter.*`` settings a resume must keep (all but :data:`RESUMABLE_CHANGES`)."""
    return {k: v for k, v in to_flat_dict(cfg).items()
            if k.split(".")[0] in ("train", "drafter") and k not in RESUMABLE_CHANGES}


def check_resumable(ckpt_dir: Path, trained_on: dict, settings: dict | None = None) -> None:
    """Record what the checkpoints in ``ckpt_dir`` train on and with; refuse to resume checkpoints trained on another
    target or other data (a rerun after the world or the data changed would otherwise export the old drafter), or
    with other settings (naming each key; ``train.restart=true`` starts over)."""
    record = ckpt_dir / "trained_on.json"
    settings = json.loads(json.dumps(settings or {}))
    if (ckpt_dir / "drafter-last.ckpt").is_file():
        old = json.loads(record.read_text()) if record.is_file() else None
        if old is None or {k: old.get(k) for k in trained_on} != trained_on:
            raise SpecdraftError(f"{ckpt_dir} holds checkpoints trained on another target or other data (or not "
                                 "recorded); delete it to train afresh, or set train.export_name to train elsewhere")
        was = old.get("settings")
        changed = sorted(k for k in (was or {}).keys() | settings.keys() if (was or {}).get(k) != settings.get(k))
        if was is not None and changed:
            raise SpecdraftError(f"{ckpt_dir} holds checkpoints trained with other settings ("
                                 + "; ".join(f"{k}: {was.get(k)!r} then, {settings.get(k)!r} now" for k in changed)
                                 + "): set them back to resume, or train.restart=true to start over")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({**trained_on, "settings": settings}))


def resumed_step(checkpoint: Path) -> int | None:
    """The optimizer step a Lightning checkpoint was saved at (None: no checkpoint); tensors are mapped, not read."""
    if not checkpoint.is_file():
        return None
    try:
        return int(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True).get("global_step", 0))
    except Exception as e:  # a truncated or foreign file: name it (Lightning would fail on it the same way)
        raise SpecdraftError(f"cannot read the checkpoint {checkpoint} ({type(e).__name__}): delete it, or "
                             "train.restart=true to start over") from None


def _weights_digest(drafter_dir: Path) -> str | None:
    f = drafter_dir / "model.safetensors"
    return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None


def data_temperature_note(objective: Objective, data_temperature: float | None) -> str | None:
    """A warning when a stage trained for speculative sampling trains on responses regenerated at another
    temperature than it serves at: the drafter learns on the contexts the data holds, while sampled serving continues
    sampled text (docs/experiments/2026-11-30-training-losses.md, "Sampling losses need sampled data")."""
    if data_temperature is None or not objective.trains_for_sampling:
        return None
    T = objective.temperature
    if data_temperature == T:
        return None
    return (f"stage {objective.stage!r} trains for speculative sampling at T={T:g}, but its responses were "
            f"regenerated at data.temperature={data_temperature:g}; regenerate them at T={T:g} in another work_dir "
            f"(specdraft data CONFIG data.temperature={T:g} work_dir=...) so training sees the text serving will")


def _best_including_final(trainer, best_cb, ckpt_dir: Path, metric: str = "eval/sim_tau") -> tuple[Path, float]:
    """The checkpoint to export: the best evaluated one, or the final weights when they score at least as well
    (the last steps may end between two evaluations). Returns ``(path, its score on metric)``."""
    final = trainer.callback_metrics.get(metric)
    final = float(final) if final is not None else float("nan")
    score = float(best_cb.best_model_score) if best_cb.best_model_score is not None else float("nan")
    if best_cb.best_model_path and not final >= score:  # (a NaN final never wins)
        return Path(best_cb.best_model_path), score
    best = ckpt_dir / "drafter-best.ckpt"
    trainer.save_checkpoint(str(best), weights_only=False)  # said, or Lightning logs that it defaulted to it
    return best, final
