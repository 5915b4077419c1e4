"""The adaptive speculation policy: its choice on synthetic cost models (nothing when verification cannot pay, the
whole block when acceptance is near certain), its calibration, and the engine under it: greedy output is the
target's and sampled output fits the target's distribution, through a real DFlash drafter with pinned acceptance."""

from copy import deepcopy

import pytest
import torch

from specdraft.runtime import rounds
from specdraft.runtime.backlog import Backlog
from specdraft.runtime.calibration import Calibration
from specdraft.runtime.cost_model import CostModel, measure_costs
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.policy import AdaptivePolicy, expected_committed
from tests.helpers import bigram_oracle, make_drafter, make_target, retrace_from
from tests.lossless import (
    RAGGED_CAPS,
    RAGGED_PROMPTS,
    SAMPLING_SETTINGS,
    ControlledDrafter,
    check_greedy,
    sampling_pvalues,
)

ALPHA = 1e-3
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
CAPS = [10, 25, 17, 30, 8, 21, 14, 19, 12]
ROWS = list(range(8))  # the running requests of a synthetic round


def costs(per_token: float, drafter: float = 0.1, base: float = 1.0, K: int = 3) -> CostModel:
    """A synthetic machine: a target pass costs ``base + per_token * (new tokens - 1)`` per row count."""
    tokens = list(range(1, K + 2))
    return CostModel([1, 64], tokens, [[base + per_token * (t - 1) for t in tokens]] * 2, [drafter, drafter])


def drafted_at(plan) -> list[int]:
    """The rounds of ``plan`` (one ``draft_this_round`` answer a round) that drafted."""
    return [i for i, d in enumerate(plan) if d]


def plain_between(plan) -> list[int]:
    """Plain rounds before each drafted round of ``plan``, since the one before it."""
    at = drafted_at(plan)
    return [b - a - 1 for a, b in zip([-1, *at], at)]


def test_no_drafts_when_verification_cannot_pay_and_the_whole_block_when_acceptance_is_near_certain():
    conf_low = torch.full((4, 3), 0.3)
    assert AdaptivePolicy(costs(per_token=2.0)).verify_len(conf_low) == 0
    assert AdaptivePolicy(costs(per_token=0.0, drafter=0.01)).verify_len(torch.full((4, 3), 0.99)) == 3
    # in between: the first slot pays, later ones (less likely, as costly) do not
    assert AdaptivePolicy(costs(per_token=0.4)).verify_len(torch.tensor([[0.9, 0.3, 0.3]] * 4)) == 1
    assert expected_committed(torch.tensor([[0.5, 0.5, 1.0]])).tolist() == [[1.0, 1.5, 1.75, 2.0]]
    # two drafts predicted 4.8 % better than the whole block: two
    half = Calibration(bins=1, table=[[0.5]] * 3)
    assert AdaptivePolicy(costs(per_token=0.18), half).verify_len(torch.full((4, 3), 0.5)) == 2


def test_a_drafter_that_does_not_pay_reverts_to_plain_rounds_and_is_retried():
    policy = AdaptivePolicy(costs(per_token=0.5, drafter=0.5), retry_every=3, explore_share=1.0)
    assert policy.draft_this_round(ROWS)  # nothing known yet: draft
    assert policy.verify_len(torch.full((8, 3), 0.05)) == 0  # no draft worth verifying
    plan = [policy.draft_this_round(ROWS) for _ in range(19)]
    # plain rounds, retried after retry_every of them, then (retries failing: nothing better came in) twice as many
    every = policy.retry_every
    assert plain_between(plan) == [every, 2 * every] and policy.wait == 4 * every
    policy.width = 3
    for _ in range(6):  # drafting pays again (two of three drafts accepted): drafted rounds, and the wait resets
        policy.observe(torch.full((8,), 2), ROWS)
    assert policy.draft_this_round(ROWS) and policy.wait == 0 and policy.accept[0] > 0.85 > policy.accept[2]
    policy.observe(torch.zeros(8, dtype=torch.long), ROWS)  # a round that accepted nothing: realised, per slot
    assert policy.accept[0] < 0.65 and policy.draft_this_round(ROWS) is False
    good = AdaptivePolicy(costs(per_token=0.1, drafter=0.1))
    assert good.verify_len(torch.full((8, 3), 0.95)) == 3
    good.observe(torch.full((8,), 3), ROWS)
    assert good.accept == [1.0, 1.0, 1.0] and all(good.draft_this_round(ROWS) for _ in range(5))


def test_rounds_that_verify_nothing_back_off_to_plain_rounds():
    """A cheap drafter whose drafts are predicted just short of paying: each drafted round verifies none. Drafting
    must not go on paying the drafter for nothing; it backs off like any failing retry."""
    policy = AdaptivePolicy(costs(per_token=0.5, drafter=0.01), retry_every=8, explore_share=0.02)
    unsure = torch.full((8, 3), 0.46)  # one draft would commit 1.46 tokens for 1.51 s: 3 % short of plain decoding
    drafted = 0
    for _ in range(120):
        if policy.draft_this_round(ROWS):
            drafted += 1
            assert policy.verify_len(unsure) == 0
    # the first round, then retries once 2 % of the plain rounds' seconds pays for a retry's 0.51 s extra (26 plain
    # rounds), each waiting twice as long as the last (8, 16, 32): three retries, and the wait at its ceiling
    assert drafted == 4 and policy.wait == policy.max_retry_every
    # one unsure round blends in, it does not erase what verified rounds realised
    sure = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), accept=[0.9, 0.9, 0.9], width=3)
    assert sure.verify_len(torch.full((8, 3), 0.05)) == 0
    assert sure.accept == pytest.approx([0.9 * 0.7 + 0.05 * 0.3] * 3) and sure.draft_this_round(ROWS)


def test_slots_a_narrow_round_leaves_unverified_follow_its_prediction_not_a_past_burst():
    """After a burst of whole-block acceptance, rounds whose drafts are predicted to fail past the first slot verify
    one draft: the deep slots' running acceptance must follow that prediction (it is all that is known of them), or
    the burst's values keep drafting going round after round for one failing draft."""
    burst = AdaptivePolicy(costs(per_token=0.1, drafter=0.3), explore_share=1.0)
    assert burst.draft_this_round(ROWS) and burst.verify_len(torch.full((8, 3), 0.99)) == 3
    burst.observe(torch.full((8,), 3), ROWS)
    assert burst.accept == [1.0, 1.0, 1.0]
    drafted = 0
    for _ in range(20):
        if burst.draft_this_round(ROWS):
            drafted += 1
            assert burst.verify_len(torch.tensor([[0.3, 0.02, 0.02]] * 8)) == 1
            burst.observe(torch.tensor([1, 0, 0, 1, 0, 0, 0, 0]), ROWS)  # the first draft accepted as predicted
    # one draft at 1 in 4 and nothing past it cannot pay for a drafter round (with the burst's deep slots it would
    # seem to: 1.75 tokens per row for 1.6 s against 1 per 1 s): drafting stops once the running acceptance has
    # followed the rounds (smoothing 0.3), where the burst's deep slots would keep it going all 20 rounds
    assert burst.accept[1] < 0.2 and burst.accept[2] < 0.2
    assert drafted <= 8 and not burst.draft_this_round(ROWS)


def test_new_requests_start_from_the_deep_slots_rounds_predict_not_a_past_burst():
    """The same for the population new requests start from: after one request's burst verified every slot, requests
    whose drafts are predicted to fail past the first slot verify one draft each; the deep slots' population
    acceptance must take in those predictions (a row's worth per drafting row), or each new request, starting from
    the burst's deep slots, is drafted for at a loss (at one row the engine meets a new request every few rounds)."""
    policy = AdaptivePolicy(costs(per_token=0.1, drafter=0.6), explore_share=1.0)
    assert policy.draft_this_round([0], 1) and policy.verify_len(torch.full((1, 3), 0.99)) == 3
    policy.observe(torch.tensor([3]), [0])
    assert policy.population[1] > 0.95
    drafted = []
    for request in range(1, 21):  # a request a round, each drafted for from the population
        if policy.draft_this_round([request]):
            drafted.append(request)
            assert policy.verify_len(torch.tensor([[0.3, 0.02, 0.02]])) == 1
            policy.observe(torch.tensor([int(request % 4 == 0)]), [request])  # the first draft at 1 in 4
    # one draft at 1 in 4 cannot pay for a drafter round (at most 2 tokens for 1.7 s against 1 per 1 s); with the
    # burst's deep slots (3 drafts, 1 + 3 * a tokens for 1.9 s) it seems to while the first slot's is above 0.3
    assert len(drafted) <= 14 and not policy.draft_this_round([21]) and policy.population[1] < 0.5, drafted


def test_retries_are_spread_so_their_extra_cost_stays_a_small_share():
    """Where a drafted round costs several plain ones (many rows on a CPU), a failing retry every 8 rounds would
    cost more than drafting could win back: retries wait until ``explore_share`` of the plain rounds' seconds pays
    for their extra seconds."""
    policy = AdaptivePolicy(costs(per_token=1.0, drafter=1.0), explore_share=0.02, measured=False)  # 3 s against 1 s
    assert policy.draft_this_round(ROWS) and policy.verify_len(torch.full((8, 3), 0.05)) == 0
    plan = [policy.draft_this_round(ROWS) for _ in range(250)]
    extra, plain, share = 2.0, 1.0, 0.02  # a retry's seconds over a plain round's, a plain round's, explore_share
    assert plain_between(plan) == [round(extra / (share * plain))] * 2  # each retry paid for, as soon as it is
    # a retry that first fed the drafter 2 s of deferred features: that too is paid for before the next one, which
    # comes that many plain rounds later than it would have
    twin = deepcopy(policy)
    policy.observe_seconds(8, 1, 0, 3.0, flushed=2.0)
    flushed, unflushed = (drafted_at(p.draft_this_round(ROWS) for _ in range(250)) for p in (policy, twin))
    assert flushed[0] - unflushed[0] == round(2.0 / (share * plain))
    cheap = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), explore_share=0.02)  # 0.2 s extra: 10 rounds' worth
    assert cheap.draft_this_round(ROWS) and cheap.verify_len(torch.full((8, 3), 0.05)) == 0
    # the budget's 10 plain rounds first, then the backed-off wait (twice retry_every), whichever is longer
    assert plain_between(cheap.draft_this_round(ROWS) for _ in range(40)) == [10, 2 * cheap.retry_every]


def test_retries_stay_within_their_share_in_measured_seconds():
    """The exploring budget holds in measured seconds: retries that each take 2 s or 6 s over a plain round of 1 s
    cost, in all, at most ``explore_share`` of the plain rounds' seconds (and one retry's own), and the slower ones
    come three times as seldom."""
    low = torch.full((8, 3), 0.05)

    def retries(measured: float) -> list[int]:
        policy = AdaptivePolicy(costs(per_token=1.0, drafter=1.0), explore_share=0.02)  # plain rounds of 1 s
        assert policy.draft_this_round(ROWS) and policy.verify_len(low) == 0
        policy.observe_seconds(8, 8, 0, 1.0 + measured)  # the job's first round: not a retry, charged nothing
        at = []
        for i in range(2000):
            if policy.draft_this_round(ROWS):
                at.append(i)
                assert policy.verify_len(low) == 0
                policy.observe_seconds(8, 8, 0, 1.0 + measured)
            else:
                policy.observe_seconds(8, 0, 0, 1.0)
        return at

    counts = {}
    for measured in (2.0, 6.0):
        at = retries(measured)
        assert len(at) * measured <= 0.02 * (2000 - len(at)) + measured
        counts[measured] = len(at)
    assert counts[2.0] >= 3 * counts[6.0] - 1 and counts[6.0] >= 3


def test_new_requests_filling_half_the_batch_bring_the_retry_forward():
    """Requests admitted while drafting does not pay have unknown acceptance: once they are half the batch's running
    rows, drafting is retried after ``retry_every`` plain rounds instead of the (long) backed-off wait, which stays;
    the exploring budget still holds."""
    policy = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), explore_share=0.02)  # a failing retry: 0.2 s extra
    low = torch.full((8, 3), 0.05)
    assert policy.draft_this_round(ROWS) and policy.verify_len(low) == 0
    for _ in range(200):  # retries keep failing: the wait doubles up to 64
        if policy.draft_this_round(ROWS):
            assert policy.verify_len(low) == 0
    assert policy.wait == 64 and policy.skipped < 64
    while policy.skipped:  # up to the next retry
        if policy.draft_this_round(ROWS):
            assert policy.verify_len(low) == 0
    assert not any(policy.draft_this_round(ROWS) for _ in range(20))
    assert not any(policy.draft_this_round(ROWS, fresh=3) for _ in range(20))  # three of eight rows are new: not enough
    assert policy.draft_this_round(ROWS, fresh=4)  # four of eight: this round probes them
    assert policy.verify_len(low) == 0  # the new rows do not pay either: back to waiting
    assert plain_between(policy.draft_this_round(ROWS) for _ in range(65)) == [policy.wait]  # the wait that stayed
    poor = AdaptivePolicy(costs(per_token=1.0, drafter=1.0), explore_share=0.02)  # a probe: 2 s extra
    assert poor.draft_this_round(ROWS) and poor.verify_len(low) == 0
    # new requests or not, a probe waits until the exploring budget pays for it (2 % of 1 s plain rounds)
    assert plain_between(poor.draft_this_round(ROWS, fresh=8) for _ in range(101)) == [round(2.0 / 0.02)]


def test_new_requests_start_from_the_acceptance_drafted_requests_had():
    """A stretch of failing rounds (the requests' hard tails) stops drafting for them; requests admitted after it start
    from the slowly averaged acceptance of every drafted round, and are drafted for at once where that pays."""
    policy = AdaptivePolicy(costs(per_token=0.2, drafter=0.2))
    assert policy.draft_this_round(ROWS) and policy.verify_len(torch.full((8, 3), 0.95)) == 3
    for _ in range(40):
        policy.observe(torch.full((8,), 3), ROWS)  # requests whose drafts are all accepted
    for _ in range(5):
        policy.observe(torch.zeros(8, dtype=torch.long), ROWS)  # then a tail where none are
    assert policy.accept[0] < 0.2 < 0.7 < policy.population[0]
    assert not policy.draft_this_round(ROWS)
    assert policy.draft_this_round(list(range(8, 16)))  # new requests


def test_drafting_is_judged_on_the_requests_still_running():
    """Two of eight requests accept every draft, six none: drafting for all eight pays (14 tokens for 1.4 s against 8
    for 1 s). Once the two end, the six left must decode plainly; the batch's running acceptance (one in four at the
    first slot, the deep slots reached only by the two) would keep drafting for them (1.75 tokens each for 1.4 s)."""
    policy = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), measured=False)
    rows = list(range(8))
    assert policy.draft_this_round(rows, 8)  # the job's first round explores
    for _ in range(6):
        policy.verify_len(torch.full((8, 3), 0.9))
        policy.observe(torch.tensor([3, 3, 0, 0, 0, 0, 0, 0]), rows)
    assert policy.draft_this_round(rows)
    assert not policy.draft_this_round(rows[2:])


def test_a_request_that_stopped_drafting_drifts_back_to_the_population():
    """A request whose drafts failed for a stretch decodes plainly; each plain round weighs its own record less
    against the population's (here: drafting pays), so it drafts again without spending the exploring budget (a
    drafter that recovers at the end of an answer is not missed); with ``drift=1`` only the exploring budget's retry
    comes back (its 1.2 s extra earned at 1.5 % of 1 s plain rounds: 80 rounds)."""
    for drift, back in ((0.9, range(5, 15)), (1.0, range(78, 83))):
        policy = AdaptivePolicy(costs(per_token=0.3, drafter=0.3), measured=False, drift=drift, explore_share=0.015)
        assert policy.draft_this_round([0, 1], 2)
        policy.verify_len(torch.full((2, 3), 0.9))
        for _ in range(20):
            policy.observe(torch.tensor([3, 3]), [0, 1])  # two requests: every draft accepted
        policy.new_job()
        assert policy.draft_this_round([5], 1)  # a new request starts from the population: it drafts
        for _ in range(4):
            policy.observe(torch.tensor([0]), [5])  # then its drafts fail
        plan = [policy.draft_this_round([5]) for _ in range(100)]
        assert plan.index(True) in back and (policy.wait == 0) == (drift < 1)  # drift: a paying round, not a retry


def exact_rates(policy: AdaptivePolicy) -> list[int]:
    """Counts the rounds ``policy`` computed the exact drafted rate for (over the rows' records): one element."""
    calls, exact = [0], policy._drafted_rate

    def counted(rows):
        calls[0] += 1
        return exact(rows)

    policy._drafted_rate = counted
    return calls


def _costs_by_context(per_token: float, drafter: float) -> CostModel:
    """:func:`costs` measured at 256 tokens of cache a row, and at 64 with the plain pass 60 % cheaper (attention over
    the cache weighs most on it): drafting pays better at longer contexts."""
    model = costs(per_token=per_token, drafter=drafter)
    short = [[c - 0.6 * model.target_s[0][0] for c in row] for row in model.target_s]
    return CostModel(model.rows, model.tokens, model.target_s, model.drafter_s, {}, 256,
                     {"context": 64, "target_s": short, "drafter_s": model.drafter_s})


@pytest.mark.parametrize("world", ["model-only", "measured", "by-context"])
@pytest.mark.parametrize("seed", range(3))
def test_rounds_decided_on_the_bound_decide_as_the_exact_rate(seed, world):
    """After a plain round the policy first asks an upper bound of the drafted rate over any requests (``bounded``),
    kept while the acceptance stands; only where it could pay is the exact rate over the rows' drifting records
    computed. Over random requests of mixed skill, arrivals and endings, with (``measured``) noisy measured seconds,
    slower than modelled at some sizes, and (``by-context``) costs priced at a context that grows a token a round and
    falls as requests are replaced, the plans, the retry waits and the exploring budget are those of the policy
    deciding every round on the exact rate, round for round, while many plain rounds skip it; drafting stops and
    comes back (drift included)."""
    g = torch.Generator().manual_seed(seed)
    plans, credits, exact = [], [], []
    for bounded in (True, False):
        g.manual_seed(seed)
        policy = AdaptivePolicy(_costs_by_context(0.3, 0.3) if world == "by-context" else costs(0.3, 0.3),
                                explore_share=0.02, measured=world != "model-only", bounded=bounded)
        calls = exact_rates(policy)
        good = 0.5 if world == "model-only" else 0.1
        skill = (torch.rand(60, generator=g) < good).float() * 0.9 + 0.02  # each request's chance per draft
        rows, fresh, plan, credit, context = [0, 1, 2, 3], 0, [], [], 40.0
        for _ in range(600):
            if torch.rand(1, generator=g) < 0.05:  # a request ends, and the next may arrive
                arrived = [max(rows) + 1] if torch.rand(1, generator=g) < 0.7 and max(rows) < 59 else []
                rows = rows[1:] + arrived
                fresh = min(fresh + 1, len(rows))
                rows = rows or [max(rows, default=0) + 1]
                context = 40 + (context - 40) / 2
            if world == "by-context":
                policy.at_context(context)
            context += 1
            m = len(rows) if policy.draft_this_round(rows, fresh) else 0
            if bounded and policy.accept:  # the bound over any requests holds for these
                assert policy._ceiling_rate(len(rows)) * (1 + 1e-9) >= AdaptivePolicy._drafted_rate(policy, rows)
            plan.append((m, policy.skipped, policy.wait))
            credit.append(policy._credit)
            k = 0
            if m:
                fresh = 0
                k = policy.verify_len(torch.full((m, 3), 0.7))
                n = (torch.rand(m, 3, generator=g) < skill[rows][:, None]).long().cumprod(1).sum(1).clamp(max=k)
                if k:
                    policy.observe(n, rows)
            model = (policy.costs.drafter(m) if m else 0.0) + policy.costs.target(len(rows), k + 1)
            slow = 1.6 if len(rows) < 3 else 1.0  # a machine slower than modelled at few rows
            policy.observe_seconds(len(rows), m, k, model * slow * float(0.7 + 0.7 * torch.rand(1, generator=g)))
        plans.append(plan)
        credits.append(credit)
        exact.append(calls[0])
    assert plans[0] == plans[1] and credits[0] == credits[1]
    drafted = sum(m > 0 for m, _, _ in plans[0])
    assert exact[1] == 599  # every round but the first
    if world != "model-only":  # few good requests: the bound over any of them settles many plain rounds
        assert exact[0] <= exact[1] - 20, exact
    assert sum(a > 0 and b == 0 for (a, _, _), (b, _, _) in zip(plans[0][1:], plans[0])) >= 2  # drafting came back
    assert 0 < drafted < 500


def test_plain_rounds_of_poor_requests_ending_one_by_one_skip_the_rows_records():
    """Many rows whose requests all drafted poorly, one ending every round (a static batch's tail): the bound over
    any requests says no round can pay, so plain rounds are decided without a pass over the rows' records, and
    exactly as on the exact rate; once a request that drafts well is known, the rows' records are asked again."""
    plans = []
    for bounded in (True, False):
        policy = AdaptivePolicy(costs(per_token=0.3, drafter=0.3), measured=False, bounded=bounded)
        rows = list(range(64))
        while policy.draft_this_round(rows):  # rounds that draft accept nothing, until it stops
            if policy.verify_len(torch.full((len(rows), 3), 0.7)):
                policy.observe(torch.zeros(len(rows), dtype=torch.long), rows)
            rows = rows[1:]
        calls = exact_rates(policy)
        plan = []
        for _ in range(20):
            rows = rows[1:]  # a request ends every round
            plan.append(policy.draft_this_round(rows))
        plans.append(plan)
        assert calls[0] == (0 if bounded else 20)
        policy.verify_len(torch.full((1, 3), 0.9))
        policy.observe(torch.tensor([3]), [1000])  # a request known to accept every draft
        assert not policy.draft_this_round(rows) and calls[0] == (1 if bounded else 21)  # the bound asks the rows
    assert plans[0] == plans[1] == [False] * 20


def test_measured_round_seconds_rescale_the_cost_model():
    """The cost model times the target's and drafter's passes; a round also samples, verifies, commits and feeds
    the drafter. Where measured drafted rounds cost three times what the model says (plain ones as modelled),
    drafting that the model says pays stops; one slow round moves the ratio by at most a step."""
    policy = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), accept=[0.5, 0.5, 0.5], width=3)
    assert policy.draft_this_round(ROWS)  # modelled: 1.875 tokens per row for 1.4 s against 1 per 1 s
    policy.observe_seconds(8, 0, 0, 1.0)
    for _ in range(30):
        policy.observe_seconds(8, 8, 3, 3 * 1.4)
    assert policy.measured_ratio("drafted") == pytest.approx(3.0, rel=0.05) and not policy.draft_this_round(ROWS)
    policy.observe_seconds(8, 0, 0, 100.0)  # a stall (another process, a collection) in one plain round
    assert policy.measured_ratio("plain") == pytest.approx(1.1)
    model_only = AdaptivePolicy(costs(per_token=0.1, drafter=0.1), accept=[0.5, 0.5, 0.5], width=3, measured=False)
    model_only.observe_seconds(8, 8, 3, 3 * 1.4)
    assert model_only.draft_this_round(ROWS)


def test_the_policy_learns_from_the_drafts_rows_committed():
    """Drafts accepted past a row's stop token or cap commit nothing: the policy's running acceptance counts what
    each drafting row committed, which is what a round's worth is."""
    target, oracle = bigram_oracle(2)
    seen = []

    class Recording(AdaptivePolicy):
        def observe(self, num_accepted, rows):
            seen.append(num_accepted.tolist())
            super().observe(num_accepted, rows)

    caps = [2, 3, 5, 9]
    got = generate(target, PROMPTS[:4], GenerationConfig(max_new_tokens=caps), drafter=oracle,
                   policy=Recording(costs(per_token=0.0, drafter=0.0), measured=False))
    emitted = [[e - 1 for e, v in zip(r.accept_lengths, r.verified) if v] for r in got]
    accepted = [[a for a, v in zip(r.accepted, r.verified) if v] for r in got]
    assert sorted(x for rnd in seen for x in rnd) == sorted(x for row in emitted for x in row)
    assert sum(map(sum, emitted)) < sum(map(sum, accepted))  # short caps cut accepted runs


def test_calibration_maps_confidence_to_the_observed_acceptance():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(4000, 3, generator=g)
    truth = conf ** 2  # the drafter is over-confident
    hit = torch.rand(4000, 3, generator=g) < truth
    accepted = hit.long().cumprod(1).sum(1)
    cal = Calibration.fit(conf, accepted)
    probe = torch.tensor([[0.15, 0.55, 0.95]])
    torch.testing.assert_close(cal(probe), probe ** 2, atol=0.08, rtol=0.0)
    assert torch.equal(Calibration()(probe), probe)  # uncalibrated: the confidence itself


@pytest.mark.parametrize("per_token,right", [(0.0, 2), (0.3, 2), (5.0, 2), (0.0, 0)],
                         ids=["free-verify", "costly-verify", "never-pays", "never-accepted"])
def test_greedy_output_is_the_targets_under_the_policy(per_token, right):
    target, oracle = bigram_oracle(right)
    for stop in ((3,), ()):  # with a stop token the rows end early; without one they run to their caps
        gen = GenerationConfig(max_new_tokens=CAPS, stop_token_ids=stop)
        want = generate(target, PROMPTS, gen)
        for batching in ({"slots": 3, "prefill_chunk": 2}, {}):  # continuous (requests join mid-way), static
            # decisions on the synthetic machine alone: measured seconds of rounds this small tie plain and drafted
            # rounds within the machine's noise
            policy = AdaptivePolicy(costs(per_token), retry_every=2, measured=False)
            reported = []  # (rows, rows drafting) of each round the engine reported the seconds of
            real = policy.observe_seconds
            policy.observe_seconds = lambda b, drafting, *a, **k: reported.append((b, drafting)) or real(
                b, drafting, *a, **k)
            got = generate(target, PROMPTS, gen, drafter=oracle, policy=policy, **batching)
            assert [r.tokens for r in got] == [r.tokens for r in want]
            assert len(reported) == max(len(r.verified) for r in got) or batching  # every round of a static batch
            if right == 0 and not stop:  # plain rounds and drafted ones were both reported
                assert {d == 0 for _, d in reported} == {True, False}
    verified = [v for r in got for v in r.verified]
    assert all(a <= v for r in got for a, v in zip(r.accepted, r.verified))
    if per_token == 0.0 and right == 2:
        assert max(verified) == 3 and max(a for r in got for a in r.accepted) == 2
    if per_token == 5.0:
        assert set(verified) == {0}  # verification never pays: plain decoding throughout
    if right == 0:  # nothing is accepted: mostly plain rounds, with retries
        assert verified.count(0) > len(verified) // 2 and max(verified) > 0
    fixed = generate(target, PROMPTS, gen, drafter=oracle)
    assert {v for r in fixed for v in r.verified} == {3}


@pytest.mark.parametrize("budget", [32_768, 0], ids=["deferred", "fed-at-admission"])
def test_deferred_prompt_ingest_leaves_every_draft_unchanged(budget, monkeypatch):
    """Under a policy the drafter ingests admitted prompts only when drafting resumes (or at admission, past the
    deferral budget). A policy that always drafts the whole block must then see the fixed engine's drafts, row by
    row and round by round (a prompt fed late, twice or to the wrong row changes a real drafter's logits), static
    and continuous with chunked prefill."""
    monkeypatch.setattr(rounds, "MAX_DEFERRED_TOKENS", budget)
    target = make_target(seed=3, vocab=48)
    drafter = make_drafter(target, seed=2, block_size=4)
    gen = GenerationConfig(max_new_tokens=CAPS)
    for batching in ({}, {"slots": 3, "prefill_chunk": 2}):
        drafts = []
        free = AdaptivePolicy(costs(per_token=0.0, drafter=0.0), measured=False)  # verifying is free
        for policy in (None, free):
            seen: dict[int, list] = {}
            generate(target, PROMPTS, gen, drafter=drafter, policy=policy, **batching,
                     observer=lambda rec: [seen.setdefault(r, []).append(d) for r, d in
                                           zip(rec.rows.tolist(), rec.draft_tokens.tolist())])
            drafts.append(seen)
        assert drafts[0] == drafts[1] and sum(len(v) for v in drafts[0].values()) > len(PROMPTS)


def test_the_shared_greedy_harness_passes_with_narrower_rounds():
    target = make_target(seed=3, vocab=48)
    half = Calibration(bins=1, table=[[0.5]] * 4)  # two of the four drafts pay at these costs
    widths = []

    def engine(*args, **kwargs):  # a fresh policy per call, as each decode job builds one
        results = generate(*args, **kwargs, policy=AdaptivePolicy(costs(per_token=0.2, K=4), half, measured=False))
        widths.extend(v for r in results for v in r.verified)
        return results

    def factory(prompts):
        return ControlledDrafter(target, prompts, 5, mode="oracle", inner=make_drafter(target, seed=2, block_size=5))

    got = check_greedy(target, factory, RAGGED_PROMPTS, RAGGED_CAPS, engine=engine)
    assert got["mismatches"] == 0, got
    assert set(widths) == {2} and got["partial"] > 0 and got["none"] > 0, got


@pytest.mark.slow
@pytest.mark.parametrize("right", [2, 0], ids=["narrow-rounds", "plain-rounds-mixed-in-continuous"])
def test_sampled_output_fits_the_target_distribution_under_the_policy(right):
    """Narrow rounds on one static batch; plain rounds mixed in under continuous batching (1024 slots for 6000 rows,
    admitted rows prefilled a token per round)."""
    target, oracle = bigram_oracle(right)
    half = Calibration(bins=1, table=[[0.5]] * 3)  # every slot accepted half the time: one draft pays, not three
    widths = []
    batching = {} if right else {"slots": 1024, "prefill_chunk": 1}

    def engine(*args, **kwargs):
        results = generate(*args, **kwargs, **batching,
                           policy=AdaptivePolicy(costs(per_token=0.3), half, retry_every=2, measured=False,
                                                explore_share=0.005 if right else 0.5))
        widths.extend(v for r in results for v in r.verified)
        return results

    check = sampling_pvalues(target, lambda p: oracle, SAMPLING_SETTINGS[0], n=6000, engine=engine)
    assert check.min_p > ALPHA, check
    if right:  # one draft verified per round, often accepted (requests left with a poor record of their own at the
        # end may decode plainly)
        assert set(widths) <= {0, 1} and widths.count(1) > 10 * widths.count(0) and check.profile["partial"] > 0
    else:  # drafts that rarely pay: plain rounds between drafted retries of every row
        assert set(widths) == {0, 1}


def test_measured_costs_grow_with_rows_and_tokens():
    target = make_target(seed=0, vocab=64)
    drafter = make_drafter(target, block_size=5)
    model = measure_costs(target, drafter, rows=(1, 4), tokens=(1, 5), context=32, repeats=1)
    assert model.tokens == [1, 5] and len(model.target_s) == 2 and all(s > 0 for s in model.drafter_s)
    assert model.target(2, 3) > 0 and model.drafter(2) > 0


def test_a_retrace_drafters_round_is_timed_with_the_prior_a_round_carries():
    """ReTrace's drafted round fuses the prior the round before carried and builds the next: both are in its price
    (a round rejected at its first draft carries the longest prior)."""
    target = make_target(seed=0, vocab=64)
    drafter = retrace_from(make_drafter(target, block_size=5), active=True)
    priors = []
    embeds = drafter.block_embeds
    drafter.block_embeds = lambda blk, state, **kw: priors.append(state) or embeds(blk, state, **kw)
    model = measure_costs(target, drafter, rows=(1, 4), tokens=(1, 5), context=32, repeats=1, short_context=0)
    assert all(s > 0 for s in model.drafter_s)
    carried = [p for p in priors if p is not None]
    assert len(carried) == len(priors) - 2 and all(bool(p.valid[:, 1:].all()) for p in carried)  # but the first


@torch.inference_mode()
def test_deferred_ingest_fills_the_drafter_context_as_ingesting_every_round():
    """Prompts' and plain rounds' features wait in the backlog through an admission and a compaction; one flush
    leaves the drafter's context cache as ingesting them pass by pass would (a prompt's features concatenated, or
    the layers' outputs as views, followed by plain rounds' entries, concatenated or split, kept whole for every row
    until the rows change)."""
    target = make_target(seed=0, vocab=64, layers=6)
    drafter = make_drafter(target, block_size=4)
    assert len(set(drafter.target_layer_ids)) == 2  # distinct layers: a split piece's columns in the wrong order show
    tokens = torch.randint(0, 64, (3, 9))
    feats = target(tokens, feature_layers=drafter.target_layer_ids).features  # [3, 8, F]
    split = target(tokens, feature_layers=drafter.target_layer_ids, concat_features=False).features  # [3, 8, D] each
    ref, got = drafter.new_cache(2, 40), drafter.new_cache(2, 40)  # ingested pass by pass / deferred
    drafter.ingest(ref, feats[:2, :3], torch.tensor([3, 2]))  # two prompts (3 and 2 tokens)
    backlog = Backlog()
    backlog.add(feats[:2, :3], torch.tensor([3, 2]))
    one = torch.ones(2, dtype=torch.long)
    for t in (3, 4):  # two plain rounds
        drafter.ingest(ref, feats[:2, t:t + 1], one)
        backlog.add(feats[:2, t:t + 1])
    new_ref, new_got = drafter.new_cache(1, 40), drafter.new_cache(1, 40)  # a third request joins with its prompt
    drafter.ingest(new_ref, feats[2:, :4], torch.tensor([4]))
    joining = Backlog()
    joining.add(tuple(x[2:, :6] for x in split), torch.tensor([4]))  # the layers' outputs, padded past 4: views
    ref.cat_rows(new_ref)
    got.cat_rows(new_got)
    backlog.cat_rows(joining, 2, 1)
    for t in (5, 6):  # plain rounds of the engine: the layers' outputs, whole (a concatenated one first)
        drafter.ingest(ref, feats[:, t:t + 1], torch.ones(3, dtype=torch.long))
        backlog.add(feats[:, t:t + 1] if t == 5 else tuple(x[:, t:t + 1] for x in split))
    keep = torch.tensor([1, 2])  # the first request ends
    for c in (ref, got):
        c.select_rows(keep)
    backlog.select(keep)
    for t in (7, 8):
        drafter.ingest(ref, feats[1:, t:t + 1], one)
        backlog.add(tuple(x[1:, t:t + 1] for x in split))
    assert backlog.tokens == 2 + 6 + 4 + 4  # the ended row's entries are no longer counted
    backlog.flush(drafter, got)
    assert ref.lengths.tolist() == got.lengths.tolist() == [2 + 6, 4 + 4] and backlog.rows == [[], []]
    assert backlog.tokens == 0
    for t in (9, 10):  # plain rounds after the flush: a row's backlog that starts with a run
        more = target(tokens[1:, :2], feature_layers=drafter.target_layer_ids, concat_features=False).features
        drafter.ingest(ref, torch.cat(more, -1)[:, t - 9:t - 8], one)
        backlog.add(tuple(x[:, t - 9:t - 8] for x in more))
    backlog.flush(drafter, got)
    for row, n in enumerate(ref.lengths.tolist()):
        for a, b in zip(ref.k + ref.v, got.k + got.v):
            torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-5, atol=1e-5)
    backlog.add(feats[1:, 7:8])  # rows holding chunks all end, and a request joins after them: nothing to feed
    backlog.select(torch.tensor([], dtype=torch.long))
    backlog.cat_rows(Backlog(), 0, 1)
    backlog.flush(drafter, None)
    assert backlog.rows == [[]]
