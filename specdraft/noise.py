"""Known third-party chatter a user reads past, dropped where it is logged; every other record passes.

- torch's ONNX exporter: "torchvision is not installed. Skipping torchvision::nms" (and three more ops) each time
  its registry is built, though nothing here uses torchvision;
- MLflow's "Creating initial MLflow database tables..." and alembic's migration notes on a new sqlite store.
"""

from __future__ import annotations

import logging


class DropMessages(logging.Filter):
    """Drops a logger's records whose message contains one of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


_installed: set[str] = set()


def drop(logger: str, *fragments: str) -> None:
    """Drop ``logger``'s records containing any of ``fragments`` (once per logger)."""
    if logger not in _installed:
        logging.getLogger(logger).addFilter(DropMessages(*fragments))
        _installed.add(logger)


def quiet_onnx_export() -> None:
    drop("torch.onnx._internal.exporter._registration", "torchvision is not installed")


def quiet_mlflow_store() -> None:
    drop("mlflow.store.db.utils", "Creating initial MLflow database tables")
    for name in ("alembic.runtime.migration", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
