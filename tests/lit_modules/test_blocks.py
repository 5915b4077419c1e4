"""DFlash training masks and labels: one test per pitfall in the research notes."""

import torch

from specdraft.lit_modules.blocks import build_blocks, decay_weights, default_gamma, sample_anchors

MASK = 99


def _blocks(anchors, valid=None, S=12, Bk=4, loss_mask=None, length=None):
    ids = torch.arange(100, 100 + S)[None]  # token at position p is 100 + p
    lm = torch.ones(1, S, dtype=torch.long) if loss_mask is None else torch.tensor([loss_mask])
    lengths = torch.tensor([S if length is None else length])
    a = torch.tensor([anchors])
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else torch.tensor([valid])
    return build_blocks(ids, lm, lengths, a, v, Bk, MASK)


def test_block_inputs_positions_and_same_position_labels():
    b = _blocks([3, 7])
    assert b.tokens.tolist() == [[103, MASK, MASK, MASK, 107, MASK, MASK, MASK]]
    assert b.positions.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]
    # slot k predicts the token AT anchor + k (no shift); slot 0 is excluded from the labels
    assert b.labels.tolist() == [[[104, 105, 106], [108, 109, 110]]]


def test_context_strictly_before_anchor():
    b = _blocks([3, 7])
    ctx = b.mask[0, 0, :, :12]  # [Q, S]
    for q in range(4):  # block 0, anchor 3: sees positions 0..2 only (not the anchor's own feature)
        assert ctx[q].nonzero().flatten().tolist() == [0, 1, 2]
    for q in range(4, 8):
        assert ctx[q].nonzero().flatten().tolist() == list(range(7))


def test_bidirectional_within_block_and_no_cross_block_even_when_overlapping():
    b = _blocks([3, 5])  # overlapping anchors: block 0 covers 3..6, block 1 covers 5..8
    blk = b.mask[0, 0, :, 12:]  # [Q, Q]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:4, :4] = True
    expected[4:, 4:] = True
    assert torch.equal(blk, expected)
    # block 0 (anchor 3) must not see context at 3..4 that block 1 may see
    assert not b.mask[0, 0, :4, 3:12].any()


def test_label_mask_uses_label_position_and_bounds():
    # positions 0..5 are prompt (mask 0), 6.. response; anchor 5 is the last prompt token
    lm = [0] * 6 + [1] * 6
    b = _blocks([5, 9], loss_mask=lm, length=11)
    # anchor 5: labels at 6,7,8 are response tokens -> supervised
    assert b.label_mask[0, 0].tolist() == [True, True, True]
    # anchor 9: labels at 10 (in bounds), 11 and 12 (>= length 11) -> cut
    assert b.label_mask[0, 1].tolist() == [True, False, False]
    lm2 = [1] * 4 + [0] * 8
    b2 = _blocks([2], loss_mask=lm2)
    assert b2.label_mask[0, 0].tolist() == [True, False, False]  # label at 3 supervised, 4 and 5 are not


def test_padding_blocks_see_no_context_and_carry_no_loss():
    b = _blocks([3, 0], valid=[True, False])
    assert not b.mask[0, 0, 4:, :12].any()
    assert not b.label_mask[0, 1].any()


def test_anchor_sampling_only_supervised_positions_and_resampled():
    lm = torch.tensor([[0] * 10 + [1] * 20 + [0] * 2])
    lengths = torch.tensor([30])
    seen = set()
    for s in range(5):
        a, v = sample_anchors(lm, lengths, 6, torch.Generator().manual_seed(s))
        assert v.all() and a.shape == (1, 6)
        assert ((a >= 10) & (a < 29)).all()  # supervised, and at least one label after it
        assert a[0].tolist() == sorted(a[0].tolist()) and len(set(a[0].tolist())) == 6
        seen.add(tuple(a[0].tolist()))
    assert len(seen) > 1
    a, v = sample_anchors(torch.tensor([[0, 0, 1, 1, 0]]), torch.tensor([5]), 8)
    assert v.sum() == 2 and a[v].tolist() == [2, 3]


def test_decay_weights():
    w = decay_weights(16, default_gamma(16))
    assert w.shape == (15,) and w[0] == 1.0
    assert torch.allclose(w[7], torch.exp(torch.tensor(-1.0)))
    assert default_gamma(10) == 5.0 and default_gamma(8) == 4.0
