"""D²SD rounds: a first (DFlash) draft with per-slot confidences, a batched second draft from the likely rejection
points, one deduplicated prefix tree, verified in one target pass (D²SD, arXiv:2606.04446 §3; tree attention and
verification as in SpecInfer, arXiv:2305.09781).

Per active row: the first drafter drafts ``[anchor, MASK x K]``; its confidences ``c_k = max_v q_k(v)`` give the
boundary posterior and the ``J`` prefix lengths ``l_j`` (:mod:`specdraft.runtime.tree`); the second drafter drafts
``J`` blocks ``[anchor, d_1..d_l_j, MASK...]`` in one pass; the ``J + 1`` candidates merge into a prefix tree; the
target scores every node in one pass (tree mask over the committed context, positions ``len + depth``); the walk
from the root accepts the longest path (:func:`~specdraft.runtime.tree.accept_tree`); the accepted path's K/V move
into the committed slots (KV compaction) and its target features go to the drafters' contexts.

Draft tokens are deterministic (each drafter's argmax), so under sampling the walk samples the target at each node
it reaches, which keeps the output distributed exactly as the target's. The first drafter must keep no cross-round
state (a DFlash drafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdraft.runtime.drafter import Drafter
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.sampling import SamplingParams, sample
from specdraft.runtime.tree import Placement, Tree, TreeAcceptance, accept_tree, build_tree, prefix_lengths


@dataclass
class TreeDrafting:
    """How a D²SD round builds its tree (``generate(..., tree=)``)."""

    second: Drafter
    """The second drafter: a VP drafter, or the first drafter itself (the ablation). It must implement
    ``draft_branches(cache, block_embeds [b, J, Bk, D]) -> [b, J, Bk, D]``."""
    num_branches: int = 4
    """``J``: blocks the second drafter re-drafts per round (``decode.tree_k``)."""
    placement: Placement = "confidence"
    """Where the branches start: the most likely rejection points (confidence) or evenly spread (uniform)."""
    distinct: bool = False
    """A branch drafts the second drafter's best token OTHER than the first draft's at its first free slot (the one
    the posterior expects rejected), so no branch repeats the first draft there. Off: its argmax, as published."""

    def max_nodes(self, block_size: int) -> int:
        return 1 + (self.num_branches + 1) * (block_size - 1)

    def check(self, first: Drafter) -> None:
        """Raise ``ValueError`` unless the second drafter can branch from ``first``'s blocks."""
        second = self.second
        if not hasattr(second, "draft_branches"):
            raise ValueError(f"the second drafter ({type(second).__name__}) has no draft_branches")
        if second.block_size != first.block_size or tuple(second.target_layer_ids) != tuple(first.target_layer_ids):
            raise ValueError(f"the second drafter (block size {second.block_size}, target layers "
                             f"{list(second.target_layer_ids)}) must match the first ({first.block_size}, "
                             f"{list(first.target_layer_ids)})")
        if not 1 <= self.num_branches <= first.block_size - 2:
            raise ValueError(f"{self.num_branches} branches need 1..{first.block_size - 2} boundaries (block size "
                             f"{first.block_size})")


class TreeRound(NamedTuple):
    """What a D²SD round hands back to the engine (the committed part of the target cache already compacted)."""

    draft_tokens: torch.Tensor  # [b, K] the winning candidate (its first num_accepted tokens are accepted)
    draft_logits: torch.Tensor  # [b, K, V] the first drafter's logits
    hidden: torch.Tensor  # [b, Bk, D] the first drafter's hidden states
    acceptance: TreeAcceptance
    path_logits: torch.Tensor  # [b, K + 1, V] the target's logits along the winner's path (index i scores slot i + 1)
    path_features: torch.Tensor | None  # [b, A, F] the target features of the root and the accepted nodes (A = 1 + max)
    tree: Tree


def verify_tree(tree: Tree, target_logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> TreeAcceptance:
    """The target's token at every node (its argmax, or one sample per node from the processed distribution) and
    the walk that follows it: lossless for deterministic drafts (:func:`accept_tree`)."""
    return accept_tree(tree, sample(target_logits, params, generator))


def draft_candidates(drafter: Drafter, drafting: TreeDrafting, dcache, scache, anchor: torch.Tensor,
                     clock: PhaseClock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(candidates [b, J + 1, K], first logits [b, K, V], first hidden [b, Bk, D])``: the first draft and the
    second drafter's ``J`` re-drafts, whose prefixes are the first draft's tokens exactly."""
    b = anchor.shape[0]
    Bk = drafter.block_size
    mask_id = drafter.config.mask_token_id
    block = torch.full((b, Bk), mask_id, dtype=torch.long, device=anchor.device)
    block[:, 0] = anchor
    hidden = drafter.draft_hidden(dcache, drafter.block_embeds(block, None))  # [b, Bk, D]
    logits = drafter.logits(hidden[:, 1:])  # [b, K, V]
    confidence, first = logits.float().softmax(-1).max(-1)  # [b, K] each
    clock.lap("draft")
    lengths = prefix_lengths(confidence, drafting.num_branches, drafting.placement)  # [b, J]
    known = torch.arange(Bk, device=anchor.device)[None, None, :] <= lengths[:, :, None]  # [b, J, Bk]
    chain = torch.cat([anchor[:, None], first], dim=1)  # [b, Bk]
    second = drafting.second
    blocks = torch.where(known, chain[:, None, :], second.config.mask_token_id)  # [b, J, Bk]
    embeds = second.block_embeds(blocks.flatten(0, 1), None)  # [b * J, Bk, D]
    branch_hidden = second.draft_branches(scache, embeds.view(b, drafting.num_branches, Bk, -1))  # [b, J, Bk, D]
    branch_logits = second.logits(branch_hidden[:, :, 1:])  # [b, J, K, V]
    if drafting.distinct:  # rule the first draft's token out at each branch's first free slot
        K, V = first.shape[1], branch_logits.shape[-1]
        at = torch.nn.functional.one_hot(lengths, K).bool()  # [b, J, K]
        own = torch.nn.functional.one_hot(first, V).bool()[:, None]  # [b, 1, K, V]
        branch_logits = branch_logits.masked_fill(at[..., None] & own, float("-inf"))
    branch = branch_logits.argmax(-1)  # [b, J, K]
    branch = torch.where(known[:, :, 1:], first[:, None, :], branch)  # [b, J, K] the prefix is the first draft's
    clock.lap("second_draft")
    return torch.cat([first[:, None], branch], dim=1), logits, hidden  # [b, J + 1, K]


def tree_round(target, drafter: Drafter, drafting: TreeDrafting, dcache, scache, tcache, anchor: torch.Tensor,
               params: SamplingParams, feature_layers: tuple[int, ...], generator: torch.Generator | None,
               clock: PhaseClock) -> TreeRound:
    """One D²SD round for every active row. The target cache's committed lengths are left for the engine to raise by
    ``num_accepted + 1``; the accepted path's K/V already sit in those slots."""
    candidates, draft_logits, hidden = draft_candidates(drafter, drafting, dcache, scache, anchor, clock)
    tree = build_tree(anchor, candidates)
    tree = tree.trimmed(int(tree.num_nodes.max()))  # the ragged batch's largest tree (one host read)
    clock.lap("tree")
    lengths = tcache.lengths
    out = target(tree.tokens, cache=tcache, positions=lengths[:, None] + tree.depth, new_mask=tree.mask,
                 feature_layers=feature_layers)  # logits [b, N, V]
    acc = verify_tree(tree, out.logits, params, generator)
    clock.lap("verify")
    A = int(acc.num_accepted.max()) + 1
    steps = torch.arange(A, device=anchor.device)
    tcache.move(lengths[:, None] + acc.path[:, :A], lengths[:, None] + steps)  # KV compaction
    features = None
    if out.features is not None:
        features = out.features.gather(1, acc.path[:, :A, None].expand(-1, -1, out.features.shape[-1]))  # [b, A, F]
    path_logits = out.logits.gather(1, acc.path[:, :, None].expand(-1, -1, out.logits.shape[-1]))  # [b, K + 1, V]
    winner = candidates.gather(1, acc.winner[:, None, None].expand(-1, 1, candidates.shape[-1]))[:, 0]  # [b, K]
    clock.lap("compaction")
    return TreeRound(winner, draft_logits, hidden, acc, path_logits, features, tree)
