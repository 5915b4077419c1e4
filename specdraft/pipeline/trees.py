"""Tree rounds from a run config: D²SD's second drafter next to a first (DFlash) drafter, checked against it, the
one-pass tree of a DFlash drafter, and the two merged."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from specdraft.errors import SpecdraftError
from specdraft.pipeline.config import RunConfig
from specdraft.runtime.cost_model import CostModel
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.node_budget import NodeBudget, budget_choices
from specdraft.runtime.one_pass import OnePassDrafting

FIRST_DRAFTERS = ("dflash", "vp")
"""Architectures a tree round can draft first with (no cross-round state)."""


def tree_drafting(cfg: RunConfig, target, first, num_branches: int | None = None,
                  load: Callable[[Path], object] | None = None) -> TreeDrafting:
    """The :class:`TreeDrafting` of ``decode.second_drafter`` / ``decode.tree_placement`` with ``num_branches``
    (default ``decode.tree_k``) for ``first``; a mismatch is one clear error before any decoding. ``load`` reads the
    second drafter's directory (default the torch drafter bound to ``target``; an engine backend reads its export)."""
    k = num_branches or cfg.decode.tree_k
    if first.arch_name not in FIRST_DRAFTERS:
        raise SpecdraftError(f"config key 'decode.method': d2sd drafts first with a {' or '.join(FIRST_DRAFTERS)} "
                             f"drafter, not {first.arch_name!r} (its cross-round state has no meaning in a tree)")
    if not 1 <= k <= first.block_size - 2:
        raise SpecdraftError(f"config key 'decode.tree_k': {k} branches need 1..{first.block_size - 2} boundaries "
                             f"(block size {first.block_size})")
    where = cfg.second_drafter_dir()
    second = first
    if where is not None:
        if not (where / "config.json").is_file():
            raise SpecdraftError(f"config key 'decode.second_drafter': no drafter at {where}; train one with "
                                 "train.stage=vp, or set decode.second_drafter (a directory, an export name, or "
                                 "'same')")
        second = load(where) if load is not None else load_drafter(where, target)
    tree = TreeDrafting(second, k, cfg.decode.tree_placement, cfg.decode.tree_distinct)
    try:
        tree.check(first)
    except ValueError as e:
        raise SpecdraftError(f"config key 'decode.second_drafter': {where}: {e}") from None
    return tree


Prices = Callable[[tuple[int, ...]], CostModel]
"""The machine's cost model holding target passes of the given token counts (:func:`~specdraft.pipeline.policy.
machine_costs` bound to a job's target and drafter): what a measured node budget prices its trees by."""


def one_pass_drafting(cfg: RunConfig, first, nodes: int | None = None, budget: str | None = None,
                      prices: Prices | None = None) -> OnePassDrafting:
    """The :class:`OnePassDrafting` of ``nodes`` (default ``decode.tree_nodes``) spent as ``budget`` (default
    ``decode.tree_budget``; ``measured`` priced by ``prices``) for ``first``, refused in one line unless ``first``
    keeps no cross-round state."""
    if first.arch_name not in FIRST_DRAFTERS:
        raise SpecdraftError(f"config key 'decode.method': ddtree drafts with a {' or '.join(FIRST_DRAFTERS)} drafter, "
                             f"not {first.arch_name!r} (its cross-round state has no meaning in a tree)")
    nodes = nodes or cfg.decode.tree_nodes
    return OnePassDrafting(nodes, cfg.decode.tree_chain, node_budget(cfg, first, nodes, budget, prices))


def merged_drafting(cfg: RunConfig, first, branches: TreeDrafting, nodes: int | None = None,
                    budget: str | None = None, prices: Prices | None = None) -> MergedDrafting:
    """The :class:`MergedDrafting` of D²SD's ``branches`` (:func:`tree_drafting`'s) and the
    one-pass tree of ``first``, ``nodes`` (default ``decode.tree_nodes``) spent as ``budget`` (default
    ``decode.tree_budget``; ``measured`` priced by ``prices``), checked before any decoding."""
    nodes = nodes or cfg.decode.tree_nodes
    merged = MergedDrafting(branches, nodes, cfg.decode.tree_chain,
                            node_budget(cfg, first, nodes, budget, prices))
    try:
        merged.check(first)
    except ValueError as e:
        raise SpecdraftError(f"config key 'decode.tree_nodes': {e}") from None
    return merged


def node_budget(cfg: RunConfig, first, nodes: int, budget: str | None = None,
                prices: Prices | None = None) -> NodeBudget | None:
    """A :class:`NodeBudget` up to ``nodes`` priced by ``prices`` when ``budget`` (default ``decode.tree_budget``) is
    measured."""
    if (budget or cfg.decode.tree_budget) != "measured":
        return None
    if prices is None:
        raise ValueError("a measured node budget needs the machine's prices (pipeline.policy.machine_costs)")
    choices = budget_choices(first.block_size, nodes)
    return NodeBudget(choices, prices(choices))
