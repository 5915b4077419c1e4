"""Merged trees: D²SD's branches and the one-pass tree's paths in one tree, the best ``nodes`` of both by estimated
path probability, verified in one target pass (``decode.method=merged``).

A round drafts as D²SD does (:mod:`specdraft.runtime.d2sd`: the first drafter's block, the second drafter's ``J``
re-drafts from the likely rejection points) and builds the first drafter's best-first tree as a one-pass round does
(:mod:`specdraft.runtime.one_pass`). Every node of either is scored by the probability of its path under the drafter
that proposed it: a one-pass node by the first drafter's per-slot distributions, a branch's node by the first
drafter up to the branch's prefix and the second drafter after it (conditioned on the prefix: the sharper estimate
deep in the block); a path both propose is one node, with the larger score. A score never grows along a path, so
the best ``nodes`` (the root included) form a tree, numbered best-first; a measured budget
(:class:`~specdraft.runtime.node_budget.NodeBudget`) verifies the best prefix of it that pays, down to the drafter's
own block.

Every token is a drafter's ranked token (argmax branches, the first drafter's ranked siblings), so the tree is
deterministic and the walk follows the target's own token at each node (its argmax, or a sample from it): lossless
at every temperature (:func:`~specdraft.runtime.one_pass.accept_nodes`). Under sampling with sampled drafts (the
default) a merged job verifies the one-pass tree of the same budget instead (:func:`samples_drafts`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdraft.runtime.d2sd import Candidates, TreeDrafting, branch_candidates
from specdraft.runtime.drafter import Drafter
from specdraft.runtime.node_budget import NodeBudget
from specdraft.runtime.one_pass import (
    _CHAIN,
    _DEPTH_TIE,
    MAX_NODES,
    OnePassDrafting,
    Shape,
    best_first,
    budget_setting,
    chain_round,
    choose_nodes,
    draft_block,
    node_tokens,
    skips_tree,
    verify_nodes,
)
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.sampling import SamplingParams, logits_to_probs
from specdraft.runtime.tree import build_tree
from specdraft.runtime.tree_round import TreeRound


@dataclass
class MergedDrafting:
    """How a merged round builds its tree (``generate(..., tree=)``; ``decode.method=merged``)."""

    branches: TreeDrafting
    """D²SD's part: the second drafter, its branches and where they start (``decode.tree_k``,
    ``decode.tree_placement``, ``decode.tree_distinct``)."""
    nodes: int = 64
    """``N``: nodes verified per row and round, the root included (``decode.tree_nodes``)."""
    keep_chain: bool = True
    """The first drafter's own block is always in the tree, the best nodes filling the rest (``decode.tree_chain``)."""
    budget: NodeBudget | None = None
    """Set: each round verifies the best prefix of the tree, up to ``nodes``, that maximises expected committed tokens
    per second (``decode.tree_budget=measured``); None: ``nodes`` every round."""

    @property
    def second(self) -> Drafter:
        return self.branches.second

    @property
    def num_branches(self) -> int:
        return self.branches.num_branches

    def max_nodes(self, block_size: int) -> int:
        """Cache slots a round writes past a row's context: its nodes, or the second drafter's ``J`` branch blocks
        when they are more (the static path pads its tree to this size)."""
        return max(self.nodes, self.num_branches * block_size)

    def check(self, first: Drafter) -> None:
        """Raise ``ValueError`` unless the second drafter can branch from ``first``'s blocks into a tree of 2 to
        :data:`~specdraft.runtime.one_pass.MAX_NODES` nodes."""
        self.branches.check(first)
        if not 2 <= self.nodes <= MAX_NODES:
            raise ValueError(f"a merged tree has 2..{MAX_NODES} nodes (the root and at least a draft), not "
                             f"{self.nodes}")

    def round(self, target, drafter: Drafter, dcache, scache, tcache, anchor: torch.Tensor, params: SamplingParams,
              feature_layers: tuple[int, ...], generator: torch.Generator | None, clock: PhaseClock,
              draft_sampling: str = "sample") -> TreeRound:
        return merged_round(target, drafter, self, dcache, scache, tcache, anchor, params, feature_layers, generator,
                            clock)

    def one_pass(self) -> OnePassDrafting:
        """The tree a merged job of sampled drafts verifies: the first drafter's one-pass tree of the same budget
        (:func:`samples_drafts`)."""
        return OnePassDrafting(self.nodes, self.keep_chain, self.budget)


def samples_drafts(params: SamplingParams, draft_sampling: str) -> bool:
    """Whether a merged job verifies the one-pass tree of sampled siblings instead of its merged tree of ranked
    tokens (its second drafter idle): under sampling with sampled drafts (``draft_sampling="sample"``, the default).
    Ranked tokens are accepted with the target's own probability of them, sampled drafts with the overlap of the two
    distributions; the second drafter's sampled branches in the same tree were tried (docs/results.md says how
    they fared)."""
    return not params.greedy and draft_sampling == "sample"


def candidate_log_probs(cands: Candidates, log_q1: torch.Tensor, log_q2: torch.Tensor) -> torch.Tensor:
    """``[b, J + 1, K]`` each candidate's path log-probability up to each slot: its tokens scored by the drafter that
    proposed them (a branch's copied prefix by the first drafter), ``log_q1`` ``[b, K, V]`` and ``log_q2``
    ``[b, J, K, V]`` the two drafters' log-distributions."""
    tokens = cands.tokens  # [b, J + 1, K]
    first = log_q1.gather(2, tokens[:, 0, :, None])[..., 0]  # [b, K]
    own = log_q2.gather(3, tokens[:, 1:, :, None])[..., 0]  # [b, J, K]
    branch = torch.where(cands.proposes[:, 1:], own, first[:, None])  # [b, J, K]
    return torch.cat([first[:, None], branch], 1).double().cumsum(-1)


def one_pass_part(q1: torch.Tensor, nodes: int, keep_chain: bool = True) -> tuple[Shape, torch.Tensor]:
    """The first drafter's best-first tree of ``nodes`` over ``q1`` ``[b, K, V]`` and each slot's tokens by rank
    ``[b, K, W]``: a merged tree's one-pass part."""
    top, ranked = q1.topk(min(nodes - 1, q1.shape[-1]), dim=-1)  # [b, K, W]
    return best_first(top, nodes, keep_chain), ranked


def merged_shape(anchor: torch.Tensor, cands: Candidates, one: Shape, ranked: torch.Tensor, q1: torch.Tensor,
                 q2: torch.Tensor, keep_chain: bool = True) -> tuple[Shape, torch.Tensor]:
    """The best non-root nodes of D²SD's candidates and the first drafter's best-first tree ``one`` (as many as it
    has), best-first: ``(shape, tokens)``. Pure tensor code of fixed shapes, no host read.

    Args:
        cands: the first draft and the second drafter's branches ``[b, J + 1, K]``.
        one, ranked: :func:`one_pass_part`'s tree and ranked tokens.
        q1: ``[b, K, V]`` the first drafter's distributions; q2: ``[b, J, K, V]`` the second drafter's per branch.
        keep_chain: the first draft's nodes come first, as deep as the budget allows.
    """
    b, K, _ = q1.shape
    M, W, dev = one.parent.shape[1], ranked.shape[-1], q1.device
    rows = torch.arange(b, device=dev)[:, None]
    one_tok = node_tokens(one, ranked, None, None)  # [b, M]
    # D²SD's candidates as one prefix tree (node ids 1..C*K, parents first)
    dtree = build_tree(anchor, cands.tokens)
    Nd = dtree.tokens.shape[1]
    node_of, parent_of = dtree.node_of.flatten(1), dtree.parent_of.flatten(1)  # [b, C * K]
    lp = candidate_log_probs(cands, q1.log(), q2.log()).flatten(1)  # [b, C * K]
    d_lp = lp.new_full((b, Nd), float("-inf")).scatter_reduce(1, node_of, lp, "amax")  # [b, Nd] best candidate's
    d_parent = torch.zeros(b, Nd, dtype=torch.long, device=dev).scatter(1, node_of, parent_of)  # [b, Nd]
    d_real = torch.arange(Nd, device=dev) < dtree.num_nodes[:, None]  # [b, Nd]
    # each D²SD node's twin in the one-pass tree (-1: none), found level by level through the children by rank
    children = torch.zeros(b, (M + 1) * W + 1, dtype=torch.long, device=dev)
    children[rows, torch.where(one.valid, one.parent * W + one.rank, (M + 1) * W)] = torch.arange(
        1, M + 1, device=dev).expand(b, M)
    children = children[:, :-1].view(b, M + 1, W)  # [b, M + 1, W] one-pass node ids by (parent, rank); 0: none
    at_rank = ranked.gather(1, (dtree.depth - 1).clamp_min(0)[:, :, None].expand(-1, -1, W)) == dtree.tokens[
        :, :, None]  # [b, Nd, W]
    ranked_at, rank = at_rank.any(-1), at_rank.long().argmax(-1)  # [b, Nd]
    twin = torch.where(torch.arange(Nd, device=dev) == 0, 0, -1).expand(b, Nd)
    for d in range(1, K + 1):
        up = twin.gather(1, d_parent)  # [b, Nd] the parent's twin
        kid = children[rows, up.clamp_min(0), rank]  # [b, Nd]
        found = (up >= 0) & ranked_at & (kid > 0) & d_real
        twin = torch.where(dtree.depth == d, torch.where(found, kid, -1), twin)
    # the union: the root, the one-pass nodes 1..M, then D²SD's nodes without a twin at M + id
    d_union = torch.where(twin >= 0, twin, M + torch.arange(Nd, device=dev))  # [b, Nd]
    parent = torch.cat([one.parent.new_zeros(b, 1), one.parent, d_union.gather(1, d_parent)[:, 1:]], 1)  # [b, U]
    tok = torch.cat([anchor[:, None], one_tok, dtree.tokens[:, 1:]], 1)  # [b, U]
    depth = torch.cat([one.depth.new_zeros(b, 1), one.depth, dtree.depth[:, 1:]], 1)  # [b, U]
    valid = torch.cat([torch.zeros_like(one.valid[:, :1]), one.valid, (d_real & (twin < 0))[:, 1:]], 1)  # [b, U]
    score = torch.cat([lp.new_zeros(b, 1), torch.where(one.valid, one.log_prob, float("-inf")), d_lp[:, 1:]], 1)
    score = score.scatter_reduce(1, d_union, d_lp, "amax")  # a twin takes the larger estimate
    chain = torch.zeros_like(valid).scatter(1, d_union.gather(1, dtree.node_of[:, 0]), True)  # the first draft's
    key = score - depth * _DEPTH_TIE + (_CHAIN if keep_chain else 0.0) * chain  # [b, U]
    key, pick = torch.where(valid & (score > float("-inf")), key, float("-inf")).topk(M, dim=-1)  # [b, M]
    real = key > float("-inf")
    # renumber best-first: the picked nodes 1..M, each parent picked (and numbered) before its children
    new_id = torch.zeros(b, tok.shape[1] + 1, dtype=torch.long, device=dev)
    new_id[rows, torch.where(real, pick, tok.shape[1])] = torch.arange(1, M + 1, device=dev).expand(b, M)
    new_parent = torch.where(real, new_id.gather(1, parent.gather(1, pick)), 0)  # [b, M]
    earlier = torch.ones(M, M, dtype=torch.bool, device=dev).tril(-1)  # [M, M] j < i
    rank = ((new_parent[:, :, None] == new_parent[:, None, :]) & real[:, None, :] & earlier).sum(-1)  # [b, M]
    shape = Shape(new_parent, torch.where(real, rank, 0), depth.gather(1, pick), real,
                  torch.where(real, score.gather(1, pick), float("-inf")))
    return shape, tok.gather(1, pick)


def walk_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """A drafter's distributions as the walk's target samples them (processed as the target's are; at T=0 the
    softmax): what a node's score estimates its acceptance by."""
    return logits.float().softmax(-1) if params.greedy else logits_to_probs(logits, params)


def padded(shape: Shape, tokens: torch.Tensor, count: int) -> tuple[Shape, torch.Tensor]:
    """``shape`` and ``tokens`` with padding nodes up to ``count`` non-root nodes (a fixed verify shape)."""
    extra = count - tokens.shape[1]
    if extra <= 0:
        return shape, tokens
    zeros = tokens.new_zeros(tokens.shape[0], extra)  # [b, extra]
    pad = Shape(zeros, zeros, zeros, zeros.bool(), torch.full(zeros.shape, float("-inf"), dtype=shape.log_prob.dtype,
                                                                device=zeros.device))
    return Shape(*(torch.cat([x, p], 1) for x, p in zip(shape, pad))), torch.cat([tokens, zeros], 1)


def merged_round(target, drafter: Drafter, drafting: MergedDrafting, dcache, scache, tcache, anchor: torch.Tensor,
                 params: SamplingParams, feature_layers: tuple[int, ...], generator: torch.Generator | None,
                 clock: PhaseClock) -> TreeRound:
    """One merged round for every active row (the accepted path's K/V already moved into the committed slots, the
    lengths left for the engine to raise).

    With a measured budget that keeps the chain, the budget first prices the first drafter's own one-pass tree (a
    merged tree's best nodes are at least as likely): where even that picks the chain, the round is a chain round
    and the second drafter does not draft."""
    started = time.perf_counter()
    logits, hidden = draft_block(drafter, dcache, anchor)  # [b, K, V], [b, Bk, D]
    first = logits.argmax(-1)  # [b, K] ranked drafts
    clock.lap("draft")
    q1, budget = walk_probs(logits, params), drafting.budget
    if skips_tree(drafting, logits.shape[1]):
        return chain_round(target, budget, first, None, logits, hidden, tcache, anchor, params, feature_layers,
                           generator, clock, started)
    one, ranked = one_pass_part(q1, drafting.nodes, drafting.keep_chain)
    if budget is not None and drafting.keep_chain:
        n = choose_nodes(budget, one, tcache, budget_setting(params, None), clock)
        if n == budget.choices[0]:
            return verify_nodes(target, drafting, one, lambda s: node_tokens(s, ranked, None, None), lambda: first,
                                None, logits, hidden, tcache, anchor, params, feature_layers, generator, clock,
                                started, n)
    cands = branch_candidates(drafting.branches, scache, anchor, first, None, logits, hidden, clock)
    shape, tokens = merged_shape(anchor, cands, one, ranked, q1, walk_probs(cands.branch_logits, params),
                                 drafting.keep_chain)
    return verify_nodes(target, drafting, shape, lambda s: tokens[:, :s.parent.shape[1]], lambda: first, None,
                        logits, hidden, tcache, anchor, params, feature_layers, generator, clock, started)
