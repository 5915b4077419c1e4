"""``specdraft init-drafter``: a freshly initialised drafter directory for a local target checkpoint (its mask token
comes from the target's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.export.hf import export_drafter
from specdraft.runtime.drafter_io import build_drafter, drafter_config_for_target, record_target
from specdraft.runtime.load import read_target_args


def init_drafter(target_dir: str | Path, out_dir: str | Path, num_layers: int = 5, block_size: int = 16,
                 mask_token_id: int | None = None, seed: int = 0) -> Path:
    """Write a freshly initialised drafter sized for the target at ``target_dir``."""
    target_dir = Path(target_dir)
    args = read_target_args(target_dir)
    if mask_token_id is None:
        mask_token_id = tokenizer_mask_id(target_dir, args.vocab_size)
    torch.manual_seed(seed)
    drafter = build_drafter(drafter_config_for_target(args, mask_token_id, num_layers, block_size))
    out = export_drafter(drafter, out_dir)
    record_target(out, target_dir, stage="init")
    return out


def tokenizer_mask_id(target_dir: Path, vocab_size: int) -> int:
    """The tokenizer's mask token (DFlash needs one); refuses a tokenizer larger than the target vocabulary."""
    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SpecdraftError(f"no usable tokenizer in {target_dir} ({e}); pass --mask-token-id") from None
    if len(tok) > vocab_size:
        raise SpecdraftError(f"tokenizer has {len(tok)} tokens but the target vocabulary has {vocab_size}: "
                             "drafter and target would disagree on token ids")
    if tok.mask_token_id is None:
        raise SpecdraftError(f"tokenizer in {target_dir} has no mask token; add one or pass --mask-token-id")
    return int(tok.mask_token_id)
