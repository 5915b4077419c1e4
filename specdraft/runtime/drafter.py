"""What the decode engine needs from a drafter: the :class:`Drafter` protocol, and the per-round record an observer
of :func:`~specdraft.runtime.decode.generate` receives.

DFlash and ReTrace implement the protocol (``runtime/models``); so must every engine backend (an exported ONNX or
TensorRT drafter) and every test stub. A round, per active row: ``block_embeds`` of ``[anchor, MASK x K]`` given the
cross-round state -> ``draft_hidden`` against the drafter's context cache -> ``logits`` of slots 1..K -> the target
verifies -> ``ingest`` the committed tokens' target features -> ``next_round_state``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Drafter(Protocol):
    """A block drafter the decode engine can run.

    ``config.mask_token_id`` is the token of the block's draft slots. The cross-round state is ``None`` or an object
    with ``select(rows) -> state`` (rows kept when finished rows are compacted away), ``blank(n) -> state`` (``n`` rows
    that carry nothing) and ``cat(state) -> state`` (rows admitted by continuous batching).
    """

    config: Any

    @property
    def block_size(self) -> int:
        """Tokens per block: the anchor and ``K = block_size - 1`` draft slots."""
        ...

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (the target returns their features)."""
        ...

    def new_cache(self, batch_size: int, max_len: int) -> Any:
        """A context cache for ``batch_size`` rows of up to ``max_len`` tokens (``select_rows(rows)`` keeps ``rows``,
        in the given order, which need not be sorted; ``cat_rows(cache)`` appends another's rows; an optional
        ``reserve(rows)`` makes room once for the rows continuous batching will hold)."""
        ...

    def ingest(self, cache: Any, ctx_features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """Append the first ``counts[b]`` rows of ``ctx_features`` ``[b, T, F]`` to each row's context; returns what
        :meth:`next_round_state` reads as ``target_context`` (``[b, T, D]``), or None."""
        ...

    def block_embeds(self, block_tokens: torch.Tensor, state: Any) -> torch.Tensor:
        """Input embeddings ``[b, Bk, D]`` of blocks ``[b, Bk]`` given the cross-round state."""
        ...

    def draft_hidden(self, cache: Any, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[b, Bk, D]`` of one block per row, anchored right after each row's context."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[..., V]`` of hidden states ``[..., D]``."""
        ...

    def next_round_state(self, state: Any, hidden: torch.Tensor, draft_tokens: torch.Tensor,
                         num_accepted: torch.Tensor, target_logits: torch.Tensor, target_context: Any) -> Any:
        """The state carried into the next round (``None`` for a stateless drafter)."""
        ...


@dataclass
class RoundRecord:
    """One verify round of :func:`generate`, as an observer sees it (tensors are the engine's own; do not modify)."""

    rows: torch.Tensor  # [b] original row index of each active row
    draft_tokens: torch.Tensor  # [b, K] drafted tokens (K = 0 for the target alone)
    draft_logits: torch.Tensor | None  # [b, K, V] the drafter's logits (None for the target alone)
    hidden: torch.Tensor | None  # [b, Bk, D] the drafter's hidden states of the block (None for the target alone and
    #   from the static path, whose captured draft step returns logits only)
    num_accepted: torch.Tensor  # [b] accepted drafts
    next_tokens: torch.Tensor  # [b] the target's token after the accepted drafts (the next anchor)
    target_logits: torch.Tensor | None  # [b, K + 1, V] the verify pass's logits (index i scores slot i + 1); None
    #   from an executor that never makes them (the static path's argmax heads)
    nodes: torch.Tensor | None = None  # [b] D²SD: tree nodes verified (then draft_tokens is the winning candidate,
    #   target_logits are along its path and draft_logits/hidden are the first drafter's)
    winner: torch.Tensor | None = None  # [b] D²SD: the winning candidate (0 = the first draft)
