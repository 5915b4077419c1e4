"""The adaptive policy with tree rounds: it chooses between a whole tree round (one-pass, D²SD) and a plain round,
the plain rounds' features waiting for both drafters. Greedy output is the target's with trees winning and plain
rounds mixed in; a policy that always drafts decodes the fixed tree engine's rounds exactly (the deferred prompt ingest
reaches the first drafter and D²SD's second one as the fixed engine's per-round ingest does); sampled output fits the
target's distribution."""

import pytest

from specdraft.runtime import rounds
from specdraft.runtime.cost_model import CostModel
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.policy import AdaptivePolicy
from tests.helpers import bigram_oracle, make_drafter, make_target
from tests.lossless import SAMPLING_SETTINGS, sampling_pvalues

ALPHA = 1e-3
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
CAPS = [10, 25, 17, 30, 8, 21, 14, 19, 12]


def costs(per_token: float, drafter: float = 0.1, K: int = 3) -> CostModel:
    """A synthetic machine: a target pass costs ``1 + per_token * (new tokens - 1)`` at any row count."""
    tokens = list(range(1, K + 2))
    return CostModel([1, 64], tokens, [[1.0 + per_token * (t - 1) for t in tokens]] * 2, [drafter, drafter])


def whole(per_token: float, **kwargs) -> AdaptivePolicy:
    return AdaptivePolicy(costs(per_token), whole_rounds=True, measured=False, **kwargs)


def _trees(target, oracle):
    second = convert_drafter(make_drafter(target, seed=5, block_size=oracle.block_size, std=0.3), "vp")
    return {"one_pass": OnePassDrafting(8), "d2sd": TreeDrafting(second, 1)}


@pytest.mark.parametrize("kind", ["one_pass", "d2sd"])
@pytest.mark.parametrize("per_token", [0.0, 0.6, 5.0], ids=["free", "mixed", "never-pays"])
def test_greedy_output_is_the_targets_with_tree_and_plain_rounds(kind, per_token):
    """The bigram oracle drafts two right tokens, then a wrong one whose runner-up is right (a one-pass sibling wins
    there); free verification drafts every round, a costly one mixes plain rounds with drafted retries, a hopeless one
    decodes plainly but for its first round and retries."""
    target, oracle = bigram_oracle(2, runner_up=True)
    tree = _trees(target, oracle)[kind]
    verified, accepted, nodes = [], [], []
    for stop in ((3,), ()):
        gen = GenerationConfig(max_new_tokens=CAPS, stop_token_ids=stop)
        want = [r.tokens for r in generate(target, PROMPTS, gen)]
        for batching in ({}, {"slots": 3, "prefill_chunk": 2}):
            got = generate(target, PROMPTS, gen, drafter=oracle, tree=tree, policy=whole(per_token, retry_every=2),
                           **batching)
            assert [r.tokens for r in got] == want
            for r in got:
                assert len(r.nodes) == len(r.verified) == len(r.accept_lengths)  # plain rounds: the root alone
                verified += r.verified
                accepted += r.accepted
                nodes += r.nodes
    drafted = [a for a, v in zip(accepted, verified) if v > 0]
    plain = verified.count(0)
    assert nodes.count(1) >= plain  # a plain round verifies the root alone
    if per_token == 5.0:  # the first round and the retries draft; plain rounds between them
        assert plain > 4 * (len(verified) - plain), (plain, len(verified))
    else:
        assert drafted and max(drafted) == 3  # past the oracle's two right drafts: a sibling or a branch
    if per_token == 0.0:
        assert set(verified) == {3}
    if per_token == 0.6:
        assert verified.count(0) > 0 and len(drafted) > 0, (verified.count(0), len(drafted))


@pytest.mark.parametrize("budget", [32_768, 0], ids=["deferred", "fed-at-admission"])
@pytest.mark.parametrize("kind", ["one_pass", "d2sd"])
def test_a_policy_that_always_drafts_decodes_the_fixed_tree_engines_rounds(kind, budget, monkeypatch):
    """Real drafters whose drafts follow their context (a prompt fed late, twice or to the wrong row, to either
    drafter, changes the trees): the same trees, walks and winners, round for round, static and continuous."""
    monkeypatch.setattr(rounds, "MAX_DEFERRED_TOKENS", budget)
    target = make_target(seed=7, vocab=6, std=1.0)
    first = make_drafter(target, seed=2, block_size=5, std=0.3)
    tree = _trees(target, first)[kind]
    gen = GenerationConfig(max_new_tokens=CAPS)
    for batching in ({}, {"slots": 3, "prefill_chunk": 2}):
        traces = []
        free = AdaptivePolicy(costs(0.0, drafter=0.0), whole_rounds=True, measured=False)  # drafting is free
        for policy in (None, free):
            seen: dict[int, list] = {}

            def observe(rec):
                for r, d, a, n, w in zip(rec.rows.tolist(), rec.draft_tokens.tolist(), rec.num_accepted.tolist(),
                                         rec.nodes.tolist(), rec.winner.tolist()):
                    seen.setdefault(r, []).append((d, a, n, w))
            generate(target, PROMPTS, gen, drafter=first, tree=tree, policy=policy, observer=observe, **batching)
            traces.append(seen)
        assert traces[0] == traces[1]
        assert sum(a for t in traces[0].values() for _, a, _, _ in t) > 0
        assert any(w > 0 for t in traces[0].values() for *_, w in t)  # siblings or branches win


def test_a_policy_without_whole_rounds_is_refused_with_a_tree():
    target, oracle = bigram_oracle(2)
    with pytest.raises(ValueError, match="whole_rounds"):
        generate(target, PROMPTS, GenerationConfig(max_new_tokens=4), drafter=oracle, tree=OnePassDrafting(8),
                 policy=AdaptivePolicy(costs(0.0)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one_pass", "d2sd"])
def test_sampled_output_fits_the_target_distribution_with_plain_rounds_mixed_in(kind):
    """Continuous batching (1024 slots for 6000 rows, admitted rows prefilled a token per round): drafted tree rounds
    (sampled one-pass siblings; D²SD's sampled candidates) between plain rounds."""
    target = make_target(seed=7, vocab=6, std=0.5)
    first = make_drafter(target, seed=2, block_size=4, std=0.3)
    tree = _trees(target, first)[kind]
    verified = []

    def engine(*args, **kwargs):
        results = generate(*args, **kwargs, slots=1024, prefill_chunk=1,
                           policy=whole(0.6, retry_every=2, explore_share=0.5))
        verified.extend(v for r in results for v in r.verified)
        return results

    check = sampling_pvalues(target, lambda p: (first, tree), SAMPLING_SETTINGS[1], n=6000, engine=engine)
    assert check.min_p > ALPHA, check
    assert verified.count(0) > 0 and verified.count(3) > 0, (verified.count(0), verified.count(3))
    assert check.profile["partial"] + check.profile["full"] > 0, check.profile
