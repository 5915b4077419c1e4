"""ReTrace: rejected-trajectory conditioning on a DFlash backbone (ReTrace; backbone: DFlash, arXiv:2602.06036).

After a verification that accepted ``n`` of ``K`` drafts, the rejected suffix (slots ``n+1..K``) is not thrown away:
the drafter's last-layer hidden states there, with the embeddings of the tokens it drafted, are RETAINED; ALIGNED to
the next block (the next anchor sits at the old slot ``n+1``, so old slot ``s`` lands on new slot ``s - (n+1)``);
REFINED with correction signals the same verification already produced (the target's own token at the slot, its
features there, draft/target agreement, the target's probability of the draft token, its entropy, the slot index);
and admitted into the next block's input embeddings by GATED RESIDUAL FUSION ``x = e(token) + m * g * W_o u`` with
``W_o`` zero-initialised, so a fresh ReTrace drafter computes exactly what its DFlash backbone computes. Only drafter
inputs change: verification, and therefore losslessness, are untouched; rejected tokens are never committed; no extra
forward pass of either model is needed.

Layout of the fusion:

- the retained state carries the drafted token's embedding next to ``h`` (rejected tokens may still match the
  target continuation at their positions; ``e(d_s)`` states it directly), unless ``embed_drafted`` is off;
- the refiner is one layer ``u = SiLU(W_in [h; e(d); LN(c)])`` of width ``W``; a second linear layer would compose
  into both ``W_g`` and ``W_o`` and add nothing they cannot express, so ``[W_g u ; W_o u]`` is one matmul. The gate
  reads ``u`` alone, ``h`` enters without a LayerNorm (it is already RMS-normed), and refine/gate/``W_o`` run only
  on the new slots that can receive a prior;
- the target features enter as the drafter's own fused context ``hidden_norm(fc(f))``, which
  :meth:`DFlashDrafter.ingest` already computed for the verify block (no second ``fc``).

Options (:class:`ReTraceOptions`): ``alignment`` hard (shift) or soft (Gaussian kernel over offsets, learnable
width); ``use_correction`` (refine with target signals or with the drafter's retained state alone); ``gate_anchor``
(fuse into the anchor slot too). Training (``lit_modules/retrace_step.py``) takes its correction signals from an
exact replay of the serving verify pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.errors import OptionError, check_range
from specdraft.kernels.retrace_fusion import FusionWeights, landing, retrace_fusion
from specdraft.runtime.models.dflash import DFlashConfig, DFlashDrafter
from specdraft.runtime.models.registry import register_drafter

N_SCALARS = 4  # agreement, p_target(draft), target entropy, slot / block
Alignment = Literal["hard", "soft"]


@dataclass
class ReTraceOptions:
    """ReTrace's architecture options (``drafter.retrace.*``), saved in the drafter's ``retrace_config``."""

    alignment: Alignment = "hard"
    """How the rejected suffix lands on the next block: hard (shift by ``n + 1``) or soft (a Gaussian over offsets
    with a learnable width)."""
    use_correction: bool = True
    """Refine the retained states with the verify pass's target signals (false: the drafter's states only)."""
    gate_anchor: bool = False
    """Fuse into the anchor slot too (default: mask slots only)."""
    gate_bias_init: float = 0.0
    """Gate bias at init. ``W_o = 0`` alone makes a fresh ReTrace drafter exactly its backbone, whatever the bias."""
    refiner_width: int = 0
    """Width ``W`` of ``u`` (0 = the hidden size). The fusion's per-round cost is its weight bytes at small batch and
    its FLOPs at large batch, both proportional to its ``(h_in + 2D + 4) * W + W * 2D`` parameters."""
    embed_drafted: bool = True
    """Feed ``e(d)`` (the drafted token's embedding) to the refiner next to ``h``. Under greedy drafting ``d`` is the
    argmax of ``lm_head(h)``, so ``e(d)`` restates part of ``h``; it costs ``D * W`` parameters and a lookup."""

    def __post_init__(self):
        if self.alignment not in get_args(Alignment):
            raise OptionError("alignment", f"must be one of {', '.join(get_args(Alignment))}, got {self.alignment!r}")
        check_range("refiner_width", self.refiner_width, 0)


@dataclass
class ReTraceConfig(DFlashConfig):
    retrace: ReTraceOptions = field(default_factory=ReTraceOptions)

    def to_hf_config(self) -> dict:
        cfg = super().to_hf_config()
        cfg["architectures"] = ["ReTraceDraftModel"]
        cfg["retrace_config"] = {"alignment": self.retrace.alignment, "use_correction": self.retrace.use_correction,
                                 "gate_anchor": self.retrace.gate_anchor,
                                 "gate_bias_init": self.retrace.gate_bias_init,
                                 "refiner_width": self.refiner_width, "embed_drafted": self.retrace.embed_drafted}
        return cfg

    @property
    def refiner_width(self) -> int:
        return self.retrace.refiner_width or self.hidden_size

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ReTraceConfig":
        base = DFlashConfig.from_hf_config({k: v for k, v in cfg.items() if k != "retrace_config"})
        kw = {f: getattr(base, f) for f in DFlashConfig.__dataclass_fields__}
        return cls(**kw, retrace=ReTraceOptions(**(cfg.get("retrace_config") or {})))

    @classmethod
    def from_dflash(cls, base: DFlashConfig, options: ReTraceOptions) -> "ReTraceConfig":
        return cls(**{f: getattr(base, f) for f in DFlashConfig.__dataclass_fields__}, retrace=options)


class Prior(NamedTuple):
    """The previous block as the next round sees it, indexed by OLD slot (0..Bk-1), per row."""

    hidden: torch.Tensor  # [b, Bk, D] retained drafter state: last-layer hidden (; e(drafted token) [D] if embedded)
    signals: torch.Tensor  # [b, Bk, 2D + 4] correction signals per slot, concatenated:
    #   e(target's own token at the slot) [D] ; hidden_norm(fc(target features)) at the slot [D] ;
    #   agreement, p_target(draft), target entropy, slot / Bk [4]
    valid: torch.Tensor  # [b, Bk] bool: slot was rejected (s >= n + 1, s <= K)
    shift: torch.Tensor  # [b] n + 1: old slot s lands on new slot s - shift

    def select(self, rows: torch.Tensor) -> "Prior":
        return Prior(*(t.index_select(0, rows) for t in self))

    def blank(self, n: int) -> "Prior":
        """``n`` rows that carry nothing (what a fully accepted round leaves): rows joining a running batch."""
        Bk = self.valid.shape[1]
        return Prior(self.hidden.new_zeros(n, *self.hidden.shape[1:]),
                     self.signals.new_zeros(n, *self.signals.shape[1:]), self.valid.new_zeros(n, Bk),
                     self.shift.new_full((n,), Bk))

    def cat(self, other: "Prior") -> "Prior":
        return Prior(*(torch.cat([a, b]) for a, b in zip(self, other)))


class VerifyStats(NamedTuple):
    """What the target's verify logits say about each draft slot 1..K (reductions over the vocabulary only)."""

    target_tokens: torch.Tensor  # [b, K] the target's own token at the slot (argmax given the prefix before it)
    p_draft: torch.Tensor  # [b, K] the target's probability of the drafted token
    entropy: torch.Tensor  # [b, K] entropy of the target's distribution


def verify_stats(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyStats:
    """Reduce verify logits ``[b, >=K, V]`` (index ``i`` scores slot ``i + 1``) for drafts ``[b, K]``."""
    K = draft_tokens.shape[1]
    z = target_logits[:, :K].float()  # [b, K, V]
    zmax, tgt_tok = z.max(-1)  # [b, K] (one pass gives the max for the log-sum-exp and the target's token)
    e = (z - zmax[..., None]).exp_()  # [b, K, V] (the one vocabulary-sized temporary)
    se = e.sum(-1)  # [b, K]
    p_draft = e.gather(-1, draft_tokens[..., None])[..., 0] / se
    entropy = zmax + se.log() - torch.linalg.vecdot(e, z) / se  # H(p) = lse - E_p[z]
    return VerifyStats(tgt_tok, p_draft, entropy)


def build_prior(hidden: torch.Tensor, draft_tokens: torch.Tensor, num_accepted: torch.Tensor, stats: VerifyStats,
                target_context: torch.Tensor, embed, embed_drafted: bool = True) -> Prior:
    """Retain the rejected suffix of one round (no extra forward: every input comes from the draft/verify passes).

    Args:
        hidden: ``[b, Bk, D]`` drafter hidden states of the block (slot 0 = anchor).
        draft_tokens: ``[b, K]`` drafts for slots 1..K (``K < Bk - 1``: a round that verified the first ``K`` of the
            block's drafts; the slots past ``K`` retain nothing).
        num_accepted: ``[b]``.
        stats: :func:`verify_stats` of the verify logits.
        target_context: ``[b, >=K + 1, D]`` the drafter's fused view of the verify features (``fuse_context``); index
            ``s`` is the target's state at slot ``s``.
        embed: the (target's) token embedding.
        embed_drafted: retain ``e(drafted token)`` next to ``hidden`` (:attr:`ReTraceOptions.embed_drafted`).
    """
    b, Bk, _ = hidden.shape
    K = draft_tokens.shape[1]  # drafts verified: Bk - 1, or fewer in a narrow round (the slots past carry nothing)
    if K > Bk - 1:
        raise ValueError(f"{K} drafts for a block of {Bk} slots (at most {Bk - 1} drafts)")
    agree = (stats.target_tokens == draft_tokens).to(stats.p_draft.dtype)
    slot = torch.arange(1, K + 1, device=hidden.device, dtype=stats.p_draft.dtype).div_(Bk).expand(b, K)
    scalars = torch.stack([agree, stats.p_draft, stats.entropy, slot], -1)  # [b, K, 4]
    scalars = F.pad(scalars, (0, 0, 1, 0))  # slot 0 (the anchor) carries no signal
    s = torch.arange(Bk, device=hidden.device)[None, :]
    valid = (s > num_accepted[:, None]) & (s <= K)  # [b, Bk] rejected: n + 1 <= s <= K
    signals = torch.cat([embed(F.pad(stats.target_tokens, (1, 0))).to(hidden.dtype),
                         target_context[:, :K + 1].to(hidden.dtype), scalars.to(hidden.dtype)], dim=-1)  # [b, K+1, .]
    signals = F.pad(signals, (0, 0, 0, Bk - 1 - K))  # [b, Bk, 2D + 4]
    if embed_drafted:
        drafted = embed(F.pad(draft_tokens, (1, Bk - 1 - K))).to(hidden.dtype)  # [b, Bk, D] (slot 0: never valid)
        hidden = torch.cat([hidden, drafted], dim=-1)  # [b, Bk, 2D]
    return Prior(hidden.detach(), signals.detach(), valid, num_accepted + 1)


def _gather_slots(prior: Prior, src: torch.Tensor) -> Prior:
    """The prior's per-slot fields at old slots ``src`` ``[b, n]`` (one row per new slot)."""
    def take(t):  # [b, Bk, C] -> [b, n, C]
        return t.gather(1, src[..., None].expand(-1, -1, t.shape[-1]))
    return Prior(take(prior.hidden), take(prior.signals), prior.valid, prior.shift)


@register_drafter("retrace", hf_names=("ReTraceDraftModel",))
class ReTraceDrafter(DFlashDrafter):
    config_class = ReTraceConfig
    options_class = ReTraceOptions
    wants_verify_context = True  # the refiner reads the target's features at the rejected slots

    @classmethod
    def config_from_backbone(cls, backbone: DFlashConfig, options: ReTraceOptions | None = None) -> ReTraceConfig:
        return ReTraceConfig.from_dflash(backbone, options or ReTraceOptions())

    def __init__(self, config: ReTraceConfig):
        super().__init__(config)
        D = config.hidden_size
        E = D  # DFlash embeds with the target's embedding: E == D
        opts = config.retrace
        W = config.refiner_width
        c_dim = 2 * D + N_SCALARS
        h_dim = 2 * D if opts.embed_drafted else D
        self.retrace_norm_c = nn.LayerNorm(c_dim)  # h needs none: it is the drafter's final-normed state
        self.retrace_refiner = nn.Linear(h_dim + c_dim, W)  # u = SiLU(W_in [h; e(d); LN(c)])  [..., W]
        # [W_g u + b_g ; W_o u] in one matmul: the refiner's second layer would compose into both (a linear map
        # after the SiLU), so it is folded in here rather than paid for per round
        self.retrace_gate_out = nn.Linear(W, 2 * E)
        self.retrace_log_width = nn.Parameter(torch.zeros(()))  # soft alignment bandwidth (log sigma)
        self._init_fusion()

    def _init_fusion(self) -> None:
        E = self.config.hidden_size
        with torch.no_grad():
            self.retrace_gate_out.weight[E:].zero_()  # W_o = 0: fresh ReTrace == DFlash, bit for bit
            self.retrace_gate_out.bias[E:].zero_()
            self.retrace_gate_out.bias[:E].fill_(self.config.retrace.gate_bias_init)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        self.retrace_norm_c.reset_parameters()
        self._init_fusion()

    # ---- fusion -----------------------------------------------------------------------------------------
    def _refine(self, prior: Prior) -> torch.Tensor:
        """``u`` per OLD slot ``[b, Bk, W]``."""
        h = prior.hidden
        if self.config.retrace.use_correction:
            c = prior.signals
        else:
            c = h.new_zeros(*h.shape[:2], self.retrace_norm_c.normalized_shape[0])
        return F.silu(self.retrace_refiner(torch.cat([h, self.retrace_norm_c(c)], dim=-1)))

    def _align(self, u: torch.Tensor, prior: Prior) -> tuple[torch.Tensor, torch.Tensor]:
        """Map old-slot refinements onto new slots: ``([b, Bk, W], present [b, Bk])``."""
        b, Bk, _ = u.shape
        new = torch.arange(Bk, device=u.device)
        src, present = landing(prior.valid, prior.shift, 0)  # [b, Bk] each
        if self.config.retrace.alignment == "hard":
            aligned = u.gather(1, src[..., None].expand(-1, -1, u.shape[-1]))
        else:
            # soft: every retained slot contributes to every new slot by a Gaussian in its aligned offset
            offset = (new[None, None, :] - (new[None, :, None] - prior.shift[:, None, None])).float()  # [b, old, new]
            sigma = F.softplus(self.retrace_log_width) + 0.1
            logits = -(offset ** 2) / (2 * sigma ** 2)
            logits = logits.masked_fill(~prior.valid[:, :, None], float("-inf"))
            w = torch.nan_to_num(torch.softmax(logits, dim=1), nan=0.0)  # [b, old, new]
            aligned = torch.einsum("bon,boe->bne", w.to(u.dtype), u)
        return aligned, present

    def fusion_weights(self) -> FusionWeights:
        """The fusion's parameters as the kernel launcher takes them."""
        ln, gate_out = self.retrace_norm_c, self.retrace_gate_out
        return FusionWeights(ln.weight, ln.bias, ln.eps, self.retrace_refiner.weight, self.retrace_refiner.bias,
                             gate_out.weight, gate_out.bias)

    def block_embeds(self, block_tokens: torch.Tensor, state: Prior | None, fixed_shape: bool = False) -> torch.Tensor:
        """``e(block)`` plus the gated residual from the previous round's rejected suffix (if any): the fused kernel
        under hard alignment (:func:`~specdraft.kernels.retrace_fusion.retrace_fusion`), eager PyTorch under soft.
        ``fixed_shape`` (the static path): no host reads, every slot fused (slots no prior lands on add zero)."""
        x = self.embed(block_tokens)  # [b, Bk, D]
        if state is None or not fixed_shape and not bool(state.valid.any()):
            return x
        opts = self.config.retrace
        if opts.alignment == "hard":
            return retrace_fusion(x, state.hidden, state.signals, state.valid, state.shift, self.fusion_weights(),
                                  lo=0 if opts.gate_anchor else 1, use_correction=opts.use_correction)
        return x + self.fusion_delta(state, fixed_shape).to(x.dtype)

    def empty_prior(self, b: int) -> Prior:
        """A prior of ``b`` rows that carries nothing (what a first round, or a fully accepted one, leaves)."""
        D, Bk, p = self.config.hidden_size, self.block_size, self.fc.weight
        h_dim = 2 * D if self.config.retrace.embed_drafted else D
        return Prior(p.new_zeros(b, Bk, h_dim), p.new_zeros(b, Bk, 2 * D + N_SCALARS),
                     torch.zeros(b, Bk, dtype=torch.bool, device=p.device),
                     torch.full((b,), Bk, dtype=torch.long, device=p.device))

    def fusion_delta(self, prior: Prior, fixed_shape: bool = False) -> torch.Tensor:
        """``m * g * W_o u`` per NEW slot ``[b, Bk, E]``, computed only on the new slots that can carry a prior.

        New slots past ``Bk - min(shift)`` hold no retained slot in any row, and slot 0 (the anchor) is fused only
        with ``gate_anchor``; under hard alignment the prior rows are gathered first, so the refiner, gate and output
        projection run on those slots alone (the refiner is row-wise: gather-then-refine == refine-then-gather).
        """
        Bk = prior.valid.shape[1]
        lo = 0 if self.config.retrace.gate_anchor else 1
        hi = Bk if fixed_shape else Bk - int(prior.shift.min())  # [lo, hi): new slots that some row can fill
        if hi <= lo:
            return prior.hidden.new_zeros(*prior.hidden.shape[:2], self.config.hidden_size)
        if self.config.retrace.alignment == "hard":
            src, present = (t[:, :hi - lo] for t in landing(prior.valid, prior.shift, lo))  # [b, n] each
            u = self._refine(_gather_slots(prior, src))  # [b, n, W]
        else:
            u, present = self._align(self._refine(prior), prior)  # [b, Bk, W], [b, Bk]
            u, present = u[:, lo:hi], present[:, lo:hi]
        gate, out = self.retrace_gate_out(u).chunk(2, dim=-1)  # [b, n, E] each
        delta = present[..., None].to(u.dtype) * torch.sigmoid(gate) * out  # [b, n, E]
        return F.pad(delta, (0, 0, lo, Bk - hi))  # [b, Bk, E]

    # ---- engine hooks -------------------------------------------------------------------------------------
    def next_round_state(self, state, hidden, draft_tokens, num_accepted, target_logits, target_context):
        """Carry the rejected suffix into the next round (reset on full acceptance: ``valid`` is then empty)."""
        stats = verify_stats(target_logits, draft_tokens)
        return build_prior(hidden, draft_tokens, num_accepted, stats, target_context, self.embed,
                           self.config.retrace.embed_drafted)

