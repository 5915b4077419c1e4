"""ReTrace training step (methods.md §1.5): a no-grad first round produces drafts and rejected suffixes at random
anchors, simulated greedy verification (the runtime's ``accept_greedy`` against the target's teacher-forced tokens)
picks the next anchors ``a' = a + n + 1``, and the second round trains with the aligned prior fused into its inputs.

Correction signals use the target's teacher-forced logits and features at the old slots ("cheap mode"): exact at
the first rejected slot, approximate after it (the real verify pass conditions on the draft prefix). Prior dropout
keeps the no-prior path calibrated; blocks whose first round was fully accepted carry an empty prior naturally.
"""

from __future__ import annotations

import torch

from specdraft.runtime.models.retrace import build_prior
from specdraft.runtime.verify import accept_greedy


def two_round_blocks(module, batch, split: str, generator: torch.Generator | None, prior_dropout: float):
    """Returns ``(DraftBatch of round 2, stats)``; ``module`` is a :class:`DrafterModule` over a ReTrace drafter."""
    from specdraft.lit_modules.blocks import sample_anchors
    from specdraft.lit_modules.drafter_module import DraftBatch

    d = module.drafter
    bs, K = d.block_size, d.block_size - 1
    feats, target_hidden, greedy = module._features(batch, split)
    lengths = batch["lengths"]
    anchors, valid = sample_anchors(batch["loss_mask"], lengths, module.hparams.num_anchors, generator)
    B, N = anchors.shape
    with torch.no_grad():
        logits1, hidden1, _, _ = module.run_blocks(batch, feats, anchors, valid)
        tokens1, slot_logits1 = module.target_view(anchors, greedy, target_hidden, K)
        drafts = logits1.argmax(-1)  # [B, N, K]
        V = logits1.shape[-1]
        n, _ = accept_greedy(drafts.flatten(0, 1), torch.nn.functional.one_hot(tokens1.flatten(0, 1), V).float())
        n = n.view(B, N)
        S, F = feats.shape[1], feats.shape[2]
        pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).clamp(max=S - 1)  # [B, N, Bk]
        f_slots = feats.gather(1, pos.flatten(1)[..., None].expand(-1, -1, F)).view(B, N, bs, F)
        verify_logits = torch.cat([slot_logits1, slot_logits1[:, :, -1:]], dim=2)  # index i scores slot i + 1
        prior = build_prior(hidden1.flatten(0, 1), drafts.flatten(0, 1), n.flatten(), verify_logits.flatten(0, 1),
                            f_slots.flatten(0, 1))
        if prior_dropout > 0:
            gen_dev = generator.device if generator is not None else anchors.device
            keep = torch.rand(B * N, generator=generator, device=gen_dev).to(anchors.device) >= prior_dropout
            prior = prior._replace(valid=prior.valid & keep[:, None])
        anchors2 = anchors + n + 1
        valid2 = valid & (anchors2 < lengths[:, None] - 1)
        anchors2 = torch.where(valid2, anchors2, torch.zeros_like(anchors2))
    logits2, _, blk2, ctx2 = module.run_blocks(batch, feats, anchors2, valid2, prior)
    tokens2, slot_logits2 = module.target_view(anchors2, greedy, target_hidden, K)
    with_prior = (prior.valid.any(-1).view(B, N) & valid2).float()
    stats = {"round1_tau": float((n[valid].float() + 1).mean()) if valid.any() else float("nan"),
             "prior_fraction": float(with_prior.sum() / valid2.float().sum().clamp_min(1))}
    return DraftBatch(logits2, blk2, tokens2, slot_logits2, ctx2), stats
