"""benchmarks/policy_overhead.py: ``timed_passes`` (the models' passes timed, one-token target passes apart, the
decode loop's rounds counted), which the host-time and step columns rest on."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import policy_overhead  # noqa: E402
from specdraft.runtime import decode  # noqa: E402


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Target:
    def forward(self, tokens: torch.Tensor):
        _busy(0.002 * tokens.shape[1])
        return tokens.shape


class _Drafter:
    def draft_hidden(self, ms: float):
        _busy(ms / 1e3)

    def logits(self, ms: float):
        _busy(ms / 1e3)

    def ingest(self, ms: float):
        return self.ingest_rows(ms)  # a pass that calls another: counted once

    def ingest_rows(self, ms: float):
        _busy(ms / 1e3)


def test_passes_are_added_up_steps_kept_apart_and_rounds_counted(monkeypatch):
    monkeypatch.setattr(decode, "verify_round", lambda *a, **k: "verified")
    target, drafter = _Target(), _Drafter()
    tally = policy_overhead.timed_passes(target, drafter)
    start = time.perf_counter()
    assert target.forward(torch.zeros(2, 1)) == (2, 1)  # the pass's own result
    target.forward(torch.zeros(2, 3))  # not a one-token step
    _busy(0.01)  # the host's time between passes
    drafter.ingest(4.0)
    assert decode.verify_round() == "verified"
    took = time.perf_counter() - start
    assert len(tally["steps"]) == 1 and 0.002 <= tally["steps"][0] < took
    assert 0.002 + 0.006 + 0.004 <= tally["seconds"] <= took - 0.01
    assert tally["rounds"] == 1
    tally["seconds"] = 0.0
    drafter.ingest(50.0)
    assert 0.05 <= tally["seconds"] < 0.09  # the nested ingest counted once (twice: 0.1)
