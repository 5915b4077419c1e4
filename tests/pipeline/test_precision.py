"""Training precision: bf16 autocast only where bf16 is native, and a bf16-trained world cached apart from fp32's."""

from pathlib import Path

import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.pipeline import lightning_utils
from specdraft.pipeline.config import load_config
from specdraft.pipeline.lightning_utils import native_bf16, resolve_precision
from specdraft.pipeline.world import world_hash

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")


def _cpu_with(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize("avx512_bf16,amx,expected", [(False, False, "32-true"), (True, False, "bf16-mixed"),
                                                      (False, True, "bf16-mixed")])
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, avx512_bf16, amx, expected):
    _cpu_with(monkeypatch, avx512_bf16, amx)
    assert native_bf16() is (expected == "bf16-mixed")
    assert resolve_precision("auto") == expected
    assert resolve_precision("32-true") == "32-true" and resolve_precision("bf16-mixed") == "bf16-mixed"


def test_cuda_is_native_bf16(monkeypatch):
    _cpu_with(monkeypatch, False, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert lightning_utils.resolve_precision("auto") == "bf16-mixed"


def test_a_torch_without_the_cpu_probes_trains_in_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert resolve_precision("auto") == "32-true"


def test_the_world_is_keyed_by_the_precision_it_trains_in(monkeypatch):
    _cpu_with(monkeypatch, False, False)
    fp32_auto = world_hash(load_config(TINY))
    assert world_hash(load_config(TINY, ["target.tiny.precision=32-true"])) == fp32_auto
    bf16 = world_hash(load_config(TINY, ["target.tiny.precision=bf16-mixed"]))
    assert bf16 != fp32_auto
    _cpu_with(monkeypatch, True, False)
    assert world_hash(load_config(TINY)) == bf16  # auto on a bf16 CPU is the bf16 world
    assert world_hash(load_config(TINY, ["target.tiny.precision=32-true"])) == fp32_auto


def test_an_unknown_target_precision_names_the_key():
    with pytest.raises(SpecdraftError, match="target.tiny.precision"):
        load_config(TINY, ["target.tiny.precision=fp8"])
