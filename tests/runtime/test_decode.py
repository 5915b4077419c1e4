"""Losslessness of the decode engine: stub-pinned acceptance, greedy == AR token for token (batch 1 and ragged
batch 8), batch == one row at a time, and a chi-square goodness-of-fit test of sampled output."""

import pytest
import torch

from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter import Drafter
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.sampling import SamplingParams
from tests.helpers import PROMPTS, ar, chi2_pvalue, exact_two_token_dist, make_drafter, make_target
from tests.runtime.stub_drafter import OracleStubDrafter, random_corruption


@pytest.mark.parametrize("corrupt,expect", [
    (lambda r, i: None, "all"),  # drafts = target's greedy continuation: every round accepts K
    (lambda r, i: 1, "none"),  # slot 1 always wrong: every round commits only the target's token
    (random_corruption(0), "partial"),
])
def test_stub_drafter_pins_acceptance_and_output(corrupt, expect):
    target = make_target(vocab=32)
    prompts = PROMPTS[:3]
    stub = OracleStubDrafter(target, prompts, block_size=5, corrupt=corrupt, vocab=32)
    res = generate(target, prompts, GenerationConfig(max_new_tokens=16), drafter=stub)  # 1 + 3 full rounds of 5
    assert [r.tokens for r in res] == ar(target, prompts, 16)
    rounds = [a for r in res for a in r.accept_lengths]
    if expect == "all":
        assert all(a == 5 for a in rounds)
    elif expect == "none":
        assert all(a == 1 for a in rounds)
    else:
        assert 1 in rounds and any(a > 1 for a in rounds)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_dflash_equals_ar_batch1(seed):
    target = make_target(seed=seed)
    drafter = make_drafter(target, seed=seed + 10)
    for p in PROMPTS[:4]:
        spec = generate(target, [p], GenerationConfig(max_new_tokens=24), drafter=drafter)[0].tokens
        assert spec == ar(target, [p], 24)[0]


def test_greedy_ragged_batch8_equals_ar_and_single_rows():
    target = make_target(seed=3, vocab=12)  # small vocab: a random drafter gets partial acceptance
    drafter = make_drafter(target, seed=4)
    prompts = [[t % 11 for t in p] for p in PROMPTS]
    max_new = [10, 25, 17, 30, 8, 21, 14, 19]  # per-row caps: rows finish at different rounds
    gen = GenerationConfig(max_new_tokens=max_new)
    batch = generate(target, prompts, gen, drafter=drafter)
    expected = [ar(target, [p], m)[0] for p, m in zip(prompts, max_new)]
    assert [r.tokens for r in batch] == expected
    singles = [generate(target, [p], GenerationConfig(max_new_tokens=m), drafter=drafter)[0]
               for p, m in zip(prompts, max_new)]
    assert [r.tokens for r in batch] == [s.tokens for s in singles]
    assert [r.accept_lengths for r in batch] == [s.accept_lengths for s in singles]
    assert any(a > 1 for r in batch for a in r.accept_lengths), "test needs some accepted drafts"
    assert all(len(r.tokens) == m for r, m in zip(batch, max_new))


def test_stop_token_per_row():
    target = make_target(seed=5, vocab=16)
    drafter = make_drafter(target, seed=6)
    prompts = [[t % 15 for t in p] for p in PROMPTS[:4]]
    free = ar(target, prompts, 30)
    stop = free[1][5]  # a token row 1 emits at index 5 (and maybe earlier in other rows)
    got = generate(target, prompts, GenerationConfig(max_new_tokens=30, stop_token_ids=(stop,)), drafter=drafter)
    for r, f in zip(got, free):
        cut = f.index(stop) if stop in f else len(f)
        assert r.tokens == f[:cut]
        assert r.finish_reason == ("stop" if stop in f else "length")


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
def test_sampled_output_follows_target_distribution(draft_sampling):
    V, N = 6, 6000
    target = make_target(seed=7, vocab=V, std=0.5)
    drafter = make_drafter(target, seed=8, block_size=4)
    prompt = [1, 2, 3]
    gen = GenerationConfig(max_new_tokens=2, sampling=SamplingParams(temperature=1.0), draft_sampling=draft_sampling)
    rounds = []
    res = generate(target, [prompt] * N, gen, drafter=drafter, generator=torch.Generator().manual_seed(0),
                   observer=rounds.append)
    pairs = torch.tensor([r.tokens[0] * V + r.tokens[1] for r in res])
    counts = torch.bincount(pairs, minlength=V * V).double()
    probs = exact_two_token_dist(target, prompt, V).double()
    assert chi2_pvalue(counts, probs) > 1e-3
    # (the cap of 2 tokens cuts every round to 1 emitted token, so acceptance is read from the rounds themselves)
    assert any(int(r.num_accepted.max()) > 0 for r in rounds), "drafts must sometimes be accepted"
    # the test has power: a sampler off by a 15% uniform mixture is rejected at the same sample size
    biased = 0.85 * probs + 0.15 / (V * V)
    wrong = torch.multinomial(biased, N, replacement=True, generator=torch.Generator().manual_seed(1))
    assert chi2_pvalue(torch.bincount(wrong, minlength=V * V).double(), probs) < 1e-3


def test_ar_sampling_same_engine_is_target_distribution():
    V, N = 5, 4000
    target = make_target(seed=9, vocab=V, std=0.5)
    gen = GenerationConfig(max_new_tokens=2, sampling=SamplingParams(temperature=1.0))
    res = generate(target, [[1, 2]] * N, gen, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(torch.tensor([r.tokens[0] * V + r.tokens[1] for r in res]), minlength=V * V).double()
    assert chi2_pvalue(counts, exact_two_token_dist(target, [1, 2], V).double()) > 1e-3


def test_empty_prompt_rejected(target):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(target, [[1], []], GenerationConfig(max_new_tokens=3))


def test_drafters_and_the_test_stub_implement_the_drafter_protocol(target):
    dflash = make_drafter(target)
    retrace = convert_drafter(dflash, "retrace")
    stub = OracleStubDrafter(target, [[1, 2]], 4, lambda r, i: None, target.args.vocab_size)
    for d in (dflash, retrace, stub):
        assert isinstance(d, Drafter), type(d).__name__
    assert not isinstance(object(), Drafter)


def test_observer_sees_every_round_as_the_engine_committed_it(target):
    drafter = make_drafter(target, block_size=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9]]
    rounds = []
    res = generate(target, prompts, GenerationConfig(max_new_tokens=[10, 17]), drafter=drafter,
                   observer=rounds.append)
    per_row = {0: [], 1: []}
    for r in rounds:
        assert r.draft_tokens.shape == (r.rows.numel(), 4) and r.draft_logits.shape[:2] == (r.rows.numel(), 4)
        assert torch.equal(r.draft_tokens, r.draft_logits.argmax(-1))  # greedy drafts are the logits' argmax
        assert torch.equal(r.next_tokens, r.target_logits.gather(1, r.num_accepted[:, None, None].expand(
            -1, 1, r.target_logits.shape[-1]))[:, 0].argmax(-1))  # the target's token after the accepted drafts
        for row, n in zip(r.rows.tolist(), r.num_accepted.tolist()):
            per_row[row].append(n + 1)
    assert [per_row[0], per_row[1]] == [x.accept_lengths for x in res]
    ar_rounds = []
    generate(target, prompts[:1], GenerationConfig(max_new_tokens=5), observer=ar_rounds.append)
    assert len(ar_rounds) == 4 and all(r.draft_logits is None and r.draft_tokens.shape[1] == 0 for r in ar_rounds)


def test_tau_counts_what_each_round_emitted_when_a_stop_or_the_cap_cuts_it():
    target = make_target(vocab=32)
    prompts = PROMPTS[:2]
    stub = OracleStubDrafter(target, prompts, block_size=5, corrupt=lambda r, i: None, vocab=32)  # accepts all
    res = generate(target, prompts, GenerationConfig(max_new_tokens=[8, 13]), drafter=stub)
    assert [r.accept_lengths for r in res] == [[5, 2], [5, 5, 2]]  # 1 + 5 + 2 = 8; 1 + 5 + 5 + 2 = 13
    free = ar(target, prompts[:1], 20)[0]
    first = next(i for i in range(2, 5) if free[i] not in free[:i])  # inside the first round's run (tokens 1..5)
    cut = generate(target, prompts[:1], GenerationConfig(max_new_tokens=20, stop_token_ids=(free[first],)),
                   drafter=OracleStubDrafter(target, prompts[:1], 5, lambda r, i: None, 32))[0]
    assert cut.tokens == free[:first] and cut.finish_reason == "stop"
    assert cut.accept_lengths == [first] and cut.accepted == [4]  # emitted up to the stop; all 4 drafts accepted
    assert 1 + sum(cut.accept_lengths) == len(cut.tokens) + 1  # the stop token counts: it was generated
