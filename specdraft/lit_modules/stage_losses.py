"""The per-stage losses of the drafter stages, each ``(module, DraftBatch, generator) -> (loss, stats)``.

``module`` is the :class:`~specdraft.lit_modules.drafter_module.DrafterModule` (its ``objective`` and
``slot_weights``); the tensor math lives in :mod:`specdraft.lit_modules.losses`. ``stats`` (floats) are logged as
``train/<stage>_<name>``.
"""

from __future__ import annotations

import torch

from specdraft.lit_modules.blocks import DraftBatch
from specdraft.lit_modules.losses import decayed_ce, eal_loss, forward_kl, tv_hybrid_loss, wtv_loss


def sft_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """DFlash's decayed cross-entropy (arXiv:2602.06036 §4.2), plus ``kl_weight`` times the forward KL."""
    o, blk = module.objective, db.blocks
    loss = decayed_ce(db.logits, blk.labels, blk.label_mask, module.slot_weights)
    if o.kl_weight > 0:
        loss = loss + o.kl_weight * forward_kl(db.logits, db.target_logits, blk.label_mask, module.slot_weights,
                                               o.temperature)
    return loss, {}


def kl_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """Forward KL to the target at the objective's temperature (the baseline of the sampling losses)."""
    o, blk = module.objective, db.blocks
    return forward_kl(db.logits, db.target_logits, blk.label_mask, module.slot_weights, o.temperature), {}


def tv_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """The LK-style KL / total-variation hybrid (LK losses, arXiv:2602.23881)."""
    o, blk = module.objective, db.blocks
    return tv_hybrid_loss(db.logits, db.target_logits, blk.label_mask, module.slot_weights, o.temperature), {}


def eal_stage_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """Expected accepted length under greedy verification, optionally mixed with decayed CE
    (``lambda = exp(-ce_mix_eta * mean q)``)."""
    o, blk = module.objective, db.blocks
    K = db.logits.shape[2]
    loss, _ = eal_loss(db.logits, db.target_tokens[..., :K], blk.label_mask, blk.valid, form=o.acceptance_form,
                       variant=o.eal_variant)
    if o.ce_mix_eta > 0:
        q = db.logits.float().log_softmax(-1).gather(-1, db.target_tokens[..., :K, None])[..., 0].exp()  # [B, N, K]
        m = blk.label_mask.float()
        lam = torch.exp(-o.ce_mix_eta * ((q.detach() * m).sum() / m.sum().clamp_min(1)))
        loss = lam * decayed_ce(db.logits, blk.labels, blk.label_mask, module.slot_weights) + (1 - lam) * loss
    return loss, {}


def wtv_stage_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """Window total variation: expected accepted length under speculative sampling at the objective's temperature."""
    o, blk = module.objective, db.blocks
    loss = wtv_loss(db.logits, db.target_logits, blk.label_mask, o.temperature, blk.valid, form=o.acceptance_form,
                    variant=o.wtv_variant)[0]
    return loss, {}


def vp_loss(module, db: DraftBatch, generator: torch.Generator | None = None):
    """D²SD's VP loss: decayed CE on the slots after each block's prefix, the decay re-based at ``l + 1``
    (arXiv:2606.04446 §3.4; the per-block weights come from the vp step)."""
    blk = db.blocks
    return decayed_ce(db.logits, blk.labels, blk.label_mask, db.slot_weights), {}
