"""Drafter registry: ``@register_drafter("name")`` on a class; configs select it with ``drafter.arch``.

Adding an architecture is a new file plus the decorator; nothing else changes.
"""

from __future__ import annotations

from torch import nn

_DRAFTERS: dict[str, type[nn.Module]] = {}
# HF ``architectures[0]`` values that map onto a registered name (z-lab DFlash checkpoints say DFlashDraftModel).
HF_ARCHITECTURES = {"DFlashDraftModel": "dflash"}


def register_drafter(name: str):
    def wrap(cls):
        if name in _DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        _DRAFTERS[name] = cls
        cls.arch_name = name
        return cls
    return wrap


def available_drafters() -> list[str]:
    return sorted(_DRAFTERS)


def resolve_drafter(name: str) -> type[nn.Module]:
    name = HF_ARCHITECTURES.get(name, name)
    if name not in _DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _DRAFTERS[name]
