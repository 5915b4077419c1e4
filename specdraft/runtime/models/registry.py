"""Drafter registry: ``@register_drafter("name", hf_names=...)`` on a class; configs select it with ``drafter.arch``.

Adding an architecture is a new module under ``runtime/models`` with the decorated class, plus its import in
``runtime/models/__init__.py`` (the one list of architectures). An architecture with options of its own declares them
as its ``options_class`` (a dataclass) and takes them in ``config_from_backbone``; the pipeline nests them under
``drafter.<name>``.
"""

from __future__ import annotations

from torch import nn

_DRAFTERS: dict[str, type[nn.Module]] = {}
HF_ARCHITECTURES: dict[str, str] = {}
"""HF ``architectures[0]`` values that map onto a registered name (z-lab DFlash checkpoints say DFlashDraftModel)."""


def register_drafter(name: str, hf_names: tuple[str, ...] = ()):
    """Class decorator: register a drafter architecture under ``name`` (``drafter.arch``, ``decode.method``) and the
    HF ``architectures[0]`` values its checkpoints carry."""
    def wrap(cls):
        if name in _DRAFTERS:
            raise ValueError(f"drafter {name!r} registered twice")
        _DRAFTERS[name] = cls
        cls.arch_name = name
        for hf in hf_names:
            HF_ARCHITECTURES[hf] = name
        return cls
    return wrap


def available_drafters() -> list[str]:
    return sorted(_DRAFTERS)


def resolve_drafter(name: str) -> type[nn.Module]:
    name = HF_ARCHITECTURES.get(name, name)
    if name not in _DRAFTERS:
        raise KeyError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return _DRAFTERS[name]
