"""Target forward and drafters (plain nn.Modules; importing this package registers every drafter)."""

from specdraft.runtime.models import dflash, retrace  # noqa: F401  (registers "dflash", "retrace")
from specdraft.runtime.models.registry import available_drafters, register_drafter, resolve_drafter
from specdraft.runtime.models.target import TargetArgs, TargetLM, TargetOutput

__all__ = ["TargetArgs", "TargetLM", "TargetOutput", "available_drafters", "register_drafter", "resolve_drafter"]
