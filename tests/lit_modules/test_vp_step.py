"""The vp stage: the prefix law, blocks whose known slots hold the data, and the decay re-based after the prefix."""

import torch

from specdraft.lit_modules.blocks import DraftBatch
from specdraft.lit_modules.drafter_module import DrafterModule
from specdraft.lit_modules.stage_table import Objective
from specdraft.lit_modules.vp_step import sample_prefix_lengths, vp_step, vp_tau
from specdraft.runtime.drafter_io import convert_drafter
from tests.helpers import chi2_pvalue, make_drafter, make_target


def test_prefix_lengths_follow_the_truncated_geometric_law():
    g = torch.Generator().manual_seed(0)
    draws = sample_prefix_lengths((20000,), 8, 0.7, g)
    law = torch.tensor([0.7 ** j for j in range(7)], dtype=torch.float64)
    assert draws.min() >= 0 and draws.max() <= 6
    assert chi2_pvalue(torch.bincount(draws, minlength=7), law / law.sum()) > 1e-3


def test_vp_step_fills_known_slots_with_the_data_and_rebases_the_decay():
    target = make_target(seed=0)
    drafter = convert_drafter(make_drafter(target, seed=1, block_size=6), "vp")
    module = DrafterModule(drafter, target, lr=1e-3, warmup_ratio=0.0, total_steps=10, num_anchors=6,
                           objective=Objective(stage="vp", gamma=2.0))
    ids = torch.randint(0, 60, (2, 40), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([40, 33])}
    db, extra, stats = vp_step(module, batch, "train", torch.Generator().manual_seed(2))
    assert isinstance(db, DraftBatch) and extra == 0.0
    blk, K = db.blocks, 5
    tokens = blk.tokens.view(2, -1, 6)[:, :, 1:]  # [B, N, K]
    known = tokens != drafter.config.mask_token_id
    prefix = known.sum(-1)  # [B, N]
    assert bool((known == (torch.arange(K) < prefix[..., None])).all())  # known slots lead the block
    assert bool((tokens[known] == blk.labels[known]).all())  # and hold the data's tokens
    assert not bool((blk.label_mask & known).any())  # no loss on them
    assert prefix.max() > 0 and (prefix == 0).any()
    w = db.slot_weights
    first_free = prefix.clamp(max=K - 1)[..., None]
    assert torch.allclose(w.gather(-1, first_free), torch.ones_like(first_free, dtype=w.dtype))  # w = 1 at l + 1
    assert torch.allclose(w[..., 1:][~known[..., :-1]] / w[..., :-1][~known[..., :-1]],
                          torch.tensor(torch.exp(torch.tensor(-1 / 2.0)).item()))  # then the decay
    assert (w[known] == 0).all()
    loss = module.objective_loss(db)
    assert loss.requires_grad and torch.isfinite(loss)
    assert stats["vp_tau"] >= 1.0


def test_vp_tau_counts_acceptance_after_the_prefix():
    V = 5
    target_tokens = torch.tensor([[[1, 2, 3, 4]]])
    draft = torch.tensor([[[0, 2, 3, 0]]])  # slot 1 wrong but known: acceptance after the prefix is 2
    logits = torch.nn.functional.one_hot(draft, V).float()
    known = torch.tensor([[[True, False, False, False]]])
    blk = type("B", (), {"valid": torch.tensor([[True]]), "label_mask": ~known})()
    assert vp_tau(logits, blk, target_tokens, known) == 3.0
