"""Verification rules as pure functions over tokens and distributions. Both rules are lossless; tests prove it.

Shapes: ``K`` draft tokens per row; the target scores ``K + 1`` positions (the K drafts plus the bonus slot).
"""

from __future__ import annotations

import torch

from specdraft.runtime.sampling import sample_from_probs


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix that equals the target's argmax, then the target's token.

    Args:
        draft_tokens: ``[B, K]``.
        target_logits: ``[B, K + 1, V]``; position ``k`` scores the token after draft prefix ``d_<k``.
    Returns:
        ``(num_accepted [B] in 0..K, next_token [B])``; output equals target-only greedy decoding.
    """
    return accept_greedy_tokens(draft_tokens, target_logits.argmax(-1))


def accept_greedy_tokens(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_greedy` given the target's greedy tokens ``[B, K + 1]`` instead of its logits (from the fused
    LM-head argmax, which never materialises logits)."""
    K = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :K]).long()  # [B, K]
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target_tokens.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return num_accepted, next_token


def accept_speculative_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).

    Draft token ``d_k ~ q_k`` is accepted with probability ``min(1, p_k(d_k) / q_k(d_k))``; at the first rejection
    the next token is drawn from ``norm(max(p_k - q_k, 0))``; if all K are accepted it is drawn from ``p_K`` (bonus).
    Every emitted token is then distributed exactly as the target's ``p``. A deterministic (argmax) drafter is the
    special case ``q_k = one_hot(d_k)``.

    Args:
        draft_tokens: ``[B, K]`` tokens drawn from ``draft_probs``.
        draft_probs: ``[B, K, V]`` the drafter's (temperature/top-k/top-p processed) distributions.
        target_probs: ``[B, K + 1, V]`` the target's distributions, processed identically.
    Returns:
        ``(num_accepted [B], next_token [B])``.
    """
    B, K = draft_tokens.shape
    p = target_probs[:, :K].gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, K]
    u = torch.rand(B, K, generator=generator, device=p.device)
    accepted = (u * q <= p).long()  # u < p/q without dividing
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)  # [B, K + 1, V]
    rows = torch.arange(B, device=p.device)
    residual = (target_probs[rows, num_accepted] - q_pad[rows, num_accepted]).clamp_min(0)  # [B, V]
    # a == K: q_pad row is zero so residual == p_K (bonus). a < K: rejection implies p(d) < q(d), so mass > 0.
    next_token = sample_from_probs(residual / residual.sum(-1, keepdim=True), generator)
    return num_accepted, next_token
