"""ReTrace training signals: the replayed verify pass equals the runtime's verify pass block for block, and the
exact-mode training step hands the drafter the same prior the engine would build."""

import torch

from specdraft.lit_modules.features import online_features
from specdraft.lit_modules.retrace_step import verify_blocks
from specdraft.runtime.kv_cache import cached_attention_mask
from tests.conftest import make_drafter, make_target


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
    logits, features = verify_blocks(target, cache, anchors, blocks, drafter.target_layer_ids)  # [2, 3, 5, V], [.., F]
    for b in range(2):
        for j, a in enumerate(anchors[b].tolist()):
            serve = target.new_cache(1, 40)  # serving: prefill the context before the anchor, then one verify pass
            target(ids[b:b + 1, :a], cache=serve)
            serve.crop(torch.tensor([a]))
            out = target(blocks[b:b + 1, j], cache=serve, feature_layers=drafter.target_layer_ids)
            torch.testing.assert_close(logits[b, j], out.logits[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(features[b, j], out.features[0], atol=1e-5, rtol=1e-4)
