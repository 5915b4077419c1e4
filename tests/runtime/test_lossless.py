"""Every decoding path through the losslessness harness (tests/lossless.py), and the harness's power: it fails on
each deliberately wrong verification rule."""

import functools

import pytest
import torch

from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from tests.helpers import make_drafter, make_target
from tests.lossless import (
    RAGGED_CAPS,
    RAGGED_PROMPTS,
    SAMPLING_SETTINGS,
    TREE_WRONG_RULES,
    WRONG_RULES,
    ControlledDrafter,
    check_greedy,
    run,
    sampling_pvalues,
    wrong_rule_caught,
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


def tree_factory(path: str, target, mode: str, block_size: int, branches: int, placement: str = "confidence",
                 distinct: bool = False):
    """``prompts -> (first drafter, TreeDrafting)`` for the D²SD path: controlled first and second drafters, alone or
    running a real DFlash first drafter and a real VP second drafter (its batched branch pass and its own cache)."""
    first = make_drafter(target, seed=2, block_size=block_size) if path == "dflash" else None
    second = convert_drafter(make_drafter(target, seed=5, block_size=block_size), "vp") if path == "dflash" else None
    return lambda prompts: (
        ControlledDrafter(target, prompts, block_size, mode=mode, inner=first, right=0.6),
        TreeDrafting(ControlledDrafter(target, prompts, block_size, mode=mode, inner=second, seed=1, right=0.5,
                                       alternative=mode == "mix"), branches, placement, distinct))


TREE_PATHS = ["stub", "dflash"]


@pytest.mark.parametrize(("branches", "placement", "distinct"), [(1, "confidence", False), (2, "confidence", False),
                                                               (4, "confidence", False), (2, "uniform", True)])
@pytest.mark.parametrize("path", TREE_PATHS)
def test_d2sd_greedy_output_is_the_targets_with_branches_winning(path, branches, placement, distinct):
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, tree_factory(path, target, "oracle", 6, branches, placement, distinct), RAGGED_PROMPTS,
                       RAGGED_CAPS)
    assert got["mismatches"] == 0, got
    assert got["tau"] > 2.5 and got["full"] and got["partial"] and got["none"], got
    assert got["branch_wins"] > 0 and got["stopped_rows"] > 0, got


TREE_SAMPLING = [("stub", p, "sample") for p in SAMPLING_SETTINGS] + [("dflash", SAMPLING_SETTINGS[1], "sample"),
                                                                     ("stub", SAMPLING_SETTINGS[1], "greedy")]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "params", "drafts"), TREE_SAMPLING,
                         ids=lambda x: x if isinstance(x, str) else f"T{x.temperature:g}")
def test_d2sd_sampled_output_is_distributed_as_the_targets(path, params, drafts):
    """Sampled drafts go through multi-candidate speculative sampling, argmax drafts through the target-token walk."""
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, tree_factory(path, target, "mix", 4, 2), params, draft_sampling=drafts)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5 and got.profile["full"] and got.profile["none"], got.profile
    assert got.profile["branch_wins"] > 0, got.profile


@pytest.mark.parametrize("path", PATHS)
def test_greedy_output_is_the_targets_with_drafts_accepted(path):
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, factory(path, target, "oracle", block_size=5), RAGGED_PROMPTS, RAGGED_CAPS)
    assert got["mismatches"] == 0, got
    assert got["tau"] > 2.5 and got["full"] and got["partial"] and got["none"], got
    assert got["stopped_rows"] > 0


@pytest.mark.parametrize("path", ["dflash", "retrace", "d2sd"])
def test_continuous_batching_decodes_each_request_as_alone_in_any_arrival_order(path):
    """Three slots for nine ragged requests, the admitted ones prefilled two prompt tokens per round: the harness
    (target alone, one-row decoding, a stop inside an accepted run) passes, and a reversed arrival order gives every
    request the same tokens and rounds."""
    target = make_target(seed=3, vocab=48)
    f = (tree_factory("dflash", target, "oracle", 6, 2) if path == "d2sd"
         else factory(path, target, "oracle", block_size=5))
    widths: list[int] = []
    engine = functools.partial(generate, slots=3, prefill_chunk=2,
                               observer=lambda rec: widths.append(rec.rows.numel()))
    got = check_greedy(target, f, RAGGED_PROMPTS, RAGGED_CAPS, engine=engine)
    assert got["mismatches"] == 0, got
    assert got["tau"] > 2.5 and got["full"] and got["partial"] and got["none"] and got["stopped_rows"] > 0, got
    assert max(widths) == 3 and len(RAGGED_PROMPTS) > 3, "the slots bound the running rows"
    order = list(reversed(range(len(RAGGED_PROMPTS))))
    static = run(target, RAGGED_PROMPTS, GenerationConfig(max_new_tokens=RAGGED_CAPS), f)
    rev = run(target, [RAGGED_PROMPTS[i] for i in order], GenerationConfig(max_new_tokens=[RAGGED_CAPS[i] for i in
                                                                                          order]), f, engine=engine)
    for j, i in enumerate(order):
        assert (rev[j].tokens, rev[j].accept_lengths) == (static[i].tokens, static[i].accept_lengths), i


@pytest.mark.slow
@pytest.mark.parametrize("params", SAMPLING_SETTINGS, ids=lambda p: f"T{p.temperature:g}")
@pytest.mark.parametrize("path", PATHS)
def test_sampled_output_is_distributed_as_the_targets(path, params):
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, factory(path, target, "mix"), params)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 2 and got.profile["full"] and got.profile["none"], got.profile


@pytest.mark.slow
def test_deterministic_drafts_under_sampling_are_lossless():
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, factory("dflash", target, "mix"), SAMPLING_SETTINGS[0], draft_sampling="greedy")
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5, got.profile


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(TREE_WRONG_RULES))
def test_the_harness_fails_on_a_wrong_tree_rule(rule, monkeypatch):
    caught, got = wrong_rule_caught(TREE_WRONG_RULES[rule], monkeypatch,
                                    lambda target, mode, bk: tree_factory("stub", target, mode, bk, 2),
                                    rule.startswith("sampled drafts"), ALPHA)
    assert caught, (rule, got)
