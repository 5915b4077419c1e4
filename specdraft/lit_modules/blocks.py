"""DFlash training blocks: random anchors, block inputs, labels and the block attention mask (pure tensor code).

Reference: DFlash (arXiv:2602.06036) §4.2 + Fig. 4, and the pitfalls fixed in SpecForge (#427 bidirectional blocks, #470
anchor-position visibility, #473 random anchors + decay). For anchor ``a_j`` the block is ``[x_{a_j}, MASK x K]`` at
positions ``a_j + 0..K`` (block size ``Bk = K + 1``); slot ``k`` predicts ``x_{a_j + k}`` (same position, no shift; slot
0 is never a target). A block query sees context key ``t`` iff ``t < a_j`` (STRICTLY before the anchor: the anchor's own
target feature does not exist yet at inference), sees its own block bidirectionally, and never sees another block.
Padding blocks (fewer valid anchors than requested) see only themselves and carry no loss."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Blocks(NamedTuple):
    anchors: torch.Tensor  # [B, N] anchor positions (0 for padding blocks)
    valid: torch.Tensor  # [B, N] bool, real block
    tokens: torch.Tensor  # [B, N * Bk] block input ids (anchor + MASKs)
    positions: torch.Tensor  # [B, N * Bk] absolute positions
    labels: torch.Tensor  # [B, N, Bk - 1] target ids for slots 1..Bk-1
    label_mask: torch.Tensor  # [B, N, Bk - 1] bool, supervised (in bounds, loss_mask at the LABEL position)
    mask: torch.Tensor  # [B, 1, N * Bk, S + N * Bk] bool attention visibility


class DraftBatch(NamedTuple):
    """One training forward: drafter logits for a set of blocks and the target's view of them."""

    logits: torch.Tensor  # [B, N, K, V] drafter logits for slots 1..K
    blocks: Blocks
    target_tokens: torch.Tensor  # [B, N, K + 1] target greedy token after each block prefix (teacher-forced)
    target_logits: torch.Tensor | None  # [B, N, K, V] target logits for slots 1..K (teacher-forced)
    ctx: tuple  # (block embeds, block positions, ctx features, ctx positions) to re-run a drafter (GRPO reference)
    slot_weights: torch.Tensor | None = None  # [B, N, K] per-block loss weights (default: the stage's decay [K])
    replay: object = None  # opd: the rollout rounds these blocks re-draft (lit_modules.opd.Replay)


def full_windows(blk) -> torch.Tensor:
    """Blocks ``[B, N]`` whose whole window is supervised (the simulated acceptance metrics and GRPO use only these)."""
    return blk.valid & blk.label_mask.all(-1)


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None,
                   row_seeds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform anchors without replacement among supervised positions that have at least one label after them.

    Args:
        loss_mask: ``[B, S]`` 1 on assistant tokens.
        lengths: ``[B]`` real lengths.
        row_seeds: one seed per sequence (``B`` ints): its anchors then depend on the sequence and its seed alone, not
            on the batch it came in (data-parallel ranks then draw what one process draws); else ``generator``.
    Returns:
        ``(anchors [B, N], valid [B, N])``, anchors sorted ascending, N = min(num_anchors, max #candidates).
    """
    B, S = loss_mask.shape
    pos = torch.arange(S, device=loss_mask.device)
    candidate = loss_mask.bool() & (pos[None, :] < (lengths[:, None] - 1))  # [B, S]
    if row_seeds is not None:
        scores = torch.full((B, S), -1.0)
        for b, (seed, n) in enumerate(zip(row_seeds, lengths.tolist())):
            scores[b, :n] = torch.rand(n, generator=torch.Generator().manual_seed(seed))
        scores = scores.to(loss_mask.device)
    else:
        gen_device = generator.device if generator is not None else loss_mask.device
        scores = torch.rand(B, S, generator=generator, device=gen_device).to(loss_mask.device)
    scores = scores.masked_fill(~candidate, -1.0)
    n = max(1, min(num_anchors, int(candidate.sum(1).max())))
    top = scores.topk(n, dim=1)
    valid = top.values >= 0  # [B, n]
    anchors = torch.where(valid, top.indices, torch.zeros_like(top.indices))
    order = torch.where(valid, anchors, torch.full_like(anchors, S)).argsort(dim=1)
    return anchors.gather(1, order), valid.gather(1, order)


def build_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    B, S = input_ids.shape
    N = anchors.shape[1]
    dev = input_ids.device
    k = torch.arange(block_size, device=dev)
    positions = anchors[:, :, None] + k  # [B, N, Bk]
    tokens = torch.full((B, N, block_size), mask_token_id, dtype=torch.long, device=dev)
    tokens[:, :, 0] = input_ids.gather(1, anchors)
    label_pos = positions[:, :, 1:]  # [B, N, Bk - 1]
    in_bounds = label_pos < lengths[:, None, None]
    safe = label_pos.clamp(max=S - 1).flatten(1)  # [B, N * (Bk - 1)]
    labels = input_ids.gather(1, safe).view(B, N, block_size - 1)
    lm = loss_mask.bool().gather(1, safe).view(B, N, block_size - 1)
    label_mask = in_bounds & lm & valid[:, :, None]

    # attention: [ctx S | blocks N*Bk]
    q_anchor = anchors[:, :, None].expand(B, N, block_size).reshape(B, N * block_size)  # [B, Q]
    ctx_vis = torch.arange(S, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, Q, S] strict t < a_j
    q_valid = valid[:, :, None].expand(B, N, block_size).reshape(B, N * block_size)
    ctx_vis = ctx_vis & q_valid[:, :, None]  # padding blocks see no context
    block_id = torch.arange(N, device=dev).repeat_interleave(block_size)  # [Q]
    same_block = block_id[:, None] == block_id[None, :]  # [Q, Q]
    mask = torch.cat([ctx_vis, same_block[None].expand(B, -1, -1)], dim=2)[:, None]  # [B, 1, Q, S + Q]
    return Blocks(anchors, valid, tokens.flatten(1), positions.flatten(1), labels, label_mask, mask)


def default_gamma(block_size: int) -> float:
    """DFlash's loss-decay constant: 7 for Bk=16, 5 for Bk=10, 4 for Bk=8 (interpolated elsewhere)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def decay_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """``w_k = exp(-(k - 1) / gamma)`` for slots k = 1..Bk-1, ``[Bk - 1]``."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)
