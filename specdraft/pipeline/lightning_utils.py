"""Glue between Lightning and our tracker, and the Lightning messages a user should not have to read past."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import torch

from specdraft.pipeline.tracking import Tracker

EVAL_PREFIXES = ("eval/", "val/")

EXPECTED_WARNINGS = (
    r".*`validation_step` but have no `val_dataloader`.*",  # the tiny target trains without a validation loop
    r".*module\(s\) in eval mode.*",  # the frozen target and GRPO reference stay in eval mode on purpose
    r".*Checkpoint directory .* exists and is not empty.*",  # a rerun resumes from it
    r".*resuming from a checkpoint that ended before the epoch ended.*",  # our sampler replays the exact position
    r".*does not have many workers.*",  # the data are in memory; workers would only copy them
    r".*LeafSpec.*is deprecated.*",  # Lightning's own use of a torch API
    r".*weights_only.*",  # our checkpoints hold tensors and plain containers, loaded with weights_only=True
)


def native_bf16() -> bool:
    """Whether this machine computes bf16 matrix products natively: CUDA, or a CPU with AVX-512 BF16 or AMX. On
    other CPUs bf16 is emulated and autocast runs several times slower than fp32."""
    if torch.cuda.is_available():
        return True
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's cpuinfo checks
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def resolve_precision(precision: str) -> str:
    """A Lightning precision; ``auto`` is bf16 autocast where bf16 is native (:func:`native_bf16`), else fp32."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if native_bf16() else "32-true"


def quiet_lightning() -> None:
    """Silence what Lightning says about choices made on purpose (the litlogger tip, the warnings in
    :data:`EXPECTED_WARNINGS`); progress bars, errors and any other warning still show."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


class TrackerCallback(L.Callback):
    """Log Lightning's scalar ``callback_metrics`` to the tracker: training metrics every ``every`` steps and at the
    end, evaluation metrics (``eval/...``, ``val/...``) when an evaluation ends, so each eval point is logged at the
    step it was measured (not repeated at every later training step until the next evaluation)."""

    def __init__(self, tracker: Tracker, prefix: str = "", every: int = 10):
        self.tracker, self.prefix, self.every = tracker, prefix, every

    def _log(self, trainer, evaluation: bool) -> None:
        metrics = {}
        for k, v in trainer.callback_metrics.items():
            if k.startswith(EVAL_PREFIXES) != evaluation:
                continue
            try:
                metrics[self.prefix + k.replace("/", "_") if self.prefix else k] = float(v)
            except (TypeError, ValueError):
                continue
        if metrics:
            self.tracker.log_metrics(metrics, step=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self._log(trainer, evaluation=False)

    def on_validation_end(self, trainer, pl_module):
        self._log(trainer, evaluation=True)

    def on_train_end(self, trainer, pl_module):
        self._log(trainer, evaluation=False)
