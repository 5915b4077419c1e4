"""Glue between Lightning and our tracker."""

from __future__ import annotations

import lightning as L

from specdraft.pipeline.tracking import Tracker


class TrackerCallback(L.Callback):
    """Log every scalar Lightning has in ``callback_metrics`` to the tracker every ``every`` steps."""

    def __init__(self, tracker: Tracker, prefix: str = "", every: int = 10):
        self.tracker, self.prefix, self.every = tracker, prefix, every

    def _log(self, trainer) -> None:
        metrics = {}
        for k, v in trainer.callback_metrics.items():
            try:
                metrics[self.prefix + k.replace("/", "_") if self.prefix else k] = float(v)
            except (TypeError, ValueError):
                continue
        if metrics:
            self.tracker.log_metrics(metrics, step=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self._log(trainer)

    def on_validation_end(self, trainer, pl_module):
        self._log(trainer)

    def on_train_end(self, trainer, pl_module):
        self._log(trainer)
