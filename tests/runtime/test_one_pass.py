"""One-pass draft trees: the best-first shape against brute force, the ancestor mask, the walks, and the decoding
path through the losslessness harness (greedy equality with siblings winning, goodness of fit under sampling, and
the harness catching each wrong one-pass rule)."""

import functools
import itertools
import time

import pytest
import torch

from specdraft.runtime.cost_model import CostModel, extend_costs, measure_costs
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.node_budget import NodeBudget, budget_choices
from specdraft.runtime.one_pass import (
    OnePassDrafting,
    accept_nodes,
    accept_nodes_sampled,
    best_first,
    build_nodes,
    node_tokens,
)
from tests.helpers import chi2_pvalue, make_drafter, make_target, priced_budget
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


def _paths(shape, row):
    """node id -> tuple of ranks from the root (a node's path by the ranks of its ancestors)."""
    out = {0: ()}
    for i in range(shape.parent.shape[1]):
        if shape.valid[row, i]:
            out[i + 1] = out[int(shape.parent[row, i])] + (int(shape.rank[row, i]),)
    return out


@pytest.mark.parametrize("keep_chain", [False, True])
def test_best_first_keeps_the_likeliest_paths_as_a_tree(keep_chain):
    rng = torch.Generator().manual_seed(0)
    for trial in range(20):
        K, V, N = 3, 5, 1 + trial % 12 + 1
        q = torch.softmax(torch.randn(2, K, V, generator=rng) * 2, -1)
        top = q.topk(min(N - 1, V), dim=-1).values  # [2, K, W]
        shape = best_first(top, N, keep_chain)
        for row in range(2):
            paths = _paths(shape, row)
            assert len(paths) == N  # every node real: no path has probability 0
            assert all(len(p) == int(shape.depth[row, i - 1]) for i, p in paths.items() if i)
            for i, p in paths.items():  # a tree whose siblings are the ranks 0..m-1, every parent numbered first
                if p:
                    assert p[:-1] in paths.values() and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in paths.values())
                    assert i > next(j for j, o in paths.items() if o == p[:-1])
            prob = {p: float(torch.prod(torch.stack([top[row, d, r] for d, r in enumerate(p)]))) for p in
                    (x for L in range(1, K + 1) for x in itertools.product(range(top.shape[-1]), repeat=L))}
            chain = [(0,) * L for L in range(1, min(K, N - 1) + 1)] if keep_chain else []
            assert all(c in paths.values() for c in chain)
            best = sorted((v for p, v in prob.items() if p not in chain), reverse=True)[:N - 1 - len(chain)]
            got = sorted((prob[p] for p in paths.values() if p and p not in chain), reverse=True)
            assert got == pytest.approx(best, rel=1e-6), (trial, row)


def test_paths_of_probability_zero_are_padding_nodes():
    top = torch.tensor([[[1.0, 0.0], [0.6, 0.4]]])  # slot 1 has one token: one child at the root
    shape = best_first(top, 5)
    assert shape.valid.tolist() == [[True, True, True, False]]
    tree = build_nodes(torch.tensor([7]), shape, torch.tensor([[3, 4, 5, 6]]), 2)
    assert int(tree.num_nodes[0]) == 4 and tree.depth[0, 4] == 0 and tree.tokens[0, 4] == 7
    assert tree.mask[0, 4].nonzero().flatten().tolist() == [0, 4] and not tree.mask[0, :4, 4].any()


def test_mask_is_the_ancestor_relation_and_the_walk_follows_the_target():
    rng = torch.Generator().manual_seed(1)
    b, K, V, N = 16, 4, 6, 14
    q = torch.softmax(torch.randn(b, K, V, generator=rng) * 2, -1)
    top, ranked = q.topk(V, dim=-1)
    shape = best_first(top, N)
    tokens = ranked.gather(1, (shape.depth - 1)[:, :, None].expand(-1, -1, V)).gather(2, shape.rank[:, :, None])[
        ..., 0]
    tree = build_nodes(torch.zeros(b, dtype=torch.long), shape, tokens, K)
    targets = torch.randint(0, V, (b, N), generator=rng)
    acc = accept_nodes(tree, targets)
    for row in range(b):
        parent = [0] + shape.parent[row].tolist()
        for i in range(N):
            anc, j = {0, i}, i
            while j:
                j = parent[j]
                anc.add(j)
            assert set(tree.mask[row, i].nonzero().flatten().tolist()) == anc, (row, i)
        node, walked = 0, []  # a sequential walk: the child whose token is the target's, if any
        while True:
            nxt = [c for c in range(1, N) if parent[c] == node and int(tree.tokens[row, c]) == int(targets[row, node])]
            if not nxt:
                break
            node = nxt[0]
            walked.append(node)
        assert int(acc.num_accepted[row]) == len(walked) and acc.path[row, 1:1 + len(walked)].tolist() == walked
        assert int(acc.next_token[row]) == int(targets[row, node])


def _walk_law(tree, p, q, row: int = 0) -> dict[tuple[int, int], float]:
    """Recursive rejection sampling down ``tree``'s row, step by step, exactly: ``(last node, next token) ->
    probability``, siblings tried in rank order against ``q`` without the earlier ones and the target's distribution
    ``p`` [N, V] reduced after each rejection."""
    law: dict[tuple[int, int], float] = {}

    def visit(node: int, weight: float):
        target, draft = p[node].double(), q[min(int(tree.depth[row, node]), q.shape[0] - 1)].double()
        for kid in [int(c) for c in tree.children[row, node] if c > 0]:
            x = int(tree.tokens[row, kid])
            accept = min(1.0, float(target[x] / draft[x]))
            visit(kid, weight * accept)
            weight *= 1 - accept
            target = (target - draft).clamp_min(0)
            target, draft = target / target.sum(), draft.index_fill(0, torch.tensor([x]), 0.0)
            draft = draft / draft.sum()
        for v in range(p.shape[-1]):
            law[node, v] = law.get((node, v), 0.0) + weight * float(target[v])

    visit(0, 1.0)
    return law


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sampled_walk_on_a_fixed_tree_is_recursive_rejection_sampling(seed):
    """The vectorised walk (every node's move decided at once) against the step-by-step rule, on one tree repeated
    over a batch of draws: where it stops and the token it emits."""
    check_walk_law(seed, "cpu")


def check_walk_law(seed: int, device: str):
    """:func:`test_the_sampled_walk_on_a_fixed_tree_is_recursive_rejection_sampling` with the walk on ``device``."""
    rng = torch.Generator().manual_seed(seed)
    K, V, N, draws = 3, 5, 12, 40000
    q = torch.softmax(torch.randn(1, K, V, generator=rng) * 1.5, -1)  # [1, K, V]
    shape = best_first(q.topk(V, dim=-1).values, N)
    tokens = node_tokens(shape, q.topk(V, dim=-1).indices, q, rng)
    tree = build_nodes(torch.zeros(1, dtype=torch.long), shape, tokens, K)
    p = torch.softmax(torch.randn(N, V, generator=rng) * 0.7, -1)  # [N, V] the target after each node
    assert ((tree.children[0] > 0).sum(-1) > 1).sum() >= 3  # several nodes with siblings
    law = _walk_law(tree, p, q[0])
    many = tree._replace(**{k: getattr(tree, k).expand(draws, *getattr(tree, k).shape[1:]).to(device)
                            for k in tree._fields})
    walk_rng = torch.Generator(device=device).manual_seed(seed)
    acc = accept_nodes_sampled(many, p.expand(draws, N, V).to(device), q.expand(draws, K, V).to(device), walk_rng)
    acc = acc._replace(**{k: getattr(acc, k).cpu() for k in acc._fields})
    last = acc.path.gather(1, acc.num_accepted[:, None])[:, 0]
    counts = torch.zeros(N, V).index_put_((last, acc.next_token), torch.ones(draws), accumulate=True)
    probs = torch.zeros(N, V)
    for (node, v), w in law.items():
        probs[node, v] = w
    assert probs.sum().item() == pytest.approx(1.0) and (probs.sum(-1) > 0.01).sum() >= 4  # stops at 4+ nodes
    assert chi2_pvalue(counts, probs) > ALPHA
    assert (acc.winner > 0).any() and (acc.num_accepted >= 2).any()


def one_pass_factory(path: str, target, mode: str, block_size: int, nodes: int):
    """``prompts -> (first drafter, OnePassDrafting)``: a controlled first drafter (a wrong draft's runner-up is the
    target's token, so siblings win), alone or running a real DFlash drafter inside it."""
    inner = make_drafter(target, seed=2, block_size=block_size) if path == "dflash" else None
    return lambda prompts: (ControlledDrafter(target, prompts, block_size, mode=mode, inner=inner, right=0.6,
                                              runner_up=True), OnePassDrafting(nodes))


@pytest.mark.parametrize("nodes", [3, 8, 24])
@pytest.mark.parametrize("path", ["stub", "dflash"])
def test_one_pass_greedy_output_is_the_targets_with_siblings_winning(path, nodes):
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, one_pass_factory(path, target, "oracle", 6, nodes), RAGGED_PROMPTS, RAGGED_CAPS)
    assert got["mismatches"] == 0, got
    assert got["full"] or nodes < 6, got  # a chain of 5 drafts needs 6 nodes
    assert got["partial"] and got["stopped_rows"] > 0, got  # (siblings leave few rounds with nothing accepted)
    assert got["branch_wins"] > 0 or nodes < 4, got  # 3 nodes: a sibling never outscores the chain


def test_a_larger_node_budget_accepts_more():
    target = make_target(seed=3, vocab=48)
    tau = [check_greedy(target, one_pass_factory("stub", target, "oracle", 6, n), RAGGED_PROMPTS, RAGGED_CAPS)["tau"]
           for n in (6, 24)]
    assert tau[1] > tau[0] * 1.1, tau


def test_one_pass_with_continuous_batching():
    target = make_target(seed=3, vocab=48)
    engine = functools.partial(generate, slots=3, prefill_chunk=2)
    got = check_greedy(target, one_pass_factory("dflash", target, "oracle", 6, 12), RAGGED_PROMPTS, RAGGED_CAPS,
                       engine=engine)
    assert got["mismatches"] == 0 and got["branch_wins"] > 0 and got["stopped_rows"] > 0, got


ONE_PASS_SAMPLING = [("stub", p, d) for p in SAMPLING_SETTINGS for d in ("sample", "greedy")] + [
    ("dflash", SAMPLING_SETTINGS[1], "sample")]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "params", "drafts"), ONE_PASS_SAMPLING,
                         ids=lambda x: x if isinstance(x, str) else f"T{x.temperature:g}")
def test_one_pass_sampled_output_is_distributed_as_the_targets(path, params, drafts):
    """Siblings drawn without replacement go through recursive rejection sampling (a vocabulary of 6, so a node's
    children often exhaust the drafter's support); ranked siblings through the target-token walk."""
    target = make_target(seed=7, vocab=6, std=0.5)
    got = sampling_pvalues(target, one_pass_factory(path, target, "mix", 4, 8), params, draft_sampling=drafts)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5 and got.profile["full"], got.profile
    assert got.profile["branch_wins"] > 0, got.profile


@pytest.mark.slow
@pytest.mark.parametrize("rule", sorted(ONE_PASS_WRONG_RULES))
def test_the_harness_fails_on_a_wrong_one_pass_rule(rule, monkeypatch):
    nodes = {4: 8, 6: 12}  # by block size
    caught, got = wrong_rule_caught(ONE_PASS_WRONG_RULES[rule], monkeypatch,
                                    lambda target, mode, bk: one_pass_factory("stub", target, mode, bk, nodes[bk]),
                                    rule.startswith("sampled"), ALPHA)
    assert caught, (rule, got)


def _budget(cost):
    """A NodeBudget up to 96 nodes over synthetic verify costs ``cost(rows, nodes)`` (seconds)."""
    return priced_budget(16, 96, cost)


PEAKED = torch.tensor([[0.9 ** (i + 1) for i in range(95)]])  # a confident drafter: deep paths stay likely


def test_the_budget_grows_where_verifying_is_cheap_and_shrinks_where_it_is_not():
    assert budget_choices(16, 96) == (16, 24, 36, 54, 81, 96) and budget_choices(16, 8) == (8,)
    flat = _budget(lambda rows, n: 0.010)  # memory-bound: a bigger tree costs nothing more
    assert flat.choose(PEAKED, 0) == 96
    compute = _budget(lambda rows, n: 0.001 * rows * n)  # compute-bound: every node is paid for
    assert compute.choose(PEAKED.expand(32, -1), 0) == 16
    mixed = _budget(lambda rows, n: 0.010 + 0.0002 * rows * n)  # bigger trees at batch 1 than at batch 32
    assert mixed.choose(PEAKED, 0) > mixed.choose(PEAKED.expand(32, -1), 0)


def test_the_budget_times_one_chain_round_before_it_prices_chains_by_their_own_seconds():
    """Until a chain round ran, a chain would be priced by a tree round's seconds beyond its verify pass (drafting,
    building, walking): after the first tree round the budget runs one chain round, then chooses by both."""
    budget = _budget(lambda rows, n: 0.010)  # verifying costs the same at any size: the model picks the largest tree
    assert budget.choose(PEAKED, 0) == 96
    budget.observe(50.0, 40.0, nodes=96, rows=1, context=0, round_seconds=0.030)  # 20 ms beyond the verify pass
    assert budget.choose(PEAKED, 0) == 16
    budget.observe(10.0, 9.0, nodes=16, rows=1, context=0, round_seconds=0.012)  # a chain round: 2 ms beyond it
    assert budget.choose(PEAKED, 0) == 16  # about 7 tokens in 12 ms beat about 8 in 30 ms
    cheap = _budget(lambda rows, n: 0.010)
    cheap.observe(50.0, 40.0, nodes=96, rows=1, context=0, round_seconds=0.012)
    cheap.observe(10.0, 9.0, nodes=16, rows=1, context=0, round_seconds=0.012)
    assert cheap.choose(PEAKED, 0) == 96  # trees as cheap as chains: the largest


def test_the_budget_is_priced_at_the_rows_context():
    """Costs measured at two cache lengths: at 64 tokens a row a verify pass costs 10 ms whatever its size, at 256 the
    attention over the cache makes every node cost; the budget picks the largest tree at a short context and a smaller
    one at a long context, and a round's seconds beyond its pass are taken against the pass at its own context."""
    choices = budget_choices(16, 96)
    near = [[0.010] * len(choices)] * 2
    far = [[0.010 + 0.0005 * n for n in choices]] * 2
    budget = NodeBudget(choices, CostModel([1, 64], list(choices), far, [0.0, 0.0], {}, 256,
                                           {"context": 64, "target_s": near, "drafter_s": [0.0, 0.0]}))
    assert budget.choose(PEAKED, 64) == 96 and budget.choose(PEAKED, 256) < 96
    assert budget.observe_committed("built", 8.0, 96, 1, 64, 0.030) == pytest.approx(0.020)
    assert budget.observe_committed("built", 8.0, 96, 1, 256, 0.070) == pytest.approx(0.012)


def test_a_drafter_accepted_less_than_it_predicts_gets_smaller_trees():
    budget = _budget(lambda rows, n: 0.010 + 0.0002 * rows * n)
    before = budget.choose(PEAKED, 0, "T0")
    budget.observe(predicted=1000.0, accepted=50.0, nodes=16, rows=1, context=0, round_seconds=0.012, setting="T0")
    assert budget.choose(PEAKED, 0, "T0") < before
    assert budget.choose(PEAKED, 0, "T1") >= before  # calibrated per sampling setting


def test_a_budget_priced_by_this_machines_costs_is_lossless():
    """The budget priced by target passes timed on this machine (the drafter's block, then the budget's node counts
    added). Greedy output equals the target's on the ragged batch and with a stop token (its budget depends on the
    rows and on the timings, so rounds are not compared with one-row decoding)."""
    target = make_target(seed=3, vocab=48)
    choices = budget_choices(6, 24)
    pricing = make_drafter(target, seed=2, block_size=6)
    costs = measure_costs(target, pricing, rows=(1, 8), context=64, repeats=1, short_context=16)
    costs = extend_costs(costs, target, pricing, tokens=choices, repeats=1)
    assert set(choices) <= set(costs.tokens) and len(costs.short["target_s"][0]) == len(costs.tokens)
    budget = NodeBudget(choices, costs)
    drafter = one_pass_factory("dflash", target, "oracle", 6, 24)(RAGGED_PROMPTS)[0]
    for stop in ((), (7,)):
        gen = GenerationConfig(max_new_tokens=RAGGED_CAPS, stop_token_ids=stop)
        expected = [r.tokens for r in generate(target, RAGGED_PROMPTS, gen)]
        got = generate(target, RAGGED_PROMPTS, gen, drafter=drafter, tree=OnePassDrafting(24, budget=budget))
        assert [r.tokens for r in got] == expected
        assert sum(a > 1 for r in got for a in r.accept_lengths) > 0
    assert sum(budget.predicted.values()) > 0


def test_a_budget_is_refused_a_cost_model_without_its_node_counts():
    with pytest.raises(ValueError, match=r"no target passes of \[9, 14, 21, 24\] new tokens"):
        NodeBudget(budget_choices(6, 24), CostModel([1], [1, 6], [[1.0, 1.5]], [0.1]))


def test_a_budget_that_picks_the_block_runs_chain_rounds():
    target = make_target(seed=3, vocab=48)
    drafter = one_pass_factory("dflash", target, "oracle", 6, 24)(RAGGED_PROMPTS)[0]
    budget = priced_budget(6, 24, lambda rows, n: 1.0 * rows * n)  # compute-bound, far above a round's other seconds
    nodes: list[int] = []
    gen = GenerationConfig(max_new_tokens=RAGGED_CAPS)
    got = generate(target, RAGGED_PROMPTS, gen, drafter=drafter, tree=OnePassDrafting(24, budget=budget),
                   observer=lambda rec: nodes.extend(rec.nodes.tolist()))
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, RAGGED_PROMPTS, gen)]
    assert set(nodes) == {6} and sum(a > 1 for r in got for a in r.accept_lengths) > 0


def _builds(budget: NodeBudget, rounds: int, tree: tuple, chain: tuple) -> list[bool]:
    """``builds_tree`` over ``rounds`` rounds, each observed as a tree round ``(accepted, seconds)`` or a chain one."""
    out = []
    for _ in range(rounds):
        built = budget.builds_tree()
        accepted, seconds = tree if built else chain
        budget.observe_committed("built" if built else "chain", accepted, 16, 1, 0, seconds)
        out.append(built)
    return out


def test_where_trees_lose_the_tree_is_built_again_after_longer_and_longer_waits():
    budget = _budget(lambda rows, n: 0.010)
    seen = _builds(budget, 40, tree=(8.0, 0.030), chain=(7.0, 0.012))  # the chain: more tokens a second
    assert seen[:2] == [True, False]  # each kind once
    tries = [i for i, b in enumerate(seen) if b][1:]
    assert len(tries) >= 3 and all(b - a > 1 for a, b in zip(tries, tries[1:]))
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], gaps  # waits grow while trees keep losing
    budget = _budget(lambda rows, n: 0.010)
    seen = _builds(budget, 40, tree=(8.0, 0.012), chain=(7.0, 0.012))  # trees win: chains are the rare tries
    assert sum(seen) > 30 and not all(seen[2:])


def test_a_kind_that_starts_winning_is_taken():
    budget = _budget(lambda rows, n: 0.010)
    _builds(budget, 30, tree=(8.0, 0.030), chain=(7.0, 0.012))
    seen = _builds(budget, 200, tree=(12.0, 0.012), chain=(7.0, 0.012))  # trees got cheap: they are re-timed
    assert sum(seen[-50:]) > 45


def test_the_kind_of_round_that_commits_less_a_second_is_built_less(monkeypatch):
    """Greedy output equals the target's; with the tree's construction made slow most rounds verify the drafter's
    block without building it, with the chain's pass made slow most rounds build the tree."""
    from specdraft.runtime import one_pass  # noqa: PLC0415  (slowed down on purpose)

    target = make_target(seed=3, vocab=48)
    drafter = one_pass_factory("dflash", target, "oracle", 6, 24)(RAGGED_PROMPTS)[0]
    gen = GenerationConfig(max_new_tokens=60)
    expected = [r.tokens for r in generate(target, RAGGED_PROMPTS, gen)]
    shape_of, chain_of, built = one_pass.tree_shape, one_pass.verify_chain, {}

    def slow(fn):
        return lambda *a: time.sleep(0.1) or fn(*a)

    for slowed in ("tree", "chain"):
        calls, rounds = [], []
        monkeypatch.setattr(one_pass, "tree_shape", lambda *a: calls.append(1) or (
            slow(shape_of) if slowed == "tree" else shape_of)(*a))
        monkeypatch.setattr(one_pass, "verify_chain", slow(chain_of) if slowed == "chain" else chain_of)
        got = generate(target, RAGGED_PROMPTS, gen, drafter=drafter,
                       tree=OnePassDrafting(24, budget=priced_budget(6, 24, lambda rows, n: 1e-4)),
                       observer=lambda rec: rounds.append(1))
        assert [r.tokens for r in got] == expected
        built[slowed] = len(calls) / len(rounds)
    assert built["tree"] < 0.5 and built["chain"] > 0.7, built


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["sample", "greedy"])
def test_chain_rounds_of_a_measured_budget_under_sampling_are_distributed_as_the_targets(drafts):
    target = make_target(seed=7, vocab=6, std=0.5)
    budget = priced_budget(4, 8, lambda rows, n: 1.0 * rows * n)
    f = one_pass_factory("stub", target, "mix", 4, 8)
    got = sampling_pvalues(target, lambda prompts: (f(prompts)[0], OnePassDrafting(8, budget=budget)),
                           SAMPLING_SETTINGS[1], draft_sampling=drafts)
    assert got.min_p > ALPHA, got
    assert got.profile["tau"] > 1.5 and got.profile["full"], got.profile
