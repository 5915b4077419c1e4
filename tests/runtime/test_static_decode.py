"""The static-shape decode path (the rounds the GPU captures in CUDA graphs), run eagerly on a CPU: greedy output is
the target's token for token across bucket changes, padding rows and stop tokens; its rounds are the eager engine's,
round for round (acceptance conformance); rows that finish stay frozen in a decoder sized exactly for its requests;
pinned acceptance (all, none, partial) through a real DFlash drafter; the sampled output fits the exact target
distribution; and the checks catch each deliberately wrong bookkeeping rule."""

import pytest
import torch

from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.static_decode import StaticDecoder, StaticEngine
from tests.helpers import bigram_oracle, make_drafter, make_target, retrace_from
from tests.lossless import (
    EXECUTOR_WRONG_RULES,
    ONE_PASS_WRONG_RULES,
    SAMPLING_SETTINGS,
    TREE_WRONG_RULES,
    check_conformance,
    check_greedy,
    round_trace,
    sampling_pvalues,
)

ALPHA = 1e-3
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
CAPS = [10, 25, 17, 30, 8, 21, 14, 19, 12]


def static_engine(buckets=(1, 2, 4, 8, 16), slot_step=256):
    """An engine with :func:`generate`'s signature that decodes through a fresh :class:`StaticEngine` per call (its
    decoders are kept for inspection); ``slot_step=1`` sizes its caches exactly for the requests."""
    def engine(target, prompts, gen, drafter=None, generator=None, tree=None, observer=None):
        static = StaticEngine(target, drafter, max(len(prompts), max(buckets)), graphs=False, buckets=buckets,
                              slot_step=slot_step, tree=tree)
        results = static(target, prompts, gen, drafter=drafter, generator=generator, tree=tree, observer=observer)
        engine.decoders.append(static.decoder)
        return results
    engine.decoders = []
    return engine


def test_greedy_output_is_the_targets_across_buckets_padding_and_stops():
    target = make_target(seed=7, vocab=6, std=1.0)
    drafter = make_drafter(target, seed=2, block_size=4)
    engine = static_engine()
    gen = GenerationConfig(max_new_tokens=CAPS)
    want = generate(target, PROMPTS, gen)
    got = engine(target, PROMPTS, gen, drafter=drafter)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sorted(engine.decoders[0]._buckets) == [1, 2, 4, 8, 16]  # 9 rows start in 16, shrink as rows finish
    assert sum(a for r in got for a in r.accepted) > 0
    for p, c, w in zip(PROMPTS[:3], CAPS, want):  # one row at a time
        assert engine(target, [p], GenerationConfig(max_new_tokens=c), drafter=drafter)[0].tokens == w.tokens
    stop = want[1].tokens[4]
    stopped = engine(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS, stop_token_ids=(stop,)), drafter=drafter)
    want_stop = generate(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS, stop_token_ids=(stop,)))
    assert [r.tokens for r in stopped] == [r.tokens for r in want_stop]
    assert any(r.finish_reason == "stop" for r in stopped)
    ar = engine(target, PROMPTS, gen)
    assert [r.tokens for r in ar] == [r.tokens for r in want]


def _conformance(kind: str, alignment: str = "hard") -> dict:
    target = make_target(seed=7, vocab=6, std=1.0)
    drafter = make_drafter(target, seed=2, block_size=4, std=0.3)  # its drafts follow its context
    drafter = convert_drafter(drafter, "vp") if kind == "vp" else drafter
    if kind == "retrace":  # an active fusion: the prior changes the drafts
        drafter = retrace_from(drafter, active=True, alignment=alignment)
    return check_conformance((target, lambda p: drafter, static_engine(slot_step=1)), (target, lambda p: drafter, None),
                             PROMPTS, CAPS)


@pytest.mark.parametrize(("kind", "alignment"), [("dflash", ""), ("vp", ""), ("retrace", "hard"),
                                               ("retrace", "soft")])
def test_rounds_are_the_eager_engines_round_for_round(kind, alignment):
    counts = _conformance(kind, alignment or "hard")
    assert counts["differing_rows"] == 0, counts
    assert counts["accepted"] > 0 and counts["rounds"] > len(PROMPTS), counts


def _early_finishers() -> bool:
    """Whether a decoder sized exactly for its requests decodes a batch whose first row (the longest context) finishes
    at once while three rows run on in the same bucket (as the CUDA-graph path writes, unchecked)."""
    target, oracle = bigram_oracle(3)
    prompts = [[1, 2, 3, 4, 5, 0] * 3, [1], [2], [3]]
    gen = GenerationConfig(max_new_tokens=[1, 40, 40, 40])
    got = static_engine(slot_step=1)(target, prompts, gen, drafter=oracle)
    return [r.tokens for r in got] == [r.tokens for r in generate(target, prompts, gen)]


def test_rows_that_finish_stay_frozen():
    assert _early_finishers()


@pytest.mark.parametrize("rule", list(EXECUTOR_WRONG_RULES))
def test_the_checks_catch_each_wrong_bookkeeping_rule(rule, monkeypatch):
    for module, attr, wrong in EXECUTOR_WRONG_RULES[rule]:
        monkeypatch.setattr(module, attr, wrong)
    target = make_target(seed=7, vocab=6, std=1.0)
    gen = GenerationConfig(max_new_tokens=CAPS)
    got = static_engine()(target, PROMPTS, gen, drafter=make_drafter(target, seed=2, block_size=4))
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]  # output equality passes
    try:
        caught = any(_conformance(kind)["differing_rows"] > 0 for kind in ("dflash", "retrace")) or \
            not _early_finishers()
    except IndexError:  # a write past an exactly sized cache
        caught = True
    assert caught


def tree_factory(first, target, branches: int = 2, distinct: bool = False):
    """``prompts -> (first drafter, TreeDrafting)`` with a real VP second drafter whose drafts follow its context."""
    second = convert_drafter(make_drafter(target, seed=5, block_size=first.block_size, std=0.3), "vp")
    return lambda prompts: (first, TreeDrafting(second, branches, distinct=distinct))


@pytest.mark.parametrize(("branches", "distinct"), [(1, False), (3, True)])
def test_d2sd_rounds_are_the_eager_engines_round_for_round(branches, distinct):
    target = make_target(seed=7, vocab=6, std=1.0)
    factory = tree_factory(make_drafter(target, seed=2, block_size=5, std=0.3), target, branches, distinct)
    got = _tree_rounds_conform(target, factory)
    assert sum(w > 0 for r in got for w in r.winner) > 0  # branches win


def _tree_rounds_conform(target, factory) -> list:
    """A tree path's static rounds are the eager engine's, round for round (the same trees, walks and winners), and
    it decodes the target's greedy output with tree statistics every round; returns that decode's results."""
    counts = check_conformance((target, factory, static_engine(slot_step=1)), (target, factory, None), PROMPTS,
                               CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts
    gen = GenerationConfig(max_new_tokens=CAPS)
    first, tree = factory(PROMPTS)
    got = static_engine()(target, PROMPTS, gen, drafter=first, tree=tree)
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
    assert all(len(r.nodes) == len(r.winner) == len(r.accept_lengths) for r in got)
    return got


def _pinned_tree_check():
    target, oracle = bigram_oracle(2, block_size=5)
    return check_greedy(target, tree_factory(oracle, target), PROMPTS, CAPS, engine=static_engine(slot_step=1))


def test_d2sd_greedy_output_is_the_targets_with_pinned_first_drafts():
    counts = _pinned_tree_check()
    assert counts["mismatches"] == 0, counts
    assert counts["partial"] > 0 and counts["stopped_rows"] > 0, counts


@pytest.mark.parametrize("rule", [r for r in TREE_WRONG_RULES if "sampled" not in r])
def test_the_tree_checks_catch_each_wrong_tree_rule(rule, monkeypatch):
    for module, attr, wrong in TREE_WRONG_RULES[rule]:
        monkeypatch.setattr(module, attr, wrong)
    target = make_target(seed=7, vocab=6, std=1.0)
    factory = tree_factory(make_drafter(target, seed=2, block_size=5, std=0.3), target, 3, True)
    caught = _pinned_tree_check()["mismatches"] > 0
    monkeypatch.undo()  # the eager reference runs the correct rules
    reference = round_trace(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS), factory)
    for module, attr, wrong in TREE_WRONG_RULES[rule]:
        monkeypatch.setattr(module, attr, wrong)
    got = round_trace(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS), factory, static_engine(slot_step=1))
    assert caught or got[1] != reference[1]


def one_pass_factory(target, nodes: int, block_size: int = 5):
    """``prompts -> (first drafter, OnePassDrafting)``: a real DFlash drafter whose drafts follow its context."""
    first = make_drafter(target, seed=2, block_size=block_size, std=0.3)
    return lambda prompts: (first, OnePassDrafting(nodes))


@pytest.mark.parametrize("nodes", [3, 12])
def test_one_pass_rounds_are_the_eager_engines_round_for_round(nodes):
    target = make_target(seed=7, vocab=6, std=1.0)
    got = _tree_rounds_conform(target, one_pass_factory(target, nodes))
    assert sum(w > 0 for r in got for w in r.winner) > 0 or nodes < 4  # siblings win


def test_one_pass_greedy_output_is_the_targets_with_pinned_drafts():
    """The bigram oracle's block is right for two slots; the tree's siblings of its wrong third draft hold the target's
    token as runner-up, so rounds accept past the chain; stop tokens and ragged caps as always."""
    target, oracle = bigram_oracle(2, block_size=5, runner_up=True)
    counts = check_greedy(target, lambda p: (oracle, OnePassDrafting(12)), PROMPTS, CAPS,
                          engine=static_engine(slot_step=1))
    assert counts["mismatches"] == 0, counts
    assert counts["partial"] > 0 and counts["stopped_rows"] > 0 and counts["branch_wins"] > 0, counts


def merged_factory(target, nodes: int, block_size: int = 5):
    """``prompts -> (first drafter, MergedDrafting)``: :func:`tree_factory`'s drafters, two branches."""
    first = make_drafter(target, seed=2, block_size=block_size, std=0.3)
    tree = tree_factory(first, target)([])[1]
    return lambda prompts: (first, MergedDrafting(tree, nodes))


@pytest.mark.parametrize("nodes", [3, 16])
def test_merged_rounds_are_the_eager_engines_round_for_round(nodes):
    """The static path pads a tree smaller than the branch blocks (3 nodes) to its fixed verify shape."""
    target = make_target(seed=7, vocab=6, std=1.0)
    got = _tree_rounds_conform(target, merged_factory(target, nodes))
    assert sum(w > 0 for r in got for w in r.winner) > 0 or nodes < 4  # a branch or a sibling wins


@pytest.mark.parametrize("rule", [r for r in ONE_PASS_WRONG_RULES if "sampled" not in r])
def test_the_one_pass_checks_catch_each_wrong_rule(rule, monkeypatch):
    """Through the pinned oracle (a bigram target, which reads no context) or a real target and drafter (which do:
    a wrong mask shows there)."""
    for module, attr, wrong in ONE_PASS_WRONG_RULES[rule]:
        monkeypatch.setattr(module, attr, wrong)
    target, oracle = bigram_oracle(2, block_size=5, runner_up=True)
    pinned = check_greedy(target, lambda p: (oracle, OnePassDrafting(12)), PROMPTS, CAPS,
                          engine=static_engine(slot_step=1))
    target = make_target(seed=7, vocab=6, std=1.0)
    real = check_greedy(target, one_pass_factory(target, 12), PROMPTS, CAPS, engine=static_engine(slot_step=1))
    assert pinned["mismatches"] + real["mismatches"] > 0, (pinned, real)


@pytest.mark.parametrize("right", [3, 0, 2], ids=["accept-all", "accept-none", "partial"])
def test_pinned_acceptance(right):
    target, oracle = bigram_oracle(right)
    gen = GenerationConfig(max_new_tokens=CAPS)
    got = static_engine()(target, PROMPTS, gen, drafter=oracle)
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
    assert {a for r in got for a in r.accepted} == {right}


@pytest.mark.slow
@pytest.mark.parametrize("params", SAMPLING_SETTINGS[:1], ids=["t0.7-top4-top0.9"])
def test_sampled_output_fits_the_target_distribution(params):
    target = make_target(seed=7, vocab=6, std=0.5)
    check = sampling_pvalues(target, lambda p: make_drafter(target, seed=2, block_size=4), params, n=6000,
                             engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] + check.profile["full"] > 0  # drafts were accepted
    target, oracle = bigram_oracle(2)
    check = sampling_pvalues(target, lambda p: oracle, params, n=6000, engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] > check.profile["rounds"] // 4  # the oracle's drafts are accepted often


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["sample", "greedy"])
def test_d2sd_sampled_output_fits_the_target_distribution(drafts):
    """Sampled drafts (multi-candidate speculative sampling) and argmax ones (the target sampled at every node)."""
    target = make_target(seed=7, vocab=6, std=0.5)
    factory = tree_factory(make_drafter(target, seed=2, block_size=4, std=0.3), target, 2)
    check = sampling_pvalues(target, factory, SAMPLING_SETTINGS[1], n=6000, draft_sampling=drafts,
                             engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] + check.profile["full"] > 0 and check.profile["branch_wins"] > 0, check


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["sample", "greedy"])
def test_one_pass_sampled_output_fits_the_target_distribution(drafts):
    """Sampled siblings (drawn without replacement, recursive rejection sampling) and ranked ones (the target sampled
    at every node the walk reaches) through the static rounds."""
    target = make_target(seed=7, vocab=6, std=0.5)
    check = sampling_pvalues(target, one_pass_factory(target, 8, block_size=4), SAMPLING_SETTINGS[1], n=6000,
                             draft_sampling=drafts, engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] + check.profile["full"] > 0 and check.profile["branch_wins"] > 0, check


@pytest.mark.slow
@pytest.mark.parametrize(("drafts", "nodes"), [("sample", 6), ("greedy", 8)])
def test_merged_sampled_output_fits_the_target_distribution(drafts, nodes):
    """Ranked drafts: the merged tree, the walk sampling the target at each node. Sampled drafts: the one-pass tree
    of sampled siblings, its 6 nodes padded to the merged tree's verify shape (two branch blocks of 4)."""
    target = make_target(seed=7, vocab=6, std=0.5)
    check = sampling_pvalues(target, merged_factory(target, nodes, block_size=4), SAMPLING_SETTINGS[1], n=6000,
                             draft_sampling=drafts, engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] + check.profile["full"] > 0 and check.profile["branch_wins"] > 0, check


def test_merged_sampled_drafts_decode_as_the_one_pass_tree():
    """Under sampling with sampled drafts the static path's merged round is its one-pass round: the same tokens from
    the same seed (a budget above the branch blocks' 10 slots: the same verify shape, so the same draws)."""
    target = make_target(seed=7, vocab=6, std=1.0)
    gen = GenerationConfig(max_new_tokens=CAPS, sampling=SAMPLING_SETTINGS[1])
    def run(factory):
        drafter, tree = factory(PROMPTS)
        return [r.tokens for r in static_engine(slot_step=1)(target, PROMPTS, gen, drafter=drafter, tree=tree,
                                                             generator=torch.Generator().manual_seed(0))]
    assert run(merged_factory(target, 12)) == run(one_pass_factory(target, 12))


@pytest.mark.slow
def test_retrace_sampled_output_fits_the_target_distribution():
    target = make_target(seed=7, vocab=6, std=0.5)
    drafter = retrace_from(make_drafter(target, seed=2, block_size=4, std=0.3), active=True)
    check = sampling_pvalues(target, lambda p: drafter, SAMPLING_SETTINGS[0], n=6000, engine=static_engine((1, 6000)))
    assert check.min_p > ALPHA, check
    assert check.profile["partial"] + check.profile["full"] > 0, check


def test_refusals_name_the_problem():
    target = make_target(seed=7, vocab=6)
    with pytest.raises(ValueError, match="reads the verify logits"):
        StaticDecoder(target, retrace_from(make_drafter(target), active=True), 4, 32, argmax_heads=True)
    decoder = StaticDecoder(target, make_drafter(target, block_size=4), 2, 32, graphs=False)
    with pytest.raises(ValueError, match="batch slots"):
        decoder.generate([[1]] * 3, GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="cache slots"):
        decoder.generate([[1]], GenerationConfig(max_new_tokens=40))
    with pytest.raises(ValueError, match="CUDA"):
        if not torch.cuda.is_available():
            StaticDecoder(target, None, 2, 32, graphs=True)
        else:
            raise ValueError("CUDA present: nothing to refuse")
