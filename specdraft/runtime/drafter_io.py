"""Drafter directories in z-lab's HF layout: ``config.json`` + ``model.safetensors`` (no embedding, no LM head).

``drafter_config_for_target`` sizes a fresh drafter from a target's config; ``load_drafter`` checks it against the
target BEFORE any compute (vocab, hidden size, layer ids) and binds the target's embedding and LM head.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
from specdraft.runtime.load import load_safetensors_dir, weights_fingerprint
from specdraft.runtime.models import resolve_drafter
from specdraft.runtime.models.dflash import DFlashConfig, build_target_layer_ids
from specdraft.runtime.models.layers import rope_inv_freq
from specdraft.runtime.models.target import TargetArgs, TargetLM


def drafter_config_for_target(target: TargetArgs, mask_token_id: int, num_layers: int = 5, block_size: int = 16,
                              target_layer_ids: list[int] | None = None, num_features: int | None = None,
                              max_position_embeddings: int | None = None) -> DFlashConfig:
    """A DFlash config with the target's layer dims (DFlash draft layers mirror the target's), its RoPE and its
    context (default: the target's ``max_position_embeddings``, else 40960, Qwen3's)."""
    if not 0 <= mask_token_id < target.vocab_size:
        raise SpecdraftError(f"mask token id {mask_token_id} is outside the target vocabulary (size "
                             f"{target.vocab_size}); the drafter must embed it with the target's embedding")
    ids = target_layer_ids or build_target_layer_ids(target.num_hidden_layers, num_features or num_layers)
    return DFlashConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        num_target_layers=target.num_hidden_layers, target_hidden_size=target.hidden_size,
        target_layer_ids=list(ids), mask_token_id=mask_token_id, block_size=block_size,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        max_position_embeddings=max_position_embeddings or target.max_position_embeddings or 40960,
        target_model_type=target.model_type)


def check_compatible(cfg: DFlashConfig, target: TargetArgs) -> None:
    """Raise a clear error when a drafter cannot serve a target (checked before any forward)."""
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab size {cfg.vocab_size} (drafter) != {target.vocab_size} (target)")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} (drafter) != {target.hidden_size} (target): the drafter "
                        "uses the target's embedding and LM head")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden size {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} do not exist in a {target.num_hidden_layers}-layer target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary")
    if problems:
        raise SpecdraftError("drafter does not match the target: " + "; ".join(problems))


def build_drafter(cfg: DFlashConfig, arch: str = "dflash", options=None):
    """A freshly initialised drafter of architecture ``arch`` on the DFlash backbone ``cfg``; ``options`` are the
    architecture's own (``drafter.<arch>`` in the pipeline config, e.g. :class:`ReTraceOptions`)."""
    cls = resolve_drafter(arch)
    model = cls(cls.config_from_backbone(cfg, options))
    model.reset_parameters()
    return model


def convert_drafter(drafter, arch: str, options=None):
    """A drafter of architecture ``arch`` that keeps ``drafter``'s weights and starts its own parameters (named
    ``<arch>_*``) at their init; for ReTrace that init computes exactly what ``drafter`` computes. Bound to the same
    target, on the same device and in the same dtype."""
    cls = resolve_drafter(arch)
    model = cls(cls.config_from_backbone(drafter.config, options))
    missing, unexpected = model.load_state_dict(drafter.state_dict(), strict=False)
    new = [k for k in missing if not k.startswith(f"{arch}_")]
    if unexpected or new:
        raise SpecdraftError(f"a {drafter.arch_name!r} drafter cannot become a {arch!r} drafter: missing {new[:5]}, "
                             f"unexpected {unexpected[:5]}")
    w = drafter.fc.weight
    return model.to(device=w.device, dtype=w.dtype).bind_target(*drafter.borrowed)


def save_drafter(drafter, out_dir: str | Path, extra_config: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.config.to_hf_config()
    cfg.update(extra_config or {})
    state = {k: v.detach().to("cpu").clone() for k, v in drafter.state_dict().items()}  # parts of fused weights
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


PROVENANCE = "specdraft.json"
"""Beside a drafter's ``config.json``: what made it (stage, run) and the target checkpoint it was made for."""


def record_target(drafter_dir: str | Path, target_dir: str | Path, **extra) -> None:
    """Write (or update) the drafter's provenance with the target it is made for: its path and the fingerprint of its
    weights (:func:`~specdraft.runtime.load.weights_fingerprint`: a copy elsewhere matches, other weights do not)."""
    f = Path(drafter_dir) / PROVENANCE
    record = json.loads(f.read_text()) if f.is_file() else {}
    record.update(extra, target=str(target_dir), target_fingerprint=weights_fingerprint(target_dir))
    f.write_text(json.dumps(record))


def check_made_for(drafter_dir: str | Path, target_dir: str | Path, allow: bool = False, log=print) -> None:
    """Refuse (before any weight is read) a drafter whose provenance names another target checkpoint than
    ``target_dir`` (same shapes, other weights: it would decode losslessly but accept almost nothing); with
    ``allow``, log it and go on. Drafters without a recorded fingerprint (made elsewhere) are not checked."""
    f = Path(drafter_dir) / PROVENANCE
    try:
        made_for = json.loads(f.read_text()).get("target_fingerprint") if f.is_file() else None
    except ValueError:
        raise SpecdraftError(f"{f} is not valid JSON: restore it or delete it") from None
    if not made_for:
        return
    now = weights_fingerprint(target_dir)
    if made_for == now:
        return
    what = (f"the drafter in {drafter_dir} was made for another target checkpoint (fingerprint {made_for}; "
            f"{target_dir} is {now})")
    if not allow:
        raise SpecdraftError(f"{what}: train a drafter for this target, or set decode.allow_other_target=true to "
                             "reuse it deliberately (e.g. a fine-tuned or quantised copy)")
    log(f"warning: {what}; using it anyway (decode.allow_other_target=true)")


def read_drafter_config(path: str | Path) -> tuple[str, DFlashConfig]:
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise SpecdraftError(f"drafter path {path} has no config.json")
    try:
        raw = json.loads(f.read_text())
        arch = (raw.get("architectures") or ["dflash"])[0]
        cls = resolve_drafter(arch)
        cfg = cls.config_class.from_hf_config(raw)
        rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # an unsupported RoPE type fails here
        return cls.arch_name, cfg
    except (KeyError, ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise SpecdraftError(f"cannot read drafter config {f}: {e}") from None


def load_drafter(path: str | Path, target: TargetLM):
    """Load a drafter directory for ``target`` (compatibility checked first), bound and in eval mode."""
    arch, cfg = read_drafter_config(path)
    check_compatible(cfg, target.args)
    model = resolve_drafter(arch)(cfg)
    state = load_safetensors_dir(path)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that do not match the config
        raise SpecdraftError(f"drafter weights in {path} do not match its config: {str(e).splitlines()[-1].strip()}"
                             ) from None
    if missing or unexpected:
        raise SpecdraftError(f"drafter weights in {path} do not match its config: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    p = target.lm_head.weight
    model = model.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    return model.bind_target(target.model.embed_tokens, target.lm_head)
