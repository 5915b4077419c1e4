"""ReTrace: zero-init fusion == backbone bit for bit, alignment of the carried suffix, reset on full acceptance,
and losslessness (greedy equality in ragged batches, chi-square under sampling) with the fusion switched on."""

import json

import pytest
import torch

from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import load_drafter, save_drafter
from specdraft.runtime.models.retrace import build_prior, verify_stats
from specdraft.runtime.sampling import SamplingParams
from tests.helpers import PROMPTS, ar, chi2_pvalue, exact_two_token_dist, make_drafter, make_target, retrace_from


def test_fusion_layout_sizes_and_exports_written_before_it_was_configurable(tmp_path):
    """Default: refiner of width D fed [h; e(d); LN(c)]; the slim option halves it and drops e(d). An export whose
    retrace_config predates ``refiner_width`` is the default layout, and loads as exactly that."""

    target = make_target()
    backbone = make_drafter(target)
    D = backbone.config.hidden_size
    slim, wide = retrace_from(backbone, active=True, **SLIM), retrace_from(backbone, active=True)
    assert SLIM["refiner_width"] == D // 2
    c_dim = 2 * D + 4
    assert slim.retrace_refiner.weight.shape == (D // 2, D + c_dim)
    assert wide.retrace_refiner.weight.shape == (D, 2 * D + c_dim)
    assert slim.retrace_gate_out.weight.shape == (2 * D, D // 2)
    assert _random_prior(slim).hidden.shape[-1] == D and _random_prior(wide).hidden.shape[-1] == 2 * D
    save_drafter(wide, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["retrace_config"]["refiner_width"] == D and cfg["retrace_config"]["embed_drafted"] is True
    for k in ("refiner_width", "embed_drafted"):  # as an export written before these keys existed
        del cfg["retrace_config"][k]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = load_drafter(tmp_path, target)
    assert old.config.retrace.embed_drafted and old.config.refiner_width == D
    blk = torch.full((3, backbone.block_size), backbone.config.mask_token_id)
    assert torch.equal(old.block_embeds(blk, _random_prior(old)), wide.block_embeds(blk, _random_prior(wide)))


def _random_prior(drafter, b=3, n=(0, 2, 4)):
    Bk, D = drafter.block_size, drafter.config.hidden_size
    K = Bk - 1
    g = torch.Generator().manual_seed(5)
    V = drafter.config.vocab_size
    drafts = torch.randint(0, V, (b, K), generator=g)
    stats = verify_stats(torch.randn(b, Bk, V, generator=g), drafts)
    return build_prior(torch.randn(b, Bk, D, generator=g), drafts, torch.tensor(n), stats,
                       torch.randn(b, Bk, D, generator=g), drafter.embed, drafter.config.retrace.embed_drafted)


SLIM = {"refiner_width": 16, "embed_drafted": False}  # half-width refiner fed [h; LN(c)]


@pytest.mark.parametrize("opts", [{}, {"alignment": "soft"}, {"use_correction": False}, {"gate_anchor": True}, SLIM])
def test_fresh_fusion_is_bit_identical_to_the_backbone(opts):
    target = make_target()
    backbone = make_drafter(target)
    r = retrace_from(backbone, active=False, **opts)
    blk = torch.full((3, backbone.block_size), backbone.config.mask_token_id)
    blk[:, 0] = torch.tensor([3, 4, 5])
    prior = _random_prior(r)
    assert prior.valid.any()
    assert torch.equal(r.block_embeds(blk, prior), backbone.block_embeds(blk, None))
    cache_a, cache_b = backbone.new_cache(3, 32), r.new_cache(3, 32)
    feats = target(torch.randint(0, 60, (3, 7)), feature_layers=backbone.target_layer_ids).features
    backbone.ingest(cache_a, feats, torch.tensor([7, 5, 6]))
    r.ingest(cache_b, feats, torch.tensor([7, 5, 6]))
    la = backbone.logits(backbone.draft_hidden(cache_a, backbone.block_embeds(blk, None)))
    lb = r.logits(r.draft_hidden(cache_b, r.block_embeds(blk, prior)))
    assert torch.equal(la, lb)


def test_carried_suffix_lands_on_the_right_slots():
    """Round: anchor at a, K=5, n=2 accepted. Rejected old slots 3..5 hold tokens that are the true continuation at
    their absolute positions; after the shift by n+1 they must sit on new slots 0..2 (slot 0 = the new anchor)."""
    target = make_target()
    r = retrace_from(make_drafter(target), active=True)
    Bk, D = r.block_size, r.config.hidden_size  # Bk = 6, K = 5
    truth = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18])  # token at absolute position a + i
    drafts = torch.tensor([[11, 12, 40, 14, 15]])  # slots 1..5: two right, slot 3 wrong (target: 13), 4..5 right
    hidden = torch.zeros(1, Bk, D)
    for s in range(Bk):
        hidden[0, s, 0] = s  # tag each old slot's hidden state with its slot index
    stats = verify_stats(torch.randn(1, Bk, r.config.vocab_size), drafts)
    prior = build_prior(hidden, drafts, torch.tensor([2]), stats, torch.randn(1, Bk, D), r.embed)
    assert prior.valid[0].tolist() == [False, False, False, True, True, True] and prior.shift.tolist() == [3]
    aligned, present = r._align(prior.hidden, prior)
    assert present[0].tolist() == [True, True, True, False, False, False]
    assert aligned[0, :3, 0].tolist() == [3.0, 4.0, 5.0]
    # new block anchored at a' = a + 3: new slot s' is absolute a + 3 + s'; the old slot carried there drafted it
    for s_new, s_old in enumerate([3, 4, 5]):
        if s_old >= 4:
            assert drafts[0, s_old - 1] == truth[3 + s_new]
    # gating touches mask slots only by default: new slot 0 (the anchor) is left alone
    delta = r.fusion_delta(prior)
    assert delta[0, 0].abs().sum() == 0 and delta[0, 1:3].abs().sum() > 0 and delta[0, 3:].abs().sum() == 0


def test_full_acceptance_resets_the_prior():
    target = make_target()
    r = retrace_from(make_drafter(target), active=True)
    K = r.block_size - 1
    prior = _random_prior(r, b=2, n=(K, 1))
    assert not prior.valid[0].any() and prior.valid[1].any()
    delta = r.fusion_delta(prior)
    assert delta[0].abs().sum() == 0 and delta[1].abs().sum() > 0


@pytest.mark.parametrize("opts", [{}, {"alignment": "soft", "gate_anchor": True}, SLIM])
def test_greedy_retrace_equals_ar_in_ragged_batches(opts):
    target = make_target(seed=3, vocab=12)
    r = retrace_from(make_drafter(target, seed=4), active=True, **opts)
    prompts = [[t % 11 for t in p] for p in PROMPTS]
    max_new = [10, 25, 17, 30, 8, 21, 14, 19]
    batch = generate(target, prompts, GenerationConfig(max_new_tokens=max_new), drafter=r)
    assert [x.tokens for x in batch] == [ar(target, [p], m)[0] for p, m in zip(prompts, max_new)]
    singles = [generate(target, [p], GenerationConfig(max_new_tokens=m), drafter=r)[0]
               for p, m in zip(prompts, max_new)]
    assert [x.accept_lengths for x in batch] == [x.accept_lengths for x in singles]  # per-row state, compaction-safe
    assert any(1 < a < r.block_size for x in batch for a in x.accept_lengths)  # rejections happened: prior in use


def test_sampled_output_with_active_fusion_follows_the_target_distribution():
    V, N = 6, 6000
    target = make_target(seed=7, vocab=V, std=0.5)
    backbone = make_drafter(target, seed=8, block_size=4)
    r = retrace_from(backbone, active=True)
    prompt = [1, 2, 3]
    used = []  # did a round actually fuse a carried prior into its block?
    plain = r.block_embeds
    r.block_embeds = lambda blk, st: (used.append(st is not None and bool(st.valid.any())), plain(blk, st))[1]
    gen = GenerationConfig(max_new_tokens=3, sampling=SamplingParams(temperature=1.0))
    res = generate(target, [prompt] * N, gen, drafter=r, generator=torch.Generator().manual_seed(0))
    assert any(used)
    counts = torch.bincount(torch.tensor([x.tokens[0] * V + x.tokens[1] for x in res]), minlength=V * V).double()
    assert chi2_pvalue(counts, exact_two_token_dist(target, prompt, V).double()) > 1e-3
