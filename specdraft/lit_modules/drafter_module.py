"""LightningModule for block drafters: a thin wrapper = target features + drafter forward + the stage's objective.

The stage (``Objective.stage``) is a row of :data:`~specdraft.lit_modules.stage_table.STAGES`: its step drafts the
blocks, its loss scores them. The target is frozen and only supplies features, its embedding and LM head. Metrics:
``train/loss``, ``train/acc_k``, ``eval/loss``, ``eval/sim_tau`` (teacher-forced greedy acceptance with the
runtime's :func:`accept_greedy`, bonus included), ``eval/sim_tau_sampled`` where the target's distributions are at
hand (expected acceptance under speculative sampling; the sampling stages' checkpoints are picked by it) and, from
the pipeline's callback, ``eval/tau`` from real decoding.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from specdraft.lit_modules.blocks import (
    DraftBatch,
    build_blocks,
    decay_weights,
    default_gamma,
    full_windows,
    sample_anchors,
)
from specdraft.lit_modules.features import OfflineFeatures, online_features
from specdraft.lit_modules.lm import cosine_with_warmup
from specdraft.lit_modules.losses import acceptance_alpha, decayed_ce, expected_accept_length
from specdraft.lit_modules.stage_table import Objective
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.verify import accept_greedy

_FROZEN = ("target.", "reference.")


class DrafterModule(L.LightningModule):
    def __init__(self, drafter, target: TargetLM, lr: float, warmup_ratio: float, total_steps: int,
                 num_anchors: int, objective: Objective | None = None, weight_decay: float = 0.0,
                 offline: OfflineFeatures | None = None, seed: int = 0):
        super().__init__()
        self.save_hyperparameters(ignore=["drafter", "target", "offline", "objective"])
        self.objective = objective or Objective()
        self.stage = self.objective.spec
        if offline is not None and self.objective.needs_target_logits:
            raise ValueError(f"stage {self.objective.stage!r} needs target logits: use online features")
        self.drafter = drafter
        self.target = target.requires_grad_(False).eval()
        self.drafter.bind_target(self.target.model.embed_tokens, self.target.lm_head)
        self.offline = offline
        Bk = drafter.block_size
        self.gamma = self.objective.gamma or default_gamma(Bk)
        self.register_buffer("slot_weights", decay_weights(Bk, self.gamma), persistent=False)
        # a frozen copy of the starting drafter (GRPO's KL anchor), kept out of checkpoints like the target
        self.reference = None
        if self.stage.reference:
            ref = type(drafter)(drafter.config)
            ref.load_state_dict(drafter.state_dict())
            self.reference = ref.to(drafter.fc.weight.device).requires_grad_(False).eval()
            self.reference.bind_target(self.target.model.embed_tokens, self.target.lm_head)
        self._tokens_seen, self._t0 = 0, None
        self._loss_stats: dict = {}

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # frozen, always in eval mode
        if self.reference is not None:
            self.reference.eval()
        return self

    # ---- shared forward -------------------------------------------------------------------------------
    def features(self, batch, split: str, cache=None):
        """``(features, target hidden or None, greedy)``; a ``cache`` forces the online pass and keeps its K/V."""
        ids = batch["input_ids"]
        if self.offline is not None and cache is None:
            feats, greedy = self.offline.batch(split, batch["index"].tolist(), ids.shape[1], ids.device)
            return feats.to(self.drafter.fc.weight.dtype), None, greedy
        feats, hidden, greedy = online_features(self.target, ids, self.drafter.target_layer_ids, cache=cache)
        return feats, (hidden if self.objective.needs_target_logits else None), greedy

    def run_blocks(self, batch, feats, anchors, valid, prior=None, edit=None):
        """Drafter forward over blocks at ``anchors`` ``[B, N]``; ``prior`` (one row per block, ReTrace) is fused into
        the block inputs; ``edit`` rewrites the built blocks first (the vp stage fills known prefixes).
        Returns ``(logits [B, N, K, V], hidden [B, N, Bk, D], blocks, ctx)``."""
        ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"], batch["lengths"]
        d = self.drafter
        Bk = d.block_size
        blk = build_blocks(ids, loss_mask, lengths, anchors, valid, Bk, d.config.mask_token_id)
        if edit is not None:
            blk = edit(blk)
        B, S = ids.shape
        N = anchors.shape[1]
        ctx_pos = torch.arange(S, device=ids.device).expand(B, S)
        embeds = d.embed(blk.tokens)  # [B, N*Bk, D]
        if prior is not None:
            embeds = embeds + d.fusion_delta(prior).view(B, N * Bk, -1).to(embeds.dtype)
        hidden = d(embeds, blk.positions, d.context_kv(feats, ctx_pos), blk.mask).view(B, N, Bk, -1)
        logits = d.logits(hidden[:, :, 1:])  # [B, N, K, V] (slot 0 is never a target)
        return logits, hidden, blk, (embeds, blk.positions, feats, ctx_pos)

    def target_view(self, anchors, greedy, target_hidden, K):
        """The target's teacher-forced view of each block: token after each prefix ``[B, N, K+1]`` and logits for
        slots 1..K ``[B, N, K, V]`` (its prediction at position ``a + k - 1``; computed only at those positions)."""
        B, N = anchors.shape
        S = greedy.shape[1]
        pos = (anchors[:, :, None] + torch.arange(K + 1, device=anchors.device)).clamp(max=S - 1)  # [B, N, K+1]
        tokens = greedy.gather(1, pos.flatten(1)).view(B, N, K + 1)
        slot_logits = None
        if target_hidden is not None:
            flat = pos[:, :, :K].flatten(1)[..., None].expand(-1, -1, target_hidden.shape[-1])
            with torch.no_grad():
                slot_logits = self.target.lm_head(target_hidden.gather(1, flat)).view(B, N, K, -1)
        return tokens, slot_logits

    def draft(self, batch, split: str, generator: torch.Generator | None = None) -> DraftBatch:
        feats, target_hidden, greedy = self.features(batch, split)
        anchors, valid = self.sample_anchors(batch, split, generator)
        if split == "train" and self.objective.anchors == "verified":
            anchors, valid = self.verified_anchors(batch, feats, greedy, anchors, valid)
        logits, _, blk, ctx = self.run_blocks(batch, feats, anchors, valid)
        tokens, slot_logits = self.target_view(anchors, greedy, target_hidden, self.drafter.block_size - 1)
        return DraftBatch(logits, blk, tokens, slot_logits, ctx)

    def sample_anchors(self, batch, split: str, generator: torch.Generator | None = None):
        """Uniform anchors ``([B, N], valid [B, N])``; in training one stream per conversation (seeded by the step's
        generator and the conversation's index), so data-parallel ranks draw exactly what one process draws."""
        row_seeds = None
        if split == "train" and generator is not None and "index" in batch:
            base = generator.initial_seed()
            row_seeds = [(base * 1_000_003 + i) % 2**63 for i in batch["index"].tolist()]  # any train.seed fits
        return sample_anchors(batch["loss_mask"], batch["lengths"], self.hparams.num_anchors, generator, row_seeds)

    @torch.no_grad()
    def verified_anchors(self, batch, feats, greedy, anchors, valid) -> tuple[torch.Tensor, torch.Tensor]:
        """Where serving anchors the next block: draft at ``anchors`` ``[B, N]`` (no grad), accept the leading drafts
        that equal the target's teacher-forced greedy tokens (the runtime's greedy rule; exact on target-greedy
        data), and return ``(a + n + 1, valid)``. Those positions follow a rejection, where the drafter has just
        failed; uniform anchors under-sample them (the Draft-OPD observation, arXiv:2605.29343)."""
        K = self.drafter.block_size - 1
        logits, _, blk, _ = self.run_blocks(batch, feats, anchors, valid)
        tokens, _ = self.target_view(anchors, greedy, None, K)
        hit = (logits.argmax(-1) == tokens[..., :K]) & blk.label_mask  # [B, N, K]
        nxt = anchors + hit.long().cumprod(-1).sum(-1) + 1  # [B, N]
        S = batch["input_ids"].shape[1]
        ok = valid & (nxt < batch["lengths"][:, None] - 1)
        ok = ok & batch["loss_mask"].bool().gather(1, nxt.clamp(max=S - 1))
        return torch.where(ok, nxt, torch.zeros_like(nxt)), ok

    def objective_loss(self, db: DraftBatch, generator: torch.Generator | None = None) -> torch.Tensor:
        """The stage's loss on ``db`` (its stats are kept in ``self._loss_stats`` for logging)."""
        loss, self._loss_stats = self.stage.loss(self, db, generator)
        return loss

    @staticmethod
    def slot_accuracy(logits, blk) -> torch.Tensor:
        """Top-1 accuracy per slot ``[K]`` over supervised slots."""
        hit = (logits.argmax(-1) == blk.labels) & blk.label_mask
        return hit.flatten(0, 1).sum(0).float() / blk.label_mask.flatten(0, 1).sum(0).clamp_min(1)

    @staticmethod
    def simulated_tau_sampled(logits, blk, target_logits, temperature: float) -> torch.Tensor:
        """Expected accepted length (bonus included) under speculative sampling at ``temperature``:
        ``1 + E_T``, ``E_T = sum_k prod_{j<=k} alpha_j``, ``alpha = sum_v min(p, q)`` against the target's
        teacher-forced distributions (the quantity WTV maximises); only fully supervised windows."""
        full = full_windows(blk)  # [B, N]
        if not full.any():
            return torch.tensor(float("nan"), device=logits.device)
        a = acceptance_alpha(logits[full], target_logits[full], temperature).clamp_min(1e-8)  # [M, K]
        return (expected_accept_length(a.log(), torch.ones_like(a, dtype=torch.bool)) + 1).mean()

    @staticmethod
    def simulated_tau(logits, blk, target_tokens) -> torch.Tensor:
        """Mean accepted length (bonus included) under greedy verification against the target's teacher-forced
        greedy tokens, computed by the runtime's ``accept_greedy``; only blocks whose window is fully supervised."""
        V = logits.shape[-1]
        full = full_windows(blk)
        onehot = torch.nn.functional.one_hot(target_tokens[full], V).float()  # as logits: argmax == target token
        n_acc, _ = accept_greedy(logits.argmax(-1)[full], onehot)
        return (n_acc.float() + 1).mean() if n_acc.numel() else torch.tensor(float("nan"), device=logits.device)

    # ---- Lightning hooks ------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        # anchors (and GRPO samples) are a function of (seed, step): resampled every step, identical after a resume
        g = torch.Generator(device="cpu").manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
        db, extra, step_stats = self.stage.step(self, batch, "train", g)
        loss = self.objective_loss(db, g) + extra
        self._tokens_seen += int(batch["lengths"].sum())
        acc = self.slot_accuracy(db.logits.detach(), db.blocks)
        loss, shown = self.global_mean(loss, db)
        self.log("train/loss", shown, prog_bar=True)
        self.log_dict({f"train/acc_{k + 1}": a for k, a in enumerate(acc.tolist())})
        self.log("train/tokens_per_s", self._tokens_seen / max(time.perf_counter() - self._t0, 1e-6))
        stats = {**step_stats, **self._loss_stats}
        if stats:
            self.log_dict({f"train/{self.stage.name}_{k}": v for k, v in stats.items()})
        return loss

    def global_mean(self, loss: torch.Tensor, db: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Under data parallelism, ``(loss to backpropagate, loss to log)`` such that the averaged gradients and the
        logged loss are those of ONE mean over the global batch's supervised slots: each rank's mean is weighted by
        its share of the slot weight (all-reduced), as one process at the same global batch weights it. Exact for
        the slot-mean losses (sft, kl, tv, vp); the block-mean ones (eal, wtv) are weighted by slots too."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world <= 1:
            return loss, loss.detach()
        w = db.slot_weights if db.slot_weights is not None else self.slot_weights
        local = (w * db.blocks.label_mask).sum().detach().float()
        total = self.trainer.strategy.reduce(local.clone(), reduce_op="sum")  # (all-reduces its input in place)
        share = local * world / total.clamp_min(1e-8)
        shown = self.trainer.strategy.reduce(loss.detach() * share, reduce_op="mean")
        return loss * share, shown

    def validation_step(self, batch, batch_idx):
        g = torch.Generator(device="cpu").manual_seed(self.hparams.seed + batch_idx)
        n = batch["input_ids"].shape[0]
        db, _, stats = self.stage.step(self, batch, "val", g)
        # sync_dist: under data parallelism every rank holds the same (averaged) scores, so every rank takes the same
        # checkpoint decisions (a no-op in one process)
        for k, v in stats.items():
            self.log(f"eval/{k}", v, batch_size=n, sync_dist=True)
        self.log("eval/loss", decayed_ce(db.logits, db.blocks.labels, db.blocks.label_mask, self.slot_weights),
                 prog_bar=True, batch_size=n, sync_dist=True)
        self.log("eval/sim_tau", self.simulated_tau(db.logits, db.blocks, db.target_tokens), prog_bar=True,
                 batch_size=n, sync_dist=True)
        if db.target_logits is not None:
            self.log("eval/sim_tau_sampled", self.simulated_tau_sampled(db.logits, db.blocks, db.target_logits,
                                                                        self.objective.temperature),
                     batch_size=n, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        scales = self.stage.lr_scales(self.objective)  # parameter-name prefix -> lr multiplier
        by_scale: dict[float, list] = {}
        for n, p in self.drafter.named_parameters():
            scale = next((s for prefix, s in scales.items() if n.startswith(prefix)), 1.0)
            by_scale.setdefault(scale, []).append(p)
        groups = [{"params": ps, "lr": hp.lr * s} for s, ps in by_scale.items()]
        opt = torch.optim.AdamW(groups, lr=hp.lr, weight_decay=hp.weight_decay, betas=(0.9, 0.95))
        warmup = int(hp.warmup_ratio * hp.total_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_with_warmup(s, warmup, hp.total_steps, 0.0))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def state_dict(self, *args, **kwargs):
        """Only the drafter is saved (the frozen target and GRPO reference come from their own checkpoints)."""
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith(_FROZEN)}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = super().load_state_dict(state_dict, strict=False, assign=assign)
        bad = [k for k in missing.missing_keys if not k.startswith(_FROZEN)] + list(missing.unexpected_keys)
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
