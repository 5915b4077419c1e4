"""The adaptive policy on the static-shape path (the rounds the GPU captures in CUDA graphs), run eagerly on a CPU:
each round a drafted round of every row (a block or a tree) or a plain one-token round whose features the drafters
ingest at once. Greedy output is the target's with drafts accepted and plain rounds mixed in, across buckets, padding
rows and stop tokens; the same pattern of drafted and plain rounds drafts what the eager engine's adaptive rounds
draft, round for round (the plain rounds' tokens reach every drafter's context, ReTrace's prior starts over); a
policy that always drafts decodes the fixed static rounds; sampled output fits the target's distribution."""

import pytest

from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.static_decode import StaticDecoder, StaticEngine
from tests.helpers import bigram_oracle, make_drafter, make_target, retrace_from
from tests.lossless import SAMPLING_SETTINGS, check_conformance, check_greedy, sampling_pvalues
from tests.runtime.test_adaptive_trees import CAPS, PROMPTS, costs

ALPHA = 1e-3


def whole(per_token: float, K: int = 3, drafter: float = 0.1, **kwargs) -> AdaptivePolicy:
    """A policy on a synthetic machine (a target pass costs ``1 + per_token`` per extra token, a drafter round
    ``drafter``), pricing whole rounds."""
    return AdaptivePolicy(costs(per_token, drafter, K=K), whole_rounds=True, measured=False, **kwargs)


class Pattern(AdaptivePolicy):
    """Drafts every row in rounds 1, 4, 7, ... of the policy's life and decodes plainly in the others; a drafted chain
    round verifies the whole block. The kinds of round are fixed, not priced, so two engines given the same calls can
    be compared round for round."""

    def draft_this_round(self, rows, fresh=0):
        self.calls = getattr(self, "calls", 0) + 1
        return self.calls % 3 == 1

    def verify_len(self, confidence):
        self.whole(confidence)
        return confidence.shape[1]


def pattern() -> Pattern:
    return Pattern(costs(0.0), whole_rounds=True, measured=False)


def static_engine(policy_factory, buckets=(1, 2, 4, 8, 16), seen: list | None = None, heads: bool = False):
    """An engine with :func:`generate`'s signature decoding through a fresh :class:`StaticEngine` and a fresh policy
    per call (as each decode job builds one); ``seen`` collects every row's drafts verified per round; ``heads``: the
    target's passes take the fused argmax (greedy jobs)."""
    def engine(target, prompts, gen, drafter=None, generator=None, tree=None, observer=None):
        policy = policy_factory()
        static = StaticEngine(target, drafter, max(len(prompts), max(buckets)), graphs=False, buckets=buckets,
                              tree=tree, policy=policy, argmax_heads=heads)
        results = static(target, prompts, gen, drafter=drafter, generator=generator, tree=tree, observer=observer,
                         policy=policy)
        if seen is not None:
            seen.extend(v for r in results for v in r.verified)
        return results
    return engine


def eager_engine(policy_factory):
    def engine(target, prompts, gen, **kwargs):
        return generate(target, prompts, gen, policy=policy_factory(), **kwargs)
    return engine


def _trees(target, block_size: int):
    second = convert_drafter(make_drafter(target, seed=5, block_size=block_size, std=0.3), "vp")
    return {"chain": None, "one_pass": OnePassDrafting(8), "d2sd": TreeDrafting(second, 1)}


@pytest.mark.parametrize("heads", [False, True], ids=["logits", "argmax-heads"])
@pytest.mark.parametrize("kind", ["chain", "one_pass", "d2sd"])
def test_the_shared_greedy_harness_passes_with_a_policy_that_always_drafts(kind, heads):
    """Free verification: every round drafts whole; the harness's ragged batch, single rows and stop token; with the
    fused argmax heads the draft keeps its logits (the policy reads the drafter's confidence)."""
    target, oracle = bigram_oracle(2, runner_up=True)
    tree = _trees(target, oracle.block_size)[kind]
    seen = []
    got = check_greedy(target, lambda p: (oracle, tree), PROMPTS, CAPS,
                       engine=static_engine(lambda: whole(0.0), seen=seen, heads=heads))
    assert got["mismatches"] == 0 and got["partial"] + got["full"] > 0, got
    assert set(seen) == {3}


@pytest.mark.parametrize("heads", [False, True], ids=["logits", "argmax-heads"])
@pytest.mark.parametrize("kind", ["chain", "one_pass", "d2sd"])
@pytest.mark.parametrize("per_token", [0.6, 5.0], ids=["pays", "never-pays"])
def test_greedy_output_is_the_targets_where_drafting_pays_and_where_it_does_not(kind, per_token, heads):
    """Where the oracle's two right drafts a round pay for the verify, every round drafts; where they cannot, rounds
    are plain but for the first and the retries. Rows finish and move to smaller buckets, a stop token ends some
    inside a round; with the fused argmax heads too (greedy jobs' default)."""
    target, oracle = bigram_oracle(2, runner_up=True)
    tree = _trees(target, oracle.block_size)[kind]
    verified, accepted = [], []
    for stop in ((3,), ()):
        gen = GenerationConfig(max_new_tokens=CAPS, stop_token_ids=stop)
        got = static_engine(lambda: whole(per_token, retry_every=2), heads=heads)(target, PROMPTS, gen,
                                                                                   drafter=oracle, tree=tree)
        assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
        for r in got:
            assert len(r.verified) == len(r.accept_lengths) == len(r.accepted)
            assert tree is None or len(r.nodes) == len(r.verified) and all(
                n == 1 for n, v in zip(r.nodes, r.verified) if v == 0)  # a plain round verifies the root alone
            verified += r.verified
            accepted += r.accepted
    plain, drafted = verified.count(0), verified.count(3)
    assert plain + drafted == len(verified) and sum(a for a, v in zip(accepted, verified) if v) > 0
    if per_token == 5.0:
        assert plain > 4 * drafted > 0, (plain, drafted)
    else:
        assert plain == 0, plain


@pytest.mark.parametrize("kind", ["dflash", "retrace", "one_pass", "d2sd"])
def test_drafted_and_plain_rounds_draft_what_the_eager_engines_adaptive_rounds_draft(kind):
    """Drafters whose drafts follow their context, the same pattern of drafted and plain rounds on both engines: the
    eager engine defers a plain round's features and feeds them when drafting resumes, the static path feeds them in
    the plain round itself; either way the next drafted round drafts from the same context (D²SD's second drafter's
    too, and ReTrace's prior starts over after a plain round), so the rounds are the same, drafts and all."""
    target = make_target(seed=7, vocab=6, std=1.0)
    first = make_drafter(target, seed=2, block_size=5, std=0.3)
    if kind == "retrace":
        first = retrace_from(first, active=True)
    tree = _trees(target, 5).get(kind)
    counts = check_conformance((target, lambda p: (first, tree), static_engine(pattern)),
                               (target, lambda p: (first, tree), eager_engine(pattern)), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts


class Recording(AdaptivePolicy):
    """A policy on a synthetic machine that records what each engine tells it (rows as sets: the engines order their
    rows differently), and decides as the policy does."""

    def __post_init__(self):
        super().__post_init__()
        self.calls = []

    def at_context(self, context):
        self.calls.append(("at_context", round(context, 6)))
        super().at_context(context)

    def draft_this_round(self, rows, fresh=0):
        drafted = super().draft_this_round(rows, fresh)
        self.calls.append(("draft_this_round", len(rows), fresh, frozenset(rows), drafted))
        return drafted

    def observe(self, num_accepted, rows):
        self.calls.append(("observe", frozenset(zip(rows, num_accepted.tolist()))))
        super().observe(num_accepted, rows)

    def observe_seconds(self, b, drafting, width, seconds, flushed=0.0):
        self.calls.append(("observe_seconds", b, drafting, width))
        super().observe_seconds(b, drafting, width, seconds, flushed)


@pytest.mark.parametrize("per_token", [0.0, 1.0], ids=["drafts", "mostly-plain"])
def test_the_policy_hears_from_the_static_path_what_it_hears_from_the_eager_engine(per_token):
    """The same static batch through both engines with a policy deciding from the model alone: the same calls, in the
    same order, with the same rows, new requests, accepted drafts and round sizes
    (the eager engine's own width choice aside: a chain round there may verify fewer drafts, so a policy that drafts
    for free, where the whole block is the best width, is compared)."""
    target, oracle = bigram_oracle(2)
    gen = GenerationConfig(max_new_tokens=CAPS)
    heard = []
    for engine in (static_engine, eager_engine):
        policy = Recording(costs(per_token), whole_rounds=True, measured=False, retry_every=2)
        got = engine(lambda: policy)(target, PROMPTS, gen, drafter=oracle)
        assert [r.tokens for r in got] == [r.tokens for r in generate(target, PROMPTS, gen)]
        heard.append(policy.calls)
    assert heard[0] == heard[1]
    kinds = [c[-1] for c in heard[0] if c[0] == "draft_this_round"]
    assert any(kinds) and (per_token == 0.0) == all(kinds), kinds


def test_a_policy_that_always_drafts_decodes_the_fixed_static_rounds():
    target = make_target(seed=7, vocab=6, std=1.0)
    drafter = make_drafter(target, seed=2, block_size=5, std=0.3)

    def fixed(target, prompts, gen, drafter=None, generator=None, tree=None, observer=None):
        return StaticEngine(target, drafter, 16, graphs=False)(target, prompts, gen, drafter=drafter,
                                                               generator=generator, observer=observer)
    counts = check_conformance((target, lambda p: drafter, static_engine(lambda: whole(0.0, K=4, drafter=0.0))),
                               (target, lambda p: drafter, fixed), PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts


def test_refusals_name_the_problem():
    target, oracle = bigram_oracle(2)
    with pytest.raises(ValueError, match="whole_rounds"):
        StaticDecoder(target, oracle, 4, 64, policy=AdaptivePolicy(costs(0.0)))
    with pytest.raises(ValueError, match="needs a drafter"):
        StaticDecoder(target, None, 4, 64, policy=whole(0.0))
    engine = StaticEngine(target, oracle, 4, graphs=False, policy=whole(0.0))
    with pytest.raises(ValueError, match="policy it was built for"):
        engine(target, PROMPTS[:2], GenerationConfig(max_new_tokens=4), drafter=oracle, policy=whole(0.0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chain", "one_pass", "retrace"])
def test_sampled_output_fits_the_target_distribution_with_plain_rounds_mixed_in(kind):
    """6000 rows in one bucket: drafted rounds (sampled chains, sampled one-pass siblings, ReTrace's prior) between
    plain rounds."""
    target = make_target(seed=7, vocab=6, std=0.5)
    first = make_drafter(target, seed=2, block_size=4, std=0.3)
    if kind == "retrace":
        first = retrace_from(first, active=True)
    tree = OnePassDrafting(8) if kind == "one_pass" else None
    verified = []
    check = sampling_pvalues(target, lambda p: (first, tree), SAMPLING_SETTINGS[1], n=6000,
                             engine=static_engine(pattern, buckets=(1, 6000), seen=verified))
    assert check.min_p > ALPHA, check
    assert verified.count(0) > 0 and verified.count(3) > 0, (verified.count(0), verified.count(3))
    assert check.profile["partial"] + check.profile["full"] > 0, check.profile
