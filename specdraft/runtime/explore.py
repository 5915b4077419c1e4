"""An adaptive policy's exploring rounds: a few rows draft while the others decode plainly, and their drafts may be
verified in a target pass of their own rows (:func:`verify_apart`)."""

from __future__ import annotations

import torch

from specdraft.runtime.models.target import TargetOutput


def explores_rows(drafter, cache) -> bool:
    """Whether a few rows can draft while the others decode plainly: the drafter carries no state between rounds and
    ingests for a subset of rows (``ingest_rows``), and its cache lends copies of rows (``gather_rows``)."""
    return (not getattr(drafter, "carries_state", True) and getattr(drafter, "ingest_rows", None) is not None
            and getattr(cache, "gather_rows", None) is not None)


def verifies_apart(cache) -> bool:
    """Whether a few rows can verify in a target pass of their own: the target's cache lends copies of rows
    (``gather_rows``) and takes their new entries back (``put_rows``)."""
    return getattr(cache, "gather_rows", None) is not None and getattr(cache, "put_rows", None) is not None


def verify_apart(target, cache, anchor: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor,
                  feature_layers) -> TargetOutput:
    """Verify ``drafts`` ``[m, k]`` of rows ``rows`` ``[m]`` in a pass of those rows alone, after a plain pass of every
    row's ``anchor`` ``[b]``: the pass over ``[anchor, d_1..d_k]`` that :func:`generate` verifies, as ``logits``
    ``[b, k + 1, V]`` and ``features`` ``[b, k + 1, F]`` (zeros past the first token of the other rows, which verify
    nothing), at the cost of ``[b, 1]`` and ``[m, k]`` passes and a copy of the explorers' rows rather than a
    ``[b, k + 1]`` pass. The explorers' rows are copied (:meth:`KVCache.gather_rows`, with their anchors), extended by
    their drafts, and the drafts' entries written back (:meth:`KVCache.put_rows`); the cache's lengths are left as
    they were, as a verify pass leaves them. ``k >= 1``."""
    if drafts.shape[1] == 0 or cache.fixed_shape:
        raise ValueError("a pass apart verifies at least one draft, on a cache that may change shape")
    cache.check_room(drafts.shape[1] + 1)  # room for the anchors and the drafts written back, before any write
    first = target(anchor[:, None], cache=cache, feature_layers=feature_layers)  # [b, 1, V], [b, 1, F]
    lengths = cache.lengths.clone()  # [b]
    cache.crop(lengths + 1)  # the anchors' entries are the explorers' context
    own = cache.gather_rows(rows, drafts.shape[1])
    cache.crop(lengths)
    rest = target(drafts, cache=own, feature_layers=feature_layers)  # [m, k, V], [m, k, F]
    cache.put_rows(own, rows, lengths[rows] + 1, drafts.shape[1])
    b, k = anchor.shape[0], drafts.shape[1]
    logits = first.logits.new_zeros(b, k + 1, first.logits.shape[-1])  # [b, k + 1, V]
    features = first.features.new_zeros(b, k + 1, first.features.shape[-1])  # [b, k + 1, F]
    logits[:, :1], features[:, :1] = first.logits, first.features
    logits[rows, 1:], features[rows, 1:] = rest.logits, rest.features
    return TargetOutput(logits=logits, features=features)


def explorers(m: int, rows: torch.Tensor, fresh: set[int], turn: int) -> torch.Tensor:
    """``[m]`` batch positions that draft in an exploring round: requests not yet drafted for first, then the others
    in turns (a window that moves by ``m`` each exploring round)."""
    ids = rows.tolist()
    new = [i for i, r in enumerate(ids) if r in fresh]
    old = [i for i, r in enumerate(ids) if r not in fresh]
    if old:
        start = (turn * m) % len(old)
        old = old[start:] + old[:start]
    return torch.tensor(sorted((new + old)[:m]), dtype=torch.long, device=rows.device)


def scatter_rows(x: torch.Tensor, rows: torch.Tensor, b: int) -> torch.Tensor:
    """``x`` ``[m, ...]`` placed at ``rows`` of a zero ``[b, ...]`` (the rows that did not draft: padding)."""
    out = x.new_zeros(b, *x.shape[1:])
    out[rows] = x
    return out
