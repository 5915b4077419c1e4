"""The adaptive policy priced at the rows' context: a pass's attention over the cache adds a cost that grows with the
context and not with the new tokens, so it weighs most on a plain pass; costs measured at two contexts price a round
at the running requests' mean cache length (:meth:`CostModel.at`, :meth:`AdaptivePolicy.at_context`)."""

from dataclasses import asdict

import pytest

from specdraft.runtime.cost_model import CostModel, measure_costs
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.policy import AdaptivePolicy
from tests.helpers import make_drafter, make_target

TOKENS = [1, 2, 3, 4]
DRAFTER_S = 0.8

ROWS = list(range(8))  # the running requests of a synthetic round


def machine(context: int) -> list[list[float]]:
    """A synthetic target pass on rows [1, 64]: 1 s, 0.3 s a new token past the first, and 1 s per 64 tokens of
    cache a row (at any row count: the rows' ratios are what the policy rescales)."""
    return [[1.0 + 0.3 * (t - 1) + context / 64 for t in TOKENS]] * 2


def measured_at(*contexts: int) -> CostModel:
    """The machine's costs as measured at ``contexts`` (the longest first; one: no context term)."""
    long, *short = contexts
    near = {"context": short[0], "target_s": machine(short[0]), "drafter_s": [DRAFTER_S] * 2} if short else {}
    return CostModel([1, 64], TOKENS, machine(long), [DRAFTER_S] * 2, {}, long, near)


def test_costs_at_a_context_are_linear_through_the_two_measured():
    model = measured_at(256, 64)
    assert model.at(160).target_s[1] == pytest.approx(machine(160)[1])
    assert model.at(160).target(8, 2) == pytest.approx(3.8) and model.at(160).drafter(8) == pytest.approx(DRAFTER_S)
    assert model.at(512).target(1, 1) == pytest.approx(9.0)  # extrapolated past the longer context
    assert model.at(16).target(1, 1) == pytest.approx(1.25)  # below the shorter context, along the line
    steep = CostModel([1], [1], [[5.0]], [0.1], {}, 256, {"context": 64, "target_s": [[1.0]], "drafter_s": [0.1]})
    assert steep.at(16).target(1, 1) == pytest.approx(0.5)  # 0 by the line: at most halved
    assert model.at(160) is model.at(160)  # priced once per context
    noisy = CostModel([1], [1], [[1.9]], [0.1], {}, 256, {"context": 64, "target_s": [[2.0]], "drafter_s": [0.1]})
    assert noisy.at(4096).target(1, 1) == pytest.approx(1.9)  # a cost falling with the context: not extended
    one = measured_at(256)
    assert one.at(32) is one  # measured at one context: the same costs at any
    earlier = asdict(one) | {"ingest_s": [0.064, 2.048]}  # a cache an earlier version wrote: a field no longer read
    assert CostModel.from_dict(earlier).target(8, 2) == one.target(8, 2)


@pytest.mark.parametrize("contexts", [(256,), (256, 64)], ids=["one-context", "two-contexts"])
def test_plain_passes_are_priced_at_the_rows_context_not_from_the_drafted_rounds_ratio(contexts):
    """Costs measured at 256 tokens of cache; the job runs at 32, where a drafted round verifying two drafts takes
    2.9 s for 1.75 tokens a row (0.60 a second) and a plain one 1.5 s for one (0.67): drafting
    does not pay. Drafted rounds' measured seconds are 0.45 of the one-context model's: its plain pass, not yet
    measured, is priced at that ratio too (2.3 s, not 1.5), so drafting looks 37 % better than plain decoding and
    goes on. Priced at the rows' context the model is right and drafting stops; at 256 tokens it pays, and does."""
    policy = AdaptivePolicy(measured_at(*contexts), accept=[0.5, 0.5, 0.5], width=2)
    policy.at_context(32)
    true = measured_at(32)
    for _ in range(10):
        policy.observe_seconds(8, 8, 2, DRAFTER_S + true.target(8, 3))
    assert policy.draft_this_round(ROWS) is (len(contexts) == 1)
    if len(contexts) == 2:
        assert policy.measured_ratio("drafted") == pytest.approx(1.0)
        policy.at_context(256)
        assert policy.draft_this_round(ROWS)
        fresh = AdaptivePolicy(measured_at(*contexts), accept=[0.5, 0.5, 0.5], width=2)
        fresh.at_context(256)  # the prices are the new context's, not the old one's
        assert policy._drafted_rate(ROWS) == pytest.approx(fresh._drafted_rate(ROWS))
    for context, bucket in ((10, 16), (33, 32), (100, 99), (1000, 1024)):  # an eighth of an octave, 16 at least
        policy.at_context(context)
        assert policy._context == bucket


def test_plain_rounds_are_priced_at_each_rounds_context():
    """Plain rounds decided on the bound over any requests go on through context buckets where drafting still cannot
    pay, each round priced at its own context: where the context grows into the range where drafting pays, that round
    drafts (decided from the model alone here)."""
    policy = AdaptivePolicy(measured_at(256, 64), accept=[0.5, 0.5, 0.5], width=2, measured=False, retry_every=1000)
    policy.at_context(32)
    assert not any(policy.draft_this_round(ROWS) for _ in range(5))
    for context in (33, 40):  # the same bucket, then the next: drafting still cannot pay
        policy.at_context(context)
        assert not policy.draft_this_round(ROWS)
    policy.at_context(256)
    assert policy.draft_this_round(ROWS)


def test_the_engine_tells_the_policy_each_rounds_context():
    """A static batch: before round ``j`` the policy hears the mean, over the rows still running, of the row's cache
    (its prompt and the tokens committed before the round but the anchor, which the round's pass feeds)."""
    target = make_target(seed=0, vocab=32)
    drafter = make_drafter(target, seed=1, block_size=4)
    seen = []

    class Spy(AdaptivePolicy):
        def at_context(self, context):
            seen.append(context)
            super().at_context(context)

    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7] * 20]
    caps = [12, 5, 20, 9]
    policy = Spy(measured_at(256, 64), measured=False)
    results = generate(target, prompts, GenerationConfig(max_new_tokens=caps), drafter=drafter, policy=policy)
    want = []
    for j in range(max(len(r.accept_lengths) for r in results)):
        running = [len(p) + sum(r.accept_lengths[:j]) for p, r in zip(prompts, results) if len(r.accept_lengths) > j]
        want.append(sum(running) / len(running))
    assert seen == pytest.approx(want) and len(set(seen)) > 5


def test_measured_costs_include_a_shorter_context():
    target = make_target(seed=0, vocab=64)
    drafter = make_drafter(target, block_size=5)
    model = measure_costs(target, drafter, rows=(1, 4), tokens=(1, 5), context=32, repeats=1, short_context=8)
    assert model.context == 32 and model.short["context"] == 8
    assert len(model.short["target_s"]) == 2 and len(model.short["target_s"][0]) == 2
    assert all(s > 0 for s in model.short["drafter_s"]) and model.at(16).target(2, 3) > 0


def costs_of(per_token: float) -> CostModel:
    """A target pass of ``1 + per_token * (new tokens - 1)`` seconds and a 0.3 s drafter round at any rows."""
    return CostModel([1, 64], TOKENS, [[1.0 + per_token * (t - 1) for t in TOKENS]] * 2, [0.3] * 2)


def test_costs_up_to_a_block_keep_both_contexts_columns():
    model = measured_at(256, 64)
    assert model.up_to(4) is model
    two = model.up_to(2)
    assert two.tokens == [1, 2] and two.target_s == [row[:2] for row in model.target_s]
    assert two.short["target_s"] == [row[:2] for row in model.short["target_s"]]
    assert two.at(160).target(8, 2) == pytest.approx(model.at(160).target(8, 2))
