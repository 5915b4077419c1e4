"""The ``vp`` stage: training D²SD's variable-prefix drafter (arXiv:2606.04446 §3.4).

Per block a prefix length ``l`` is drawn from a truncated geometric distribution, ``P(l = j) ∝ beta^j`` for
``j = 0..Bk-2`` (``beta`` is the drafter's ``vp.prefix_beta``); the block's slots ``1..l`` hold the ground-truth
tokens, slots ``l+1..Bk-1`` mask tokens; the loss is DFlash's decayed cross-entropy on slots after the prefix with the
decay re-based at ``l + 1``: ``w_k = exp(-(k - l - 1) / gamma)``. Validation reports ``vp_tau``, the teacher-forced
greedy accepted length after the prefix (bonus included), over blocks whose slots after the prefix are all
supervised; it picks the exported checkpoint.
"""

from __future__ import annotations

import torch

from specdraft.lit_modules.blocks import DraftBatch, sample_anchors


def sample_prefix_lengths(shape: tuple[int, ...], block_size: int, beta: float,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Prefix lengths ``l`` in ``0..block_size-2`` with ``P(l = j) ∝ beta^j``."""
    j = torch.arange(block_size - 1, dtype=torch.float64)
    probs = beta ** j
    draws = torch.multinomial((probs / probs.sum()).float(), int(torch.tensor(shape).prod()), replacement=True,
                              generator=generator)
    return draws.view(shape)


def vp_step(module, batch, split: str, generator: torch.Generator | None):
    """Blocks at random anchors whose first ``l`` draft slots hold the data's tokens; ``(DraftBatch, 0, stats)``
    with per-block slot weights re-based at ``l + 1``."""
    d = module.drafter
    Bk, K = d.block_size, d.block_size - 1
    feats, target_hidden, greedy = module.features(batch, split)
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], module.hparams.num_anchors, generator)
    B, N = anchors.shape
    prefix = sample_prefix_lengths((B, N), Bk, d.config.vp.prefix_beta, generator).to(anchors.device)  # [B, N]
    slot = torch.arange(1, Bk, device=anchors.device)  # [K] draft slots 1..K
    known = slot[None, None, :] <= prefix[..., None]  # [B, N, K]

    def with_prefix(blk):
        tokens = blk.tokens.view(B, N, Bk).clone()
        tokens[:, :, 1:] = torch.where(known, blk.labels, tokens[:, :, 1:])
        return blk._replace(tokens=tokens.flatten(1), label_mask=blk.label_mask & ~known)

    logits, _, blk, ctx = module.run_blocks(batch, feats, anchors, valid, edit=with_prefix)
    tokens, slot_logits = module.target_view(anchors, greedy, target_hidden, K)
    k = slot.float()[None, None, :]  # [1, 1, K]
    weights = torch.exp(-(k - prefix[..., None].float() - 1).clamp_min(0) / module.gamma) * (~known)  # [B, N, K]
    db = DraftBatch(logits, blk, tokens, slot_logits, ctx, slot_weights=weights)
    return db, 0.0, {"vp_tau": vp_tau(logits, blk, tokens[..., :K], known)}


def vp_tau(logits: torch.Tensor, blk, target_tokens: torch.Tensor, known: torch.Tensor) -> float:
    """Mean greedy accepted length after the prefix (bonus included) over blocks whose slots after the prefix are
    all supervised (``nan`` when none are)."""
    full = blk.valid & (blk.label_mask | known).all(-1) & ~known.all(-1)  # [B, N]
    if not full.any():
        return float("nan")
    hit = (logits.argmax(-1) == target_tokens) | known  # [B, N, K] the prefix counts as accepted
    run = hit.long().cumprod(-1).sum(-1) - known.sum(-1)  # [B, N] accepted after the prefix
    return float((run[full].float() + 1).mean())
