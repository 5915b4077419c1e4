"""ONNX exports shared by the export tests (an export takes seconds: each flavour is built once per session)."""

import pytest

from specdraft.export.onnx import export_onnx
from tests.helpers import make_drafter, make_target, retrace_from


@pytest.fixture(scope="session", params=["decomposed", "fused"])
def exported(request, tmp_path_factory):
    """``(target, drafter, export dir)`` for each flavour."""
    target = make_target(seed=7, vocab=6, std=0.5)
    drafter = make_drafter(target, seed=2, block_size=4, std=0.3)  # its drafts follow its context
    out = tmp_path_factory.mktemp(request.param)
    export_onnx(drafter, target, out, flavour=request.param)
    return target, drafter, out


@pytest.fixture(scope="session", params=["decomposed", "fused"])
def exported_retrace(request, tmp_path_factory):
    """``(target, ReTrace drafter with an active fusion, export dir)`` for each flavour."""
    target = make_target(seed=7, vocab=6, std=0.5)
    drafter = retrace_from(make_drafter(target, seed=2, block_size=4), active=True)
    out = tmp_path_factory.mktemp(f"retrace-{request.param}")
    export_onnx(drafter, target, out, flavour=request.param)
    return target, drafter, out
