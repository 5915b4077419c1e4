"""Lightning checkpoint -> HF-format drafter directory (``config.json`` + ``model.safetensors``, z-lab key layout),
with our own modeling file and an ``auto_map`` so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds
the drafter without specdraft (:mod:`specdraft.export.modeling_specdraft`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from specdraft.runtime.drafter_io import save_drafter

MODELING_FILE = Path(__file__).with_name("modeling_specdraft.py")


def drafter_state_from_checkpoint(ckpt_path: str | Path) -> dict[str, torch.Tensor]:
    """The drafter's weights from a Lightning checkpoint, loaded with ``weights_only=True`` (no pickle code)."""
    ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=True)
    state = ckpt["state_dict"]
    return {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}


def write_modeling_code(out_dir: str | Path) -> Path:
    """Copy the modeling file next to the export's ``config.json`` and point ``auto_map`` at the class its
    ``architectures`` names."""
    out = Path(out_dir)
    shutil.copy(MODELING_FILE, out / MODELING_FILE.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": f"{MODELING_FILE.stem}.{cfg['architectures'][0]}"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def export_drafter(drafter, out_dir: str | Path) -> Path:
    """``drafter`` as an HF directory: config, safetensors weights, modeling file and ``auto_map``."""
    return write_modeling_code(save_drafter(drafter, out_dir))


def export_checkpoint(ckpt_path: str | Path, drafter, out_dir: str | Path) -> Path:
    """Write the checkpoint's drafter weights, with ``drafter``'s config, to ``out_dir``."""
    model = type(drafter)(drafter.config)
    model.load_state_dict(drafter_state_from_checkpoint(ckpt_path), strict=True)
    return export_drafter(model, out_dir)
