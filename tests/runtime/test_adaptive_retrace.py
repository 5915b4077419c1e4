"""ReTrace under the adaptive policy: the prior covers the drafts a round verified (all of them, or the first ``k`` of
a narrow round), starts over after a plain round, and the output stays the target's (greedy equality with drafts
accepted, ragged batches, stop tokens; goodness of fit under sampling)."""

import pytest
import torch

from specdraft.runtime.calibration import Calibration
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.models.retrace import build_prior, verify_stats
from specdraft.runtime.policy import AdaptivePolicy
from tests.helpers import make_drafter, make_target, retrace_from
from tests.lossless import (
    RAGGED_CAPS,
    RAGGED_PROMPTS,
    SAMPLING_SETTINGS,
    ControlledDrafter,
    check_greedy,
    sampling_pvalues,
)
from tests.runtime.test_policy import CAPS, PROMPTS, costs

ALPHA = 1e-3


def test_a_narrow_rounds_prior_is_the_whole_rounds_on_the_slots_it_verified():
    """A round that verified the first ``k`` of ``K`` drafts retains what the whole round would on its rejected slots
    up to ``k``, and nothing past ``k`` (no verify pass scored them)."""
    g = torch.Generator().manual_seed(0)
    b, Bk, D, V, k = 3, 6, 8, 11, 3
    hidden = torch.randn(b, Bk, D, generator=g)  # [b, Bk, D]
    drafts = torch.randint(0, V, (b, Bk - 1), generator=g)  # [b, K]
    logits = torch.randn(b, Bk, V, generator=g)  # [b, K + 1, V]
    context = torch.randn(b, Bk, D, generator=g)  # [b, K + 1, D]
    accepted = torch.tensor([0, 1, 3])  # a row that accepted all k leaves nothing
    embed = torch.nn.Embedding(V, D)
    whole = build_prior(hidden, drafts, accepted, verify_stats(logits, drafts), context, embed)
    narrow = build_prior(hidden, drafts[:, :k], accepted, verify_stats(logits[:, :k + 1], drafts[:, :k]),
                         context[:, :k + 1], embed)
    assert narrow.valid.tolist() == [[s in (1, 2, 3) for s in range(Bk)], [s in (2, 3) for s in range(Bk)],
                                     [False] * Bk]
    assert torch.equal(narrow.shift, whole.shift)
    assert torch.equal(narrow.valid, whole.valid & (torch.arange(Bk) <= k))
    for got, want in ((narrow.hidden, whole.hidden), (narrow.signals, whole.signals)):
        torch.testing.assert_close(got[narrow.valid], want[narrow.valid])


def _drafters(target, block_size: int = 4):
    """A random DFlash drafter and a ReTrace drafter on a copy of it whose fusion is active (its prior moves its
    drafts; with no prior it drafts as the DFlash one)."""
    dflash = make_drafter(target, seed=2, block_size=block_size, std=0.3)
    retrace = retrace_from(make_drafter(target, seed=2, block_size=block_size, std=0.3), active=True)
    return dflash, retrace


def _hidden_by_position(target, drafter, policy, batching):
    """The drafter's block hidden states ``[Bk, D]`` of each drafted round, keyed by (request, tokens committed
    before it), with whether the request's round before was plain; and the tokens."""
    seen, done, plain_before = {}, {}, {}

    def observe(rec):
        width = rec.draft_tokens.shape[1]
        for i, (r, a) in enumerate(zip(rec.rows.tolist(), rec.num_accepted.tolist())):
            if width:
                seen[r, done.get(r, 0)] = (rec.hidden[i].clone(), plain_before.get(r, False))
            plain_before[r] = width == 0
            done[r] = done.get(r, 0) + a + 1

    out = generate(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS), drafter=drafter,
                   policy=policy, observer=observe, **batching)
    return seen, [r.tokens for r in out]


@pytest.mark.parametrize("batching", [{}, {"slots": 4, "prefill_chunk": 2}], ids=["static", "continuous"])
def test_a_policy_verifying_every_draft_drafts_what_the_fixed_retrace_engine_drafts(batching):
    """Where verifying is free the policy drafts the whole block every round: each round's hidden states are then the
    fixed ReTrace engine's, its prior carried from round to round (and that prior moved them: the DFlash backbone
    alone drafts otherwise)."""
    target = make_target(seed=3, vocab=48)
    dflash, retrace = _drafters(target)
    free = AdaptivePolicy(costs(per_token=0.0, drafter=0.0), measured=False)
    fixed, want = _hidden_by_position(target, retrace, None, batching)
    got, tokens = _hidden_by_position(target, retrace, free, batching)
    backbone, _ = _hidden_by_position(target, dflash, None, batching)
    assert tokens == want and got.keys() == fixed.keys() and len(got) > len(PROMPTS)
    for key in got:
        torch.testing.assert_close(got[key][0], fixed[key][0], rtol=1e-4, atol=1e-5)
    both = [key for key in fixed if key in backbone]
    assert sum(not torch.allclose(fixed[key][0], backbone[key][0], rtol=1e-4, atol=1e-5) for key in both) > len(
        PROMPTS)


def test_a_round_drafted_after_a_plain_one_drafts_with_no_prior():
    """Drafts predicted right 9 times in 10 and never accepted: drafted rounds, then plain ones with retries. A
    retry's block is the DFlash backbone's at the same position (the prior of the block before the plain rounds is
    gone: its slots no longer line up with the text), while a round after a drafted one carries that round's prior;
    the output is the target's."""
    target = make_target(seed=3, vocab=48)
    dflash, retrace = _drafters(target)
    sure = Calibration(bins=1, table=[[0.9]] * 3)
    policy = AdaptivePolicy(costs(per_token=0.1), sure, retry_every=2, max_retry_every=2, measured=False)
    got, tokens = _hidden_by_position(target, retrace, policy, {"slots": 4, "prefill_chunk": 2})
    backbone, want = _hidden_by_position(target, dflash, None, {})
    assert tokens == want
    same = {key: torch.allclose(h, backbone[key][0], rtol=1e-4, atol=1e-5) for key, (h, _) in got.items()
            if key in backbone}
    retries = [key for key in same if got[key][1]]
    chained = [key for key in same if not got[key][1] and key[1] > 0]  # after a drafted round of the request's
    assert len(retries) > 3 and all(same[key] for key in retries)
    assert len(chained) > 3 and not any(same[key] for key in chained)


def _controlled(target, mode: str, alpha: float = 0.8):
    return lambda prompts: ControlledDrafter(target, prompts, 5, mode=mode, alpha=alpha, inner=retrace_from(
        make_drafter(target, seed=2, block_size=5), active=True))


def test_the_shared_greedy_harness_passes_with_narrow_retrace_rounds():
    """Two of four drafts verified a round (the calibrated acceptance makes the other two cost more than they
    commit): the harness passes with drafts accepted, ragged rows and a stop token."""
    target = make_target(seed=3, vocab=48)
    half = Calibration(bins=1, table=[[0.5]] * 4)
    widths = []

    def engine(*args, **kwargs):  # a fresh policy per call, as each decode job builds one
        results = generate(*args, **kwargs, policy=AdaptivePolicy(costs(per_token=0.2, K=4), half, measured=False))
        widths.extend(v for r in results for v in r.verified)
        return results

    got = check_greedy(target, _controlled(target, "oracle"), RAGGED_PROMPTS, RAGGED_CAPS, engine=engine)
    assert got["mismatches"] == 0, got
    assert set(widths) == {2} and got["partial"] > 0 and got["none"] > 0, got


@pytest.mark.slow
def test_sampled_output_fits_the_target_distribution_with_retrace_under_the_policy():
    """Drafts accepted now and then, at costs where one draft barely pays: one-draft rounds (the prior covers that
    slot) and plain rounds (it starts over) mixed under sampling, with continuous batching and one prompt token
    prefilled a round. The joints of the first tokens, of the tokens around the first round's end and of later ones
    fit the target's."""
    target = make_target(seed=7, vocab=6, std=0.5)
    half = Calibration(bins=1, table=[[0.5]] * 4)
    widths = []

    def engine(*args, **kwargs):
        policy = AdaptivePolicy(costs(per_token=0.3, K=4), half, retry_every=2, explore_share=0.5, measured=False)
        results = generate(*args, **kwargs, slots=1024, prefill_chunk=1, policy=policy)
        widths.extend(v for r in results for v in r.verified)
        return results

    check = sampling_pvalues(target, _controlled(target, "mix", alpha=0.3), SAMPLING_SETTINGS[1], n=6000,
                             engine=engine)
    assert check.min_p > ALPHA, check
    assert set(widths) == {0, 1} and check.profile["partial"] > 0, (set(widths), check.profile)
