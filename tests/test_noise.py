"""Known third-party chatter is dropped where it is logged; every other record of the same loggers still shows."""

import logging

import pytest

from specdraft.export.onnx import export_onnx
from specdraft.noise import quiet_mlflow_store, quiet_onnx_export
from tests.helpers import make_drafter, make_target


@pytest.mark.integration
def test_the_exporters_torchvision_lines_are_dropped_and_its_other_warnings_kept(caplog, tmp_path):
    quiet_onnx_export()
    name = "torch.onnx._internal.exporter._registration"
    with caplog.at_level(logging.WARNING):
        target = make_target(seed=7, vocab=6, std=0.5)
        export_onnx(make_drafter(target, seed=2, block_size=4), target, tmp_path, flavour="decomposed")
        logging.getLogger(name).warning("torchvision is not installed. Skipping torchvision::nms")
        logging.getLogger(name).warning("an operator failed to register")
    messages = [r.getMessage() for r in caplog.records]
    assert not any("torchvision" in m for m in messages)
    assert "an operator failed to register" in messages


def test_mlflows_table_creation_note_is_dropped_and_its_warnings_kept(caplog):
    quiet_mlflow_store()
    log = logging.getLogger("mlflow.store.db.utils")
    with caplog.at_level(logging.INFO):
        log.info("Creating initial MLflow database tables...")
        log.warning("the database is locked")
    assert [r.getMessage() for r in caplog.records] == ["the database is locked"]
