"""Drafter losses: pure functions over ``[..., K, V]`` logits with masks (fp32 math, chunked over rows).

``K`` = draft slots per block (Bk - 1). Weights ``w_k`` multiply every row's slot-k term; the result is the weighted
mean over supervised slots: ``sum(w * m * l) / sum(w * m)``.
"""

from __future__ import annotations

from typing import Literal, get_args

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


# ---- acceptance-aware losses (EAL / WTV) ----------------------------------------------------------------------

def _valid_prefix(mask: torch.Tensor) -> torch.Tensor:
    """Slots after the first invalid one are cut: acceptance cannot continue past the end of the window."""
    return mask.float().cumprod(dim=-1)


def _log_reach(log_accept: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log prod_{j<=k} a_j, valid prefix)``, both ``[..., K]``."""
    m = _valid_prefix(mask)
    return torch.cumsum(log_accept * m, dim=-1), m


def expected_accept_length(log_accept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``E = sum_k prod_{j<=k} a_j`` per block from per-slot log acceptance probabilities ``[..., K]`` (log space)."""
    log_c, m = _log_reach(log_accept, mask)
    return (log_c.exp() * m).sum(-1)  # [...]


def log_expected_accept_length(log_accept: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log E`` per block by logsumexp over the valid prefix: finite however small E is. An empty block gives a large
    negative constant with zero gradient (a ``-inf`` fill would make its backward NaN)."""
    log_c, m = _log_reach(log_accept, mask)
    return torch.logsumexp(log_c.masked_fill(m == 0, -1e4), dim=-1)  # [...]


def greedy_slot_gains(hit: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``W_k = n(slot k accepted) - n(slot k rejected)`` per slot ``[..., K]``, every other slot held at its outcome.

    ``n = sum_i prod_{j<=i} g_j`` is the greedy accepted length for hard outcomes ``g`` (``hit``: the draft's argmax
    equals the target's token). ``W_k = sum_{i>=k} prod_{j<=i, j!=k} g_j`` is ``dn/dg_k`` of that multilinear form:
    0 after the first rejection, ``1 + (the run of hits right after k)`` up to and including it. At the first
    rejected slot that is the length the block would gain if that one slot were fixed.
    """
    g = (hit & _valid_prefix(mask).bool()).float()  # [..., K]
    K = g.shape[-1]
    before = torch.cumprod(F.pad(g, (1, 0), value=1.0)[..., :K], dim=-1)  # prod_{j<k} g_j
    run = torch.zeros_like(g)  # run[k] = number of consecutive hits at k+1, k+2, ...
    for k in range(K - 2, -1, -1):
        run[..., k] = g[..., k + 1] * (1 + run[..., k + 1])
    return before * (1 + run) * _valid_prefix(mask)


def eal_loss(draft_logits: torch.Tensor, target_tokens: torch.Tensor, mask: torch.Tensor,
             block_mask: torch.Tensor | None = None, *, form: AcceptanceForm,
             variant: str = "product") -> tuple[torch.Tensor, torch.Tensor]:
    """Expected accepted length under greedy verification (EAL).

    With ``q_k = softmax(z_k)[y*_k]`` (draft probability of the target's greedy token), ``E = sum_k prod_{j<=k} q_j``
    is exactly the expected number of accepted drafts for a drafter that samples each slot independently, and a
    smooth surrogate for an argmax drafter. Its gradient is automatically front-weighted:
    ``dE/dlog q_j = sum_{k>=j} prod_{i<=k} q_i``.

    Args:
        draft_logits: ``[..., K, V]``; target_tokens: ``[..., K]`` target greedy tokens; mask: ``[..., K]``.
        block_mask: ``[...]`` blocks that count (default: blocks with at least one valid slot).
        form: ``"log_len"`` -> ``-log E``, ``"log"`` -> ``-log(1 + E)``, ``"linear"`` -> ``-E / K``.
        variant: ``"product"`` (the loss of ``form``) or ``"greedy"``: ``E``'s gradient with the other slots held at
            their hard greedy outcome, ``-sum_k sg(W_k) log q_k / sum sg(W_k)`` with ``W_k`` from
            :func:`greedy_slot_gains`. For an argmax drafter the product's soft reach ``prod_{j<k} q_j`` starves the
            deep slots of a block whose earlier slots are accepted with moderate ``q``; the greedy weights do not,
            and they put no weight on slots past the first rejection, which greedy verification never reaches.
    Returns:
        ``(loss, E per block)``.
    """
    logq = _rowwise(lambda z, y: F.log_softmax(z.float(), -1).gather(-1, y[:, None])[:, 0],
                    draft_logits.reshape(-1, draft_logits.shape[-1]), target_tokens.reshape(-1))
    logq = logq.view(target_tokens.shape)  # [..., K]
    if variant == "product":
        return _reduce_acceptance(logq, mask, block_mask, form)
    if variant != "greedy":
        raise ValueError(f"unknown EAL variant {variant!r} (product, greedy)")
    hit = draft_logits.argmax(-1) == target_tokens  # [..., K]
    W = greedy_slot_gains(hit, mask) * _block_mask(mask, block_mask)[..., None]  # [..., K]
    loss = -(W * logq).sum() / W.sum().clamp_min(1)
    return loss, expected_accept_length(logq, mask)


def acceptance_alpha(draft_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float = 1.0,
                     target_temperature: float | None = None) -> torch.Tensor:
    """Per-slot acceptance probability of speculative sampling, ``alpha = sum_v min(p, q) = 1 - TV(p, q)`` ``[..., K]``.

    ``target_temperature=0`` sharpens the target to its argmax (then ``alpha = q(y*)``: WTV reduces to EAL).
    """
    tt = temperature if target_temperature is None else target_temperature
    V = draft_logits.shape[-1]

    def alpha(d, t):
        q = F.softmax(d.float() / temperature, -1)
        p = F.one_hot(t.argmax(-1), V).float() if tt == 0 else F.softmax(t.float() / tt, -1)
        return torch.minimum(p, q).sum(-1)

    return _rowwise(alpha, draft_logits.reshape(-1, V), target_logits.reshape(-1, V)).view(draft_logits.shape[:-1])


def wtv_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
             block_mask: torch.Tensor | None = None, *, form: AcceptanceForm, variant: str = "product",
             target_temperature: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Window total variation loss for speculative sampling at temperature T.

    ``E_T = sum_k prod_{j<=k} alpha_j`` with ``alpha_k = 1 - TV(p_k, q_k)`` (both temperature-scaled): the expected
    number of accepted drafts in the window, position k weighted by the acceptance of every earlier slot.
    ``variant="stopgrad"`` uses ``L = sum_k W_k (1 - alpha_k)``, ``W_k = sum_{i>=k} prod_{j<=i, j!=k} sg(alpha_j)``
    (same gradient direction per slot, no vanishing product).

    Returns:
        ``(loss, E_T per block)``.
    """
    a = acceptance_alpha(draft_logits, target_logits, temperature, target_temperature).clamp_min(1e-8)
    if variant == "product":
        return _reduce_acceptance(a.log(), mask, block_mask, form)
    E = expected_accept_length(a.log(), mask)
    if variant != "stopgrad":
        raise ValueError(f"unknown WTV variant {variant!r} (product, stopgrad)")
    m = _valid_prefix(mask)
    sa = a.detach()
    prefix = torch.cumprod(sa * m + (1 - m), dim=-1) * m  # prod_{j<=i} sg(a_j) on valid slots
    # W_k = sum_{i>=k} prefix_i / sg(a_k)
    W = torch.flip(torch.cumsum(torch.flip(prefix, [-1]), -1), [-1]) / sa
    per_block = (W * (1 - a) * m).sum(-1)
    bm = _block_mask(mask, block_mask)
    return (per_block * bm).sum() / bm.sum().clamp_min(1), E


def _block_mask(mask: torch.Tensor, block_mask: torch.Tensor | None) -> torch.Tensor:
    return (mask[..., 0] if block_mask is None else block_mask & mask[..., 0]).float()


AcceptanceForm = Literal["log_len", "log", "linear"]
"""How the acceptance losses turn ``E`` into a loss (see :func:`_reduce_acceptance`)."""
ACCEPTANCE_FORMS = get_args(AcceptanceForm)


def _reduce_acceptance(log_accept: torch.Tensor, mask: torch.Tensor, block_mask: torch.Tensor | None,
                       form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss over blocks from per-slot log acceptance ``[..., K]``; returns ``(loss, E per block)``.

    ``log``: ``-log(1 + E)``. Its gradient ``grad E / (1 + E)`` vanishes with E: a block whose first slot is rarely
    accepted (``E ~ a_1``) gets almost no gradient, so the loss trains the blocks that are already easy.
    ``log_len``: ``-log E``. Its gradient ``grad E / E = sum_k (W_k / E) grad log a_k`` with
    ``W_k = sum_{i>=k} prod_{j<=i} a_j`` gives slot 1 weight exactly 1 (``W_1 = E``) and slot k the share of E that
    needs slot k accepted -- the CE gradient on the slot that decides the round, acceptance-weighted after it.
    Same maximiser as ``-log(1 + E)``; a front-weighted variant in the spirit of D-PACE's EAL-gradient weights.
    """
    if form not in ACCEPTANCE_FORMS:
        raise ValueError(f"unknown acceptance-loss form {form!r} ({', '.join(ACCEPTANCE_FORMS)})")
    bm = _block_mask(mask, block_mask)
    E = expected_accept_length(log_accept, mask)
    if form == "log":
        per = -torch.log1p(E)
    elif form == "linear":
        per = -E / mask.shape[-1]
    else:
        per = -log_expected_accept_length(log_accept, mask)  # empty blocks: finite, zeroed by bm below
    return (per * bm).sum() / bm.sum().clamp_min(1), E


def tv_hybrid_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                   weights: torch.Tensor, temperature: float = 1.0, eta: float = 3.0) -> torch.Tensor:
    """LK-style hybrid ``lambda * KL(p||q) + (1 - lambda) * TV(p, q)``, ``lambda = exp(-eta * sg(mean alpha))``
    (arXiv:2602.23881): KL's strong gradients early, the acceptance objective once alpha is high."""
    a = acceptance_alpha(draft_logits, target_logits, temperature)
    m = mask.float()
    lam = torch.exp(-eta * ((a.detach() * m).sum() / m.sum().clamp_min(1)))
    tv = _weighted_mean(1 - a, mask, weights)
    return lam * forward_kl(draft_logits, target_logits, mask, weights, temperature) + (1 - lam) * tv
