"""Prefix trees of draft candidates (D²SD, arXiv:2606.04446 §3; tree verification as in SpecInfer, arXiv:2305.09781):
where to branch, how candidates merge into one deduplicated tree, and which root-to-node path the target accepts.

Pure tensor code over ragged batches, no host synchronisation but one read in the walk down sampled drafts. Shapes:
``b`` rows, ``C`` candidates per row (each a chain of ``K`` draft tokens after the row's anchor), ``N`` tree nodes
per row (padded to the batch's largest tree). Node 0 is the root (the anchor, depth 0); candidate ``c``'s slot ``k``
(``k = 0..K-1``) sits at depth ``k + 1``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from specdraft.runtime.sampling import sample_residual

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


def build_tree(anchor: torch.Tensor, candidates: torch.Tensor) -> Tree:
    """Merge candidates that share prefixes into one tree per row.

    Candidate ``c`` slot ``k`` is a new node unless an earlier candidate carries the same tokens at slots ``0..k``;
    new nodes are numbered candidate by candidate, slot by slot, so every parent precedes its children.

    Args:
        anchor: ``[b]`` the committed token every candidate continues.
        candidates: ``[b, C, K]`` draft tokens.
    """
    b, C, K = candidates.shape
    dev = candidates.device
    same = (candidates[:, :, None, :] == candidates[:, None, :, :]).long().cumprod(-1).bool()  # [b, C, C, K]
    earlier = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)  # [C, C] c' < c
    dup = same & earlier[None, :, :, None]  # [b, C, C', K] same prefix as an earlier candidate c'
    is_new = ~dup.any(2)  # [b, C, K]
    new_id = is_new.flatten(1).long().cumsum(-1).view(b, C, K)  # [b, C, K] 1-based among new nodes = node id
    first = torch.where(dup, torch.arange(C, device=dev)[None, None, :, None], C).amin(2)  # [b, C, K]
    owner = torch.where(is_new, torch.arange(C, device=dev)[None, :, None], first)  # [b, C, K]
    N = 1 + C * K
    node_of = new_id.gather(1, owner)  # [b, C, K] new_id[b, owner[b, c, k], k]
    parent_of = torch.cat([node_of.new_zeros(b, C, 1), node_of[:, :, :-1]], dim=-1)  # [b, C, K]
    num_nodes = 1 + is_new.flatten(1).sum(-1)  # [b]
    rows = torch.arange(b, device=dev)[:, None]
    tokens = anchor[:, None].expand(b, N).clone()  # [b, N] padding nodes repeat the anchor at depth 0
    depth = torch.zeros(b, N, dtype=torch.long, device=dev)
    tokens[rows, node_of.flatten(1)] = candidates.flatten(1)
    depth[rows, node_of.flatten(1)] = (torch.arange(K, device=dev) + 1).expand(b, C, K).flatten(1)
    # node_of[c, k] sees node_of[c, j] for j <= k (j > k points at the root instead), itself and the root;
    # candidates that share a prefix write the same entries
    mask = torch.eye(N, dtype=torch.bool, device=dev).repeat(b, 1, 1)  # [b, N, N]
    mask[:, :, 0] = True
    on_path = torch.ones(K, K, dtype=torch.bool, device=dev).tril()  # [K, K] (query slot k, key slot j)
    src = node_of[:, :, :, None].expand(b, C, K, K)  # [b, C, K, K]
    dst = torch.where(on_path, node_of[:, :, None, :], 0)  # [b, C, K, K]
    mask[rows[:, :, None, None].expand(b, C, K, K), src, dst] = True
    return Tree(tokens, depth, mask, num_nodes, node_of, parent_of, candidates)


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


def proposal_order(tree: Tree, proposes: torch.Tensor) -> torch.Tensor:
    """Which proposals the walk tries before which: ``before [b, C', C, K]``. Candidate ``c``
    proposes its slot ``k`` at node ``parent_of[c, k]`` when it drew that slot itself (``proposes``); the proposals
    at one node are tried in candidate order, so ``before[c', c, k]`` holds when ``c' < c`` proposes at the same node
    as ``c`` (at the same slot: a node's children are one depth down)."""
    C = proposes.shape[1]
    at = tree.parent_of  # [b, C, K]
    earlier = torch.ones(C, C, dtype=torch.bool, device=at.device).triu(1)  # [C', C] c' < c
    return proposes[:, :, None] & proposes[:, None] & (at[:, :, None] == at[:, None]) & earlier[None, :, :, None]


def proposal_offsets(target_probs: torch.Tensor, draft_probs: torch.Tensor, at: torch.Tensor,
                     before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution at a node after its proposals ``c'`` before ``c`` were rejected, as
    ``relu(p - sum_c' W[c', c] q_c') / S[c]``: a rejection of ``x ~ q_c'`` turns ``p_c' = relu(p - A) / S`` into
    ``norm(relu(p_c' - q_c'))``, and ``relu(relu(a) / s - c) = relu(a - s c) / s`` for ``c >= 0``, so the rejected
    proposal enters with the mass ``S[c']`` before it, and ``S[c] = sum_v relu(p - sum W q)(v)``. A node's first
    proposal sees ``p`` itself (``S = 1``); only the others need a sum over the vocabulary, computed rank by rank (the
    ``r``-th proposal at a node needs the masses of the ``r`` before it), gathered to the rows' proposals of that rank
    (one host read: how many a row has, at most, of each rank).

    Args:
        target_probs: ``[b, N, V]``; draft_probs: ``[b, C, K, V]``; at: ``[b, C, K]`` the node each proposal is made
        at; before: ``[b, C', C, K]`` (:func:`proposal_order`).
    Returns:
        ``(W [b, C', C, K], S [b, C, K])`` in float64.
    """
    b, C, K = at.shape
    rank = before.sum(1)  # [b, C, K]
    counts = (rank.flatten(1)[:, :, None] == torch.arange(1, C, device=rank.device)).sum(1).amax(0).tolist()
    rows = torch.arange(b, device=at.device)[:, None]
    S = torch.ones(b, C * K, dtype=torch.float64, device=at.device)  # [b, C * K] by proposal c * K + k
    order = before.permute(0, 2, 3, 1).reshape(b, C * K, C)  # [b, C * K, C'] proposal -> those tried before it
    for r, count in enumerate(counts, start=1):
        if not count:
            break
        is_r = rank.flatten(1) == r  # [b, C * K]
        idx = torch.sort(is_r.long(), dim=-1, descending=True, stable=True).indices[:, :count]  # [b, R]
        slot = idx % K  # [b, R]
        p = target_probs[rows, at.flatten(1).gather(1, idx)]  # [b, R, V]
        earlier = order.gather(1, idx[:, :, None].expand(-1, -1, C))  # [b, R, C'] the r proposals tried before
        prev = torch.sort(earlier.long(), dim=-1, descending=True, stable=True).indices[:, :, :r]  # [b, R, r]
        weight = earlier.gather(2, prev) * S.view(b, C, K).transpose(1, 2).gather(1, slot[:, :, None].expand(
            -1, -1, C)).gather(2, prev)  # [b, R, r] their masses S (0 on padding)
        for i in range(r):
            p = torch.addcmul(p, weight[:, :, i, None].to(p.dtype), draft_probs[rows, prev[:, :, i], slot], value=-1)
        mass = p.clamp_min(0).sum(-1).double()  # [b, R]
        S.scatter_(1, idx, torch.where(is_r.gather(1, idx), mass, S.gather(1, idx)))  # padding keeps its S
    S = S.view(b, C, K)
    return before * S[:, :, None], S  # [b, C', C, K], [b, C, K]


def accept_tree_sampled(tree: Tree, target_probs: torch.Tensor, draft_probs: torch.Tensor, proposes: torch.Tensor,
                        generator: torch.Generator | None = None) -> TreeAcceptance:
    """Multi-candidate speculative sampling down a tree of SAMPLED drafts (recursive rejection sampling, SpecInfer's
    multi-step speculative sampling, arXiv:2305.09781 §4.2): at the current node, each candidate that passes through it
    and proposes a token there (``proposes``), in candidate order, is accepted with probability
    ``min(1, p(x) / q_c(x))``; a rejection replaces ``p`` by ``norm(max(p - q_c, 0))`` (:func:`proposal_offsets`);
    the first acceptance moves the walk to that child, and when every proposal is rejected a token is drawn from the
    remaining ``p`` and the walk stops (at depth K it is the bonus). Each proposal ``x ~ q_c`` is drawn independently
    given the path, so every emitted token is distributed as the target's.

    Vectorised as the one-pass walk is (:func:`~specdraft.runtime.one_pass.accept_nodes_sampled`): every proposal is
    decided at once, each with its own uniform (the walk visits one node per depth, so deciding the others too changes
    no law); a candidate's run of moves the walk makes gives the accepted path.

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
    at, x = tree.parent_of, tree.candidates  # [b, C, K]
    before = proposal_order(tree, proposes)  # [b, C', C, K]
    W, S = proposal_offsets(target_probs, draft_probs, at, before)  # [b, C', C, K], [b, C, K]
    qx = draft_probs[rows[:, None, None], torch.arange(C, device=dev)[:, None], torch.arange(K, device=dev),
                     x].double()  # [b, C, K] q_c(x_c)
    q_earlier = draft_probs[rows[:, None, None, None], torch.arange(C, device=dev)[:, None, None],
                            torch.arange(K, device=dev), x[:, None]].double()  # [b, C', C, K] q_c'(x_c)
    px = target_probs[rows[:, None, None], at, x].double()  # [b, C, K]
    u = torch.rand(b, C, K, generator=generator, device=dev, dtype=torch.float64)
    ok = proposes & (u * qx * S < (px - (W * q_earlier).sum(1)).clamp_min(0))  # u < p_c(x) / q_c(x); none if S is 0
    first = ok & ~(before & ok[:, :, None]).any(1)  # [b, C, K] the node's first accepted proposal
    to = torch.zeros_like(target_probs[..., 0], dtype=torch.long).scatter_reduce(
        1, at.flatten(1), torch.where(first, tree.node_of, 0).flatten(1), "amax")  # [b, N] the child each node moves to
    run = (to.gather(1, at.flatten(1)).view(b, C, K) == tree.node_of).long().cumprod(-1).sum(-1)
    num_accepted, winner = run.max(dim=-1)  # [b] (max returns the first maximal candidate)
    path = torch.cat([tree.node_of.new_zeros(b, 1),
                      tree.node_of.gather(1, winner[:, None, None].expand(b, 1, K))[:, 0]], dim=-1)  # [b, K + 1]
    last = path.gather(1, num_accepted[:, None])[:, 0]  # [b] the node the walk stopped at
    slot = num_accepted.clamp_max(K - 1)  # [b] the slot its children were proposed at (none at depth K)
    tried = (proposes & (at == last[:, None, None])).gather(2, slot[:, None, None].expand(b, C, 1))[..., 0]  # [b, C]
    tried = tried & (num_accepted < K)[:, None]
    weight = torch.where(tried, S.gather(2, slot[:, None, None].expand(b, C, 1))[..., 0], 0.0)  # [b, C]
    q = draft_probs[rows, :, slot]  # [b, C, V]
    p = target_probs[rows, last]  # [b, V]
    next_token = sample_residual((p - (weight[:, :, None].to(q.dtype) * q).sum(1)).clamp_min(0), p, generator)
    path = torch.where(torch.arange(K + 1, device=dev) <= num_accepted[:, None], path, last[:, None])
    return TreeAcceptance(num_accepted, next_token, winner, path)
