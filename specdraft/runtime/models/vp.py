"""The variable-prefix (VP) drafter of D²SD (arXiv:2606.04446 §3.4): the DFlash architecture drafting from a block
whose anchor AND first ``l`` draft slots hold known tokens, the slots after them mask tokens. Its weights and its
forward are DFlash's (at ``l = 0`` it computes exactly what a DFlash drafter with the same weights computes); what
differs is training (the ``vp`` stage draws ``l`` per block) and the role: D²SD's second drafter re-drafts from the
prefixes where the first draft is likely to be rejected, in one batched pass
(:meth:`~specdraft.runtime.models.dflash.DFlashDrafter.draft_branches`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.errors import check_range
from specdraft.runtime.models.dflash import DFlashConfig, DFlashDrafter
from specdraft.runtime.models.registry import register_drafter


@dataclass
class VPOptions:
    """The VP drafter's options (``drafter.vp.*``), saved in its ``vp_config``."""

    prefix_beta: float = 0.8
    """Training draws the prefix length ``l`` of each block from a truncated geometric distribution,
    ``P(l = j) ∝ beta^j`` for ``j = 0..Bk-2`` (beta < 1 favours short prefixes; 1 is uniform)."""

    def __post_init__(self):
        check_range("prefix_beta", self.prefix_beta, 0.0, 1.0, low_open=True)


@dataclass
class VPConfig(DFlashConfig):
    vp: VPOptions = field(default_factory=VPOptions)

    def to_hf_config(self) -> dict:
        cfg = super().to_hf_config()
        cfg["architectures"] = ["VPDraftModel"]
        cfg["vp_config"] = {"prefix_beta": self.vp.prefix_beta, "max_prefix": self.block_size - 2}
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "VPConfig":
        base = DFlashConfig.from_hf_config({k: v for k, v in cfg.items() if k != "vp_config"})
        raw = cfg.get("vp_config") or {}
        return cls.from_dflash(base, VPOptions(prefix_beta=raw.get("prefix_beta", VPOptions.prefix_beta)))

    @classmethod
    def from_dflash(cls, base: DFlashConfig, options: VPOptions | None) -> "VPConfig":
        return cls(**{f: getattr(base, f) for f in DFlashConfig.__dataclass_fields__}, vp=options or VPOptions())


@register_drafter("vp", hf_names=("VPDraftModel",))
class VPDrafter(DFlashDrafter):
    """DFlash weights, drafting from variable prefixes; adds no parameters (so any DFlash drafter converts to it)."""

    config_class = VPConfig
    options_class = VPOptions

    @classmethod
    def config_from_backbone(cls, backbone: DFlashConfig, options: VPOptions | None = None) -> VPConfig:
        return VPConfig.from_dflash(backbone, options)
