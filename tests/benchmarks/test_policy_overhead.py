"""benchmarks/policy_overhead.py: ``timed_passes`` (the models' passes timed, one-token target passes apart, the
decode loop's rounds counted), which the host-time and step columns rest on."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import policy_overhead  # noqa: E402

from specdraft.runtime import rounds  # noqa: E402
from specdraft.runtime.decode import GenerationConfig, generate  # noqa: E402


class _Clock:
    """A fake ``time`` module: passes advance it by what they say they cost (no waiting, nothing to flake)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Target:
    def __init__(self, clock: _Clock):
        self.clock = clock

    def forward(self, tokens: torch.Tensor):
        self.clock.now += 2.0 * tokens.shape[1]
        return tokens.shape


class _Drafter:
    def __init__(self, clock: _Clock):
        self.clock = clock

    def draft_hidden(self, cost: float):
        self.clock.now += cost

    def logits(self, cost: float):
        self.clock.now += cost

    def ingest(self, cost: float):
        return self.ingest_packed(cost)  # a pass that calls another: counted once

    def ingest_packed(self, cost: float):
        self.clock.now += cost


def test_passes_are_added_up_once_steps_kept_apart_and_rounds_counted(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(policy_overhead, "time", clock)
    monkeypatch.setattr(rounds, "verify_round", lambda *a, **k: "verified")
    target, drafter = _Target(clock), _Drafter(clock)
    tally = policy_overhead.timed_passes(target, drafter)
    assert target.forward(torch.zeros(2, 1)) == (2, 1)  # the pass's own result
    target.forward(tokens=torch.zeros(2, 3))  # not a one-token step (tokens as a keyword too)
    clock.now += 10.0  # the host's time between passes: not counted
    drafter.ingest(4.0)
    drafter.logits(1.0)
    assert rounds.verify_round() == "verified"
    assert tally["steps"] == [2.0]
    assert tally["seconds"] == 2.0 + 6.0 + 4.0 + 1.0  # the nested ingest once (twice: 17)
    assert tally["rounds"] == 1


def test_in_the_engine_rounds_are_its_rounds_and_ar_steps_one_a_round(target, drafter, monkeypatch):
    monkeypatch.setattr(rounds, "verify_round", rounds.verify_round)  # restored after the test
    tally = policy_overhead.timed_passes(target, drafter)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    config = GenerationConfig(max_new_tokens=[6, 9])
    records = []
    start = time.perf_counter()
    generate(target, prompts, config, drafter=drafter, observer=records.append)
    assert tally["rounds"] == len(records) > 0  # one verify a round, exploring or not
    assert 0 < tally["seconds"] < time.perf_counter() - start
    tally["rounds"], tally["steps"] = 0, []
    results = generate(target, prompts, config, observer=records.append)  # AR: every round a one-token step
    assert tally["rounds"] == len(tally["steps"]) == max(len(r.accept_lengths) for r in results)
