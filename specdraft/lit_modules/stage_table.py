"""The training stages in one table, and the objective options every stage reads.

A stage is a row of :data:`STAGES`: how a training step drafts its blocks (``step``), what it minimises (``loss``),
whether the target must run inside the step, which validation metric picks the exported checkpoint, which stage's
export it warm-starts from, and which drafter architecture it trains. Adding a stage is one file with its loss (and,
if it needs one, its step and its options dataclass) plus one row here.

Where each stage's method comes from: DFlash's decayed CE (arXiv:2602.06036 §4.2) for ``sft``; forward KL and the LK
KL-TV hybrid (arXiv:2602.23881) as the sampling baselines; expected accepted length under greedy verification (EAL)
or speculative sampling (WTV); GRPO rewarded by simulated acceptance length (:mod:`specdraft.lit_modules.grpo`);
ReTrace's rejected-trajectory conditioning (:mod:`specdraft.lit_modules.retrace_step`); D²SD's variable-prefix
drafter (:mod:`specdraft.lit_modules.vp_step`); Draft-OPD's on-policy distillation from target-assisted rollouts
(:mod:`specdraft.lit_modules.opd`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from specdraft.errors import OptionError, check_range
from specdraft.lit_modules.blocks import DraftBatch
from specdraft.lit_modules.grpo import GRPOConfig, grpo_stage_loss
from specdraft.lit_modules.losses import AcceptanceForm
from specdraft.lit_modules.opd import OPDConfig, opd_loss, opd_step
from specdraft.lit_modules.retrace_step import ReTraceTraining, retrace_step
from specdraft.lit_modules.stage_losses import eal_stage_loss, kl_loss, sft_loss, tv_loss, vp_loss, wtv_stage_loss
from specdraft.lit_modules.vp_step import vp_step


@dataclass
class Objective:
    """What a drafter stage minimises (the ``train.*`` keys a loss reads; the pipeline's ``TrainConfig`` extends it)."""

    stage: str = "sft"
    """Training stage: a row of :data:`STAGES`."""
    gamma: float = 0.0
    """Loss decay exp(-(k-1)/gamma) of the per-slot CE weights; 0 = the DFlash default for the block size (7/5/4
    for 16/10/8)."""
    kl_weight: float = 0.0
    """sft: weight of forward KL to the target distribution added to the decayed CE."""
    temperature: float = 1.0
    """kl/tv/wtv and sampling GRPO: temperature applied to draft and target distributions alike (the verification
    temperature these stages train for)."""
    acceptance_form: AcceptanceForm = "log_len"
    """eal/wtv: -log E (log_len: slot 1 keeps the full CE gradient however small E is), -log(1+E) (log) or -E/K
    (linear). docs/results.md says which measurement made log_len the default."""
    wtv_variant: Literal["product", "stopgrad"] = "product"
    """wtv: product (the acceptance_form loss of E_T) or stopgrad (sum_k W_k (1 - alpha_k))."""
    eal_variant: Literal["product", "greedy"] = "product"
    """eal: product (the acceptance_form loss of E) or greedy (E's gradient with the other slots at their greedy
    outcome: the first rejected slot weighted by the accepted run it would unlock, nothing past it)."""
    anchors: Literal["random", "verified"] = "random"
    """Training anchors: random, or verified (one no-grad greedy round at random anchors, then train at a + n + 1,
    where serving puts its anchors); validation always uses random anchors. The retrace stage always trains its
    second round at verified anchors."""
    ce_mix_eta: float = 0.0
    """eal: lambda*CE + (1-lambda)*EAL with lambda = exp(-eta * mean q) (0 = pure EAL)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The grpo stage's options."""
    retrace: ReTraceTraining = field(default_factory=ReTraceTraining)
    """The retrace stage's training options."""
    opd: OPDConfig = field(default_factory=OPDConfig)
    """The opd stage's options (rollouts, refresh, the two loss streams)."""

    def __post_init__(self):
        if self.stage not in STAGES:
            raise OptionError("stage", f"{self.stage!r} is not one of {', '.join(STAGES)}")
        check_range("gamma", self.gamma, 0.0)
        check_range("kl_weight", self.kl_weight, 0.0)
        check_range("temperature", self.temperature, 0.0, low_open=True)
        check_range("ce_mix_eta", self.ce_mix_eta, 0.0)
        if self.stage == "vp" and (self.kl_weight > 0 or self.anchors != "random"):
            raise OptionError("stage", "vp trains at random anchors with its own prefix-aware CE: kl_weight and "
                                       "anchors=verified do not apply")

    @property
    def spec(self) -> "Stage":
        return STAGES[self.stage]

    @property
    def needs_target_logits(self) -> bool:
        """Whether the loss reads the target's full distributions (so the target runs inside the step)."""
        return self.spec.target_logits(self) or self.kl_weight > 0

    @property
    def online_reason(self) -> str:
        """Why this objective needs the target inside the training step ("" = precomputed features will do)."""
        if self.needs_target_logits:
            return "needs the target's full distributions"
        return self.spec.online(self)

    @property
    def trains_for_sampling(self) -> bool:
        """Trained for speculative sampling at :attr:`temperature` (not for greedy verification)."""
        return self.spec.sampling(self)

    @property
    def selection_metric(self) -> str:
        """The validation metric the exported checkpoint maximises: the expected acceptance under speculative
        sampling for the stages trained for it, the greedy simulated acceptance for the others."""
        if self.spec.metric:
            return self.spec.metric
        return "eval/sim_tau_sampled" if self.trains_for_sampling else "eval/sim_tau"


Step = Callable[..., tuple[DraftBatch, "torch.Tensor | float", dict]]
Loss = Callable[..., tuple[torch.Tensor, dict]]


def one_round_step(module, batch, split: str, generator: torch.Generator | None):
    """Blocks at random (or verified) anchors, drafted in one pass: ``(DraftBatch, extra loss 0, no stats)``."""
    return module.draft(batch, split, generator), 0.0, {}


def _never(objective: Objective) -> bool:
    return False


def _always(objective: Objective) -> bool:
    return True


def _sampling_grpo(objective: Objective) -> bool:
    return objective.grpo.mode == "sampling"


def _no_reason(objective: Objective) -> str:
    return ""


def _retrace_online(objective: Objective) -> str:
    if objective.retrace.signals == "exact":
        return "replays the target's verify pass for its correction signals (train.retrace.signals=exact)"
    return ""


def _retrace_cheap(objective: Objective) -> bool:
    return objective.retrace.signals == "cheap"


def _opd_target_logits(objective: Objective) -> bool:
    return objective.opd.response_temperature > 0  # greedy rollouts' response stream is CE on committed tokens


def _opd_online(objective: Objective) -> str:
    return "rolls out through the decode engine and scores each rollout with the target"


def _no_lr_scales(objective: Objective) -> dict[str, float]:
    return {}


def _retrace_lr_scales(objective: Objective) -> dict[str, float]:
    return {"retrace_": objective.retrace.fusion_lr_scale}  # the new, zero-initialised fusion learns faster


@dataclass(frozen=True)
class Stage:
    """One training stage."""

    name: str
    loss: Loss
    """``(module, DraftBatch, generator) -> (loss, stats)``; stats are logged as ``train/<name>_<stat>``."""
    step: Step = one_round_step
    """``(module, batch, split, generator) -> (DraftBatch, extra loss, stats)``: how the step drafts its blocks."""
    warm_start: str = "sft"
    """The stage whose export this one starts from by default ("" = a fresh drafter)."""
    target_logits: Callable[[Objective], bool] = _never
    """Whether the loss reads the target's full distributions."""
    online: Callable[[Objective], str] = _no_reason
    """Another reason the target must run inside the step ("" = none)."""
    sampling: Callable[[Objective], bool] = _never
    """Trained for speculative sampling: the export is picked by ``eval/sim_tau_sampled``."""
    arch: str | None = None
    """The drafter architecture the stage trains (a warm start of another architecture is converted)."""
    reference: bool = False
    """Keep a frozen copy of the starting drafter (``module.reference``) for the loss."""
    lr_scales: Callable[[Objective], dict[str, float]] = _no_lr_scales
    """Learning-rate multipliers by parameter-name prefix (the other parameters learn at the base rate)."""
    metric: str = ""
    """The validation metric that picks the export, when not the acceptance the stage trains for (see
    :attr:`Objective.selection_metric`)."""


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("sft", sft_loss, warm_start=""),
    Stage("kl", kl_loss, target_logits=_always, sampling=_always),
    Stage("tv", tv_loss, target_logits=_always, sampling=_always),
    Stage("eal", eal_stage_loss),
    Stage("wtv", wtv_stage_loss, target_logits=_always, sampling=_always),
    Stage("grpo", grpo_stage_loss, warm_start="eal", target_logits=_sampling_grpo, sampling=_sampling_grpo,
          reference=True),
    Stage("retrace", sft_loss, step=retrace_step, arch="retrace", target_logits=_retrace_cheap,
          online=_retrace_online, lr_scales=_retrace_lr_scales),
    Stage("vp", vp_loss, step=vp_step, arch="vp", metric="eval/vp_tau"),
    Stage("opd", opd_loss, step=opd_step, target_logits=_opd_target_logits, online=_opd_online,
          metric="eval/opd_tau"),
)}
