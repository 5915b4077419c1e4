"""GRPO for block drafters with simulated acceptance length as the reward (the third seed abstract; methods.md §3.4).

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

import torch
import torch.nn.functional as F

from specdraft.lit_modules.blocks import full_windows
from specdraft.runtime.sampling import sample_from_probs
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling


@dataclass
class GRPOConfig:
    group_size: int = 8
    """G sampled draft blocks per anchor."""
    mode: str = "greedy"
    """Reward under greedy or sampling verification."""
    draft_temperature: float = 0.5
    """Greedy mode: temperature at which the group is sampled. Below 1 the samples sit closer to the argmax drafts
    greedy serving uses (tiny world, 150 steps from eal-mix: 0.5 gave +4.2% / +7.4% greedy tau over two seeds, 1.0
    gave -0.1%). Sampling mode ignores it and samples at ``temperature``, as serving does, so the simulated
    acceptance is the runtime's."""
    temperature: float = 1.0
    """Verification temperature in sampling mode (applied to target and drafter alike)."""
    clip: float = 0.2
    kl_coef: float = 0.05
    max_blocks: int = 256
    """Cap on blocks per step that enter GRPO (memory: G x blocks x K x V probabilities)."""


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
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Args: ``logits``/``ref_logits`` ``[B, N, K, V]``, ``target_tokens`` ``[B, N, K + 1]``,
    ``target_slot_logits`` ``[B, N, K, V]`` (sampling mode). Returns ``(loss, stats)``."""
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
    td = cfg.temperature if cfg.mode == "sampling" else cfg.draft_temperature  # the policy's sampling temperature
    logq = F.log_softmax(z.float() / td, -1)  # [M, K, V]
    q = logq.detach().exp()
    drafts = sample_from_probs(q.expand(G, M, K, V), gen)  # [G, M, K]
    with torch.no_grad():
        if cfg.mode == "sampling":
            t = cfg.temperature
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
