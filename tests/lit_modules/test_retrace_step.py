"""ReTrace training signals: the replayed verify pass equals the runtime's verify pass block for block, and the
exact-mode training step hands the drafter the same prior the engine would build."""

import pytest
import torch

import specdraft.lit_modules.retrace_step as step_mod
from specdraft.lit_modules import retrace_step
from specdraft.lit_modules.drafter_module import DrafterModule
from specdraft.lit_modules.features import online_features
from specdraft.lit_modules.losses import decayed_ce
from specdraft.lit_modules.retrace_step import ReTraceTraining, verify_blocks, verify_outcome
from specdraft.lit_modules.stage_table import Objective
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.kv_cache import cached_attention_mask
from tests.helpers import make_drafter, make_target, retrace_from


def test_visible_prefix_limits_each_query_to_its_own_context():
    lengths = torch.tensor([5])
    new_mask = torch.ones(2, 2, dtype=torch.bool).tril()
    m = cached_attention_mask(lengths, 7, new_mask, visible_prefix=torch.tensor([[2, 4]]))[0, 0]
    assert m[0].tolist() == [True, True, False, False, False, True, False]
    assert m[1].tolist() == [True, True, True, True, False, True, True]
    full = cached_attention_mask(lengths, 7, new_mask)[0, 0]
    assert full[0, :5].all() and full[1, :5].all()


def test_replayed_verify_blocks_equal_the_serving_verify_pass():
    target = make_target(seed=0)
    drafter = make_drafter(target, seed=1, block_size=5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (2, 24), generator=g)
    anchors = torch.tensor([[3, 9, 15], [5, 6, 20]])
    blocks = torch.cat([ids.gather(1, anchors)[..., None], torch.randint(0, 60, (2, 3, 4), generator=g)], dim=-1)
    cache = target.new_cache(2, 24 + 3 * 5)
    feats, _, _ = online_features(target, ids, drafter.target_layer_ids, cache=cache)
    assert cache.lengths.tolist() == [24, 24]
    torch.testing.assert_close(feats, online_features(target, ids, drafter.target_layer_ids)[0])
    hidden, features = verify_blocks(target, cache, anchors, blocks, drafter.target_layer_ids)  # [2, 3, 5, D], [.., F]
    logits = target.lm_head(hidden)
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            serve = target.new_cache(1, 40)  # serving: prefill the context before the anchor, then one verify pass
            target(ids[b:b + 1, :a], cache=serve)
            serve.crop(torch.tensor([a]))
            out = target(blocks[b:b + 1, j], cache=serve, feature_layers=drafter.target_layer_ids)
            torch.testing.assert_close(logits[b, j], out.logits[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(features[b, j], out.features[0], atol=1e-5, rtol=1e-4)


def test_verify_outcome_is_the_same_in_chunks(monkeypatch):
    target = make_target(seed=2)
    g = torch.Generator().manual_seed(1)
    hidden, drafts = torch.randn(7, 5, 32, generator=g), torch.randint(0, 64, (7, 4), generator=g)
    n_all, stats_all = verify_outcome(target.lm_head, hidden, drafts)
    monkeypatch.setattr(retrace_step, "LOGITS_BUDGET", 2 * 5 * 64)  # two rows per chunk
    n_chunked, stats_chunked = verify_outcome(target.lm_head, hidden, drafts)
    assert torch.equal(n_all, n_chunked)
    for a, b in zip(stats_all, stats_chunked):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chain", [0.0, 1.0])
def test_exact_mode_trains_on_the_prior_the_engine_builds(monkeypatch, chain):
    """Train/serve consistency of ReTrace: at an anchor of a target-greedy sequence, the training step's no-grad
    rounds (drafts, replayed verification, retained suffix and its correction signals) equal the engine's rounds.
    With ``chain=1`` the step's second no-grad round is drafted with the first one's prior fused in, as the engine's
    second round is, and its retained suffix must match the engine's too."""
    target = make_target(seed=3)
    r = retrace_from(make_drafter(target, seed=4, block_size=6), active=True)
    prompt = [5, 9, 2, 7]
    ids = torch.tensor([prompt + generate(target, [prompt], GenerationConfig(max_new_tokens=24))[0].tokens])
    a = len(prompt) + 3  # the engine, given ids[:a], emits ids[a] first (greedy), which anchors its first block

    served = []
    plain = r.next_round_state
    r.next_round_state = lambda *args: served.append(plain(*args)) or served[-1]
    generate(target, [ids[0, :a].tolist()], GenerationConfig(max_new_tokens=2 * r.block_size), drafter=r)

    trained = []
    monkeypatch.setattr(step_mod, "sample_anchors", lambda *args: (torch.tensor([[a]]), torch.tensor([[True]])))
    real_build = step_mod.build_prior
    monkeypatch.setattr(step_mod, "build_prior", lambda *args: trained.append(real_build(*args)) or trained[-1])
    module = DrafterModule(r, target, lr=1e-3, warmup_ratio=0.0, total_steps=1, num_anchors=1,
                           objective=Objective(stage="retrace", retrace=ReTraceTraining(signals="exact")))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([ids.shape[1]])}
    step_mod.two_round_blocks(module, batch, "train", None, prior_dropout=0.0, signals="exact", chain=chain)

    assert len(trained) == (2 if chain else 1)
    assert served[0].valid.any()  # the engine's first round did reject: there is a suffix to carry and compare
    for s, t in zip(served, trained):
        assert torch.equal(s.valid, t.valid) and torch.equal(s.shift, t.shift)
        torch.testing.assert_close(t.hidden, s.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t.signals, s.signals, atol=1e-4, rtol=1e-4)


def test_first_round_ce_trains_the_backbone_at_the_random_anchors(monkeypatch):
    """``first_round_ce``: the first round's blocks (random anchors, no prior) get the SFT loss with gradients, and
    the second round is the same as without it."""
    target = make_target(seed=3)
    r = retrace_from(make_drafter(target, seed=4, block_size=6), active=True)
    ids = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(2))
    anchors, valid = torch.tensor([[2, 9, 17], [4, 11, 20]]), torch.ones(2, 3, dtype=torch.bool)
    monkeypatch.setattr(step_mod, "sample_anchors", lambda *args: (anchors, valid))
    module = DrafterModule(r, target, lr=1e-3, warmup_ratio=0.0, total_steps=1, num_anchors=3,
                           objective=Objective(stage="retrace"))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([30, 30])}
    w = module.slot_weights
    db, stats = step_mod.two_round_blocks(module, batch, "train", None, 0.0, "exact", 1.0, first_round_ce=w)
    plain, plain_stats = step_mod.two_round_blocks(module, batch, "train", None, 0.0, "exact", 1.0)
    assert "first_round_ce" not in plain_stats
    torch.testing.assert_close(db.logits, plain.logits)  # the trained second round does not change
    feats, _, _ = module.features(batch, "train")
    logits0, _, blk0, _ = module.run_blocks(batch, feats, anchors, valid)
    expect = decayed_ce(logits0, blk0.labels, blk0.label_mask, w)
    torch.testing.assert_close(stats["first_round_ce"], expect)
    stats["first_round_ce"].backward()
    assert r.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0
