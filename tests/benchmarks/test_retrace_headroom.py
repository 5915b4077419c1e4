"""benchmarks/retrace_headroom.py: the prior's slot alignment on a hand-built round, and the recorder replaying the
engine (its committed tokens are the engine's output; its replayed fresh acceptance is the engine's)."""

import sys
from pathlib import Path

from specdraft.runtime.decode import GenerationConfig, generate
from tests.helpers import make_drafter, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from retrace_headroom import RULES, Round, aggregate, record_rounds, round_headroom  # noqa: E402


def _round(drafts, accepted, target_argmax, top3=None, p_draft=None):
    K = len(drafts)
    return Round(drafts, accepted, target_argmax, top3 or [[d, -1, -2] for d in drafts], p_draft or [0.0] * K)


def test_rejected_suffix_that_is_the_true_continuation_shifted_by_n_plus_1_is_counted_at_the_right_slots():
    # true text after the previous anchor: 10 11 12 13 14 15 16; the previous round drafted 10 99 12 13 14 (n = 1,
    # slot 2 rejected, corrected to 11). The next round's slot j is the old slot j + 2: 12, 13, 14 are right there.
    prev = _round([10, 99, 12, 13, 14], 1, [10, 11, 50, 51, 52, 53])
    truth = [12, 13, 14, 15, 16]  # the next round's slots 1..5
    fresh_wrong = _round([0, 0, 0, 0, 0], 0, [12] * 6)
    got = round_headroom(prev, fresh_wrong, truth)
    assert got["fresh"] == 0
    assert got["copy"] == 3 and got["oracle_copy"] == 3  # old slots 3, 4, 5; old slot 6 does not exist
    assert got["target"] == 0 and got["oracle_all"] == 3  # the target's argmax there (50, 51, 52) is wrong
    # one slot off in either direction would read 99/12 or 13/14 at slot 1 and find nothing
    fresh_then_copy = _round([12, 13, 0, 15, 0], 2, [0] * 6)
    got = round_headroom(prev, fresh_then_copy, truth)
    assert got["fresh"] == 2 and got["oracle_copy"] == 4 and got["copy"] == 4
    # the target's aligned argmax rescues slot 1 only when it holds the true token
    prev_t = _round([10, 99, 0, 0, 0], 1, [10, 11, 12, 13, 7, 7])
    got = round_headroom(prev_t, fresh_wrong, truth)
    assert got["target"] == 2 and got["oracle_all"] == 2 and got["oracle_copy"] == 0


def test_rerank_takes_the_prior_only_from_the_drafters_own_top3():
    prev = _round([10, 99, 0, 0, 0], 1, [10, 11, 12, 0, 0, 0])
    truth = [12, 13, 14, 15, 16]
    in_top = _round([5, 13, 14, 15, 0], 0, [0] * 6, top3=[[5, 12, 6], [13, 1, 2], [14, 1, 2], [15, 1, 2], [0, 1, 2]])
    not_in_top = _round([5, 13, 14, 15, 0], 0, [0] * 6, top3=[[5, 6, 7], [13, 1, 2], [14, 1, 2], [15, 1, 2],
                                                               [0, 1, 2]])
    assert round_headroom(prev, in_top, truth)["rerank_target"] == 4
    assert round_headroom(prev, not_in_top, truth)["rerank_target"] == 0
    assert round_headroom(prev, not_in_top, truth)["oracle_fresh_top3"] == 0


def test_recorder_replays_the_engine_and_oracles_never_lose():
    target = make_target()
    drafter = make_drafter(target, block_size=5)
    gen = GenerationConfig(max_new_tokens=40)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    decoded = [record_rounds(target, drafter, p, gen) for p in prompts]
    for p, (rounds, committed) in zip(prompts, decoded):
        out = generate(target, [p], gen)[0].tokens  # target alone
        assert committed[: len(out) - 1] == out[1:]  # committed starts after the first (prefill) token
        engine = generate(target, [p], gen, drafter=drafter)[0].accept_lengths  # tokens emitted per round
        assert [r.accepted + 1 for r in rounds][:-1] == engine[:-1]  # the last round may be cut by the cap
        assert len(rounds) == len(engine) and rounds[-1].accepted + 1 >= engine[-1]
    assert "next_round_state" not in vars(drafter)  # the spy is removed
    res = aggregate(decoded)  # raises if the replayed fresh acceptance differs from the engine's
    assert res["post_rejection_rounds"] > 0  # the random drafter is rejected: the recorded rounds carry priors
    assert all(res[f"tau_ratio_{r}"] >= 1.0 for r in RULES if r.startswith("oracle"))


def test_aggregate_reads_each_rounds_truth_from_the_committed_text():
    # round 0 accepts 10, rejects 99 and commits the target's 11; round 1 (anchor 11) drafts nothing right and
    # commits the target's 12, which round 0 had drafted at the aligned slot 3
    r0 = _round([10, 99, 12, 13, 14], 1, [10, 11, 50, 51, 52, 53], p_draft=[0.9, 0.3, 0.1, 0.1, 0.1])
    r1 = _round([0, 0, 0, 0, 0], 0, [12, 1, 1, 1, 1, 1])
    res = aggregate([([r0, r1], [10, 11, 12])])
    assert res["post_rejection_rounds"] == 1 and res["tau"] == 1.5
    assert res["mean_accepted_fresh"] == 0 and res["mean_accepted_oracle_copy"] == 1
    bins = res["first_fail_by_p_target_rejected"]
    assert [b["slots"] for b in bins] == [0, 0, 1, 0]  # the rejected 99 had target probability 0.3
    assert bins[2]["copy_right"] == 1.0 and bins[2]["target_right"] == 0.0
    assert res["first_fail_true_token_in_prior_top3_not_fresh_top3"] == 1.0
    assert res["tau_ratio_oracle_copy"] == 4 / 3  # one more accepted draft over the 3 committed tokens
