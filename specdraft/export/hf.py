"""Lightning checkpoint -> HF-format drafter directory (``config.json`` + ``model.safetensors``, z-lab key layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.runtime.drafter_io import save_drafter


def drafter_state_from_checkpoint(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    """The drafter's weights from a Lightning checkpoint, loaded with ``weights_only=True`` (no pickle code)."""
    ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=True)
    state = ckpt["state_dict"]
    return {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}


def export_checkpoint(ckpt_path: str | Path, drafter, out_dir: str | Path) -> Path:
    """Write the checkpoint's drafter weights, with ``drafter``'s config, to ``out_dir``."""
    model = type(drafter)(drafter.config)
    model.load_state_dict(drafter_state_from_checkpoint(ckpt_path), strict=True)
    return save_drafter(model, out_dir)
