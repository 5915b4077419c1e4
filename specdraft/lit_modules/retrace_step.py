"""ReTrace training step: a no-grad first round produces drafts and rejected suffixes at random anchors,
verification picks the next anchors ``a' = a + n + 1``, and the second round trains with the aligned prior fused into
its inputs (ReTrace; the fusion itself is :mod:`specdraft.runtime.models.retrace`).

Correction signals come in two modes (:attr:`ReTraceTraining.signals`):

- ``exact`` (default): the target verifies every round-1 block ``[x_a, d_1..d_K]`` exactly as serving does, in ONE
  extra no-grad target pass over all blocks against the cached sequence (each block sees only the context before its
  anchor). Acceptance, the target's tokens, probabilities and features at the rejected slots are then the ones the
  runtime will hand the drafter. Costs one target pass over ``N * Bk`` tokens per step.
- ``cheap``: the target's teacher-forced logits/features at the old slots. Exact at the first rejected slot only:
  after it the real verify pass conditions on the WRONG draft prefix, while teacher forcing conditions on the true
  text, so the target's token at a later slot is the label itself (a drafter trained so can learn to copy it; kept
  as an ablation).

Prior dropout keeps the no-prior path calibrated; blocks whose first round was fully accepted carry an empty prior
naturally. Chaining (:attr:`ReTraceTraining.chain`): serving's retained states come from blocks that were drafted
with a prior themselves, so with that probability the first round gets a prior from a no-grad round 0 (one more
drafter pass and one more verify replay per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from specdraft.errors import check_range
from specdraft.lit_modules.blocks import DraftBatch, sample_anchors
from specdraft.lit_modules.losses import decayed_ce
from specdraft.runtime.models.retrace import VerifyStats, build_prior, verify_stats
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.verify import accept_greedy

SignalMode = Literal["exact", "cheap"]
SIGNAL_MODES = get_args(SignalMode)


@dataclass
class ReTraceTraining:
    """How the retrace stage trains (``train.retrace.*``); the fusion's layout is the drafter's
    :class:`~specdraft.runtime.models.retrace.ReTraceOptions`."""

    prior_dropout: float = 0.2
    """Share of second-round blocks trained without their prior (keeps the no-prior path calibrated)."""
    signals: SignalMode = "exact"
    """Correction signals from a replayed verify pass of each first-round block (exact, one extra target pass per
    step, needs online features) or the target's teacher-forced view (cheap, an ablation: it leaks the label)."""
    chain: float = 1.0
    """Probability that the first (no-grad) round is itself drafted with a prior from a round 0, so the fusion also
    trains on retained states of prior-conditioned blocks, as serving produces them (0 = two rounds). Any value
    > 0 costs the same (round 0 always runs)."""
    first_round_ce: float = 0.0
    """Weight of the decayed CE on the first round's random-anchor blocks, trained alongside the second round
    (0 = the second round only; its anchors follow rejections, and a backbone trained only there drifts)."""
    fusion_lr_scale: float = 10.0
    """Learning-rate multiplier of the new fusion/refiner parameters (the warm-started backbone keeps the base lr)."""

    def __post_init__(self):
        check_range("prior_dropout", self.prior_dropout, 0.0, 1.0)
        check_range("chain", self.chain, 0.0, 1.0)
        check_range("first_round_ce", self.first_round_ce, 0.0)
        check_range("fusion_lr_scale", self.fusion_lr_scale, 0.0, low_open=True)


LOGITS_BUDGET = 1 << 27
"""Most logits (elements) materialised at once when reducing replayed verify passes (512 MiB in fp32)."""


@torch.no_grad()
def verify_blocks(target: TargetLM, cache, anchors: torch.Tensor, blocks: torch.Tensor,
                  layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The serving verify pass, replayed for many blocks of one cached sequence at once.

    Args:
        target: the frozen target.
        cache: its KV cache holding the whole sequence (``lengths`` = the sequence length per row).
        anchors: ``[B, N]`` anchor positions.
        blocks: ``[B, N, Bk]`` verify inputs ``[x_a, d_1..d_K]``.
        layer_ids: the drafter's feature layers.
    Returns:
        ``(hidden [B, N, Bk, D], features [B, N, Bk, F])``: final-normed hidden states (``lm_head`` of index ``i``
        scores slot ``i + 1``) and the target's layer outputs after slot ``s`` (as :func:`generate` sees them).
    """
    B, N, Bk = blocks.shape
    dev = blocks.device
    k = torch.arange(Bk, device=dev)
    positions = (anchors[:, :, None] + k).flatten(1)  # [B, N * Bk]
    block_id = torch.arange(N, device=dev).repeat_interleave(Bk)  # [Q]
    slot = k.repeat(N)  # [Q]
    causal_in_block = (block_id[:, None] == block_id[None, :]) & (slot[:, None] >= slot[None, :])  # [Q, Q]
    visible = anchors.repeat_interleave(Bk, dim=1)  # [B, Q]: strictly before the anchor, as in serving
    out = target(blocks.flatten(1), cache=cache, positions=positions, new_mask=causal_in_block,
                 feature_layers=layer_ids, visible_prefix=visible, return_logits=False)
    return out.hidden.view(B, N, Bk, -1), out.features.view(B, N, Bk, -1)


@torch.no_grad()
def verify_outcome(lm_head, hidden: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, VerifyStats]:
    """Greedy acceptance and :class:`VerifyStats` of replayed verify passes, ``hidden [R, Bk, D]`` and ``drafts
    [R, K]``, computed in row chunks so a 150k vocabulary never materialises ``[R, Bk, V]`` logits at once."""
    R, Bk, _ = hidden.shape
    chunk = max(1, LOGITS_BUDGET // (Bk * lm_head.weight.shape[0]))
    n, stats = [], []
    for i in range(0, R, chunk):
        logits = lm_head(hidden[i:i + chunk])  # [c, Bk, V]
        n.append(accept_greedy(drafts[i:i + chunk], logits)[0])
        stats.append(verify_stats(logits, drafts[i:i + chunk]))
    return torch.cat(n), VerifyStats(*(torch.cat(parts) for parts in zip(*stats)))


def two_round_blocks(module, batch, split: str, generator: torch.Generator | None, prior_dropout: float,
                     signals: str = "exact", chain: float = 0.0, first_round_ce: torch.Tensor | None = None):
    """Returns ``(DraftBatch of round 2, stats)``; ``module`` is a :class:`DrafterModule` over a ReTrace drafter.

    ``chain``: the probability that the first round is itself drafted with a prior, from a no-grad round 0 (verified
    the same way). In serving, rounds chain: the retained hidden states come from a block that was drafted WITH the
    previous suffix fused in, not from a prior-free one; without a round 0 the fusion trains only on the latter.

    ``first_round_ce``: per-slot CE weights ``[K]``. When given, the first round (random anchors, no prior: the
    blocks SFT trains on) runs with gradients and its decayed CE is returned as ``stats["first_round_ce"]`` (a
    tensor with grad), so the backbone keeps training where SFT trains it and not only after rejections.
    """
    if signals not in SIGNAL_MODES:
        raise ValueError(f"retrace signals must be one of {SIGNAL_MODES}, got {signals!r}")
    d = module.drafter
    Bk = d.block_size
    K = Bk - 1
    ids, lengths = batch["input_ids"], batch["lengths"]
    cache = None
    if signals == "exact":  # features from a cached target pass, so the verify replay can attend to the sequence
        B0, S0 = ids.shape
        cache = module.target.new_cache(B0, S0 + min(module.hparams.num_anchors, S0) * Bk)
    feats, target_hidden, greedy = module.features(batch, split, cache=cache)
    anchors, valid = sample_anchors(batch["loss_mask"], lengths, module.hparams.num_anchors, generator)
    B, N = anchors.shape
    gen_dev = generator.device if generator is not None else anchors.device

    def keep_mask(p_drop: float) -> torch.Tensor:  # [B * N] blocks whose prior survives
        return torch.rand(B * N, generator=generator, device=gen_dev).to(anchors.device) >= p_drop

    rounds = 2 if chain > 0 else 1  # no-grad rounds before the trained one: (round 0,) round 1
    prior, first_valid = None, valid
    with torch.no_grad():
        for r in range(rounds):
            with_grad = r == 0 and first_round_ce is not None
            with torch.set_grad_enabled(with_grad):
                logits1, hidden1, blk1, _ = module.run_blocks(batch, feats, anchors, valid, prior)
                if with_grad:
                    ce0 = decayed_ce(logits1, blk1.labels, blk1.label_mask, first_round_ce)
            logits1, hidden1 = logits1.detach(), hidden1.detach()
            drafts = logits1.argmax(-1)  # [B, N, K]
            n, prior = _verify_round(module, batch, cache, feats, target_hidden, greedy, anchors, hidden1, drafts,
                                     signals)
            if r == 0:
                first_n = n
            p_drop = prior_dropout if r == rounds - 1 else 1.0 - chain
            if p_drop > 0:
                prior = prior._replace(valid=prior.valid & keep_mask(p_drop)[:, None])
            anchors = anchors + n + 1
            valid = valid & (anchors < lengths[:, None] - 1)
            anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    logits2, _, blk2, ctx2 = module.run_blocks(batch, feats, anchors, valid, prior)
    tokens2, slot_logits2 = module.target_view(anchors, greedy, target_hidden, K)
    with_prior = (prior.valid.any(-1).view(B, N) & valid).float()
    summary = {"round1_tau": float((first_n[first_valid].float() + 1).mean()) if first_valid.any() else float("nan"),
               "prior_fraction": float(with_prior.sum() / valid.float().sum().clamp_min(1))}
    if first_round_ce is not None:
        summary["first_round_ce"] = ce0
    return DraftBatch(logits2, blk2, tokens2, slot_logits2, ctx2), summary


def _verify_round(module, batch, cache, feats, target_hidden, greedy, anchors, hidden, drafts, signals):
    """Simulated verification of one no-grad round: ``(accepted [B, N], Prior of the rejected suffixes)``."""
    d = module.drafter
    Bk = d.block_size
    K = Bk - 1
    ids = batch["input_ids"]
    B, N = anchors.shape
    S, F = feats.shape[1], feats.shape[2]
    if signals == "exact":
        blocks = torch.cat([ids.gather(1, anchors)[..., None], drafts], dim=-1)  # [B, N, Bk]
        v_hidden, f_slots = verify_blocks(module.target, cache, anchors, blocks, d.target_layer_ids)
        n, stats = verify_outcome(module.target.lm_head, v_hidden.flatten(0, 1), drafts.flatten(0, 1))
    else:
        tokens1, slot_logits1 = module.target_view(anchors, greedy, target_hidden, K)
        V = slot_logits1.shape[-1]
        n, _ = accept_greedy(drafts.flatten(0, 1), torch.nn.functional.one_hot(tokens1.flatten(0, 1), V).float())
        pos = (anchors[:, :, None] + torch.arange(Bk, device=anchors.device)).clamp(max=S - 1)  # [B, N, Bk]
        f_slots = feats.gather(1, pos.flatten(1)[..., None].expand(-1, -1, F)).view(B, N, Bk, F)
        stats = verify_stats(slot_logits1.flatten(0, 1), drafts.flatten(0, 1))
    prior = build_prior(hidden.flatten(0, 1), drafts.flatten(0, 1), n, stats,
                        d.fuse_context(f_slots.to(feats.dtype)).flatten(0, 1), d.embed,
                        d.config.retrace.embed_drafted)
    return n.view(B, N), prior


def retrace_step(module, batch, split: str, generator: torch.Generator | None):
    """The retrace stage's step: ``(DraftBatch of round 2, extra loss, stats)``.

    Training draws round-2 blocks with :attr:`ReTraceTraining.prior_dropout`; validation measures the same blocks
    twice (all priors dropped, then all kept, on identical anchors) and reports ``sim_tau_noprior`` for the first.
    """
    o = module.objective.retrace
    if split == "train":
        weights = module.slot_weights if o.first_round_ce > 0 else None
        db, stats = two_round_blocks(module, batch, split, generator, o.prior_dropout, o.signals, o.chain, weights)
        extra = o.first_round_ce * stats.pop("first_round_ce") if "first_round_ce" in stats else 0.0
        return db, extra, stats
    seed = generator.initial_seed()  # both passes draw the same anchors
    db0, _ = two_round_blocks(module, batch, split, torch.Generator().manual_seed(seed), 1.0, o.signals, o.chain)
    noprior = module.simulated_tau(db0.logits, db0.blocks, db0.target_tokens)
    db, _ = two_round_blocks(module, batch, split, generator, 0.0, o.signals, o.chain)
    return db, 0.0, {"sim_tau_noprior": noprior}
