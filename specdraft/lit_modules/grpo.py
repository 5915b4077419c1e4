"""GRPO for block drafters with simulated acceptance length as the reward (acceptance-length-aware training).

Per training block (an anchor whose whole window is supervised) the policy samples ``G`` draft blocks from its own
per-slot distributions. Each block's reward is its simulated acceptance length, computed by the SAME verification
functions the runtime uses: greedy -> :func:`accept_greedy` against the target's teacher-forced greedy tokens (exact
up to the first mismatch, which is all acceptance looks at); sampling -> :func:`accept_speculative_sampling` with the
target's teacher-forced probabilities (an approximation after the first slot: the real prefix would be the accepted
draft prefix). Advantages are group-normalised; the loss is the clipped policy-ratio surrogate on the accepted
tokens plus the first rejected one (later slots cannot change the outcome), plus ``kl_coef * KL(q || q_ref)`` to the
frozen starting checkpoint. With one update per sample the ratio is 1 and clipping is inactive, as in GRPO's
single-step form; the clip matters when a batch is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from specdraft.errors import OptionError, check_range
from specdraft.lit_modules.blocks import full_windows
from specdraft.runtime.sampling import sample_from_probs
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling


@dataclass
class GRPOConfig:
    """GRPO's options (``train.grpo.*``). The verification temperature of sampling mode is the objective's
    ``temperature``, shared with the other sampling stages."""

    group_size: int = 8
    """G sampled draft blocks per anchor."""
    mode: Literal["greedy", "sampling"] = "greedy"
    """Reward under greedy or sampling verification."""
    draft_temperature: float = 0.5
    """Greedy mode: temperature at which each group is sampled (below 1 the samples sit closer to the argmax drafts
    greedy serving uses). Sampling mode ignores it and samples at the verification temperature, as serving does, so
    the simulated acceptance is the runtime's."""
    clip: float = 0.2
    """Clip range of the policy ratio."""
    kl_coef: float = 0.05
    """Weight of ``KL(q || q_ref)`` to the frozen starting drafter."""
    max_blocks: int = 256
    """Cap on blocks per step that enter GRPO (memory: G x blocks x K x V probabilities)."""

    def __post_init__(self):
        if self.group_size < 2:
            raise OptionError("group_size", f"needs at least 2 samples per group, got {self.group_size}")
        check_range("draft_temperature", self.draft_temperature, 0.0, low_open=True)
        check_range("clip", self.clip, 0.0)
        check_range("kl_coef", self.kl_coef, 0.0)
        check_range("max_blocks", self.max_blocks, 1)


def simulated_acceptance(drafts: torch.Tensor, target_tokens: torch.Tensor, mode: str = "greedy",
                         draft_probs: torch.Tensor | None = None, target_probs: torch.Tensor | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """Accepted drafts per block ``[G, M]`` for drafts ``[G, M, K]``.

    Args:
        target_tokens: ``[M, K + 1]`` target greedy token after each prefix (greedy mode).
        draft_probs: ``[G, M, K, V]`` proposal distributions (sampling mode).
        target_probs: ``[M, K + 1, V]`` target distributions (sampling mode).
    """
    G, M, K = drafts.shape
    flat = drafts.reshape(G * M, K)
    if mode == "greedy":
        V = int(max(target_tokens.max(), drafts.max())) + 1
        onehot = F.one_hot(target_tokens, V).float().expand(G, M, K + 1, V).reshape(G * M, K + 1, V)
        n, _ = accept_greedy(flat, onehot)
    elif mode == "sampling":
        V = target_probs.shape[-1]
        n, _ = accept_speculative_sampling(flat, draft_probs.reshape(G * M, K, V),
                                           target_probs.expand(G, M, K + 1, V).reshape(G * M, K + 1, V), generator)
    else:
        raise ValueError(f"unknown GRPO reward mode {mode!r} (greedy, sampling)")
    return n.view(G, M)


def grpo_loss(logits: torch.Tensor, ref_logits: torch.Tensor, target_tokens: torch.Tensor,
              target_slot_logits: torch.Tensor | None, blocks, cfg: GRPOConfig,
              generator: torch.Generator | None = None, temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Args: ``logits``/``ref_logits`` ``[B, N, K, V]``, ``target_tokens`` ``[B, N, K + 1]``,
    ``target_slot_logits`` ``[B, N, K, V]`` (sampling mode), ``temperature``: the verification temperature of
    sampling mode. Returns ``(loss, stats)``."""
    full = full_windows(blocks)  # [B, N] windows fully in the data
    z, zr, y = logits[full], ref_logits[full], target_tokens[full]  # [M, K, V], [M, K, V], [M, K+1]
    if z.shape[0] > cfg.max_blocks:
        z, zr, y = z[: cfg.max_blocks], zr[: cfg.max_blocks], y[: cfg.max_blocks]
        if target_slot_logits is not None:
            target_slot_logits = target_slot_logits[full][: cfg.max_blocks]
    elif target_slot_logits is not None:
        target_slot_logits = target_slot_logits[full]
    M, K, V = z.shape
    if M == 0:
        return logits.sum() * 0.0, {"reward_mean": 0.0, "reward_std": 0.0, "kl": 0.0}
    G = cfg.group_size
    gen = generator if generator is not None and generator.device == z.device else None
    td = temperature if cfg.mode == "sampling" else cfg.draft_temperature  # the policy's sampling temperature
    logq = F.log_softmax(z.float() / td, -1)  # [M, K, V]
    q = logq.detach().exp()
    drafts = sample_from_probs(q.expand(G, M, K, V), gen)  # [G, M, K]
    with torch.no_grad():
        if cfg.mode == "sampling":
            t = temperature
            p = F.softmax(target_slot_logits.float() / t, -1)  # [M, K, V]
            p = torch.cat([p, p[:, -1:]], dim=1)  # bonus slot: irrelevant to the accepted count
            qv = F.softmax(z.detach().float() / t, -1).expand(G, M, K, V)
            n = simulated_acceptance(drafts, y, "sampling", qv, p, gen)
        else:
            n = simulated_acceptance(drafts, y, "greedy")
    r = n.float()  # [G, M]
    adv = (r - r.mean(0, keepdim=True)) / (r.std(0, keepdim=True) + 1e-4)  # group-normalised
    logp = logq.expand(G, M, K, V).gather(-1, drafts[..., None])[..., 0]  # [G, M, K]
    ratio = torch.exp(logp - logp.detach())
    a = adv[..., None]
    surrogate = -torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * a)
    credit = torch.arange(K, device=z.device) < (n[..., None] + 1).clamp(max=K)  # accepted + first rejected
    policy = (surrogate * credit).sum() / credit.sum().clamp_min(1)
    log_ref = F.log_softmax(zr.float() / td, -1)
    kl = (logq.exp() * (logq - log_ref)).sum(-1).mean()
    stats = {"reward_mean": float(r.mean() + 1), "reward_std": float(r.std(0).mean()), "kl": float(kl.detach())}
    return policy + cfg.kl_coef * kl, stats


def grpo_stage_loss(module, db, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The grpo stage's loss: :func:`grpo_loss` against ``module.reference`` (the frozen starting drafter) re-run on
    the same blocks and context."""
    o, blk, ref = module.objective, db.blocks, module.reference
    K = db.logits.shape[2]
    with torch.no_grad():
        embeds, positions, feats, ctx_pos = db.ctx
        B, N = db.logits.shape[:2]
        hidden = ref(embeds, positions, ref.context_kv(feats, ctx_pos), blk.mask)
        ref_logits = ref.logits(hidden.view(B, N, K + 1, -1)[:, :, 1:])  # [B, N, K, V]
    return grpo_loss(db.logits, ref_logits, db.target_tokens, db.target_logits, blk, o.grpo, generator,
                     o.temperature)
