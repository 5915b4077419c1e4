"""LightningModule that trains the embedded world's target: a transformers ``Qwen3ForCausalLM`` on packed text."""

from __future__ import annotations

import math

import lightning as L
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def cosine_with_warmup(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class CausalLMModule(L.LightningModule):
    """Next-token LM training; ``batch`` is ``[B, T]`` packed token ids."""

    def __init__(self, hf_config: dict, lr: float, warmup_steps: int, max_steps: int, attention: str = "sdpa"):
        """``attention``: the transformers attention implementation the model trains with (``sdpa`` or ``eager``)."""
        super().__init__()
        self.save_hyperparameters()
        self.model = Qwen3ForCausalLM(Qwen3Config(**hf_config, attn_implementation=attention))

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids[:, :-1]).logits  # [B, T-1, V]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch[0]), prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, hp.warmup_steps, hp.max_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
