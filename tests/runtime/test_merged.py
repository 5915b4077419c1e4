"""Merged trees (D²SD's branches and the one-pass tree's paths, the best N of both): the shape against a brute-force
union, and the decoding path through the losslessness harness (greedy equality with branches and siblings winning,
goodness of fit under sampling, a measured budget, the harness catching a wrong walk)."""

import functools

import pytest
import torch

from specdraft.runtime.d2sd import Candidates, TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.merged import MergedDrafting, candidate_log_probs, merged_shape, one_pass_part
from specdraft.runtime.one_pass import OnePassDrafting, node_tokens
from tests.helpers import make_drafter, make_target, priced_budget
from tests.lossless import (
    ONE_PASS_WRONG_RULES,
    RAGGED_CAPS,
    RAGGED_PROMPTS,
    SAMPLING_SETTINGS,
    ControlledDrafter,
    check_greedy,
    sampling_pvalues,
    wrong_rule_caught,
)

ALPHA = 1e-3


def _random_candidates(rng, b, J, K, V):
    """The first draft (q1's argmax) and J branches copying a prefix of it, each a distinct length, then own tokens
    (often the first draft's again, so branches share nodes with it and with the one-pass tree)."""
    q1 = torch.softmax(torch.randn(b, K, V, generator=rng) * 2, -1)
    q2 = torch.softmax(torch.randn(b, J, K, V, generator=rng) * 2, -1)
    first = q1.argmax(-1)  # [b, K]
    lengths = torch.stack([torch.randperm(K - 1, generator=rng)[:J].sort().values for _ in range(b)])  # [b, J]
    known = torch.arange(K)[None, None] < lengths[:, :, None]  # [b, J, K]
    own = torch.where(torch.rand(b, J, K, generator=rng) < 0.5, q2.argmax(-1), first[:, None].expand(-1, J, -1))
    branch = torch.where(known, first[:, None], own)
    proposes = torch.cat([torch.ones(b, 1, K, dtype=torch.bool), ~known], 1)
    cands = Candidates(torch.cat([first[:, None], branch], 1), None, proposes, q1.log(), None, q2.log())
    return cands, q1, q2


def _paths(shape, tokens, row):
    """node id -> its token path from the root."""
    out = {0: ()}
    for i in range(shape.parent.shape[1]):
        if shape.valid[row, i]:
            out[i + 1] = out[int(shape.parent[row, i])] + (int(tokens[row, i]),)
    return out


@pytest.mark.parametrize("keep_chain", [False, True])
def test_merged_shape_is_the_best_nodes_of_the_union_as_a_tree(keep_chain):
    rng = torch.Generator().manual_seed(0)
    b, J, K, V = 3, 2, 4, 5
    for trial in range(12):
        nodes = 3 + 2 * trial
        cands, q1, q2 = _random_candidates(rng, b, J, K, V)
        one, ranked = one_pass_part(q1, nodes, keep_chain)
        shape, tokens = merged_shape(torch.zeros(b, dtype=torch.long), cands, one, ranked, q1, q2, keep_chain)
        # the union by brute force: each one-pass node and each candidate's prefix, by token path, the best score
        one_tok = node_tokens(one, ranked, None, None)
        lp = candidate_log_probs(cands, q1.log(), q2.log())  # [b, J + 1, K]
        for row in range(b):
            union: dict[tuple, float] = {}
            for i, p in _paths(one, one_tok, row).items():
                if i:
                    union[p] = float(one.log_prob[row, i - 1])
            for c in range(J + 1):
                for k in range(K):
                    p = tuple(cands.tokens[row, c, :k + 1].tolist())
                    union[p] = max(union.get(p, float("-inf")), float(lp[row, c, k]))
            chain = {tuple(cands.tokens[row, 0, :k + 1].tolist()) for k in range(K)} if keep_chain else set()
            best = sorted(union, key=lambda p: (p in chain, union[p], -len(p)), reverse=True)[:nodes - 1]
            got = _paths(shape, tokens, row)
            assert len(got) == min(nodes, len(union) + 1), (trial, row)
            assert len(set(got.values())) == len(got)  # every picked node a distinct path (twins merged)
            for i, p in got.items():  # a tree numbered best-first: each parent before its children
                if i:
                    parent = int(shape.parent[row, i - 1])
                    assert parent < i and got[parent] == p[:-1] and int(shape.depth[row, i - 1]) == len(p)
                    assert float(shape.log_prob[row, i - 1]) == pytest.approx(union[p], abs=1e-9)
            siblings = {}
            for i in range(1, len(got)):  # ranks 0..m-1 among each node's children, the first-numbered first
                siblings.setdefault(int(shape.parent[row, i - 1]), []).append(int(shape.rank[row, i - 1]))
            assert all(r == list(range(len(r))) for r in siblings.values())
            scores = sorted((union[p] for p in got.values() if p), reverse=True)
            assert scores == pytest.approx(sorted((union[p] for p in best), reverse=True), abs=1e-9), (trial, row)
            assert chain <= set(got.values()) or len(got) < len(chain) + 1


def _drafters(target, prompts, mode: str, block_size: int, second_right: float, inner=(None, None)):
    """A controlled first drafter (a wrong draft's runner-up is the target's token, so one-pass siblings win) and a
    controlled second drafter re-drafting along the target's path, right with ``second_right`` a slot (``inner``: the
    real drafters each runs inside it)."""
    first = ControlledDrafter(target, prompts, block_size, mode=mode, inner=inner[0], right=0.6, runner_up=True)
    second = ControlledDrafter(target, prompts, block_size, mode=mode, inner=inner[1], seed=1, right=second_right,
                               alternative=mode == "mix")
    return first, second


def merged_factory(target, mode: str, block_size: int, nodes: int, second_right: float = 0.5, budget=None,
                   path: str = "stub"):
    """``prompts -> (first drafter, MergedDrafting)`` over :func:`_drafters` (with ``path="dflash"`` each runs a real
    DFlash drafter inside it)."""
    inner = (make_drafter(target, seed=2, block_size=block_size), make_drafter(target, seed=4, block_size=block_size)
             ) if path == "dflash" else (None, None)

    def build(prompts):
        first, second = _drafters(target, prompts, mode, block_size, second_right, inner)
        return first, MergedDrafting(TreeDrafting(second, 2), nodes, budget=budget() if budget else None)
    return build


@pytest.mark.parametrize("nodes", [3, 12, 24])
@pytest.mark.parametrize("path", ["stub", "dflash"])
def test_merged_greedy_output_is_the_targets_with_branches_and_siblings_winning(path, nodes):
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, merged_factory(target, "oracle", 6, nodes, path=path), RAGGED_PROMPTS, RAGGED_CAPS)
    assert got["mismatches"] == 0, got
    assert got["full"] or nodes < 6, got
    assert got["partial"] and got["stopped_rows"] > 0, got
    assert got["branch_wins"] > 0 or nodes < 4, got


def test_merged_with_continuous_batching():
    target = make_target(seed=3, vocab=48)
    engine = functools.partial(generate, slots=3, prefill_chunk=2)
    got = check_greedy(target, merged_factory(target, "oracle", 6, 12, path="dflash"), RAGGED_PROMPTS, RAGGED_CAPS,
                       engine=engine)
    assert got["mismatches"] == 0 and got["branch_wins"] > 0 and got["stopped_rows"] > 0, got


def test_a_right_second_drafter_makes_the_merged_tree_accept_more_than_the_one_pass_tree():
    """At the same node budget, branches that continue the target's path from the first draft's likely rejection
    points hold accepted drafts the first drafter's own siblings miss; a second drafter that is always wrong adds
    nothing the one-pass tree lacks (its branches score low)."""
    target = make_target(seed=3, vocab=48)
    tau = {}
    for name, right in (("right", 1.0), ("wrong", 0.0)):
        tau[name] = check_greedy(target, merged_factory(target, "oracle", 6, 12, second_right=right), RAGGED_PROMPTS,
                                 RAGGED_CAPS)["tau"]

    def one_pass(prompts):
        return _drafters(target, prompts, "oracle", 6, 0.5)[0], OnePassDrafting(12)
    tau["one-pass"] = check_greedy(target, one_pass, RAGGED_PROMPTS, RAGGED_CAPS)["tau"]
    assert tau["right"] > 1.1 * tau["one-pass"], tau
    assert tau["wrong"] == pytest.approx(tau["one-pass"], rel=0.1), tau


SMALL_PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]


def test_a_measured_budget_on_a_merged_tree_is_lossless_and_shrinks_where_nodes_cost():
    """Real DFlash and VP drafters on a six-token vocabulary. Greedy output equals the target's on the ragged batch
    and with a stop token (the budget depends on the rows, so rounds are not compared with one-row decoding); where
    every node is paid for the rounds are chains (the second drafter then does not draft), where nodes are free the
    trees fill the budget."""
    target = make_target(seed=7, vocab=6, std=1.0)
    first = make_drafter(target, seed=2, block_size=5, std=0.3)
    second = convert_drafter(make_drafter(target, seed=5, block_size=5, std=0.3), "vp")
    sizes = {}
    for name, cost in (("compute", lambda rows, n: 1.0 * rows * n), ("free", lambda rows, n: 1.0)):
        sizes[name] = []
        for stop in ((), (3,)):
            budget = priced_budget(5, 16, cost)
            gen = GenerationConfig(max_new_tokens=RAGGED_CAPS, stop_token_ids=stop)
            got = generate(target, SMALL_PROMPTS, gen, drafter=first,
                           tree=MergedDrafting(TreeDrafting(second, 2), 16, budget=budget),
                           observer=lambda rec, out=sizes[name]: out.extend(rec.nodes.tolist()))
            assert [r.tokens for r in got] == [r.tokens for r in generate(target, SMALL_PROMPTS, gen)]
            assert sum(a > 1 for r in got for a in r.accept_lengths) > 0
    assert set(sizes["compute"]) == {5}, set(sizes["compute"])
    assert max(sizes["free"]) == 16 and sum(n > 5 for n in sizes["free"]) > len(sizes["free"]) // 2, sizes["free"]


@pytest.mark.slow
@pytest.mark.parametrize("params", SAMPLING_SETTINGS[:2], ids=lambda p: f"T{p.temperature:g}")
@pytest.mark.parametrize("drafts", ["sample", "greedy"])
def test_merged_under_sampling_is_distributed_as_the_targets(params, drafts):
    """Ranked drafts (``greedy``): the merged tree, the walk sampling the target at each node. Sampled drafts: the
    one-pass tree of sampled siblings."""
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, merged_factory(target, "mix", 4, 8), params, draft_sampling=drafts)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5 and got.profile["full"] and got.profile["branch_wins"] > 0, got.profile


def test_merged_under_sampled_drafts_decodes_as_the_one_pass_tree():
    """Under sampling with sampled drafts a merged job verifies the one-pass tree of its budget: the same tokens as a
    ddtree job from the same seed, its second drafter never used (with a measured budget too, whose choices follow
    the rounds' wall seconds, so its tokens are not compared)."""
    target = make_target(seed=3, vocab=48)
    first, second = _drafters(target, RAGGED_PROMPTS, "mix", 6, 0.5, (None, None))
    gen = GenerationConfig(max_new_tokens=24, sampling=SAMPLING_SETTINGS[1])
    def run(tree):
        return [r.tokens for r in generate(target, RAGGED_PROMPTS, gen, drafter=first, tree=tree,
                                           generator=torch.Generator().manual_seed(0))]
    used = []  # the second drafter's cache, context and drafts: none of them
    for name in ("new_cache", "ingest", "draft_branches", "next_round_state"):
        setattr(second, name, lambda *a, name=name: used.append(name))
    assert run(MergedDrafting(TreeDrafting(second, 2), 12)) == run(OnePassDrafting(12))
    measured = run(MergedDrafting(TreeDrafting(second, 2), 12,
                                  budget=priced_budget(6, 12, lambda rows, n: 1e-3 * rows * n)))
    assert len(measured) == len(RAGGED_PROMPTS) and not used, used


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["tree mask lets a node see the nodes numbered before it",
                                  "token after the accepted path taken at the root"])
def test_the_harness_fails_on_a_wrong_merged_rule(rule, monkeypatch):
    caught, got = wrong_rule_caught(ONE_PASS_WRONG_RULES[rule], monkeypatch,
                                    lambda target, mode, bk: merged_factory(target, mode, bk, {4: 8, 6: 12}[bk]),
                                    False, ALPHA)
    assert caught, (rule, got)
