"""Logits -> probabilities (temperature, top-k, top-p) and sampling. Draft and target go through the SAME function,
which is what keeps speculative sampling lossless when truncation is on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set with cumulative probability >= top_p (1.0 = off)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities ``[..., V]`` after temperature, top-k and top-p (greedy -> one-hot of the argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of ``probs`` ``[..., V]`` (non-negative, need not sum to one) without a host sync.

    Inverse CDF: one float64 uniform per row against the row's float64 running sum, so a token of probability 0 is
    never drawn and rounding stays near float64's (the exponential race of gpt-fast draws ``V`` exponentials per
    row, which on a CPU costs some 20 times as much for a block of drafts).
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total: the last positive token
    index = torch.searchsorted(cdf, u, right=True)[..., 0]  # first index whose cdf exceeds u
    return index.clamp_max(probs.shape[-1] - 1)  # in range even for rows with no mass (NaN: a caller's bug)


def sample_residual(residual: torch.Tensor, probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of ``residual`` ``[..., V]`` (what is left of the target's distribution ``probs`` after a
    node's proposals were rejected, unnormalised), or of ``probs`` in a row rounding left no mass (a row that exact
    arithmetic never gives: a proposal is rejected only with some ``p(x) < q(x)``, which leaves mass elsewhere)."""
    return sample_from_probs(torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs), generator)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    if params.greedy:
        return logits.argmax(-1)
    return sample_from_probs(logits_to_probs(logits, params), generator)
