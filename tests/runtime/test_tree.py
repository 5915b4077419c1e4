"""D²SD's parts one by one: the boundary posterior, tree construction and deduplication, the ancestor mask, the walk
that accepts a path, KV compaction, the VP drafter and its batched branch pass."""

import functools
import itertools
import random

import pytest
import torch

from specdraft.runtime.d2sd import verify_tree
from specdraft.runtime.drafter_io import convert_drafter, load_drafter, save_drafter
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.tree import (
    accept_tree,
    accept_tree_sampled,
    boundary_posterior,
    build_tree,
    prefix_lengths,
    proposal_offsets,
    proposal_order,
)
from tests.helpers import chi2_pvalue, make_drafter, make_target

ALPHA = 1e-3


def test_boundary_posterior_matches_brute_force_enumeration():
    c = torch.tensor([[0.9, 0.7, 0.4, 0.8, 0.6], [0.2, 0.99, 0.5, 0.5, 0.1]], dtype=torch.float64)
    K = c.shape[1]
    for row in range(2):
        exact = [0.0] * (K + 1)
        for outcome in itertools.product([0, 1], repeat=K):  # every accept/reject pattern of the K slots
            p = 1.0
            for k, o in enumerate(outcome):
                p *= float(c[row, k]) if o else 1 - float(c[row, k])
            run = next((k for k, o in enumerate(outcome) if not o), K)  # drafts accepted before the first rejection
            exact[run] += p
        assert boundary_posterior(c)[row].tolist() == pytest.approx(exact[:K - 1], abs=1e-12)


def test_prefix_lengths_pick_the_most_likely_boundaries_or_spread_evenly():
    c = torch.tensor([[0.95, 0.9, 0.3, 0.9, 0.9, 0.2, 0.9]])  # r = .05 .095 .60 .026 .023 .17: boundaries 2, 5
    r = boundary_posterior(c)[0]
    assert prefix_lengths(c, 2).tolist() == [sorted(r.topk(2).indices.tolist())]
    assert prefix_lengths(c, 2).tolist() == [[2, 5]]
    for J in range(1, 7):
        u = prefix_lengths(c, J, "uniform")[0].tolist()
        assert len(set(u)) == J and u == sorted(u) and u[0] == 0 and u[-1] == (5 if J > 1 else 0)
    with pytest.raises(ValueError, match="branches"):
        prefix_lengths(c, 7)


def _prefixes(tree, row):
    """Each real node's token path from the root (exclusive) as a tuple, recovered from the candidates."""
    out = {0: ()}
    b, C, K = tree.candidates.shape
    for c in range(C):
        for k in range(K):
            out.setdefault(int(tree.node_of[row, c, k]), tuple(tree.candidates[row, c, :k + 1].tolist()))
    return out


def test_tree_deduplicates_shared_prefixes_and_masks_ancestors_exactly():
    cands = torch.tensor([[[5, 6, 7], [5, 6, 9], [5, 8, 1], [4, 4, 4]],
                          [[1, 1, 1], [1, 1, 1], [1, 2, 1], [1, 1, 2]]])  # row 1: a full duplicate
    tree = build_tree(torch.tensor([3, 2]), cands)
    for row in range(2):
        prefixes = _prefixes(tree, row)
        unique = {tuple(cands[row, c, :k + 1].tolist()) for c in range(4) for k in range(3)}
        assert int(tree.num_nodes[row]) == 1 + len(unique) == len(prefixes)
        assert sorted(prefixes) == list(range(len(prefixes)))  # compact numbering
        for n, pre in prefixes.items():
            assert int(tree.depth[row, n]) == len(pre)
            if pre:
                assert int(tree.tokens[row, n]) == pre[-1]
            for m, other in prefixes.items():  # ancestor-or-self mask, by brute force over the prefixes
                assert bool(tree.mask[row, n, m]) == (pre[:len(other)] == other), (row, n, m)
            assert all(p < n for p in [m for m, o in prefixes.items() if pre[:len(o)] == o and m != n])
    assert tree.num_nodes.tolist() == [10, 7]
    # padding nodes see the root and themselves only
    pad = int(tree.num_nodes[1])
    assert tree.mask[1, pad].nonzero().flatten().tolist() == [0, pad]


def _walk(tree, row, targets):
    """The sequential walk: from the root, follow the child whose token is the target's token at the node."""
    prefixes = _prefixes(tree, row)
    node_of = {v: k for k, v in prefixes.items()}
    path, node = [0], 0
    while True:
        t = int(targets[row, node])
        nxt = node_of.get(prefixes[node] + (t,))
        if nxt is None:
            return len(path) - 1, t, path
        path.append(nxt)
        node = nxt


def test_accept_tree_equals_a_sequential_walk_on_random_trees():
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        b, C, K, V = 3, 1 + trial % 4, 1 + trial % 5, 3
        cands = torch.randint(0, V, (b, C, K), generator=rng)
        tree = build_tree(torch.zeros(b, dtype=torch.long), cands)
        targets = torch.randint(0, V, tree.tokens.shape, generator=rng)
        got = accept_tree(tree, targets)
        for row in range(b):
            n, t, path = _walk(tree, row, targets)
            assert int(got.num_accepted[row]) == n and int(got.next_token[row]) == t
            assert got.path[row, :n + 1].tolist() == path
            w = int(got.winner[row])
            assert cands[row, w, :n].tolist() == [int(tree.tokens[row, p]) for p in path[1:]]
            assert all(cands[row, c, :n].tolist() != cands[row, w, :n].tolist() for c in range(w))  # the first


def test_sampled_tree_walk_emits_the_targets_distribution_at_every_node():
    # one node, two children: the walk accepts child t with the target's probability p(t), then samples again
    cands = torch.tensor([[[0, 1], [1, 0]]])
    tree = build_tree(torch.tensor([2]), cands)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None, None].expand(1, tree.tokens.shape[1], 3)
    g = torch.Generator().manual_seed(1)
    first = torch.zeros(3)
    for _ in range(4000):
        acc = verify_tree(tree, logits, SamplingParams(temperature=1.0), g)
        first[int(cands[0, int(acc.winner), 0]) if int(acc.num_accepted) else int(acc.next_token)] += 1
    assert (first / 4000).tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.03)


def _sampled_walk_law(tree, p, q, proposes, row: int) -> torch.Tensor:
    """Multi-candidate speculative sampling down ``tree``'s row, step by step, exactly: ``[N, V]`` the probability
    of stopping at each node and emitting each token, each proposal at a node tried in candidate order against the
    target's distribution ``p`` [N, V] reduced after each rejection (``q`` [C, K, V] what candidate c's slot k was
    drawn from). Each node's law is computed once (proposals of one token lead to one child)."""
    C, K = tree.candidates.shape[1:]

    @functools.cache
    def reached(node: int, depth: int) -> torch.Tensor:  # [N, V] the law once the walk is at ``node``
        law, target, stay = torch.zeros(p.shape, dtype=torch.float64), p[node].double(), 1.0
        for c in range(C if depth < K else 0):
            x = int(tree.candidates[row, c, depth])
            if not proposes[row, c, depth] or int(tree.parent_of[row, c, depth]) != node:
                continue
            draft = q[c, depth].double()
            accept = min(1.0, float(target[x] / draft[x]))
            law += stay * accept * reached(int(tree.node_of[row, c, depth]), depth + 1)
            stay *= 1 - accept
            target = (target - draft).clamp_min(0)
            target = target / target.sum().clamp_min(1e-300)
        law[node] += stay * target
        return law

    return reached(0, 0).float()


SAMPLED_TREES = (  # (candidates [C, K], proposes [C, K]): the first draft, then branches from prefix lengths
    ([[1, 2, 3], [1, 0, 2], [1, 2, 0], [2, 1, 1]],  # 3 proposals at the root (two of token 1) and at node "1"
     [[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]]),
    ([[0, 1, 2], [0, 1, 0], [0, 3, 3], [0, 3, 1]],  # two of token 0 at the root, 3 proposals at node "0" (two of
     [[1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]]),  # token 3), 2 at "0 1" and at "0 3"; 8 nodes against 10
)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_the_sampled_tree_walk_is_multi_candidate_speculative_sampling(seed):
    """The vectorised walk (every proposal decided at once) against the step-by-step rule, two different trees
    alternating over the rows of one batch of draws: where it stops and the token it emits, row by row."""
    check_sampled_walk_law(seed, "cpu")


def check_sampled_walk_law(seed: int, device: str):
    """:func:`test_the_sampled_tree_walk_is_multi_candidate_speculative_sampling` with the walk on ``device``."""
    rng = torch.Generator().manual_seed(seed)
    V, draws = 6, 40000
    cands = torch.tensor([c for c, _ in SAMPLED_TREES])  # [2, C, K]
    proposes = torch.tensor([p for _, p in SAMPLED_TREES]).bool()  # [2, C, K]
    tree = build_tree(torch.tensor([3, 2]), cands)
    tree = tree.trimmed(int(tree.num_nodes.max()))
    N = tree.tokens.shape[1]
    drawn = torch.nn.functional.one_hot(cands, V) * 2.0  # each proposal among its q's likely tokens
    q = torch.softmax(torch.randn(2, *cands.shape[1:], V, generator=rng) + drawn, -1)  # [2, C, K, V]
    p = torch.softmax(torch.randn(2, N, V, generator=rng) * 0.7, -1)  # [2, N, V] the target after each node
    laws = [_sampled_walk_law(tree, p[r], q[r], proposes, r) for r in range(2)]
    pick = torch.arange(draws) % 2  # [draws] which tree each row is
    many = tree._replace(**{k: getattr(tree, k)[pick].to(device) for k in tree._fields})
    walk_rng = torch.Generator(device=device).manual_seed(seed)
    acc = accept_tree_sampled(many, p[pick].to(device), q[pick].to(device), proposes[pick].to(device), walk_rng)
    acc = acc._replace(**{k: getattr(acc, k).cpu() for k in acc._fields})
    last = acc.path.gather(1, acc.num_accepted[:, None])[:, 0]
    for r, law in enumerate(laws):
        mine = pick == r
        counts = torch.zeros(N, V).index_put_((last[mine], acc.next_token[mine]), torch.ones(int(mine.sum())),
                                              accumulate=True)
        probs = law
        assert probs.sum().item() == pytest.approx(1.0) and (probs.sum(-1) > 0.01).sum() >= 4  # stops at 4+ nodes
        assert chi2_pvalue(counts, probs) > ALPHA, r
        n, path = acc.num_accepted[mine], acc.path[mine]  # [d], [d, K + 1]
        steps = torch.arange(path.shape[1])
        assert bool((path == torch.where(steps <= n[:, None], path, last[mine][:, None])).all())  # then the last
        depth = steps[:-1] < n[:, None]  # [d, K] the accepted slots
        on_path = torch.where(depth, tree.tokens[r][path[:, 1:]], -1)  # [d, K]
        holds = (torch.where(depth[:, None], cands[r], -1) == on_path[:, None]).all(-1)  # [d, C]
        assert bool((acc.winner[mine] == holds.long().argmax(-1)).all())  # the first candidate holding the path
        assert (acc.winner[mine] > 0).any() and (n == cands.shape[-1]).any()


def test_the_residual_after_rejected_proposals_is_the_sequential_one():
    """Exactly, without sampling: at every node of both trees, the target's distribution before each proposal as
    offsets (``relu(p - sum W q) / S``) against the residuals renormalised one rejection at a time."""
    rng = torch.Generator().manual_seed(0)
    V = 6
    cands = torch.tensor([c for c, _ in SAMPLED_TREES])  # [2, C, K]
    proposes = torch.tensor([p for _, p in SAMPLED_TREES]).bool()  # [2, C, K]
    tree = build_tree(torch.tensor([3, 2]), cands)
    q = torch.softmax(torch.randn(2, *cands.shape[1:], V, generator=rng) * 2, -1)  # [2, C, K, V]
    p = torch.softmax(torch.randn(2, tree.tokens.shape[1], V, generator=rng), -1)  # [2, N, V]
    before = proposal_order(tree, proposes)
    W, S = proposal_offsets(p, q, tree.parent_of, before)  # [2, C', C, K], [2, C, K]
    checked = 0
    for r, (c, k) in itertools.product(range(2), itertools.product(range(cands.shape[1]), range(cands.shape[2]))):
        if not proposes[r, c, k]:
            continue
        residual = p[r, tree.parent_of[r, c, k]].double()  # the sequential rule, one proposal after another
        for e in range(c):
            if before[r, e, c, k]:
                residual = (residual - q[r, e, k]).clamp_min(0)
                residual = residual / residual.sum()
        offsets = (p[r, tree.parent_of[r, c, k]].double() - (W[r, :, c, k, None] * q[r, :, k].double()).sum(0))
        assert torch.allclose(offsets.clamp_min(0) / S[r, c, k], residual, atol=1e-6), (r, c, k)
        checked += int(before[r, :, c, k].sum() >= 2)
    assert checked >= 2  # proposals after two rejections, in both trees


def test_a_token_of_target_probability_zero_is_never_emitted_when_rounding_leaves_no_residual():
    """Two proposals of token 2, which the target never emits; the first one's ``q`` covers ``p`` up to float32
    rounding, so rejecting it leaves no mass: the second is rejected too and the token comes from ``p``."""
    tree = build_tree(torch.tensor([3]).expand(1000), torch.tensor([[[2], [2]]]).expand(1000, 2, 1))
    p = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(1000, tree.tokens.shape[1], 4)  # [b, N, V]
    q = torch.tensor([[0.5, 0.5, 1e-8, 0.0], [0.25, 0.25, 0.5, 0.0]]).expand(1000, 2, 4)[:, :, None]  # [b, 2, 1, V]
    acc = accept_tree_sampled(tree, p, q, torch.ones(1000, 2, 1, dtype=torch.bool), torch.Generator().manual_seed(0))
    assert int(acc.num_accepted.sum()) == 0 and set(acc.next_token.tolist()) == {0, 1}


def test_kv_compaction_leaves_the_cache_of_decoding_the_winning_path_directly():
    target = make_target(seed=3, vocab=32)
    prompts = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    cands = torch.tensor([[[11, 12, 13], [11, 14, 15], [16, 17, 18]],
                          [[19, 20, 21], [19, 20, 22], [23, 24, 25]]])
    anchor = torch.tensor([30, 31])
    tree = build_tree(anchor, cands)
    cache = target.new_cache(2, 32)
    target(prompts, cache=cache)
    cache.crop(torch.tensor([5, 5]))
    out = target(tree.tokens, cache=cache, positions=cache.lengths[:, None] + tree.depth, new_mask=tree.mask)
    targets = tree.tokens.clone()
    targets[0, 0], targets[0, int(tree.node_of[0, 1, 0])] = 11, 14  # row 0 accepts 11, 14 (branch 1), then stops
    targets[0, int(tree.node_of[0, 1, 1])] = 0
    targets[1, 0], targets[1, int(tree.node_of[1, 2, 0])] = 23, 24  # row 1 accepts 23, 24 (branch 2), then stops
    targets[1, int(tree.node_of[1, 2, 1])] = 0
    acc = accept_tree(tree, targets)
    assert acc.num_accepted.tolist() == [2, 2] and acc.winner.tolist() == [1, 2]
    A = 3
    cache.move(cache.lengths[:, None] + acc.path[:, :A], cache.lengths[:, None] + torch.arange(A))
    cache.crop(cache.lengths + acc.num_accepted + 1)

    chain = target.new_cache(2, 32)
    direct = torch.tensor([[1, 2, 3, 4, 5, 30, 11, 14], [6, 7, 8, 9, 10, 31, 23, 24]])
    ref = target(direct, cache=chain)
    chain.crop(torch.tensor([8, 8]))
    for layer in range(len(target.model.layers)):
        for got, want in ((cache.k[layer], chain.k[layer]), (cache.v[layer], chain.v[layer])):
            torch.testing.assert_close(got[:, :, :8], want[:, :, :8], rtol=1e-5, atol=1e-5)
    # and the tree's logits on the path equal the chain's
    path_logits = out.logits.gather(1, acc.path[:, :A, None].expand(-1, -1, out.logits.shape[-1]))
    torch.testing.assert_close(path_logits, ref.logits[:, 5:8], rtol=1e-4, atol=1e-4)


def test_vp_drafter_at_prefix_zero_is_the_dflash_drafter_and_branches_are_independent_blocks(tmp_path):
    target = make_target(seed=3, vocab=32)
    dflash = make_drafter(target, seed=4, block_size=5)
    vp = convert_drafter(dflash, "vp").eval()
    assert vp.arch_name == "vp" and sum(p.numel() for p in vp.parameters()) == sum(
        p.numel() for p in dflash.parameters())
    out = target(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), feature_layers=dflash.target_layer_ids)
    caches = []
    for d in (dflash, vp):
        c = d.new_cache(2, 32)
        d.ingest(c, out.features, torch.tensor([4, 3]))  # ragged contexts
        caches.append(c)
    block = torch.tensor([[9, 31, 31, 31, 31], [10, 31, 31, 31, 31]])
    h_d = dflash.draft_hidden(caches[0], dflash.block_embeds(block))
    h_v = vp.draft_hidden(caches[1], vp.block_embeds(block))
    assert torch.equal(h_d, h_v)
    # J blocks side by side in one pass == each block alone
    blocks = torch.tensor([[[9, 31, 31, 31, 31], [9, 12, 31, 31, 31], [9, 12, 13, 14, 31]],
                           [[10, 31, 31, 31, 31], [10, 15, 16, 31, 31], [10, 15, 31, 31, 31]]])
    together = vp.draft_branches(caches[1], vp.block_embeds(blocks.flatten(0, 1)).view(2, 3, 5, -1))
    for j in range(3):
        alone = vp.draft_hidden(caches[1], vp.block_embeds(blocks[:, j]))
        torch.testing.assert_close(together[:, j], alone, rtol=1e-5, atol=1e-5)
    # saved with its own config keys, loaded back as a VP drafter
    vp.config.vp.prefix_beta = 0.6
    save_drafter(vp, tmp_path / "vp")
    back = load_drafter(tmp_path / "vp", target)
    assert back.arch_name == "vp" and back.config.vp.prefix_beta == 0.6
    assert torch.equal(back.draft_hidden(caches[1], back.block_embeds(block)), h_v)


def test_random_trees_visit_every_branch_shape():
    random.seed(0)  # sanity of the walk's input space: random trees really share prefixes
    cands = torch.randint(0, 2, (64, 4, 3), generator=torch.Generator().manual_seed(0))
    tree = build_tree(torch.zeros(64, dtype=torch.long), cands)
    assert int(tree.num_nodes.min()) < 1 + 4 * 3 and int(tree.num_nodes.max()) > 1 + 3
