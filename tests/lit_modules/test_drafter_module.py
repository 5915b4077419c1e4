"""Drafter training: train/serve consistency, overfitting one batch, simulated tau, offline == online features."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.lit_modules import features
from specdraft.lit_modules.blocks import build_blocks
from specdraft.lit_modules.data import ShareGPTDataModule, collate
from specdraft.lit_modules.drafter_module import DrafterModule
from specdraft.lit_modules.features import OfflineFeatures, build_offline_cache
from specdraft.lit_modules.stage_table import Objective
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import build_drafter, drafter_config_for_target
from specdraft.runtime.load import load_target
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling
from tests.helpers import make_drafter, make_target


def test_training_forward_equals_runtime_draft_path():
    """Logits of a block built by the training mask == logits of the same block drafted by the runtime cache path."""
    target = make_target(seed=0)
    drafter = make_drafter(target, seed=1, block_size=5)
    ids = torch.randint(0, 60, (1, 20))
    feats = target(ids, feature_layers=drafter.target_layer_ids).features  # [1, 20, F]
    anchors = torch.tensor([[4, 9, 13]])
    blk = build_blocks(ids, torch.ones_like(ids), torch.tensor([20]), anchors,
                       torch.ones_like(anchors, dtype=torch.bool),
                       5, drafter.config.mask_token_id)
    ctx_kv = drafter.context_kv(feats, torch.arange(20)[None])
    train_logits = drafter.logits(drafter(drafter.embed(blk.tokens), blk.positions, ctx_kv, blk.mask)).view(3, 5, -1)
    for j, a in enumerate(anchors[0].tolist()):
        cache = drafter.new_cache(1, 40)
        drafter.ingest(cache, feats[:, :a], torch.tensor([a]))
        block = torch.full((1, 5), drafter.config.mask_token_id)
        block[0, 0] = ids[0, a]
        serve_logits = drafter.logits(drafter.draft_hidden(cache, drafter.embed(block)))[0]
        torch.testing.assert_close(train_logits[j], serve_logits, atol=1e-5, rtol=1e-4)


def _batch(world, n=4):
    tok = AutoTokenizer.from_pretrained(str(world.target_dir))
    dm = ShareGPTDataModule(str(world.target_dir.parent / "data.jsonl"), tok, n, 256, 4, seed=0)
    dm.setup()
    return dm, collate(dm.train_items[:n])


def _module(world, drafter_seed=1, stage="sft", **kw):
    target = load_target(world.target_dir, dtype="float32", device="cpu")
    torch.manual_seed(drafter_seed)
    d = build_drafter(drafter_config_for_target(target.args, target.args.vocab_size - 1, 1, 4, num_features=2))
    return DrafterModule(d, target, lr=3e-3, warmup_ratio=0.0, total_steps=100, num_anchors=8,
                         objective=Objective(stage=stage), **kw)


def _step(m, batch, g):
    db = m.draft(batch, "train", g)
    return m.objective_loss(db, g), db


def _fit(m, batch, opt, seed, steps):
    for _ in range(steps):
        loss, _ = _step(m, batch, torch.Generator().manual_seed(seed))  # the same anchors every step
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_overfit_one_batch_loss_falls_and_sim_tau_rises(tiny_world):
    _, batch = _batch(tiny_world)
    m = _module(tiny_world)
    opt = torch.optim.AdamW(m.drafter.parameters(), lr=2e-2)

    def g():  # the same anchors every step: a fixed batch to memorise
        return torch.Generator().manual_seed(0)

    with torch.no_grad():
        loss0, db = _step(m, batch, g())
        tau0 = m.simulated_tau(db.logits, db.blocks, db.target_tokens)
    _fit(m, batch, opt, 0, 100)
    with torch.no_grad():
        loss1, db = _step(m, batch, g())
        acc = m.slot_accuracy(db.logits, db.blocks)
    assert loss1 < 0.5 * loss0
    assert acc[0] > 0.5
    # sim_tau compares drafts with the TARGET's greedy tokens: train on the target's own greedy continuations
    prompts = [it["input_ids"][:12] for it in _batch(tiny_world)[0].train_items[:4]]
    gens = generate(m.target, prompts, GenerationConfig(max_new_tokens=40))
    tgt_batch = collate([{"input_ids": p + r.tokens, "loss_mask": [0] * len(p) + [1] * len(r.tokens), "index": i}
                         for i, (p, r) in enumerate(zip(prompts, gens))])
    with torch.no_grad():
        _, db = _step(m, tgt_batch, g())
        tau_before = m.simulated_tau(db.logits, db.blocks, db.target_tokens)
    _fit(m, tgt_batch, opt, 0, 100)
    with torch.no_grad():
        _, db = _step(m, tgt_batch, g())
        tau_after = m.simulated_tau(db.logits, db.blocks, db.target_tokens)
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    assert 1.0 <= tau0 <= 4.0


def test_simulated_tau_counts_leading_matches_plus_bonus():
    K, V = 3, 7
    target_tokens = torch.tensor([[[1, 2, 3, 4], [5, 6, 0, 1]]])  # target's token after each block prefix
    anchors = torch.tensor([[0, 4]])
    ids = torch.zeros(1, 10, dtype=torch.long)
    blk = build_blocks(ids, torch.ones_like(ids), torch.tensor([10]), anchors, torch.ones(1, 2, dtype=torch.bool),
                       K + 1, 6)
    drafts = torch.tensor([[[1, 2, 0], [0, 6, 0]]])  # block 0: 2 leading matches; block 1: none
    logits = torch.nn.functional.one_hot(drafts, V).float()
    tau = DrafterModule.simulated_tau(logits, blk, target_tokens)
    assert tau.item() == ((2 + 1) + (0 + 1)) / 2


def test_simulated_sampled_tau_is_the_runtime_expected_acceptance():
    """1 + E_T equals the mean accepted length (bonus included) of the runtime's speculative sampling on drafts ~ q at
    temperature T, when the target's slot distributions are the teacher-forced ones; windows that are not fully
    supervised are left out, and a drafter equal to the target accepts every slot."""
    torch.manual_seed(21)
    K, V, T, G = 3, 5, 0.7, 40_000
    anchors = torch.tensor([[0, 4, 6]])
    ids = torch.zeros(1, 9, dtype=torch.long)  # the window at anchor 6 runs past the end: not fully supervised
    blk = build_blocks(ids, torch.ones_like(ids), torch.tensor([9]), anchors, torch.ones(1, 3, dtype=torch.bool),
                       K + 1, 4)
    assert blk.label_mask.all(-1).tolist() == [[True, True, False]]
    draft_logits, target_logits = torch.randn(1, 3, K, V), torch.randn(1, 3, K, V)
    tau = DrafterModule.simulated_tau_sampled(draft_logits, blk, target_logits, T)
    g = torch.Generator().manual_seed(2)
    runs = []
    for j in range(2):
        q = torch.softmax(draft_logits[0, j] / T, -1)  # [K, V]
        p = torch.softmax(target_logits[0, j] / T, -1)
        drafts = torch.multinomial(q, G, replacement=True, generator=g).T  # [G, K]
        p_full = torch.cat([p, p[-1:]]).expand(G, K + 1, V)  # the bonus row does not change the count
        n, _ = accept_speculative_sampling(drafts, q.expand(G, K, V), p_full, g)
        runs.append(n.float().mean() + 1)
    assert abs(tau.item() - torch.stack(runs).mean().item()) < 0.02
    same = DrafterModule.simulated_tau_sampled(target_logits, blk, target_logits, T)
    torch.testing.assert_close(same, torch.tensor(K + 1.0))


def test_offline_features_give_the_same_loss_as_online(tiny_world, tmp_path):
    dm, batch = _batch(tiny_world)
    online = _module(tiny_world)
    cache = build_offline_cache(online.target, tiny_world.target_dir, {"train": dm.train_items[:4]},
                                online.drafter.target_layer_ids, tmp_path / "feats")
    offline = _module(tiny_world, offline=OfflineFeatures(cache))
    offline.drafter.load_state_dict(online.drafter.state_dict())
    with torch.no_grad():
        a = _step(online, batch, torch.Generator().manual_seed(0))[0]
        b = _step(offline, batch, torch.Generator().manual_seed(0))[0]
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)  # features are stored in bf16


def test_offline_cache_refuses_other_layer_set(tiny_world, tmp_path):
    dm, _ = _batch(tiny_world)
    m = _module(tiny_world)
    build_offline_cache(m.target, tiny_world.target_dir, {"train": dm.train_items[:2]}, (0, 1), tmp_path / "f")
    with pytest.raises(SpecdraftError, match="layer_ids"):
        build_offline_cache(m.target, tiny_world.target_dir, {"train": dm.train_items[:2]}, (1, 2), tmp_path / "f")


def test_one_offline_cache_for_all_ranks_rank_0_builds_the_others_wait_and_read_it(tiny_world, tmp_path,
                                                                                      monkeypatch):
    dm, _ = _batch(tiny_world)
    m = _module(tiny_world)
    items, layers, out = {"train": dm.train_items[:2]}, m.drafter.target_layer_ids, tmp_path / "f"
    writes = []
    monkeypatch.setattr(features, "save_file", lambda t, path: (writes.append(path), save_file(t, path)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SpecdraftError, match="rank 1: no offline feature cache"):
        build_offline_cache(m.target, tiny_world.target_dir, items, layers, out, wait_s=0.2)
    assert not writes  # rank 1 never builds
    monkeypatch.setenv("RANK", "0")
    build_offline_cache(m.target, tiny_world.target_dir, items, layers, out)
    monkeypatch.setenv("RANK", "1")
    assert build_offline_cache(m.target, tiny_world.target_dir, items, layers, out, wait_s=0.2) == out
    assert len(writes) == 1  # built once, by rank 0; rank 1 read it


def test_training_anchors_are_one_stream_per_conversation_for_any_seed(tiny_world):
    m = _module(tiny_world)
    _, batch = _batch(tiny_world)
    g = torch.Generator().manual_seed(20260101 * 1_000_003 + 7)  # a date-style train.seed at step 7
    anchors, valid = m.sample_anchors(batch, "train", g)
    half = {k: v[:2] if torch.is_tensor(v) else v for k, v in batch.items()}
    half["input_ids"], half["loss_mask"] = (half[k][:, :int(half["lengths"].max())] for k in ("input_ids", "loss_mask"))
    a2, v2 = m.sample_anchors(half, "train", g)  # the same conversations in a smaller, less padded batch
    assert torch.equal(a2[v2], anchors[:2][valid[:2]][: int(v2.sum())]) and v2.sum() == valid[:2].sum()


def test_verified_anchors_sit_where_greedy_serving_anchors_the_next_block(tiny_world):
    """a' = a + n + 1 with n = the leading drafts equal to the target's greedy tokens. Drafts are planted to first
    differ at slot ``i % K + 1`` of block i (n = i % K), and n is cross-checked with the runtime's ``accept_greedy``;
    ``train.anchors=verified`` then trains at exactly those anchors."""
    m = _module(tiny_world)
    m.objective.anchors = "verified"
    _, batch = _batch(tiny_world)
    feats, _, greedy = m.features(batch, "train")
    anchors, valid = m.sample_anchors(batch, "train", torch.Generator().manual_seed(3))
    B, N = anchors.shape
    K, V = m.drafter.block_size - 1, m.drafter.config.vocab_size
    S = greedy.shape[1]
    pos = (anchors[:, :, None] + torch.arange(K)).clamp(max=S - 1)  # [B, N, K]: greedy[p] predicts token p + 1
    drafts = greedy.gather(1, pos.flatten(1)).view(B, N, K).clone()
    miss = torch.arange(N).remainder(K).expand(B, N)  # block i first differs at slot i % K + 1
    drafts.scatter_(2, miss[..., None], (drafts.gather(2, miss[..., None]) + 1) % V)
    real = m.run_blocks
    m.run_blocks = lambda *a, **k: (torch.nn.functional.one_hot(drafts, V).float() * 10, *real(*a, **k)[1:])
    new, ok = m.verified_anchors(batch, feats, greedy, anchors, valid)
    checked = 0
    for b in range(B):
        L = int(batch["lengths"][b])
        for i in range(N):
            a = int(anchors[b, i])
            if not valid[b, i] or a + K + 1 >= L:  # a window past the sequence end is cut earlier: skip the edge
                continue
            tgt = torch.nn.functional.one_hot(greedy[b, a:a + K + 1], V).float()[None]  # the target's view as logits
            n = int(accept_greedy(drafts[b, i][None], tgt)[0])
            assert n == i % K
            expect = a + n + 1
            if expect < L - 1 and batch["loss_mask"][b, expect]:
                assert ok[b, i] and int(new[b, i]) == expect
                checked += 1
            else:
                assert not ok[b, i]
    assert checked >= 8 and len({int(x) for x in (new - anchors)[ok]}) > 2  # several different n exercised
    db = m.draft(batch, "train", torch.Generator().manual_seed(3))  # training drafts its blocks there
    assert torch.equal(db.blocks.tokens.view(B, N, -1)[..., 0][ok], batch["input_ids"].gather(1, new)[ok])
