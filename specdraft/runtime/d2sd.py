"""D²SD rounds: a first (DFlash) draft with per-slot confidences, a batched second draft from the likely rejection
points, one deduplicated prefix tree, verified in one target pass (D²SD, arXiv:2606.04446 §3; tree attention and
verification as in SpecInfer, arXiv:2305.09781).

Per active row: the first drafter drafts ``[anchor, MASK x K]``; its confidences ``c_k = max_v q_k(v)`` give the
boundary posterior and the ``J`` prefix lengths ``l_j`` (:mod:`specdraft.runtime.tree`); the second drafter drafts
``J`` blocks ``[anchor, d_1..d_l_j, MASK...]`` in one pass; the ``J + 1`` candidates merge into a prefix tree; the
target scores every node in one pass (tree mask over the committed context, positions ``len + depth``); the walk
from the root accepts the longest path (:func:`~specdraft.runtime.tree.accept_tree`); the accepted path's K/V move
into the committed slots (KV compaction) and its target features go to the drafters' contexts.

Under greedy verification (or ``draft_sampling="greedy"``) draft tokens are each drafter's argmax, and the walk
follows the target's own token at each node it reaches (its argmax, or a sample from it). Under sampling with
``draft_sampling="sample"`` both drafters SAMPLE their tokens from their processed distributions and the walk runs
multi-candidate speculative sampling (:func:`~specdraft.runtime.tree.accept_tree_sampled`). Either way the output is
distributed exactly as the target's. The first drafter must keep no cross-round state (a DFlash drafter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdraft.runtime.drafter import Drafter
from specdraft.runtime.one_pass import draft_block
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.sampling import SamplingParams, logits_to_probs, sample, sample_from_probs
from specdraft.runtime.tree import (
    Placement,
    Tree,
    TreeAcceptance,
    accept_tree,
    accept_tree_sampled,
    build_tree,
    prefix_lengths,
)
from specdraft.runtime.tree_round import TreeRound, commit_path


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

    def round(self, target, drafter: Drafter, dcache, scache, tcache, anchor: torch.Tensor, params: SamplingParams,
              feature_layers: tuple[int, ...], generator: torch.Generator | None, clock: PhaseClock,
              draft_sampling: str = "sample") -> TreeRound:
        return tree_round(target, drafter, self, dcache, scache, tcache, anchor, params, feature_layers, generator,
                          clock, draft_sampling)

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


class Candidates(NamedTuple):
    tokens: torch.Tensor  # [b, J + 1, K] the first draft, then the second drafter's J branches
    probs: torch.Tensor | None  # [b, J + 1, K, V] the distributions sampled drafts were drawn from (None: argmax)
    proposes: torch.Tensor  # [b, J + 1, K] candidate c drew slot k itself (False on a branch's copied prefix)
    first_logits: torch.Tensor  # [b, K, V] the first drafter's logits
    hidden: torch.Tensor  # [b, Bk, D] the first drafter's hidden states
    branch_logits: torch.Tensor  # [b, J, K, V] the second drafter's logits (its first draft's token ruled out where
    # ``distinct`` rules it out)


def verify_tree(tree: Tree, target_logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None, cands: Candidates | None = None) -> TreeAcceptance:
    """Deterministic drafts (``cands.probs`` None): the target's token at every node (its argmax, or one sample per
    node from the processed distribution) and the walk that follows it (:func:`accept_tree`). Sampled drafts:
    multi-candidate speculative sampling (:func:`accept_tree_sampled`). Both are lossless."""
    if cands is None or cands.probs is None:
        return accept_tree(tree, sample(target_logits, params, generator))
    return accept_tree_sampled(tree, logits_to_probs(target_logits, params), cands.probs, cands.proposes, generator)


def draw_tokens(logits: torch.Tensor, params: SamplingParams, sampled: bool, generator: torch.Generator | None):
    """Tokens and the distribution they were drawn from (argmax and None unless ``sampled``)."""
    if not sampled:
        return logits.argmax(-1), None
    q = logits_to_probs(logits, params)
    return sample_from_probs(q, generator), q


def branch_blocks(anchor: torch.Tensor, first: torch.Tensor, first_logits: torch.Tensor,
                  drafting: TreeDrafting) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the second drafter re-drafts from: the prefix lengths ``[b, J]`` (by the first draft's confidences
    ``max_v q_k(v)``) and the ``J`` blocks ``[b, J, Bk]`` it drafts, ``[anchor, d_1..d_l_j, MASK...]``."""
    confidence = first_logits.float().softmax(-1).amax(-1)  # [b, K]
    lengths = prefix_lengths(confidence, drafting.num_branches, drafting.placement)  # [b, J]
    Bk = first.shape[1] + 1
    known = torch.arange(Bk, device=anchor.device)[None, None, :] <= lengths[:, :, None]  # [b, J, Bk]
    chain = torch.cat([anchor[:, None], first], dim=1)  # [b, Bk]
    return lengths, torch.where(known, chain[:, None, :], drafting.second.config.mask_token_id)  # [b, J, Bk]


def merge_candidates(first: torch.Tensor, first_q: torch.Tensor | None, first_logits: torch.Tensor,
                     hidden: torch.Tensor | None, lengths: torch.Tensor, branch_logits: torch.Tensor,
                     drafting: TreeDrafting, params: SamplingParams, sampled: bool,
                     generator: torch.Generator | None) -> Candidates:
    """The first draft ``[b, K]`` and the second drafter's branches, drawn from its logits ``[b, J, K, V]`` after the
    prefix ``lengths`` ``[b, J]``, whose prefixes are the first draft's tokens exactly."""
    K = first.shape[1]
    known = torch.arange(K, device=first.device)[None, None, :] < lengths[:, :, None]  # [b, J, K] copied slots
    if drafting.distinct:  # rule the first draft's token out at each branch's first free slot
        at = torch.nn.functional.one_hot(lengths, K).bool()  # [b, J, K]
        own = torch.nn.functional.one_hot(first, branch_logits.shape[-1]).bool()[:, None]  # [b, 1, K, V]
        branch_logits = branch_logits.masked_fill(at[..., None] & own, float("-inf"))
    branch, branch_q = draw_tokens(branch_logits, params, sampled, generator)  # [b, J, K], [b, J, K, V] or None
    branch = torch.where(known, first[:, None, :], branch)  # [b, J, K] the prefix is the first draft's
    proposes = torch.cat([torch.ones_like(known[:, :1]), ~known], dim=1)  # [b, J + 1, K]
    probs = torch.cat([first_q[:, None], branch_q], dim=1) if sampled else None  # [b, J + 1, K, V]
    return Candidates(torch.cat([first[:, None], branch], dim=1), probs, proposes, first_logits, hidden,
                      branch_logits)


def draft_candidates(drafter: Drafter, drafting: TreeDrafting, dcache, scache, anchor: torch.Tensor,
                     clock: PhaseClock, params: SamplingParams = SamplingParams(), sampled: bool = False,
                     generator: torch.Generator | None = None) -> Candidates:
    """The first draft and the second drafter's ``J`` re-drafts, whose prefixes are the first draft's tokens
    exactly; drawn from each drafter's processed distribution when ``sampled``, else each drafter's argmax."""
    logits, hidden = draft_block(drafter, dcache, anchor)  # [b, K, V], [b, Bk, D]
    first, first_q = draw_tokens(logits, params, sampled, generator)  # [b, K], [b, K, V] or None
    clock.lap("draft")
    return branch_candidates(drafting, scache, anchor, first, first_q, logits, hidden, clock, params, sampled,
                             generator)


def branch_candidates(drafting: TreeDrafting, scache, anchor: torch.Tensor, first: torch.Tensor,
                      first_q: torch.Tensor | None, logits: torch.Tensor, hidden: torch.Tensor, clock: PhaseClock,
                      params: SamplingParams = SamplingParams(), sampled: bool = False,
                      generator: torch.Generator | None = None) -> Candidates:
    """The second drafter's ``J`` re-drafts of the first draft ``first`` ``[b, K]`` (its ``logits``, ``hidden``),
    and the candidates they make with it."""
    b, Bk = anchor.shape[0], first.shape[1] + 1
    lengths, blocks = branch_blocks(anchor, first, logits, drafting)  # [b, J], [b, J, Bk]
    second = drafting.second
    embeds = second.block_embeds(blocks.flatten(0, 1), None)  # [b * J, Bk, D]
    branch_hidden = second.draft_branches(scache, embeds.view(b, drafting.num_branches, Bk, -1))  # [b, J, Bk, D]
    cands = merge_candidates(first, first_q, logits, hidden, lengths, second.logits(branch_hidden[:, :, 1:]),
                             drafting, params, sampled, generator)
    clock.lap("second_draft")
    return cands


def tree_round(target, drafter: Drafter, drafting: TreeDrafting, dcache, scache, tcache, anchor: torch.Tensor,
               params: SamplingParams, feature_layers: tuple[int, ...], generator: torch.Generator | None,
               clock: PhaseClock, draft_sampling: str = "sample") -> TreeRound:
    """One D²SD round for every active row. The target cache's committed lengths are left for the engine to raise by
    ``num_accepted + 1``; the accepted path's K/V already sit in those slots."""
    sampled = not params.greedy and draft_sampling == "sample"
    cands = draft_candidates(drafter, drafting, dcache, scache, anchor, clock, params, sampled, generator)
    candidates = cands.tokens  # [b, J + 1, K]
    tree = build_tree(anchor, candidates)
    tree = tree.trimmed(int(tree.num_nodes.max()))  # the ragged batch's largest tree (one host read)
    clock.lap("tree")
    out = target(tree.tokens, cache=tcache, positions=tcache.lengths[:, None] + tree.depth, new_mask=tree.mask,
                 feature_layers=feature_layers)  # logits [b, N, V]
    clock.lap("verify")
    acc = verify_tree(tree, out.logits, params, generator, cands)
    clock.lap("walk")
    winner = candidates.gather(1, acc.winner[:, None, None].expand(-1, 1, candidates.shape[-1]))[:, 0]  # [b, K]
    return commit_path(tree.num_nodes, acc, out, tcache, winner, cands.first_logits, cands.hidden, clock)
