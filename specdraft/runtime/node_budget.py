"""How many tree nodes a round verifies: the budget that maximises expected committed tokens per second.

Each round of a one-pass tree (:mod:`specdraft.runtime.one_pass`) the best-first tree is built at the largest budget;
its nodes come in best-first order, so its first ``n`` nodes are the best tree of ``n``. For each allowed ``n`` the
batch commits ``sum over rows of 1 + c * sum_{i < n} P_i`` tokens in expectation: ``P_i`` is the drafter's
probability of node ``i``'s path (what the walk accepts node ``i`` with, were the drafter calibrated) and ``c`` the
calibration, drafts accepted over drafts predicted over the rounds so far (one pseudo-round of each to start). The
round costs the target's verify pass of ``rows x n`` tokens, priced by the machine's cost model at the rows' context
(:class:`~specdraft.runtime.cost_model.CostModel`, measured once per machine and models, as the adaptive policy's),
plus the rest of a round (drafter, tree, walk, compaction), measured from the rounds so far apart for chain rounds
and tree rounds. At a large batch, where a verify pass is compute-bound, the trees shrink (down to the drafter's own
block when it is kept first); at batch 1 they grow.

Building the tree costs a round time whatever the budget then picks, so before it a round asks
:meth:`NodeBudget.builds_tree`: the committed tokens per second of the rounds that built a tree against those of
the chain rounds that did not, each kind tried again now and then while it loses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.runtime.cost_model import CostModel, priced_context

MAX_PATIENCE = 64
"""Rounds of the winning kind, at most, between two tries of the losing one (:meth:`NodeBudget.builds_tree`)."""


@dataclass
class NodeBudget:
    choices: tuple[int, ...]
    """Node budgets a round may verify (the root included), ascending."""
    costs: CostModel
    """The machine's costs, holding target passes of every choice's tokens (:func:`~specdraft.pipeline.policy.
    machine_costs`)."""
    overhead_s: dict[str, float] = field(default_factory=dict)
    """Per round kind (``chain``: the drafter's block alone, ``tree``): the round's seconds beyond its priced verify
    pass (the drafter, the tree's construction, the walk, the compaction), exponentially averaged."""
    accepted: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)
    """Per sampling setting: drafts accepted and the tree's predicted acceptance, summed over the rounds so far."""
    committed: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``built`` (rounds that built a tree, whatever budget they verified) and ``chain`` (chain rounds that did not):
    tokens committed per row and seconds per round (the priced verify pass and the rest), exponentially averaged (the
    winning kind's rounds by 0.2, the losing kind's rarer ones by 0.5)."""
    patience: int = 1
    """Rounds of the winning kind before the losing one is tried again (doubling while it keeps losing)."""
    wait: int = 1
    """Rounds of the winning kind left before that try."""
    tree_won: bool = True
    """The winner at the last comparison: rounds that built a tree (True) or chain rounds that did not."""

    def __post_init__(self):
        missing = sorted(set(self.choices) - set(self.costs.tokens))
        if missing:
            raise ValueError(f"the cost model has no target passes of {missing} new tokens to price the budget by")

    def price(self, rows: int, context: float, nodes: int) -> float:
        """Seconds of a verify pass of ``nodes`` tokens on ``rows`` rows against ``context`` tokens of cache a row."""
        return self.costs.at(priced_context(context)).target(rows, nodes)

    def choose(self, node_probs: torch.Tensor, context: float, setting: str = "") -> int:
        """The budget to verify this round.

        Args:
            node_probs: ``[b, M]`` each non-root node's path probability, in the tree's best-first node order.
            context: the rows' mean tokens of cache.
            setting: the sampling setting the calibration is kept for.
        """
        b = node_probs.shape[0]
        cum = torch.cat([node_probs.new_zeros(b, 1), node_probs.double().cumsum(-1)], 1).sum(0).tolist()  # [M + 1]
        c = (self.accepted.get(setting, 0.0) + 1.0) / (self.predicted.get(setting, 0.0) + 1.0)
        best, best_rate = self.choices[0], -1.0
        for n in self.choices:
            tokens = b + c * cum[min(n - 1, len(cum) - 1)]
            rate = tokens / (self.overhead(self.kind(n)) + self.price(b, context, n))
            if rate > best_rate:
                best, best_rate = n, rate
        if self.kind(best) == "tree" and "tree" in self.overhead_s and "chain" not in self.overhead_s:
            return self.choices[0]  # once: the chain's own seconds, not the trees' borrowed
        return best

    def kind(self, nodes: int) -> str:
        """``chain`` for the smallest choice (the drafter's block: a chain round when the block is kept first)."""
        return "chain" if nodes == self.choices[0] else "tree"

    def overhead(self, kind: str) -> float:
        """A round's seconds beyond its verify pass; a kind not seen yet borrows the other's (0 before any round).
        :meth:`choose` runs one chain round after the first tree round, so a chain is not priced by a tree's drafting,
        building and walking."""
        return self.overhead_s.get(kind, self.overhead_s.get("tree" if kind == "chain" else "chain", 0.0))

    def builds_tree(self) -> bool:
        """Whether this round builds its tree (and :meth:`choose` prices it) or verifies the drafter's block alone:
        a tree first, then a chain, then whichever commits more tokens a second, the other tried again after
        ``patience`` rounds (1, 2, 4, .. up to :data:`MAX_PATIENCE` while it keeps losing), so a kind is re-timed as
        the batch and the context change and a slow first round does not decide the job."""
        if "built" not in self.committed or "chain" not in self.committed:
            return "built" not in self.committed
        (bt, bs), (ct, cs) = self.committed["built"], self.committed["chain"]
        tree_wins = bt * cs >= ct * bs
        if tree_wins != self.tree_won:
            self.tree_won, self.patience, self.wait = tree_wins, 1, 1
        if self.wait > 0:
            self.wait -= 1
            return tree_wins
        self.patience = min(2 * self.patience, MAX_PATIENCE)
        self.wait = self.patience
        return not tree_wins

    def observe_committed(self, kind: str, accepted: float, nodes: int, rows: int, context: float,
                          round_seconds: float) -> float:
        """A round's accepted drafts (summed over rows), the budget it verified at ``rows`` rows and ``context``
        tokens of cache a row, and its wall seconds, for :meth:`builds_tree`; returns its seconds beyond the priced
        verify pass. Kept per row and in units of a chain's verify pass at the round's rows and context, so rounds of
        a batch that shrinks as its requests finish, and whose context grows, compare."""
        verify = self.price(rows, context, nodes)
        extra = max(round_seconds - verify, 0.0)
        unit = self.price(rows, context, self.choices[0]) or round_seconds  # a chain's verify pass at these rows
        now = (1.0 + accepted / rows, (extra + verify) / max(unit, 1e-12))
        w = 0.2 if (kind == "built") == self.tree_won else 0.5  # the losing kind's rare tries count more
        self.committed[kind] = tuple((1 - w) * a + w * x for a, x in zip(self.committed.get(kind, now), now))
        return extra

    def observe(self, predicted: float, accepted: float, nodes: int, rows: int, context: float,
                round_seconds: float, setting: str = "") -> None:
        """A round's predicted and accepted drafts (summed over rows), the budget it verified at ``rows`` rows and
        ``context`` tokens of cache a row, and its wall seconds, for a round that built its tree."""
        extra = self.observe_committed("built", accepted, nodes, rows, context, round_seconds)
        self.predicted[setting] = self.predicted.get(setting, 0.0) + predicted
        self.accepted[setting] = self.accepted.get(setting, 0.0) + accepted
        kind = self.kind(nodes)
        self.overhead_s[kind] = extra if kind not in self.overhead_s else 0.8 * self.overhead_s[kind] + 0.2 * extra


def budget_choices(block_size: int, nodes: int) -> tuple[int, ...]:
    """The drafter's block, then about 1.5 times more each step, up to ``nodes``."""
    out, n = [], min(block_size, nodes)
    while n < nodes:
        out.append(n)
        n = max(n + 1, round(n * 1.5))
    return (*out, nodes)
