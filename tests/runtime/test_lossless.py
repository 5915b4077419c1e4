"""Every decoding path through the losslessness harness (tests/lossless.py), and the harness's power: it fails on
each deliberately wrong verification rule."""

import pytest
import torch

from specdraft.runtime.drafter_io import convert_drafter
from tests.helpers import make_drafter, make_target
from tests.lossless import (
    RAGGED_CAPS,
    RAGGED_PROMPTS,
    SAMPLING_SETTINGS,
    WRONG_RULES,
    ControlledDrafter,
    check_greedy,
    sampling_pvalues,
)

ALPHA = 1e-3  # every p-value below is from a fixed seed; the wrong rules give p-values far below it


def _retrace(target, block_size):
    r = convert_drafter(make_drafter(target, seed=2, block_size=block_size), "retrace")
    with torch.no_grad():  # an active fusion: the prior changes the drafts
        torch.nn.init.normal_(r.retrace_gate_out.weight, std=0.5)
        torch.nn.init.zeros_(r.retrace_gate_out.bias)
    return r.eval()


def factory(path: str, target, mode: str, block_size: int = 4):
    """``prompts -> drafter`` for a decoding path: the stub alone, or a real drafter run inside it."""
    inner = {"stub": lambda: None, "dflash": lambda: make_drafter(target, seed=2, block_size=block_size),
             "retrace": lambda: _retrace(target, block_size)}[path]()
    return lambda prompts: ControlledDrafter(target, prompts, block_size, mode=mode, inner=inner)


PATHS = ["stub", "dflash", "retrace"]


@pytest.mark.parametrize("path", PATHS)
def test_greedy_output_is_the_targets_with_drafts_accepted(path):
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, factory(path, target, "oracle", block_size=5), RAGGED_PROMPTS, RAGGED_CAPS)
    assert got["mismatches"] == 0, got
    assert got["tau"] > 2.5 and got["full"] and got["partial"] and got["none"], got
    assert got["stopped_rows"] > 0


@pytest.mark.parametrize("params", SAMPLING_SETTINGS, ids=lambda p: f"T{p.temperature:g}")
@pytest.mark.parametrize("path", PATHS)
def test_sampled_output_is_distributed_as_the_targets(path, params):
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, factory(path, target, "mix"), params)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 2 and got.profile["full"] and got.profile["none"], got.profile


def test_deterministic_drafts_under_sampling_are_lossless():
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, factory("dflash", target, "mix"), SAMPLING_SETTINGS[0], draft_sampling="greedy")
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5, got.profile


@pytest.mark.parametrize("rule", sorted(WRONG_RULES))
def test_the_harness_fails_on_a_wrong_rule(rule, monkeypatch):
    for module, attr, wrong in WRONG_RULES[rule]:
        monkeypatch.setattr(module, attr, wrong)
    greedy_target = make_target(seed=3, vocab=48)
    greedy = check_greedy(greedy_target, factory("stub", greedy_target, "oracle", block_size=5), RAGGED_PROMPTS,
                          RAGGED_CAPS)
    target = make_target(seed=7, vocab=6, std=0.5)
    sampled = sampling_pvalues(target, factory("stub", target, "mix"), SAMPLING_SETTINGS[0])
    caught = greedy["mismatches"] > 0 or sampled.min_p < ALPHA
    assert caught, (rule, greedy, sampled)
