"""The end of every tree round (D²SD's, one-pass, merged): what the round hands back to the engine, and the accepted
path's K/V moved into the committed slots."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.tree import TreeAcceptance


class TreeRound(NamedTuple):
    """What a tree round (D²SD's or one-pass) hands back to the engine (the committed part of the target cache already
    compacted)."""

    draft_tokens: torch.Tensor  # [b, K] the winning candidate (its first num_accepted tokens are accepted)
    draft_logits: torch.Tensor  # [b, K, V] the first drafter's logits
    hidden: torch.Tensor  # [b, Bk, D] the first drafter's hidden states
    acceptance: TreeAcceptance
    path_logits: torch.Tensor  # [b, K + 1, V] the target's logits along the winner's path (index i scores slot i + 1)
    path_features: torch.Tensor | None  # [b, A, F] the target features of the root and the accepted nodes (A = 1 + max)
    num_nodes: torch.Tensor  # [b] real tree nodes verified (root included)


def commit_path(num_nodes: torch.Tensor, acc: TreeAcceptance, out, tcache, draft_tokens: torch.Tensor,
                draft_logits: torch.Tensor, hidden: torch.Tensor, clock: PhaseClock) -> TreeRound:
    """Move the accepted path's K/V into the committed slots after each row's cache (KV compaction) and gather its
    logits and target features: the end of every tree round (``out``: the target's pass over the tree's nodes)."""
    lengths = tcache.lengths
    A = int(acc.num_accepted.max()) + 1
    steps = torch.arange(A, device=lengths.device)
    tcache.move(lengths[:, None] + acc.path[:, :A], lengths[:, None] + steps)  # KV compaction
    features = None
    if out.features is not None:
        features = out.features.gather(1, acc.path[:, :A, None].expand(-1, -1, out.features.shape[-1]))  # [b, A, F]
    path_logits = out.logits.gather(1, acc.path[:, :, None].expand(-1, -1, out.logits.shape[-1]))  # [b, K + 1, V]
    clock.lap("compaction")
    return TreeRound(draft_tokens, draft_logits, hidden, acc, path_logits, features, num_nodes)
