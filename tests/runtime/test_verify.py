"""Verification rules with hand-built distributions: accept-all, accept-none, partial; residual correctness."""

import torch

from specdraft.runtime.sampling import SamplingParams, logits_to_probs
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling
from tests.lossless import reference_probs


def onehot_logits(tokens, V=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()[None] * 10  # [1, T, V]


def test_greedy_accept_all_none_partial():
    target = onehot_logits([3, 4, 5, 6])  # target wants 3,4,5 then bonus 6
    n, nxt = accept_greedy(torch.tensor([[3, 4, 5]]), target)
    assert n.tolist() == [3] and nxt.tolist() == [6]
    n, nxt = accept_greedy(torch.tensor([[9, 4, 5]]), target)
    assert n.tolist() == [0] and nxt.tolist() == [3]
    n, nxt = accept_greedy(torch.tensor([[3, 4, 9]]), target)
    assert n.tolist() == [2] and nxt.tolist() == [5]
    # a later match after a mismatch does not count
    n, _ = accept_greedy(torch.tensor([[3, 9, 5]]), target)
    assert n.tolist() == [1]


def test_greedy_batch_rows_independent():
    target = torch.cat([onehot_logits([1, 2, 3]), onehot_logits([7, 8, 9])])
    n, nxt = accept_greedy(torch.tensor([[1, 2], [0, 8]]), target)
    assert n.tolist() == [2, 0] and nxt.tolist() == [3, 7]


def test_sampling_accepts_all_when_draft_equals_target():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, 12), -1)  # K = 5
    d = torch.multinomial(p[:, :5].reshape(-1, 12), 1).view(4, 5)
    n, _ = accept_speculative_sampling(d, p[:, :5], p, torch.Generator().manual_seed(1))
    assert n.tolist() == [5, 5, 5, 5]


def test_sampling_rejects_all_when_target_gives_zero_mass():
    V = 8
    q = torch.zeros(2, 3, V)
    q[..., 0] = 1.0  # drafter always proposes token 0
    p = torch.zeros(2, 4, V)
    p[..., 1:] = 1.0 / (V - 1)  # target never emits token 0
    n, nxt = accept_speculative_sampling(torch.zeros(2, 3, dtype=torch.long), q, p, torch.Generator().manual_seed(0))
    assert n.tolist() == [0, 0]
    assert (nxt != 0).all()


def test_residual_distribution_is_exact():
    """One slot: the emitted token is distributed as p for any q (the rejection-sampling identity)."""
    V, N = 5, 200_000
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1])
    q = torch.tensor([0.1, 0.1, 0.6, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    d = torch.multinomial(q.expand(N, V), 1, generator=g)  # [N, 1]
    n, nxt = accept_speculative_sampling(d, q.expand(N, 1, V), p.expand(N, 2, V), g)
    emitted = torch.where(n == 1, d[:, 0], nxt)
    freq = torch.bincount(emitted, minlength=V).float() / N
    assert torch.allclose(freq, p, atol=0.005), freq
    assert 0 < n.float().mean() < 1  # both branches exercised


def test_top_k_top_p_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    pk = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[0, 2:] == 0).all() and torch.isclose(pk.sum(), torch.tensor(1.0))
    pp = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert pp[0, 0] == 1.0  # the top token alone already has >= 50% of the mass
    greedy = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_truncation_matches_a_reference_on_unsorted_logits():
    """Top-k then top-p on logits in random order (a sorted input would hide a missing un-sort), against the
    harness's loop-by-loop reference."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 9, generator=g) * 2  # [rows, V], unsorted
    for params in (SamplingParams(0.7, top_k=4, top_p=0.8), SamplingParams(1.3, top_p=0.6), SamplingParams(1.0, 3)):
        torch.testing.assert_close(logits_to_probs(logits, params).double(), reference_probs(logits, params))
