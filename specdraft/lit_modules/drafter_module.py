"""SFT LightningModule for block drafters (DFlash, arXiv:2602.06036 §4.2): thin wrapper = features + forward + loss.

The target is frozen and only supplies features, its embedding and LM head; the drafter trains. Metrics:
``train/loss``, ``train/acc_k`` (slot-k top-1 accuracy), ``eval/loss``, ``eval/sim_tau`` (teacher-forced simulated
acceptance length computed with the runtime's own :func:`accept_greedy`, bonus included) and, from the callback in
``pipeline``, ``eval/tau`` from real decoding.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from specdraft.lit_modules.blocks import build_blocks, decay_weights, default_gamma, sample_anchors
from specdraft.lit_modules.features import OfflineFeatures, online_features
from specdraft.lit_modules.lm import cosine_with_warmup
from specdraft.lit_modules.losses import decayed_ce, forward_kl
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.verify import accept_greedy


class DrafterSFTModule(L.LightningModule):
    def __init__(self, drafter, target: TargetLM, lr: float, warmup_ratio: float, total_steps: int,
                 num_anchors: int, gamma: float = 0.0, kl_weight: float = 0.0, weight_decay: float = 0.0,
                 offline: OfflineFeatures | None = None, seed: int = 0):
        super().__init__()
        self.save_hyperparameters(ignore=["drafter", "target", "offline"])
        self.drafter = drafter
        self.target = target.requires_grad_(False).eval()
        self.drafter.bind_target(self.target.model.embed_tokens, self.target.lm_head)
        self.offline = offline
        bs = drafter.block_size
        self.gamma = gamma or default_gamma(bs)
        self.register_buffer("slot_weights", decay_weights(bs, self.gamma), persistent=False)
        self._tokens_seen, self._t0 = 0, None

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # frozen, always in eval mode
        return self

    # ---- shared forward -------------------------------------------------------------------------------
    def _features(self, batch, split: str):
        ids = batch["input_ids"]
        layer_ids = self.drafter.target_layer_ids
        if self.offline is not None:
            feats, greedy = self.offline.batch(split, batch["index"].tolist(), ids.shape[1], ids.device)
            return feats.to(self.drafter.fc.weight.dtype), None, greedy
        return online_features(self.target, ids, layer_ids, need_logits=self.hparams.kl_weight > 0)

    def _step(self, batch, split: str, generator: torch.Generator | None = None):
        ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
        feats, target_logits, greedy = self._features(batch, split)
        d = self.drafter
        bs = d.block_size
        anchors, valid = sample_anchors(loss_mask, lengths, self.hparams.num_anchors, generator)
        blk = build_blocks(ids, loss_mask, lengths, anchors, valid, bs, d.config.mask_token_id)
        S = ids.shape[1]
        ctx_pos = torch.arange(S, device=ids.device).expand(ids.shape[0], S)
        ctx_kv = d.context_kv(feats, ctx_pos)
        hidden = d(d.embed(blk.tokens), blk.positions, ctx_kv, blk.mask)  # [B, N*Bk, D]
        B, N = anchors.shape
        hidden = hidden.view(B, N, bs, -1)[:, :, 1:]  # [B, N, K, D] (slot 0 is never a target)
        logits = d.logits(hidden)  # [B, N, K, V]
        loss = decayed_ce(logits, blk.labels, blk.label_mask, self.slot_weights)
        if target_logits is not None and self.hparams.kl_weight > 0:
            # target distribution for slot k of anchor a is its prediction at position a + k - 1
            pos = (anchors[:, :, None] + torch.arange(bs - 1, device=ids.device)).clamp(max=S - 1)  # [B, N, K]
            t_logits = target_logits.gather(1, pos.flatten(1)[..., None].expand(-1, -1, target_logits.shape[-1]))
            kl = forward_kl(logits, t_logits.view_as(logits), blk.label_mask, self.slot_weights)
            loss = loss + self.hparams.kl_weight * kl
        return loss, logits, blk, greedy, anchors

    @staticmethod
    def slot_accuracy(logits, blk) -> torch.Tensor:
        """Top-1 accuracy per slot ``[K]`` over supervised slots."""
        hit = (logits.argmax(-1) == blk.labels) & blk.label_mask
        return hit.flatten(0, 1).sum(0).float() / blk.label_mask.flatten(0, 1).sum(0).clamp_min(1)

    @staticmethod
    def simulated_tau(logits, blk, greedy, anchors) -> torch.Tensor:
        """Mean accepted length (bonus included) under greedy verification against the target's teacher-forced
        greedy tokens, using the runtime's ``accept_greedy``; blocks must be fully in bounds."""
        B, N, K, V = logits.shape
        S = greedy.shape[1]
        pos = anchors[:, :, None] + torch.arange(K + 1, device=logits.device)  # [B, N, K+1]
        in_bounds = (pos[:, :, -1] < S) & blk.valid & blk.label_mask.all(-1)
        tgt = greedy.gather(1, pos.clamp(max=S - 1).flatten(1)).view(B, N, K + 1)  # target token after each prefix
        onehot = torch.nn.functional.one_hot(tgt[in_bounds], V).float()  # as logits: argmax == tgt
        n_acc, _ = accept_greedy(logits.argmax(-1)[in_bounds], onehot)
        return (n_acc.float() + 1).mean() if n_acc.numel() else torch.tensor(float("nan"), device=logits.device)

    # ---- Lightning hooks ------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        # anchors are a function of (seed, step): resampled every step, identical after a resume
        g = torch.Generator(device="cpu").manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
        loss, logits, blk, _, _ = self._step(batch, "train", g)
        self._tokens_seen += int(batch["lengths"].sum())
        acc = self.slot_accuracy(logits.detach(), blk)
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"train/acc_{k + 1}": a for k, a in enumerate(acc.tolist())})
        self.log("train/tokens_per_s", self._tokens_seen / max(time.perf_counter() - self._t0, 1e-6))
        return loss

    def validation_step(self, batch, batch_idx):
        g = torch.Generator(device="cpu").manual_seed(self.hparams.seed + batch_idx)
        loss, logits, blk, greedy, anchors = self._step(batch, "val", g)
        self.log("eval/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log("eval/sim_tau", self.simulated_tau(logits, blk, greedy, anchors), prog_bar=True,
                 batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self):
        hp = self.hparams
        opt = torch.optim.AdamW(self.drafter.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95))
        warmup = int(hp.warmup_ratio * hp.total_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, warmup, hp.total_steps, 0.0))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """Only the drafter is saved (the frozen target is loaded from its own checkpoint)."""
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("target.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = super().load_state_dict(state_dict, strict=False, assign=assign)
        bad = [k for k in missing.missing_keys if not k.startswith("target.")] + list(missing.unexpected_keys)
        if strict and bad:
            raise RuntimeError(f"checkpoint does not match the drafter: {bad[:5]}")
        return missing

    def on_save_checkpoint(self, checkpoint):
        checkpoint["rng"] = {"torch": torch.get_rng_state(),
                             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}

    def on_load_checkpoint(self, checkpoint):
        rng = checkpoint.get("rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
