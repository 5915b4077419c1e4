"""Load targets and drafters from local HF-format directories (safetensors only; never pickle, never a hub)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.runtime.host_memory import keep_freed_memory
from specdraft.runtime.models.layers import rope_inv_freq
from specdraft.runtime.models.target import TargetArgs, TargetLM, read_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise SpecdraftError(f"unknown dtype {dtype!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_safetensors_dir(path: str | Path, prefix_filter: str | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise SpecdraftError(f"cannot read {index}: {e!r}") from None
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SpecdraftError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors = load_file(str(path / f))
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise SpecdraftError(f"cannot read weights file {path / f}: {str(e).splitlines()[0] if str(e) else e!r} "
                                 "(truncated or corrupt? re-copy the checkpoint)") from None
        for k, v in tensors.items():
            if prefix_filter is None or k.startswith(prefix_filter):
                state[k] = v
    return state


def target_fingerprint(target_dir: str | Path) -> str:
    """Which checkpoint this is, cheaply: its resolved path, ``config.json`` and each weight file's name, size and
    modification time (a target retrained in place gets a new one; hashing the weights would take minutes)."""
    d = Path(target_dir).resolve()
    h = hashlib.sha256(str(d).encode() + (d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


SAMPLE_BYTES = 1 << 20


def weights_fingerprint(target_dir: str | Path) -> str:
    """Which weights these are, wherever the directory lies: per safetensors file, its name, size, and 1 MiB at its
    start (the header: tensor names, dtypes, offsets; then the first tensors), middle and end. A copy of a checkpoint
    keeps it (its config and tokenizer files may differ); a checkpoint of the same shapes with other weights
    (retrained, or a sibling) changes it. Reads a few MB, not the weights (hashing all would take minutes at 8B)."""
    d = Path(target_dir)
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as r:
            for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                r.seek(offset)
                h.update(r.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def read_target_args(path: str | Path) -> TargetArgs:
    """The architecture of the target checkpoint at ``path`` (no weights read); clear errors for bad paths."""
    path = Path(path)
    if not path.is_dir():
        raise SpecdraftError(f"target path {path} does not exist (set target.path to a local HF checkpoint directory)")
    try:
        args = TargetArgs.from_hf_config(read_hf_config(path))
        rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)  # an unsupported RoPE type fails here
        return args
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise SpecdraftError(f"cannot read target config in {path}: {e}") from None


def load_target(path: str | Path, dtype: str = "auto", device: str = "auto") -> TargetLM:
    """Build a :class:`TargetLM` from a local HF checkpoint directory (sharded or not). On a CPU, the process keeps
    freed host memory for the next round (:func:`~specdraft.runtime.host_memory.keep_freed_memory`)."""
    path = Path(path)
    args = read_target_args(path)
    dev = resolve_device(device)
    if dev.type == "cpu":
        keep_freed_memory()
    with torch.device("meta"):
        model = TargetLM(args)
    state = load_safetensors_dir(path)
    state = {k.removeprefix("language_model."): v for k, v in state.items()
             if not k.endswith("rotary_emb.inv_freq")}  # older checkpoints carry RoPE buffers
    if args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise SpecdraftError(f"the weights in {path} do not match its config.json: "
                             f"{str(e).splitlines()[0]}") from None
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)  # built on meta above
    return model.to(device=dev, dtype=resolve_dtype(dtype, dev)).eval().requires_grad_(False)
