"""Drafter losses: pure functions over ``[..., K, V]`` logits with masks (fp32 math, chunked over rows).

``K`` = draft slots per block (B - 1). Weights ``w_k`` multiply every row's slot-k term; the result is the weighted
mean over supervised slots: ``sum(w * m * l) / sum(w * m)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_CHUNK = 2048


def _weighted_mean(per_slot: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w = weights * mask.float()  # [..., K]
    return (per_slot * w).sum() / w.sum().clamp_min(1e-8)


def _rowwise(fn, *flat: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to row chunks of row-aligned tensors (bounds the fp32 copy of a 150k vocabulary)."""
    R = flat[0].shape[0]
    return torch.cat([fn(*(t[i:i + ROW_CHUNK] for t in flat)) for i in range(0, R, ROW_CHUNK)])


def decayed_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """DFlash SFT loss: cross-entropy per slot weighted by ``exp(-(k-1)/gamma)`` (arXiv:2602.06036 §4.2)."""
    ce = _rowwise(lambda lg, y: F.cross_entropy(lg.float(), y, reduction="none"),
                 logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return _weighted_mean(ce.view(labels.shape), mask, weights)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
               weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``KL(p_target || q_draft)`` per slot, temperature-scaled, weighted like :func:`decayed_ce`."""

    def kl(d, t):
        logq = F.log_softmax(d.float() / temperature, -1)
        logp = F.log_softmax(t.float() / temperature, -1)
        return (logp.exp() * (logp - logq)).sum(-1)

    V = draft_logits.shape[-1]
    per = _rowwise(kl, draft_logits.reshape(-1, V), target_logits.reshape(-1, V))
    return _weighted_mean(per.view(mask.shape), mask, weights)
