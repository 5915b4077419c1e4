"""Draft-OPD: on-policy distillation of a block drafter from target-assisted rollouts (arXiv:2605.29343).

Rollouts are real speculative decoding through :func:`~specdraft.runtime.decode.generate` with the current drafter,
so the committed text follows the target while the blocks, the accepted lengths and the rejected drafts are the
drafter's own. A round per row records its anchor position, its drafted block, how many drafts the target accepted
and, from the verify pass itself, the target's log-probability of every drafted token given the drafted prefix
before it (exactly the teacher the rejected-draft stream needs, at no extra target pass).

Replay: the frozen target scores prompt + response once (context features and its distributions); the drafter
re-drafts exactly the rollout's blocks, at the real anchors, so every block sees the context it saw while serving
(target features strictly before the anchor) and its logits equal the serving logits.

Loss (per batch): ``response_weight * L_resp + rejected_weight * L_rej``

- ``L_resp``: on every committed token (a round's accepted drafts and its correction, slots ``1..n+1``), forward KL
  to the target: the full distribution ``sum_v p log p/q`` or the published code's sampled-token (Bernoulli) form
  ``p_y log(p_y/q_y) + (1 - p_y) log((1 - p_y)/(1 - q_y))``; mean over committed tokens.
- ``L_rej``: on rejected drafts ``x`` at slot ``o`` (``o > n``), the reverse-KL k3 estimator ``(r - 1) - log r``,
  ``r = p(x) / q(x)``, weighted ``decay^(o - 1)`` (o = the slot in the block, as the published code's offsets) and
  normalised by the weights' sum. ``exact`` scores every rejected slot with the target conditioned on the drafted
  prefix (the recorded verify pass); ``cheap`` only the first rejected slot (the published code's stream), whose
  prefix is committed text.

Choices the method leaves open, made here: the response stream's teacher is the target at the rollout temperature,
so under greedy rollouts (the teacher is the target's argmax) both KL forms are the cross-entropy of the committed
tokens; the rejected stream compares distributions at the rollout temperature, or at T=1 under greedy rollouts (at
T -> 0 a rejected draft has target probability 0 and k3 diverges); the response stream carries no per-slot decay
(each committed token once); a round whose commit was cut by the row's length cap contributes no rejected drafts
(its correction is not in the text).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from specdraft.errors import OptionError, check_range
from specdraft.lit_modules.blocks import DraftBatch
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter import RoundRecord
from specdraft.runtime.sampling import SamplingParams


@dataclass
class OPDConfig:
    """The opd stage's options (``train.opd.*``)."""

    rollout_temperature: float = 0.0
    """Temperature of the rollouts (0 = greedy); set it to the temperature the drafter will serve at."""
    refresh_every: int = 10
    """Optimizer steps between rollout refreshes with the current drafter; 0 = never (offline replay: the prompts of
    the whole run are rolled out once, by the starting drafter)."""
    buffer_prompts: int = 0
    """Prompts rolled out per refresh (0 = ``refresh_every * batch_size``: each rollout is replayed once; fewer are
    replayed more than once; more would never be replayed and are refused)."""
    max_new_tokens: int = 160
    """Rollout response cap (tokens)."""
    rollout_batch_size: int = 16
    """Rows per engine call while rolling out."""
    response_loss: Literal["full", "sampled"] = "full"
    """Forward KL on committed tokens over the full distribution, or its sampled-token (Bernoulli) form."""
    response_teacher: Literal["serving", "raw"] = "serving"
    """The response stream's teacher: the target at the rollout temperature (greedy rollouts: its argmax, so both
    KL forms become cross-entropy on the committed tokens, their T -> 0 limit), or its raw T=1 distribution whatever
    the rollout temperature (the ablation)."""
    rejected_teacher: Literal["exact", "cheap"] = "cheap"
    """Rejected-draft stream: every rejected slot, scored by the target on the drafted prefix (exact), or only the
    first rejected slot (cheap, the published code's)."""
    rejected_decay: float = 0.8
    """Weight ``decay^(o - 1)`` of a rejected draft at block slot ``o``."""
    response_weight: float = 1.0
    rejected_weight: float = 0.0
    """Weight of the rejected-draft stream (the published default is 1; docs/experiments/2026-12-01-draft-opd.md
    measures why it is off here)."""
    eval_prompts: int = 16
    """Held-in validation prompts rolled out at each evaluation (``eval/opd_tau``, which picks the export)."""

    def __post_init__(self):
        check_range("rollout_temperature", self.rollout_temperature, 0.0)
        for key in ("refresh_every", "buffer_prompts"):
            check_range(key, getattr(self, key), 0)
        for key in ("max_new_tokens", "rollout_batch_size", "eval_prompts"):
            check_range(key, getattr(self, key), 1)
        check_range("rejected_decay", self.rejected_decay, 0.0, 1.0, low_open=True)
        check_range("response_weight", self.response_weight, 0.0)
        check_range("rejected_weight", self.rejected_weight, 0.0)
        if self.response_weight == 0 and self.rejected_weight == 0:
            raise OptionError("response_weight", "response_weight and rejected_weight are both 0: nothing to train")

    @property
    def loss_temperature(self) -> float:
        """The temperature of the rejected-draft stream's distributions (and of the recorded teacher log-probs): the
        rollout temperature, or 1 under greedy rollouts (at T -> 0 the target gives a rejected draft probability 0 and
        the k3 estimator diverges)."""
        return self.rollout_temperature if self.rollout_temperature > 0 else 1.0

    @property
    def response_temperature(self) -> float:
        """The response stream's temperature (0 = the target's argmax: cross-entropy)."""
        return self.rollout_temperature if self.response_teacher == "serving" else 1.0


@dataclass
class Rollout:
    """One prompt's rollout: the committed text and, per verify round, what the drafter proposed and the target
    decided."""

    prompt_len: int
    tokens: list[int]
    """Prompt + committed response (the stop token included when the row stopped on one)."""
    anchors: list[int] = field(default_factory=list)
    """Per round: position of its anchor (the last committed token) in :attr:`tokens`."""
    drafts: list[list[int]] = field(default_factory=list)
    """Per round: the K drafted tokens."""
    accepted: list[int] = field(default_factory=list)
    """Per round: drafts the target accepted (the engine's ``RowResult.accepted``)."""
    corrections: list[int] = field(default_factory=list)
    """Per round: the target's token after the accepted drafts (the next anchor)."""
    teacher_logp: list[list[float]] = field(default_factory=list)
    """Per round: the target's log-probability of each drafted token given the anchor and the drafts before it, at
    the loss temperature, from the round's verify pass."""
    draft_logits: list[torch.Tensor] = field(default_factory=list)
    """Per round ``[K, V]`` (only with ``keep_logits``: tests compare them with the replay)."""


def rollout(target, drafter, prompts: list[list[int]], cfg: OPDConfig, stop_token_ids: tuple[int, ...] = (),
            generator: torch.Generator | None = None, keep_logits: bool = False) -> tuple[list[Rollout], dict]:
    """Speculative decoding of ``prompts`` with ``drafter`` (a drafter without cross-round state) at the rollout
    temperature, recording every round. Returns ``(rollouts, stats)``; stats: ``tau`` (committed tokens per round,
    bonus included, as the bench counts), ``rounds``, ``tokens``."""
    params = SamplingParams(cfg.rollout_temperature)
    gen_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=params, stop_token_ids=stop_token_ids)
    T = cfg.loss_temperature
    out: list[Rollout] = []
    emitted, rounds = 0, 0
    for start in range(0, len(prompts), cfg.rollout_batch_size):
        chunk = prompts[start:start + cfg.rollout_batch_size]
        recs = [Rollout(len(p), list(p)) for p in chunk]
        pos = [len(p) for p in chunk]  # each row's anchor position (the first response token is committed at P)

        def observe(rec: RoundRecord) -> None:
            K = rec.draft_tokens.shape[1]
            z = rec.target_logits[:, :K].float() / T  # [b, K, V]
            dlogp = z.gather(-1, rec.draft_tokens[..., None])[..., 0] - z.logsumexp(-1)  # [b, K], no [b, K, V] copy
            rows = zip(rec.rows.tolist(), rec.num_accepted.tolist(), rec.draft_tokens.tolist(),
                       rec.next_tokens.tolist(), dlogp.tolist())  # one host transfer per tensor, not per row
            for i, (row, n, drafts, nxt, lp) in enumerate(rows):
                r = recs[row]
                r.anchors.append(pos[row])
                r.drafts.append(drafts)
                r.accepted.append(n)
                r.corrections.append(nxt)
                r.teacher_logp.append(lp)
                if keep_logits:
                    r.draft_logits.append(rec.draft_logits[i].float().clone())
                pos[row] += n + 1

        results = generate(target, chunk, gen_cfg, drafter=drafter, generator=generator, observer=observe)
        for r, res in zip(recs, results):
            if r.accepted != res.accepted:
                raise RuntimeError("rollout records disagree with the engine's accepted lengths")
            r.tokens = r.tokens + res.tokens
            if res.finish_reason == "stop" and r.anchors:  # the stop token was committed: keep it (learn to end)
                last = r.drafts[-1][: r.accepted[-1]] + [r.corrections[-1]]
                r.tokens.append(last[res.accept_lengths[-1] - 1])
            emitted += sum(res.accept_lengths)
            rounds += len(res.accept_lengths)
        out.extend(recs)
    return out, {"tau": emitted / max(rounds, 1), "rounds": rounds, "tokens": emitted}


class Replay(NamedTuple):
    """A batch's rounds, as the loss reads them (``[B, N]`` rounds per row, padded)."""

    accepted: torch.Tensor  # [B, N] accepted drafts per round
    drafts: torch.Tensor  # [B, N, K] drafted tokens
    teacher_logp: torch.Tensor  # [B, N, K] the target's log-prob of each draft given the drafted prefix
    complete: torch.Tensor  # [B, N] bool: the round's correction is in the text


def collate_rollouts(rollouts: list[Rollout], max_rounds: int = 0, generator: torch.Generator | None = None) -> dict:
    """A replay batch: the ShareGPT batch keys (``input_ids``, ``loss_mask`` on the response, ``lengths``) plus the
    rounds (``anchors``, ``valid``, ``accepted``, ``drafts``, ``teacher_logp``, ``complete``). With ``max_rounds``
    a row keeps that many of its rounds, drawn uniformly (blocks never see each other, so any subset replays
    exactly)."""
    B = len(rollouts)
    S = max(len(r.tokens) for r in rollouts)
    keep = []
    for r in rollouts:
        R = len(r.anchors)
        if max_rounds and R > max_rounds:
            keep.append(sorted(torch.randperm(R, generator=generator)[:max_rounds].tolist()))
        else:
            keep.append(list(range(R)))
    N = max(1, max(len(k) for k in keep))
    K = next((len(r.drafts[0]) for r in rollouts if r.drafts), 1)
    ids = torch.zeros(B, S, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.long)
    anchors = torch.zeros(B, N, dtype=torch.long)
    valid = torch.zeros(B, N, dtype=torch.bool)
    accepted = torch.zeros(B, N, dtype=torch.long)
    drafts = torch.zeros(B, N, K, dtype=torch.long)
    teacher = torch.zeros(B, N, K)
    complete = torch.zeros(B, N, dtype=torch.bool)
    for b, (r, rounds) in enumerate(zip(rollouts, keep)):
        n_rounds, L_ = len(rounds), len(r.tokens)
        ids[b, :L_] = torch.tensor(r.tokens)
        loss_mask[b, r.prompt_len:L_] = 1
        if n_rounds:
            anchors[b, :n_rounds] = torch.tensor([r.anchors[j] for j in rounds])
            valid[b, :n_rounds] = True
            accepted[b, :n_rounds] = torch.tensor([r.accepted[j] for j in rounds])
            drafts[b, :n_rounds] = torch.tensor([r.drafts[j] for j in rounds])
            teacher[b, :n_rounds] = torch.tensor([r.teacher_logp[j] for j in rounds])
            complete[b, :n_rounds] = anchors[b, :n_rounds] + accepted[b, :n_rounds] + 1 < L_
    return {"input_ids": ids, "loss_mask": loss_mask, "lengths": torch.tensor([len(r.tokens) for r in rollouts]),
            "anchors": anchors, "valid": valid, "accepted": accepted, "drafts": drafts, "teacher_logp": teacher,
            "complete": complete}


def stream_masks(replay: Replay, label_mask: torch.Tensor, rejected_teacher: str,
                 decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response mask [B, N, K] bool, rejected weights [B, N, K])``: slot ``k`` (1-based) is committed when
    ``k <= n + 1`` and in the text; a rejected draft when ``k > n`` in a complete round (only ``k = n + 1`` for
    ``cheap``), weighted ``decay^(k - 1)``."""
    K = replay.drafts.shape[-1]
    k = torch.arange(1, K + 1, device=replay.drafts.device)  # [K]
    n = replay.accepted[..., None]  # [B, N, 1]
    response = label_mask & (k <= n + 1)
    rejected = (k > n) & replay.complete[..., None]
    if rejected_teacher == "cheap":
        rejected = rejected & (k == n + 1)
    weights = decay ** (k - 1).float()  # [K]
    return response, rejected.float() * weights


def response_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                form: str, temperature: float) -> torch.Tensor:
    """Mean forward KL on committed tokens: ``sum_v p log(p/q)`` (full) or the sampled-token Bernoulli form at the
    committed token ``y``; at ``temperature`` 0 the teacher is the target's argmax, where both forms are the
    cross-entropy of ``y`` (the committed token of a greedy rollout is that argmax). Logits ``[..., V]``, labels and
    mask ``[...]``."""
    if temperature == 0:
        ce = F.cross_entropy(draft_logits[mask].float(), labels[mask], reduction="sum")
        return ce / mask.sum().clamp_min(1)
    logq = F.log_softmax(draft_logits[mask].float() / temperature, -1)  # [M, V]
    logp = F.log_softmax(target_logits[mask].float() / temperature, -1)
    if form == "full":
        per = (logp.exp() * (logp - logq)).sum(-1)
    else:
        y = labels[mask][:, None]
        lq, lp = logq.gather(-1, y)[:, 0], logp.gather(-1, y)[:, 0]
        p = lp.exp()
        per = p * (lp - lq) + (1 - p) * (torch.log1p(-p.clamp(max=1 - 1e-6)) - torch.log1p(-lq.exp().clamp(
            max=1 - 1e-6)))
    return per.sum() / mask.sum().clamp_min(1)


def rejected_k3(draft_logits: torch.Tensor, drafts: torch.Tensor, teacher_logp: torch.Tensor, weights: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """Weighted mean of the reverse-KL k3 estimator ``(r - 1) - log r``, ``r = p(x) / q(x)``, over rejected drafts
    ``x`` (``weights`` ``[...]`` 0 elsewhere). Logits ``[..., V]``, drafts and teacher log-probs ``[...]``."""
    on = weights > 0
    if not on.any():
        return draft_logits.sum() * 0.0
    logq = F.log_softmax(draft_logits[on].float() / temperature, -1).gather(-1, drafts[on][:, None])[:, 0]  # [M]
    log_r = (teacher_logp[on] - logq).clamp(max=30.0)  # r = p/q; the clamp only guards exp against overflow
    k3 = log_r.exp() - 1 - log_r
    return (k3 * weights[on]).sum() / weights.sum().clamp_min(1e-8)


def opd_loss(module, db: DraftBatch, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """The opd stage's loss on a replayed batch (see the module docstring)."""
    cfg: OPDConfig = module.objective.opd
    replay: Replay = db.replay
    response, rejected = stream_masks(replay, db.blocks.label_mask, cfg.rejected_teacher, cfg.rejected_decay)
    l_resp = response_kl(db.logits, db.target_logits, db.blocks.labels, response, cfg.response_loss,
                         cfg.response_temperature)
    l_rej = rejected_k3(db.logits, replay.drafts, replay.teacher_logp, rejected, cfg.loss_temperature)
    loss = cfg.response_weight * l_resp + cfg.rejected_weight * l_rej
    return loss, {"response_loss": float(l_resp.detach()), "rejected_loss": float(l_rej.detach()),
                  "rejected_drafts": float((rejected > 0).sum())}


def rollout_share(module) -> float | None:
    """Seconds spent rolling out over seconds since the first rollout began (None before any rollout)."""
    spent = getattr(module, "opd_rollout_clock", None)
    if not spent or spent["t0"] is None:
        return None
    return spent["rollout_s"] / max(time.perf_counter() - spent["t0"], 1e-6)


def opd_step(module, batch, split: str, generator: torch.Generator | None):
    """Training: re-draft the rollout's blocks at their real anchors against the target's scoring of the whole text.
    Validation: the usual random-anchor blocks (the pipeline's rollout evaluation adds ``eval/opd_tau``)."""
    if split != "train":
        return module.draft(batch, split, generator), 0.0, {}
    feats, target_hidden, greedy = module.features(batch, split)
    anchors, valid = batch["anchors"], batch["valid"]
    logits, _, blk, ctx = module.run_blocks(batch, feats, anchors, valid)
    tokens, slot_logits = module.target_view(anchors, greedy, target_hidden, module.drafter.block_size - 1)
    replay = Replay(batch["accepted"], batch["drafts"], batch["teacher_logp"], batch["complete"] & valid)
    # the latest rollout's acceptance (the on-policy signal) and the rollouts' share of the training time so far
    stats = dict(getattr(module, "opd_rollout_stats", {}))
    share = rollout_share(module)
    if share is not None:
        stats["rollout_share"] = share
    return DraftBatch(logits, blk, tokens, slot_logits, ctx, replay=replay), 0.0, stats
