"""Each request's record as the engines fill it: a request reported as it ends is already whole (a batch job writes
it right then), and its counts agree with its tokens."""

import copy

import pytest

from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.requests import Requests
from tests.helpers import bigram_oracle

PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5]]
CAPS = [10, 25, 17, 30, 8]


@pytest.mark.parametrize("slots", [None, 2])
def test_a_request_reported_as_it_ends_is_already_whole(slots):
    target, oracle = bigram_oracle(2)
    free = generate(target, PROMPTS, GenerationConfig(max_new_tokens=CAPS))
    stop = free[1].tokens[5]
    gen = GenerationConfig(max_new_tokens=CAPS, stop_token_ids=(stop,))
    seen = {}
    final = generate(target, PROMPTS, gen, drafter=oracle, slots=slots,
                     on_result=lambda i, r: seen.setdefault(i, copy.deepcopy(r)))
    assert sorted(seen) == list(range(len(PROMPTS)))
    assert any(r.finish_reason == "stop" for r in final)
    for i, r in enumerate(final):
        got = seen[i]
        assert (got.tokens, got.accept_lengths, got.accepted, got.verified, got.finish_reason) == (
            r.tokens, r.accept_lengths, r.accepted, r.verified, r.finish_reason)
        assert 1 + sum(got.accept_lengths) == len(got.tokens) + (got.finish_reason == "stop")
        assert len(got.accepted) == len(got.verified) == len(got.accept_lengths)
    assert sum(a for r in seen.values() for a in r.accepted) > 0  # rounds with drafts accepted were reported


def test_emission_stops_at_a_stop_token_or_the_cap():
    requests = Requests([[1], [2]], GenerationConfig(max_new_tokens=[3, 10], stop_token_ids=(9,)))
    assert requests.emit(0, [4, 5, 6, 7]) == 3 and requests.results[0].tokens == [4, 5, 6]
    assert requests.results[0].finish_reason == "length" and requests.done == [True, False]
    assert requests.record(1, 2, [4, 9, 5], 6, 3) == 1  # the stop token is the second draft: one draft committed
    assert requests.results[1].tokens == [4] and requests.results[1].finish_reason == "stop"
    assert requests.results[1].accept_lengths == [2] and requests.results[1].accepted == [2]
    with pytest.raises(ValueError, match="empty prompt"):
        Requests([[1], []], GenerationConfig())
