"""One-pass draft trees (the idea of DDTree, arXiv:2604.12989; our own implementation): the tree comes from ONE
block-diffusion pass of the first drafter, its per-slot distributions ``q_1..q_K`` expanded best-first by path
probability under a fixed node budget, and is verified in one target pass (tree attention as in SpecInfer,
arXiv:2305.09781).

Shapes: ``b`` rows, ``K`` draft slots, ``N`` nodes per row (the root, the anchor, is node 0; ``M = N - 1``), ``W``
children ranks per node (``min(M, V)``). A node at depth ``d`` continues its parent with one of the ``W`` tokens of
``q_d``; its child of rank ``j`` scores ``log q_d`` of the ``j``-th most likely token. The tree's SHAPE (which ranks
each node expands) is the best-first tree of ``M`` nodes by path log-probability (:func:`best_first`): a function of
the drafter's distributions alone. Its tokens are

- the ranked tokens themselves (greedy verification, or argmax drafts under sampling): the walk follows the target's
  own token at each node (:func:`accept_nodes`), lossless for any deterministic tree;
- under sampling with ``draft_sampling="sample"``, a node's ``j``-th child is the ``j``-th token drawn WITHOUT
  replacement from ``q_d`` (Gumbel top-k, one draw a slot: :func:`node_tokens`): the walk runs recursive rejection
  sampling for siblings drawn without replacement (:func:`accept_nodes_sampled`; Jeon et al., arXiv:2402.14160),
  exact because the shape does not depend on the drawn tokens.

Pure tensor code with a few host reads per round (the tree's widest fan-out, the sampled walk's count of nodes with
a ``j``-th child, and a measured budget's choice); no loop over the tree's depth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from specdraft.runtime.drafter import Drafter
from specdraft.runtime.node_budget import NodeBudget
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.sampling import SamplingParams, logits_to_probs, sample, sample_from_probs, sample_residual
from specdraft.runtime.tree import TreeAcceptance
from specdraft.runtime.tree_round import TreeRound, commit_path
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling

_DEPTH_TIE, _RANK_TIE = 1e-9, 1e-12
"""Float64 tie-breakers of the best-first keys: a child ranks strictly below its parent and a sibling strictly below
its elder, so the chosen nodes always form a tree whose siblings are ranks ``0..m-1`` (while ``W * _RANK_TIE`` stays
below ``_DEPTH_TIE``: at most :data:`MAX_NODES` nodes)."""
MAX_NODES = 1000
_CHAIN = 1e6
"""Added to the keys of the rank-0 chain's nodes when it is kept (larger than any path's negative log-probability
spread, small enough for float64 to keep the tie-breakers)."""


@dataclass
class OnePassDrafting:
    """How a one-pass round builds its tree (``generate(..., tree=)``; ``decode.method=ddtree``)."""

    nodes: int = 32
    """``N``: nodes verified per row and round, the root included (``decode.tree_nodes``)."""
    keep_chain: bool = True
    """The drafter's own block (its most likely token at every slot) is always in the tree, the best-first nodes
    filling the rest of the budget, so a round accepts at least what a chain round would under greedy verification
    (``decode.tree_chain``). Off: the ``N`` most likely paths alone, as DDTree builds them."""
    budget: NodeBudget | None = None
    """Set: each round verifies the budget up to ``nodes`` that maximises expected committed tokens per second
    (``decode.tree_budget=measured``); None: ``nodes`` every round."""
    second = None  # no second drafter: the tree is the first drafter's

    def max_nodes(self, block_size: int) -> int:
        return self.nodes

    def check(self, first: Drafter) -> None:
        if not 2 <= self.nodes <= MAX_NODES:
            raise ValueError(f"a one-pass tree has 2..{MAX_NODES} nodes (the root and at least a draft), not "
                             f"{self.nodes}")

    def round(self, target, drafter: Drafter, dcache, scache, tcache, anchor: torch.Tensor, params: SamplingParams,
              feature_layers: tuple[int, ...], generator: torch.Generator | None, clock: PhaseClock,
              draft_sampling: str = "sample"):
        return one_pass_round(target, drafter, self, dcache, tcache, anchor, params, feature_layers, generator,
                              clock, draft_sampling)


class Shape(NamedTuple):
    """The best-first tree's non-root nodes ``1..M``, in best-first order (every parent before its children)."""

    parent: torch.Tensor  # [b, M] node id of the parent (0 = root)
    rank: torch.Tensor  # [b, M] the node's rank among its parent's children (0 = the most likely token)
    depth: torch.Tensor  # [b, M] 1..K
    valid: torch.Tensor  # [b, M] False: no such node (its path has probability 0); a padding node
    log_prob: torch.Tensor  # [b, M] float64 log of the path's probability (-inf: padding)

    def first(self, count: int) -> "Shape":
        """The best tree of ``count`` non-root nodes (best-first order keeps parents before children)."""
        return Shape(*(x[:, :count] for x in self))


def best_first(top_probs: torch.Tensor, num_nodes: int, keep_chain: bool = False) -> Shape:
    """The ``num_nodes - 1`` most likely non-root nodes, a node's probability being the product of ``q_k`` of the
    ranked tokens along its path (conditionally independent slots, as one block-diffusion pass gives them).

    The set is found level by level: the best ``M`` nodes of depth ``d`` extend the best ``M`` of depth ``d - 1``
    (a child is never likelier than its parent), so the best ``M`` of all levels are the best ``M`` overall.

    Args:
        top_probs: ``[b, K, W]`` each slot's ``W`` largest probabilities, descending.
        keep_chain: the rank-0 chain (the drafter's own block: what a chain round verifies) comes first, as deep as
            the budget allows; the best-first nodes fill the rest.
    """
    b, K, W = top_probs.shape
    M, dev = num_nodes - 1, top_probs.device
    if W > MAX_NODES:
        raise ValueError(f"{W} ranks per slot: at most {MAX_NODES} keep the tie-breakers exact")
    logq = top_probs.double().log()  # [b, K, W]
    rank_tie = torch.arange(W, device=dev, dtype=torch.float64) * _RANK_TIE  # [W]
    boost = _CHAIN if keep_chain else 0.0
    level_log = logq.new_full((b, M), float("-inf"))  # [b, M] path log-probabilities of the level's nodes
    level_log[:, :W] = logq[:, 0, :M]
    level_parent = torch.full((b, M), -1, dtype=torch.long, device=dev)  # index in the previous level (-1: root)
    level_rank = torch.arange(M, device=dev).clamp_max(W - 1).expand(b, M)  # [b, M] (past W: -inf, never real)
    chain = level_rank == 0  # [b, M] the level's chain node
    key = level_log - _DEPTH_TIE - rank_tie[level_rank] + boost * chain
    logs, keys, parents, ranks = [level_log], [key], [level_parent], [level_rank]
    # the level's i-th parent (by key) and rank j can be among its best M children only if the i * (j + 1) pairs
    # (i', j') with 1 <= i' <= i, j' <= j, which beat it, are fewer than M; parent 0 (the chain's, when boosted) keeps
    # every rank
    i, j = torch.arange(M, device=dev)[:, None], torch.arange(W, device=dev)[None, :]
    pi, pj = ((i == 0) | (i * (j + 1) <= M)).nonzero(as_tuple=True)  # [P] candidate (parent, rank) pairs
    for d in range(1, K):
        cand = level_log[:, pi] + logq[:, d, pj]  # [b, P]
        cand_chain = chain[:, pi] & (pj == 0)  # [b, P]
        cand_key = cand - (d + 1) * _DEPTH_TIE - rank_tie[pj] + boost * cand_chain
        key, at = cand_key.topk(M, dim=-1)  # [b, M]
        level_log, level_parent, level_rank = cand.gather(1, at), pi[at], pj[at]
        chain = cand_chain.gather(1, at)
        logs.append(level_log), keys.append(key), parents.append(level_parent), ranks.append(level_rank)
    key = torch.stack(keys, 1).flatten(1)  # [b, K * M]
    best = key.topk(M, dim=-1).indices  # [b, M] descending: a parent always before its children
    level = best // M  # [b, M]
    node_id = torch.zeros(b, K * M, dtype=torch.long, device=dev)
    node_id.scatter_(1, best, torch.arange(1, M + 1, device=dev).expand(b, M))  # (level, pos) -> node id (0: none)
    parent_pos = torch.stack(parents, 1).flatten(1).gather(1, best)  # [b, M] position in level - 1
    parent = torch.where(level > 0, node_id.gather(1, ((level - 1) * M + parent_pos).clamp_min(0)), 0)
    rank = torch.stack(ranks, 1).flatten(1).gather(1, best)
    log_prob = torch.stack(logs, 1).flatten(1).gather(1, best)  # [b, M]
    valid = log_prob > float("-inf")
    return Shape(torch.where(valid, parent, 0), rank, level + 1, valid, log_prob)


class NodeTree(NamedTuple):
    """A one-pass tree per row (padding nodes see the root and themselves at depth 0; no real node sees them and
    none is ever accepted)."""

    tokens: torch.Tensor  # [b, N] node tokens (the anchor at node 0)
    depth: torch.Tensor  # [b, N] depth (0 = root)
    mask: torch.Tensor  # [b, N, N] bool ancestor-or-self mask
    num_nodes: torch.Tensor  # [b] real nodes (root included)
    children: torch.Tensor  # [b, N, W] node ids of each node's children by rank (0: none)
    parent: torch.Tensor  # [b, N] (the root's and padding nodes': 0)
    rank: torch.Tensor  # [b, N] a node's rank among its siblings (0: the drafter's likeliest token there)


def build_nodes(anchor: torch.Tensor, shape: Shape, tokens: torch.Tensor, max_depth: int,
                width: int | None = None) -> NodeTree:
    """The tree of ``shape`` with non-root node tokens ``tokens`` ``[b, M]`` (``width``: children a node holds at
    most, for a tree built without reading the shape on the host; default the shape's widest)."""
    b, M = tokens.shape
    N, dev = M + 1, tokens.device
    W = width or (int(shape.rank.max()) + 1 if M else 1)
    rows = torch.arange(b, device=dev)[:, None]
    ids = torch.arange(1, N, device=dev).expand(b, M)
    node_tokens = torch.cat([anchor[:, None], torch.where(shape.valid, tokens, anchor[:, None])], 1)  # [b, N]
    depth = torch.cat([shape.depth.new_zeros(b, 1), torch.where(shape.valid, shape.depth, 0)], 1)  # [b, N]
    parent = torch.cat([shape.parent.new_zeros(b, 1), shape.parent], 1)  # [b, N] (the root's: itself)
    mask = torch.eye(N, dtype=torch.bool, device=dev).repeat(b, 1, 1)  # [b, N, N] within distance 0
    mask[:, :, 0] = True
    up = parent  # [b, N] the ancestor 2^t steps up (the root stays the root)
    for _ in range(max(max_depth - 1, 0).bit_length()):  # pointer doubling: within 2^(t+1) - 1 steps
        mask = mask | mask.gather(1, up[:, :, None].expand(b, N, N))
        up = up.gather(1, up)
    slot = torch.where(shape.valid, shape.parent * W + shape.rank, N * W)  # [b, M] (padding -> a dropped slot)
    flat = torch.zeros(b, N * W + 1, dtype=torch.long, device=dev)
    flat[rows, slot] = ids
    children = flat[:, :-1].view(b, N, W)
    rank = torch.cat([shape.rank.new_zeros(b, 1), torch.where(shape.valid, shape.rank, 0)], 1)  # [b, N]
    return NodeTree(node_tokens, depth, mask, 1 + shape.valid.sum(-1), children, parent, rank)


def draw_without_replacement(q: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``[..., count]`` tokens drawn one after another without replacement from ``q`` ``[..., V]`` (Gumbel top-k in
    its exponential form: the order of ``q / E``, ``E ~ Exp(1)``, is the order of ``log q + G``, that sequential
    draw); draws past ``q``'s support are arbitrary tokens of probability 0 (a shape never asks for them)."""
    e = torch.empty_like(q, dtype=torch.float64).exponential_(generator=generator).clamp_min(1e-300)
    return (q.double() / e).topk(count, dim=-1).indices  # probability 0: key 0, never before a possible token


def accept_nodes(tree: NodeTree, node_targets: torch.Tensor, max_depth: int | None = None) -> TreeAcceptance:
    """From the root, move to the child whose token is the target's token at the current node, until none is; that
    token follows the accepted path (greedy verification with argmax targets; with one SAMPLE per node, lossless
    speculative sampling for deterministic siblings, as :func:`~specdraft.runtime.tree.accept_tree`).

    Args:
        node_targets: ``[b, N]`` the target's token after each node.
        max_depth: the tree's depth at most (default: read from the tree on the host).
    Returns:
        ``winner`` 1 where the accepted path leaves the rank-0 children (a sibling won), else 0.
    """
    moves = tree.tokens == node_targets.gather(1, tree.parent)  # [b, N] siblings are distinct: one at most
    last, num_accepted, path, sibling = follow_moves(tree, moves, max_depth)
    return TreeAcceptance(num_accepted, node_targets.gather(1, last[:, None])[:, 0], sibling, path)


def follow_moves(tree: NodeTree, moves: torch.Tensor, max_depth: int | None = None):
    """The walk from the root that moves, at each node, to the child marked in ``moves`` ``[b, N]`` (at most one
    child of a node is; padding nodes never are): ``(last [b], num_accepted [b], path [b, N], sibling [b])``, the
    node it stops at, its depth, the path's node at each depth (past it the last node), and whether the path leaves
    the rank-0 children.

    Vectorised: a node is on the path when it and each of its ancestors are marked, found by pointer doubling over
    the parents (not the attention mask); the walk stops at the deepest of them.
    """
    b, N = moves.shape
    real = torch.arange(N, device=moves.device) < tree.num_nodes[:, None]  # [b, N]
    on_path = moves & real  # every node within 2^t - 1 steps up is marked
    on_path[:, 0] = True  # the root is committed
    up = tree.parent  # [b, N] the ancestor 2^t steps up
    for _ in range((max_depth if max_depth is not None else int(tree.depth.max())).bit_length()):
        on_path, up = on_path & on_path.gather(1, up), up.gather(1, up)
    depth = torch.where(on_path, tree.depth, -1)  # [b, N]
    last = depth.argmax(-1)  # [b] the deepest node on the path (the root when no draft is accepted)
    num_accepted = tree.depth.gather(1, last[:, None])[:, 0]
    path = last.new_zeros(b, N + 1)  # by depth: the path's node there (column N takes the other nodes)
    path.scatter_(1, torch.where(on_path, tree.depth, N), torch.arange(N, device=last.device).expand(b, N))
    steps = torch.arange(N, device=last.device)
    path = torch.where(steps <= num_accepted[:, None], path[:, :N], last[:, None])  # [b, N] past it: the last node
    return last, num_accepted, path, (on_path & (tree.rank > 0)).any(-1).long()


def rest_mass(qx: torch.Tensor) -> torch.Tensor:
    """``[..., W]`` the mass of ``q`` left when the ``j``-th sibling is drawn: one minus the earlier siblings'
    ``q(x_0..x_{j-1})`` (``qx`` ``[..., W]`` in draw order); the ``j``-th sibling was drawn from ``q`` without them,
    ``q(x_j) / rest_mass_j``."""
    return (1.0 - (qx.cumsum(-1) - qx)).clamp_min(1e-30)


def residual_offsets(p: torch.Tensor, q: torch.Tensor, rest: torch.Tensor, live: list[int]) -> tuple[torch.Tensor, ...]:
    """After the first ``j`` siblings of a node are rejected, the target's distribution there is
    ``relu(p - T_j q) / S_j``: each rejection of a sibling ``x`` drawn from ``q_j = q / rest_j`` (the earlier siblings
    out) turns ``p_j`` into ``norm(relu(p_j - q_j))``, and ``relu(relu(a) - c) = relu(a - c)`` for ``c >= 0``, so
    ``T_{j+1} = T_j + S_j / rest_j`` (the rejected siblings' own mass is already 0 there). ``T_0 = 0`` and
    ``S_0 = 1``.

    Args:
        p, q: ``[..., F, V]`` the target's distribution at ``F`` nodes and the distribution their children were drawn
            from, the nodes with the most children first.
        rest: ``[..., F, W]`` :func:`rest_mass` of the nodes' children.
        live: for each rejection ``j < W``, how many of the leading nodes have a ``j``-th child (``S_j`` is summed
            over the vocabulary there only; 1 elsewhere, where it is never read).
    Returns:
        ``(T, S)`` ``[..., F, W + 1]`` and ``[..., F, W]``.
    """
    T, S = [torch.zeros_like(rest[..., 0])], [torch.ones_like(rest[..., 0])]
    for j in range(len(live)):
        T.append(T[j] + S[j] / rest[..., j])
        if j + 1 < len(live):
            n = live[j + 1]
            mass = (p[..., :n, :] - T[j + 1][..., :n, None].to(p.dtype) * q[..., :n, :]).clamp_min(0).sum(-1)
            S.append(torch.cat([mass.to(rest.dtype), S[0][..., n:]], -1))
    return torch.stack(T, -1), torch.stack(S, -1)


def accept_nodes_sampled(tree: NodeTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                         generator: torch.Generator | None = None) -> TreeAcceptance:
    """Recursive rejection sampling down a tree whose siblings were drawn WITHOUT replacement from ``q_d``: at the
    current node its children ``x_0, x_1, ..`` are tried in draw order, ``x_j`` accepted with probability
    ``min(1, p_j(x_j) / q_j(x_j))`` where ``q_j`` is ``q_d`` without ``x_0..x_{j-1}`` (renormalised: what ``x_j`` was
    drawn from) and ``p_j`` the target's distribution after the ``j`` rejections (:func:`residual_offsets`). When
    every child is rejected a token is drawn from what is left of ``p`` and the walk stops. Every emitted token is
    distributed as the target's (Jeon et al., arXiv:2402.14160).

    Vectorised: which child the walk would move to is decided at every node at once, each with its own uniforms
    (it visits one node per depth, so deciding the others too changes no law), and the walk follows those moves
    (:func:`follow_moves`); a residual's mass is summed only at the nodes with a sibling left to try. One host read
    (how many nodes of a row have a ``j``-th child, for each ``j``).

    Args:
        target_probs: ``[b, N, V]`` the target's processed distribution after each node.
        draft_probs: ``[b, K, V]`` the first drafter's processed distribution ``q_d`` per slot.
    """
    b, N, _ = tree.children.shape
    K, V = draft_probs.shape[1:]
    dev = target_probs.device
    rows = torch.arange(b, device=dev)[:, None]
    fanout = (tree.children > 0).sum(-1)  # [b, N]
    live = [n for n in (fanout[:, :, None] > torch.arange(tree.children.shape[-1], device=dev)).sum(1).amax(0).tolist()
            if n]  # [W] nodes a row with a j-th child, at most
    W = max(len(live), 1)
    kids = tree.children[:, :, :W]  # [b, N, W] node ids by draw order (0: none)
    slot = tree.depth.clamp_max(K - 1)  # [b, N] the slot the node's children were drawn at
    x = tree.tokens.gather(1, kids.flatten(1)).view(kids.shape)  # [b, N, W]
    qx = draft_probs[rows[:, :, None], slot[:, :, None], x].double()  # [b, N, W]
    px = target_probs.gather(2, x).double()  # [b, N, W]
    rest = rest_mass(qx)  # [b, N, W]
    T, S = residual_offsets(target_probs, draft_probs, rest, [N])  # every node's first rejection: no mass to sum
    T, S = torch.nn.functional.pad(T, (0, W - 1)), torch.nn.functional.pad(S, (0, W - 1), value=1.0)  # [b, N, W + 1]
    if W > 1:  # the nodes with several children, the most first
        at = torch.sort(fanout, dim=-1, descending=True, stable=True).indices[:, :live[1]]  # [b, F]
        p_at = target_probs.gather(1, at[:, :, None].expand(-1, -1, V))  # [b, F, V]
        q_at = draft_probs.gather(1, slot.gather(1, at)[:, :, None].expand(-1, -1, V))  # [b, F, V]
        T_at, S_at = residual_offsets(p_at, q_at, rest.gather(1, at[:, :, None].expand(-1, -1, W)), live)
        T.scatter_(1, at[:, :, None].expand(-1, -1, W + 1), T_at)
        S.scatter_(1, at[:, :, None].expand(-1, -1, W), S_at)
    u = torch.rand(b, N, W, generator=generator, device=dev, dtype=torch.float64)
    tried = torch.arange(W, device=dev) < fanout[:, :, None]  # [b, N, W]
    ok = tried & (u * qx * S < rest * (px - T[..., :W] * qx).clamp_min(0))  # u < p_j(x_j) / q_j(x_j); none if S is 0
    moved = ok.any(-1)  # [b, N]
    to = torch.where(moved, kids.gather(2, ok.long().argmax(-1, keepdim=True))[..., 0], 0)  # [b, N] first accepted
    moves = to.gather(1, tree.parent) == torch.arange(N, device=dev)  # [b, N]
    last, num_accepted, path, sibling = follow_moves(tree, moves, K)
    stop = last[:, None]  # [b, 1]
    offset = T.gather(1, stop[:, :, None].expand(-1, -1, W + 1))[:, 0].gather(1, fanout.gather(1, stop))  # [b, 1]
    p = target_probs[rows[:, 0], last]  # [b, V]
    left = (p - offset.to(p.dtype) * draft_probs[rows[:, 0], slot.gather(1, stop)[:, 0]]).clamp_min(
        0)  # [b, V] the target's distribution after every child of the last node failed
    next_token = sample_residual(left, p, generator)
    return TreeAcceptance(num_accepted, next_token, sibling, path)


def draft_block(drafter: Drafter, dcache, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first drafter's one pass over ``[anchor, MASK x K]``: ``(logits [b, K, V], hidden [b, Bk, D])``."""
    b, Bk = anchor.shape[0], drafter.block_size
    block = torch.full((b, Bk), drafter.config.mask_token_id, dtype=torch.long, device=anchor.device)
    block[:, 0] = anchor
    hidden = drafter.draft_hidden(dcache, drafter.block_embeds(block, None))  # [b, Bk, D]
    return drafter.logits(hidden[:, 1:]), hidden


def tree_shape(q: torch.Tensor, drafting: OnePassDrafting):
    """``(shape, ranked [b, K, W])``: the best-first tree over ``q`` ``[b, K, V]`` at the drafting's node budget, and
    each slot's tokens by rank."""
    W = min(drafting.nodes - 1, q.shape[-1])
    top, ranked = q.topk(W, dim=-1)  # [b, K, W]
    return best_first(top, drafting.nodes, drafting.keep_chain), ranked


def node_tokens(shape: Shape, ranked: torch.Tensor, q: torch.Tensor | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """``[b, M]`` the non-root nodes' tokens: each node's ranked token, or with ``q`` (sampled siblings) the node's rank
    in one draw without replacement from ``q`` at its slot. The draw is one a slot, shared by the slot's parents: the
    walk tries the children of one node a depth, and each depth's draw is independent of the shallower ones it got
    there by, so the children it tries are a fresh draw wherever it stands."""
    slot = (shape.depth - 1).clamp_min(0)  # [b, M] the slot a node's token fills
    if q is not None:
        ranked = draw_without_replacement(q, min(ranked.shape[-1], max(shape.parent.shape[1], 1)), generator)
    return ranked.gather(1, slot[:, :, None].expand(-1, -1, ranked.shape[-1])).gather(
        2, shape.rank[:, :, None])[..., 0]


def one_pass_round(target, drafter: Drafter, drafting: OnePassDrafting, dcache, tcache, anchor: torch.Tensor,
                   params: SamplingParams, feature_layers: tuple[int, ...], generator: torch.Generator | None,
                   clock: PhaseClock, draft_sampling: str = "sample") -> TreeRound:
    """One one-pass round for every active row (the accepted path's K/V already moved into the committed slots, the
    lengths left for the engine to raise)."""
    sampled = not params.greedy and draft_sampling == "sample"
    started = time.perf_counter()
    logits, hidden = draft_block(drafter, dcache, anchor)  # [b, K, V], [b, Bk, D]
    clock.lap("draft")
    q = logits_to_probs(logits, params) if sampled else logits.float().softmax(-1)  # [b, K, V]
    def chain() -> torch.Tensor:  # [b, K] the drafter's own block
        return sample_from_probs(q, generator) if sampled else logits.argmax(-1)
    if skips_tree(drafting, logits.shape[1]):
        return chain_round(target, drafting.budget, chain(), q if sampled else None, logits, hidden, tcache, anchor,
                           params, feature_layers, generator, clock, started)
    shape, ranked = tree_shape(q, drafting)
    def tokens(verified: Shape) -> torch.Tensor:  # [b, M]
        return node_tokens(verified, ranked, q if sampled else None, generator)
    return verify_nodes(target, drafting, shape, tokens, chain, q if sampled else None, logits, hidden, tcache,
                        anchor, params, feature_layers, generator, clock, started)


def verify_chain(target, draft_tokens: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, tcache,
                 anchor: torch.Tensor, params: SamplingParams, feature_layers: tuple[int, ...],
                 generator: torch.Generator | None, clock: PhaseClock):
    """``(acceptance, target output)``: the target's causal pass over ``[anchor, draft_tokens]`` (``[b, K]``) and
    its acceptance (sampled drafts drawn from ``q``; None: deterministic ones), as a chain round's."""
    b, K = draft_tokens.shape
    out = target(torch.cat([anchor[:, None], draft_tokens], 1), cache=tcache, feature_layers=feature_layers)
    if params.greedy:
        n_acc, nxt = accept_greedy(draft_tokens, out.logits)
    else:
        own = q if q is not None else torch.nn.functional.one_hot(draft_tokens, logits.shape[-1]).float()
        n_acc, nxt = accept_speculative_sampling(draft_tokens, own, logits_to_probs(out.logits, params), generator)
    path = torch.arange(K + 1, device=anchor.device).expand(b, -1)  # [b, K + 1]
    clock.lap("verify")  # a chain's acceptance is the verify phase's, as in a chain round
    return TreeAcceptance(n_acc, nxt, torch.zeros_like(n_acc), path), out


def skips_tree(drafting, K: int) -> bool:
    """Whether this round verifies the drafter's block of ``K`` drafts without building the tree: a measured budget
    that keeps the chain says so (:meth:`~specdraft.runtime.node_budget.NodeBudget.builds_tree`)."""
    budget = drafting.budget
    return (budget is not None and drafting.keep_chain and budget.choices[0] == K + 1
            and not budget.builds_tree())


def chain_round(target, budget: NodeBudget, draft_tokens: torch.Tensor, q: torch.Tensor | None,
                logits: torch.Tensor, hidden: torch.Tensor, tcache, anchor: torch.Tensor, params: SamplingParams,
                feature_layers: tuple[int, ...], generator: torch.Generator | None, clock: PhaseClock,
                started: float) -> TreeRound:
    """A round that verifies the drafter's block ``draft_tokens`` ``[b, K]`` with no tree built (the measured
    ``budget`` said so: :meth:`~specdraft.runtime.node_budget.NodeBudget.builds_tree`)."""
    b, K = draft_tokens.shape
    context = float(tcache.lengths.float().mean())
    acc, out = verify_chain(target, draft_tokens, q, logits, tcache, anchor, params, feature_layers, generator,
                            clock)
    rnd = commit_path(torch.full_like(acc.num_accepted, K + 1), acc, out, tcache, draft_tokens, logits, hidden, clock)
    budget.observe_committed("chain", float(acc.num_accepted.sum()), K + 1, b, context, time.perf_counter() - started)
    return rnd


def budget_setting(params: SamplingParams, q: torch.Tensor | None) -> str:
    """The sampling setting a budget's calibration is kept for (sampled siblings or ranked tokens apart)."""
    return f"{params}/{'sample' if q is not None else 'ranked'}"


def choose_nodes(budget: NodeBudget, shape: Shape, tcache, setting: str, clock: PhaseClock) -> int:
    """The nodes the measured ``budget`` verifies of the best-first tree ``shape`` this round (its own phase on the
    clock)."""
    clock.lap("tree")
    probs = torch.where(shape.valid, shape.log_prob.exp(), 0.0)  # [b, M]
    n = budget.choose(probs, float(tcache.lengths.float().mean()), setting)
    clock.lap("budget")
    return n


def verify_nodes(target, drafting, shape: Shape, tokens: Callable[[Shape], torch.Tensor],
                 chain: Callable[[], torch.Tensor], q: torch.Tensor | None, logits: torch.Tensor, hidden: torch.Tensor,
                 tcache, anchor: torch.Tensor,
                 params: SamplingParams, feature_layers: tuple[int, ...], generator: torch.Generator | None,
                 clock: PhaseClock, started: float, chosen: int | None = None) -> TreeRound:
    """Verify the best-first tree ``shape`` at the drafting's node budget, or the best prefix of it its measured
    ``budget`` picks, and walk it: the end of a one-pass or a merged round. ``tokens(shape)`` gives the verified
    tree's non-root tokens ``[b, M]`` (drawn only for the nodes verified, and not for a chain round).

    When a measured budget picks the drafter's own block (``keep_chain``), the round is a plain chain round of the
    tokens ``chain()`` ``[b, K]`` (its verify pass causal, its acceptance the chain's): the same drafts, without the
    tree's work.

    Args:
        q: ``[b, K, V]`` the distributions the siblings were drawn from without replacement (None: deterministic
            tokens, and the walk follows the target's token at each node).
        started: when the round began (``time.perf_counter()``), for the budget's record of round seconds.
        chosen: the budget's choice when the caller made it already (:func:`choose_nodes`).
    """
    budget, setting = drafting.budget, budget_setting(params, q)
    b, K = logits.shape[:2]
    if budget is not None:
        context = float(tcache.lengths.float().mean())  # the rows' mean cache, before this round's nodes
        n = chosen or choose_nodes(budget, shape, tcache, setting, clock)
        shape = shape.first(n - 1)
    as_chain = budget is not None and drafting.keep_chain and shape.parent.shape[1] == K
    if not as_chain:
        tree = build_nodes(anchor, shape, tokens(shape), K)
    clock.lap("tree")
    if as_chain:
        draft_tokens = chain()  # [b, K]
        acc, out = verify_chain(target, draft_tokens, q, logits, tcache, anchor, params, feature_layers, generator,
                                clock)
        num_nodes = torch.full_like(acc.num_accepted, K + 1)
    else:
        out = target(tree.tokens, cache=tcache, positions=tcache.lengths[:, None] + tree.depth, new_mask=tree.mask,
                     feature_layers=feature_layers)  # logits [b, N, V]
        clock.lap("verify")
        if q is not None:
            acc = accept_nodes_sampled(tree, logits_to_probs(out.logits, params), q, generator)
        else:
            acc = accept_nodes(tree, sample(out.logits, params, generator))
        path = acc.path[:, :K + 1]  # no node is deeper than K
        acc = acc._replace(path=torch.cat([path, path[:, -1:].expand(-1, K + 1 - path.shape[1])], 1))  # [b, K + 1]
        draft_tokens, num_nodes = tree.tokens.gather(1, acc.path[:, 1:]), tree.num_nodes  # [b, K] accepted first
    clock.lap("walk")
    rnd = commit_path(num_nodes, acc, out, tcache, draft_tokens, logits, hidden, clock)
    if budget is not None:  # the calibration's evidence and the round's seconds
        budget.observe(float(torch.where(shape.valid, shape.log_prob.exp(), 0.0).sum()),
                       float(acc.num_accepted.sum()), shape.parent.shape[1] + 1, b, context,
                       time.perf_counter() - started, setting)
    return rnd
