"""Target forward and drafters (plain nn.Modules). Importing this package registers every drafter architecture: the
import line below is the one list of them."""

from specdraft.runtime.models import dflash, retrace, vp  # noqa: F401  (registers "dflash", "retrace", "vp")
from specdraft.runtime.models.registry import available_drafters, register_drafter, resolve_drafter
from specdraft.runtime.models.target import TargetArgs, TargetLM, TargetOutput

__all__ = ["TargetArgs", "TargetLM", "TargetOutput", "available_drafters", "register_drafter", "resolve_drafter"]
