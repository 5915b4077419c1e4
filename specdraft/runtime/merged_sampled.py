"""Merged trees with SAMPLED drafts (``decode.method=merged`` under sampling, ``draft_sampling="sample"``): the
first drafter's one-pass tree with its siblings drawn without replacement (as a sampled one-pass round's) and the
second drafter's branches drawn from its own distributions, in one tree, verified in one target pass and walked by
recursive rejection sampling over both kinds of proposal.

What keeps it lossless is that no node's presence depends on a token drawn for the tree: the one-pass part's shape
is the best-first tree over the first drafter's ranked probabilities, the branches start where the first draft's
confidences say (:func:`~specdraft.runtime.tree.prefix_lengths`) and run for a span fixed by those starts alone, and
the one-pass part gets the rest of the node budget. Tokens decide only which proposals coincide: a branch token that
repeats a one-pass sibling (or another branch's) is the same node, so the branch's next token is tried under it.

At a node the walk tries the one-pass siblings first, in draw order (the rule of
:func:`~specdraft.runtime.one_pass.sibling_moves`), then the branch tokens proposed there, in branch order, each
``y ~ q_b`` accepted with probability ``min(1, r(y) / q_b(y))`` for ``r`` the target's distribution after the
rejections before it; a rejection leaves ``relu(r - q_b)``, renormalised. Each proposal is drawn independently of
the target given the path and the proposals before it, so every emitted token is distributed as the target's (the
multi-candidate rule of SpecInfer, arXiv:2305.09781 §4.2, with Jeon et al.'s siblings without replacement,
arXiv:2402.14160).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from specdraft.runtime.d2sd import Candidates, branch_candidates
from specdraft.runtime.drafter import Drafter
from specdraft.runtime.one_pass import (
    NodeTree,
    Shape,
    best_first,
    build_nodes,
    draft_block,
    draw_without_replacement,
    follow_moves,
    leftover,
    node_tokens,
    sibling_moves,
    twins,
)
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.sampling import SamplingParams, logits_to_probs, sample_residual
from specdraft.runtime.tree import TreeAcceptance, build_tree
from specdraft.runtime.tree_round import TreeRound, commit_path

if TYPE_CHECKING:
    from specdraft.runtime.merged import MergedDrafting


class Proposals(NamedTuple):
    """The branches' tokens as proposals at the tree's nodes, ``E = J * K`` per row (branch ``j``'s slot ``k`` at
    ``j * K + k``)."""

    at: torch.Tensor  # [b, E] the node the token is proposed at
    child: torch.Tensor  # [b, E] the node an acceptance moves to
    token: torch.Tensor  # [b, E]
    probs: torch.Tensor  # [b, E, V] the distribution the token was drawn from
    live: torch.Tensor  # [b, E] a proposal of the tree (False: a branch's copied prefix, or past its span)
    before: torch.Tensor  # [b, E', E] e' is tried before e (the same node, an earlier branch)


def branch_span(starts: torch.Tensor, block: int, room: torch.Tensor) -> torch.Tensor:
    """``[b]`` the longest span ``L`` whose branches, ``min(K - l_j, L)`` nodes each from their starts ``l_j``
    (``starts`` ``[b, J]``, ``K = block``), fit in ``room`` ``[b]`` nodes."""
    spans = torch.arange(block + 1, device=starts.device)  # [K + 1]
    size = (block - starts[:, :, None]).clamp_max(spans).sum(1)  # [b, K + 1] nodes at each span
    return (size <= room[:, None]).sum(-1) - 1


def branch_nodes(starts: torch.Tensor, block: int, span: torch.Tensor) -> torch.Tensor:
    """``[b]`` the nodes the branches take at ``span`` (before any coincide)."""
    return (block - starts).clamp_max(span[:, None]).sum(-1)


def union(anchor: torch.Tensor, cands: Candidates, one: Shape, draws: torch.Tensor, span: torch.Tensor,
          nodes: int) -> tuple[Shape, torch.Tensor, Proposals]:
    """The one-pass tree ``one`` (its siblings ``draws`` ``[b, K, W]`` by rank) and the branches of ``cands`` cut to
    ``span`` ``[b]`` slots, as one tree of ``nodes`` (the root included; ``one`` holds at most what the branches
    leave): ``(shape, tokens [b, nodes - 1], proposals)``. A one-pass node keeps its rank; a branch's node ranks
    after every sibling (``W`` plus its branch). Pure tensor code of fixed shapes, no host read."""
    b, C, K = cands.tokens.shape
    M, W, dev = one.parent.shape[1], draws.shape[-1], anchor.device
    rows = torch.arange(b, device=dev)[:, None]
    dtree = build_tree(anchor, cands.tokens)  # D²SD's candidates as one prefix tree (node ids 1..C*K)
    Nd = dtree.tokens.shape[1]
    node_of, parent_of = dtree.node_of.flatten(1), dtree.parent_of.flatten(1)  # [b, C * K]
    starts = K - cands.proposes[:, 1:].sum(-1)  # [b, J]
    kept = torch.cat([torch.ones_like(cands.proposes[:, :1]), torch.arange(K, device=dev) < (
        starts + span[:, None])[:, :, None]], 1)  # [b, C, K]
    d_kept = torch.zeros(b, Nd, dtype=torch.long, device=dev).scatter_reduce(1, node_of, kept.flatten(1).long(),
                                                                              "amax").bool()  # [b, Nd]
    d_parent = torch.zeros(b, Nd, dtype=torch.long, device=dev).scatter(1, node_of, parent_of)  # [b, Nd]
    d_real = torch.arange(Nd, device=dev) < dtree.num_nodes[:, None]  # [b, Nd]
    twin = twins(dtree, d_parent, d_real, one, draws)  # [b, Nd]
    d_union = torch.where(twin >= 0, twin, M + torch.arange(Nd, device=dev))  # [b, Nd] root 0, one-pass 1..M
    owner = torch.full((b, Nd), C, dtype=torch.long, device=dev).scatter_reduce(
        1, node_of, torch.arange(C, device=dev).repeat_interleave(K).expand(b, -1), "amin")  # [b, Nd] first candidate
    parent = torch.cat([one.parent, d_union.gather(1, d_parent)[:, 1:]], 1)  # [b, U - 1] non-root union nodes
    tok = torch.cat([node_tokens(one, draws, None, None), dtree.tokens[:, 1:]], 1)  # [b, U - 1]
    depth = torch.cat([one.depth, dtree.depth[:, 1:]], 1)
    valid = torch.cat([one.valid, (d_real & (twin < 0) & d_kept)[:, 1:]], 1)
    rank = torch.cat([one.rank, W + owner[:, 1:] - 1], 1)
    # the real nodes first, in order (parents before children), numbered 1..nodes - 1
    pick = torch.sort((~valid).long(), dim=-1, stable=True).indices[:, :nodes - 1]  # [b, nodes - 1]
    real = valid.gather(1, pick)
    new_id = torch.zeros(b, parent.shape[1] + 1, dtype=torch.long, device=dev)
    new_id[rows, pick + 1] = torch.arange(1, nodes, device=dev).expand(b, -1)  # union id -> node id
    shape = Shape(torch.where(real, new_id.gather(1, parent.gather(1, pick)), 0), torch.where(real, rank.gather(
        1, pick), 0), depth.gather(1, pick), real, torch.where(real, torch.cat(
            [one.log_prob, one.log_prob.new_full((b, Nd - 1), float("-inf"))], 1).gather(1, pick), float("-inf")))
    # the branches' own tokens (not their copied prefixes), as proposals at their parents' nodes
    live = (cands.proposes[:, 1:] & kept[:, 1:]).flatten(1)  # [b, E]
    at = new_id.gather(1, d_union.gather(1, parent_of[:, K:]))  # [b, E]
    child = new_id.gather(1, d_union.gather(1, node_of[:, K:]))  # [b, E]
    E = live.shape[1]
    earlier = torch.ones(E, E, dtype=torch.bool, device=dev).triu(1)  # [E', E] e' < e
    before = live[:, :, None] & live[:, None, :] & (at[:, :, None] == at[:, None, :]) & earlier
    probs = cands.probs[:, 1:].flatten(1, 2)  # [b, E, V]
    return shape, tok.gather(1, pick), Proposals(at, child, cands.tokens[:, 1:].flatten(1), probs, live, before)


def accept_merged_sampled(tree: NodeTree, target_probs: torch.Tensor, q1: torch.Tensor, props: Proposals,
                          width: int, generator: torch.Generator | None = None) -> TreeAcceptance:
    """Recursive rejection sampling down a merged tree of sampled drafts: at each node its one-pass siblings (ranks
    below ``width``, drawn without replacement from ``q1`` ``[b, K, V]``), then the branch tokens proposed there
    (``props``). Vectorised as :func:`~specdraft.runtime.one_pass.accept_nodes_sampled` is: every proposal is
    decided at once and the walk follows the decisions; the branch proposals' residual masses are found rank by
    rank (a node has at most one a branch)."""
    b, N, V = target_probs.shape
    K = q1.shape[1]
    import os  # noqa: PLC0415  prototype
    branch_first = os.environ.get("SPECDRAFT_BRANCH_FIRST") == "1"
    at = props.at
    p = target_probs.gather(1, at[:, :, None].expand(-1, -1, V))  # [b, E, V]
    if branch_first:
        base = p
    else:
        to, offset = sibling_moves(tree._replace(children=tree.children[:, :, :width]), target_probs, q1, generator)
        slot = tree.depth.gather(1, at).clamp_max(K - 1)  # [b, E]
        base = p - offset.gather(1, at)[:, :, None].to(p.dtype) * q1.gather(1, slot[:, :, None].expand(-1, -1, V))
    before = props.before.to(p.dtype)  # [b, E', E]
    mass = torch.ones(at.shape, dtype=p.dtype, device=p.device)  # [b, E] what is left of p before each proposal
    left = base
    for _ in range(int(props.before.sum(1).amax()) + 1 if at.shape[1] else 0):  # one host read: ranks at a node
        left = base - torch.bmm((before * mass[:, :, None]).transpose(1, 2), props.probs)  # [b, E, V]
        mass = left.clamp_min(0).sum(-1)
    token = props.token[:, :, None]
    qx = props.probs.gather(2, token)[..., 0].double()  # [b, E]
    rx = left.gather(2, token)[..., 0].double().clamp_min(0)  # [b, E]
    u = torch.rand(at.shape, generator=generator, device=p.device, dtype=torch.float64)
    ok = props.live & (u * qx * mass.double() < rx)  # u < r(y) / q(y)
    first = ok & ~(props.before & ok[:, :, None]).any(1)  # [b, E] the node's first accepted branch token
    branch_to = torch.zeros(b, N, dtype=torch.long, device=p.device).scatter_reduce(
        1, at, torch.where(first, props.child, 0), "amax")  # [b, N]
    if branch_first:
        last_e = props.live & ~(props.before.transpose(1, 2) & props.live[:, None, :]).any(2)  # [b, E] no later one
        after = (left - mass[:, :, None] * props.probs).clamp_min(0)  # [b, E, V]
        after = after / after.sum(-1, keepdim=True).clamp_min(1e-30)
        idx = torch.where(last_e, at, N)  # [b, E]
        p2 = torch.cat([target_probs, target_probs[:, :1]], 1).clone()
        p2.scatter_(1, idx[:, :, None].expand(-1, -1, V), after)
        target_probs = p2[:, :N]
        to, offset = sibling_moves(tree._replace(children=tree.children[:, :, :width]), target_probs, q1, generator)
        to = torch.where(branch_to > 0, branch_to, to)
    else:
        to = torch.where(to > 0, to, branch_to)  # siblings first
    moves = to.gather(1, tree.parent) == torch.arange(N, device=to.device)  # [b, N]
    last, num_accepted, path, sibling = follow_moves(tree, moves, K)
    tried = props.live & (at == last[:, None])  # [b, E] the branch tokens rejected where the walk stopped
    rest = leftover(target_probs, q1, tree, last, offset.gather(1, last[:, None])[:, 0])  # [b, V]
    if not branch_first:
        rest = (rest - torch.bmm(torch.where(tried, mass, 0.0)[:, None], props.probs)[:, 0]).clamp_min(0)
    rows = torch.arange(b, device=to.device)
    return TreeAcceptance(num_accepted, sample_residual(rest, target_probs[rows, last], generator), sibling, path)


def sampled_merged_round(target, drafter: Drafter, drafting: "MergedDrafting", dcache, scache, tcache,
                         anchor: torch.Tensor, params: SamplingParams, feature_layers: tuple[int, ...],
                         generator: torch.Generator | None, clock: PhaseClock, share: float) -> TreeRound:
    """One merged round of sampled drafts for every active row (the accepted path's K/V moved into the committed
    slots, the lengths left for the engine to raise)."""
    logits, hidden = draft_block(drafter, dcache, anchor)  # [b, K, V], [b, Bk, D]
    clock.lap("draft")
    b, K, V = logits.shape
    N, W = drafting.nodes, min(drafting.nodes - 1, V)
    q1 = logits_to_probs(logits, params)  # [b, K, V]
    one = best_first(q1.topk(W, dim=-1).values, N, keep_chain=True)
    draws = draw_without_replacement(q1, W, generator)  # [b, K, W] each slot's siblings, rank 0 the chain's
    cands = branch_candidates(drafting.branches, scache, anchor, draws[:, :, 0], q1, logits, hidden, clock, params,
                              True, generator)
    starts = K - cands.proposes[:, 1:].sum(-1)  # [b, J]
    room = torch.full((b,), int(max(N - 1 - K, 0) * share), device=anchor.device)
    span = branch_span(starts, K, room)
    ones = (N - 1 - branch_nodes(starts, K, span))[:, None]  # [b, 1] the one-pass part's nodes
    one = one._replace(valid=one.valid & (torch.arange(N - 1, device=anchor.device) < ones))
    shape, tokens, props = union(anchor, cands, one, draws, span, N)
    tree = build_nodes(anchor, shape, tokens, K)
    clock.lap("tree")
    out = target(tree.tokens, cache=tcache, positions=tcache.lengths[:, None] + tree.depth, new_mask=tree.mask,
                 feature_layers=feature_layers)  # logits [b, N, V]
    clock.lap("verify")
    acc = accept_merged_sampled(tree, logits_to_probs(out.logits, params), q1, props, W, generator)
    path = acc.path[:, :K + 1]  # no node is deeper than K
    acc = acc._replace(path=torch.cat([path, path[:, -1:].expand(-1, K + 1 - path.shape[1])], 1))  # [b, K + 1]
    clock.lap("walk")
    return commit_path(tree.num_nodes, acc, out, tcache, tree.tokens.gather(1, acc.path[:, 1:]), logits, hidden,
                       clock)
