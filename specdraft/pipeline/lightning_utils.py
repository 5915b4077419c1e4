"""Glue between Lightning and our tracker."""

from __future__ import annotations

import lightning as L

from specdraft.pipeline.tracking import Tracker

EVAL_PREFIXES = ("eval/", "val/")


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
