"""Prefix trees of draft candidates (D²SD, arXiv:2606.04446 §3; tree verification as in SpecInfer, arXiv:2305.09781):
where to branch, how candidates merge into one deduplicated tree, and which root-to-node path the target accepts.

Pure tensor code over ragged batches, no host synchronisation. Shapes: ``b`` rows, ``C`` candidates per row (each a
chain of ``K`` draft tokens after the row's anchor), ``N`` tree nodes per row (padded to the batch's largest tree).
Node 0 is the root (the anchor, depth 0); candidate ``c``'s slot ``k`` (``k = 0..K-1``) sits at depth ``k + 1``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from specdraft.runtime.sampling import sample_from_probs

Placement = Literal["confidence", "uniform"]


def boundary_posterior(confidence: torch.Tensor) -> torch.Tensor:
    """``r(i) = prod_{k<=i} c_k * (1 - c_{i+1})``: the probability that exactly ``i`` drafts are accepted, for
    ``i = 0..K-2``, if slot ``k`` is accepted with probability ``c_k`` independently (D²SD Eq. 4).

    Args:
        confidence: ``[b, K]`` per-slot confidences ``c_1..c_K`` of the first draft.
    Returns:
        ``[b, K - 1]``.
    """
    ones = confidence.new_ones(confidence.shape[0], 1)
    accepted_before = torch.cat([ones, confidence.cumprod(-1)[:, :-2]], dim=-1)  # [b, K - 1] prod_{k<=i} c_k
    return accepted_before * (1 - confidence[:, :-1])  # [b, K - 1]


def prefix_lengths(confidence: torch.Tensor, num_branches: int, placement: Placement = "confidence") -> torch.Tensor:
    """The prefix lengths ``[b, num_branches]`` (ascending) the second drafter re-drafts from: the ``num_branches``
    most likely boundaries under :func:`boundary_posterior`, or evenly spread over ``0..K-2`` (``uniform``, the
    ablation). ``num_branches`` must not exceed ``K - 1``."""
    b, K = confidence.shape
    if not 1 <= num_branches <= K - 1:
        raise ValueError(f"{num_branches} branches need 1..{K - 1} boundaries (a block of {K} draft slots)")
    if placement == "uniform":  # spacing (K - 2) / (num_branches - 1) >= 1: the rounded lengths are distinct
        return torch.linspace(0, K - 2, num_branches, device=confidence.device).round().long().expand(b, -1)
    return boundary_posterior(confidence).topk(num_branches, dim=-1).indices.sort(dim=-1).values  # [b, num_branches]


class Tree(NamedTuple):
    """A deduplicated prefix tree per row (padding nodes, past ``num_nodes``, see the root and themselves; no real
    node sees them and none is ever accepted)."""

    tokens: torch.Tensor  # [b, N] node tokens (the anchor at node 0)
    depth: torch.Tensor  # [b, N] depth (0 = root)
    mask: torch.Tensor  # [b, N, N] bool ancestor-or-self mask: mask[i, j] iff node j is on the root path of node i
    num_nodes: torch.Tensor  # [b] real nodes (root included)
    node_of: torch.Tensor  # [b, C, K] node id of candidate c's slot k
    parent_of: torch.Tensor  # [b, C, K] node id of the parent of candidate c's slot k (0 = root)
    candidates: torch.Tensor  # [b, C, K] the candidates' tokens

    def trimmed(self, num_nodes: int) -> "Tree":
        """The first ``num_nodes`` nodes of every row (nodes are numbered compactly, so ``max(self.num_nodes)``
        keeps every real node): a smaller verify pass when deduplication merged many candidates."""
        return self._replace(tokens=self.tokens[:, :num_nodes], depth=self.depth[:, :num_nodes],
                             mask=self.mask[:, :num_nodes, :num_nodes])


def build_tree(anchor: torch.Tensor, candidates: torch.Tensor, lengths: torch.Tensor | None = None) -> Tree:
    """Merge candidates that share prefixes into one tree per row.

    Candidate ``c`` slot ``k`` is a new node unless an earlier candidate carries the same tokens at slots ``0..k``;
    new nodes are numbered candidate by candidate, slot by slot, so every parent precedes its children.

    Args:
        anchor: ``[b]`` the committed token every candidate continues.
        candidates: ``[b, C, K]`` draft tokens.
        lengths: ``[b, C]`` slots each candidate holds (default all ``K``); the slots past them are no nodes, and the
            tree's ``candidates`` hold -1 there (a token no target emits, so no walk goes past a candidate's end).
    """
    b, C, K = candidates.shape
    dev = candidates.device
    valid = torch.ones(b, C, K, dtype=torch.bool, device=dev) if lengths is None else (
        torch.arange(K, device=dev) < lengths[:, :, None])  # [b, C, K]
    candidates = torch.where(valid, candidates, -1)
    same = (candidates[:, :, None, :] == candidates[:, None, :, :]).long().cumprod(-1).bool()  # [b, C, C, K]
    earlier = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)  # [C, C] c' < c
    dup = same & earlier[None, :, :, None] & valid[:, None]  # [b, C, C', K] same prefix as an earlier candidate c'
    is_new = ~dup.any(2) & valid  # [b, C, K]
    new_id = is_new.flatten(1).long().cumsum(-1).view(b, C, K)  # [b, C, K] 1-based among new nodes = node id
    first = torch.where(dup, torch.arange(C, device=dev)[None, None, :, None], C).amin(2)  # [b, C, K]
    owner = torch.where(is_new | ~valid, torch.arange(C, device=dev)[None, :, None], first)  # [b, C, K]
    N = 1 + C * K
    node_of = torch.where(valid, new_id.gather(1, owner), 0)  # [b, C, K] new_id[b, owner[b, c, k], k]
    parent_of = torch.cat([node_of.new_zeros(b, C, 1), node_of[:, :, :-1]], dim=-1)  # [b, C, K]
    num_nodes = 1 + is_new.flatten(1).sum(-1)  # [b]
    write = torch.where(valid, node_of, N)  # [b, C, K] slots past a candidate write to a dropped column
    rows = torch.arange(b, device=dev)[:, None]
    tokens = anchor[:, None].expand(b, N + 1).clone()  # [b, N + 1] padding nodes repeat the anchor at depth 0
    depth = torch.zeros(b, N + 1, dtype=torch.long, device=dev)
    tokens[rows, write.flatten(1)] = candidates.flatten(1)
    depth[rows, write.flatten(1)] = (torch.arange(K, device=dev) + 1).expand(b, C, K).flatten(1)
    # node_of[c, k] sees node_of[c, j] for j <= k (j > k points at the root instead), itself and the root;
    # candidates that share a prefix write the same entries
    mask = torch.eye(N + 1, dtype=torch.bool, device=dev).repeat(b, 1, 1)  # [b, N + 1, N + 1]
    mask[:, :, 0] = True
    on_path = torch.ones(K, K, dtype=torch.bool, device=dev).tril()  # [K, K] (query slot k, key slot j)
    src = write[:, :, :, None].expand(b, C, K, K)  # [b, C, K, K]
    dst = torch.where(on_path, node_of[:, :, None, :], 0)  # [b, C, K, K]
    mask[rows[:, :, None, None].expand(b, C, K, K), src, dst] = True
    return Tree(tokens[:, :N], depth[:, :N], mask[:, :N, :N], num_nodes, node_of, parent_of, candidates)


class TreeAcceptance(NamedTuple):
    num_accepted: torch.Tensor  # [b] drafts accepted (depth of the last accepted node)
    next_token: torch.Tensor  # [b] the target's token after the accepted path (the next anchor)
    winner: torch.Tensor  # [b] candidate whose chain holds the accepted path (the first such one)
    path: torch.Tensor  # [b, K + 1] node ids of the root and the winner's slots (valid up to num_accepted)


def accept_tree(tree: Tree, node_targets: torch.Tensor) -> TreeAcceptance:
    """Follow the target down the tree: from the root, move to the child whose token equals the target's token at
    the current node, until no child does; that token is emitted after the accepted path.

    With ``node_targets`` the target's argmax at every node this is greedy verification (the output equals the
    target's alone). With one token SAMPLED from the target's distribution at every node it is lossless speculative
    sampling for deterministic drafts: each emitted token is a fresh sample at the node the walk reached (tokens
    sampled at nodes the walk never reaches are unused), the multi-candidate rule of SpecInfer for one-hot drafts.

    Args:
        tree: the row's tree.
        node_targets: ``[b, N]`` the target's token after each node.
    """
    b, C, K = tree.candidates.shape
    expected = node_targets.gather(1, tree.parent_of.flatten(1)).view(b, C, K)  # [b, C, K] target's token at parent
    run = (tree.candidates == expected).long().cumprod(-1).sum(-1)  # [b, C] accepted along each candidate
    num_accepted, winner = run.max(dim=-1)  # [b] (max returns the first maximal candidate)
    path = torch.cat([tree.node_of.new_zeros(b, 1),
                      tree.node_of.gather(1, winner[:, None, None].expand(b, 1, K))[:, 0]], dim=-1)  # [b, K + 1]
    last = path.gather(1, num_accepted[:, None])  # [b, 1] node the walk stopped at
    return TreeAcceptance(num_accepted, node_targets.gather(1, last)[:, 0], winner, path)


def rejection_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` ``[b, V]``: what the target's distribution becomes after a proposal from ``q`` is
    rejected (its mass is positive wherever a proposal was rejected, since then ``p(x) < q(x)``)."""
    residual = (p - q).clamp_min(0)
    return residual / residual.sum(-1, keepdim=True).clamp_min(1e-30)


def accept_tree_sampled(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, proposes: torch.Tensor,
                        generator: torch.Generator | None = None) -> TreeAcceptance:
    """Multi-candidate speculative sampling down a tree of SAMPLED drafts (recursive rejection sampling, SpecInfer's
    multi-step speculative sampling, arXiv:2305.09781 §4.2): at the current node, each candidate that passes through it
    and proposes a token there (``proposes``), in candidate order, is accepted with probability
    ``min(1, p(x) / q_c(x))``; a rejection replaces ``p`` by ``norm(max(p - q_c, 0))``; the first acceptance moves
    the walk to that child, and when every proposal is rejected a token is drawn from the remaining ``p`` and the walk
    stops (at depth K it is the bonus). Each proposal ``x ~ q_c`` is drawn independently given the path, so every
    emitted token is distributed as the target's.

    Args:
        tree: the row's tree over the sampled candidates.
        target_probs: ``[b, N, V]`` the target's processed distribution after each node.
        draft_probs: ``[b, C, K, V]`` the distribution candidate ``c``'s slot ``k`` was drawn from.
        proposes: ``[b, C, K]`` whether candidate ``c`` drew slot ``k`` itself (a branch's prefix copies the first
            draft's tokens: those are the first draft's proposals, not the branch's).
    """
    b, C, K = tree.candidates.shape
    dev = target_probs.device
    rows = torch.arange(b, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    passes = torch.ones(b, C, dtype=torch.bool, device=dev)  # candidates whose chain runs through the current node
    num_accepted = torch.zeros(b, dtype=torch.long, device=dev)
    winner = torch.zeros(b, dtype=torch.long, device=dev)
    next_token = torch.zeros(b, dtype=torch.long, device=dev)
    path = torch.zeros(b, K + 1, dtype=torch.long, device=dev)
    for k in range(K + 1):
        p = target_probs[rows, node]  # [b, V]
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        child = node
        for c in range(C if k < K else 0):
            asks = active & ~moved & passes[:, c] & proposes[:, c, k]  # [b]
            x = tree.candidates[:, c, k]  # [b]
            q = draft_probs[:, c, k]  # [b, V]
            px, qx = p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
            u = torch.rand(b, generator=generator, device=dev)
            ok = asks & (u * qx <= px)  # u < p(x) / q(x) without dividing
            child = torch.where(ok, tree.node_of[:, c, k], child)
            winner = torch.where(ok, c, winner)
            moved = moved | ok
            p = torch.where((asks & ~ok)[:, None], rejection_residual(p, q), p)
        stop = active & ~moved
        next_token = torch.where(stop, sample_from_probs(p, generator), next_token)
        num_accepted = num_accepted + moved.long()
        active = active & moved
        node = child
        if k < K:
            path[:, k + 1] = node
            passes = passes & (tree.node_of[:, :, k] == node[:, None])
    return TreeAcceptance(num_accepted, next_token, winner, path)
