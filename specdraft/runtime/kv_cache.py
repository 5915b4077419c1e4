"""Static KV cache with per-row lengths (ragged batches) and the attention mask helper that reads it.

Layout: one preallocated buffer per layer, ``[B, H_kv, S_max, D_head]``. Row ``b`` holds ``lengths[b]`` committed
entries; anything at or past ``lengths[b]`` is scratch that the mask hides. A forward *writes first* (new K/V at
``lengths[b] + t``) and attends over the cache prefix, so no concatenation copies are made. Cropping a row after a
rejection is just lowering its length; the rejected entries are overwritten by the next write.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer static K/V buffers plus per-row committed lengths."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._kb, self._vb = self.k, self.v
        """The buffers ``k`` and ``v`` are views of (their first ``batch_size`` rows): rows beyond are spare room, so
        admitted requests are copied in and finished ones compacted without reallocating."""
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self.max_len = max_len
        self.fixed_shape = False
        """True inside a static-shape (CUDA-graph) round: the caller sized the cache for the whole decode, and
        nothing may read device values on the host (no room checks, no ``lengths.max()``)."""
        self.grow_to = 0
        """Past ``max_len``, up to this many slots, a write grows the buffers (to the need, at least doubling, at
        most ``grow_to``) instead of raising. A drafter cache whose ingest an adaptive policy defers starts with one
        slot: most rows of a large batch never draft, and what a prompt's catch-up needs is known when it comes."""

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new entries of one layer at per-row slots.

        Args:
            k_new, v_new: ``[B, H_kv, T, D]``.
            slots: ``[B, T]`` absolute slot index per row and new token.
        """
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [B, 1]
        dtype = self.k[layer].dtype  # a pass under a training step's autocast computes in bf16
        self.k[layer][rows, :, slots] = k_new.transpose(1, 2).to(dtype)  # [B, T, H_kv, D] into [B, H_kv, S, D]
        self.v[layer][rows, :, slots] = v_new.transpose(1, 2).to(dtype)

    def write_packed(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor) -> None:
        """Write ``N`` new entries of one layer, entry ``n`` at row ``rows[n]``, slot ``slots[n]``.

        Args:
            k_new, v_new: ``[H_kv, N, D]``.
            rows, slots: ``[N]``.
        """
        dtype = self.k[layer].dtype
        self.k[layer][rows, :, slots] = k_new.transpose(0, 1).to(dtype)  # [N, H_kv, D] into [B, H_kv, S, D]
        self.v[layer][rows, :, slots] = v_new.transpose(0, 1).to(dtype)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries from slots ``src`` to slots ``dst`` (``[B, T]`` each) in every layer, reading all sources
        before writing: a tree verify pass writes its nodes after the committed context, and the accepted path's
        entries move into the committed slots (KV compaction). Slots in ``dst`` must be distinct per row."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]  # [B, 1]
        for buf in (*self.k, *self.v):
            buf[rows, :, dst] = buf[rows, :, src]  # [B, T, H_kv, D]

    def view(self, layer: int, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``used`` slots of one layer, ``[B, H_kv, used, D]`` each (views, no copy)."""
        return self.k[layer][:, :, :used], self.v[layer][:, :, :used]

    def check_room(self, new_tokens: int) -> None:
        need = int(self.lengths.max()) + new_tokens if self.batch_size else 0
        self._make_room(need)

    def _make_room(self, need: int) -> None:
        if need <= self.max_len:
            return
        if need > max(self.grow_to, self.max_len):
            raise ValueError(f"KV cache overflow: need {need} slots, have {max(self.grow_to, self.max_len)}")
        self._reallocate(self._kb[0].shape[0], min(max(need, 2 * self.max_len), self.grow_to))

    def _reallocate(self, rows: int, length: int) -> None:
        """New zeroed buffers of ``rows`` rows and ``length`` slots, into which only the rows' committed entries are
        copied (spare rows hold none)."""
        n = self.batch_size
        used = int(self.lengths.max()) if n else 0
        bufs = []
        for b in (*self._kb, *self._vb):
            new = b.new_zeros(rows, b.shape[1], length, b.shape[3])  # [rows, H_kv, length, D]
            new[:n, :, :used] = b[:n, :, :used]
            bufs.append(new)
        self._kb, self._vb = bufs[: len(self._kb)], bufs[len(self._kb):]
        self.k, self.v = [b[:n] for b in self._kb], [b[:n] for b in self._vb]
        self.max_len = length

    def crop(self, lengths: torch.Tensor) -> None:
        """Set each row's committed length (must not grow past what was written)."""
        if self.fixed_shape:  # in place: a captured graph reads this very tensor
            self.lengths.copy_(lengths)
        else:
            self.lengths = lengths.to(self.lengths)

    def commit(self, counts: torch.Tensor) -> None:
        """Grow each row's committed length by ``counts`` ``[B]`` (entries already written)."""
        if self.fixed_shape:
            self.lengths.add_(counts)
        else:
            self.lengths = self.lengths + counts

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (compaction when requests finish, so finished rows stop costing compute), in place:
        only rows whose position changes are copied (a swap-remove order, kept rows filling the holes from the tail,
        copies one row per finished request, and only its committed entries)."""
        order = rows.tolist()
        n = len(order)
        moved = [i for i, r in enumerate(order) if r != i]
        if moved:
            dst = torch.tensor(moved, dtype=torch.long, device=rows.device)  # [m]
            src = rows.to(dst.device)[dst]  # [m]
            used = int(self.lengths.index_select(0, src.to(self.lengths.device)).max())
            for buf in (*self._kb, *self._vb):
                buf[dst, :, :used] = buf[src, :, :used]  # the right side is gathered first: overlaps are safe
        self.k, self.v = [b[:n] for b in self._kb], [b[:n] for b in self._vb]
        self.lengths = self.lengths.index_select(0, rows)

    def reserve(self, rows: int) -> None:
        """Make room for ``rows`` rows in all (continuous batching reserves its slots once): new zeroed buffers into
        which only the rows' committed entries are copied (a drafter cache whose ingest is deferred copies nothing)."""
        if rows > self._kb[0].shape[0]:
            self._reallocate(rows, self._kb[0].shape[2])

    def cat_rows(self, other: "KVCache") -> None:
        """Append ``other``'s rows (same layers and heads; its committed entries must fit this cache's ``max_len``, its
        own may be shorter, e.g. one slot for rows with nothing committed): requests admitted by continuous batching,
        copied into spare rows (made when there are none; only their committed entries)."""
        n, m = self.batch_size, other.batch_size
        used = int(other.lengths.max()) if m else 0
        self._make_room(used)
        self.reserve(n + m)
        for buf, new in zip((*self._kb, *self._vb), (*other.k, *other.v)):
            buf[n:n + m, :, :used] = new[:, :, :used]
        self.k, self.v = [b[: n + m] for b in self._kb], [b[: n + m] for b in self._vb]
        self.lengths = torch.cat([self.lengths, other.lengths])


def cached_attention_mask(lengths: torch.Tensor, used: int, new_mask: torch.Tensor,
                          visible_prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask over the cache prefix for queries that were written at ``lengths[b] + t``.

    Key ``j`` is visible to new query ``t`` of row ``b`` iff it is committed (``j < lengths[b]``, and
    ``j < visible_prefix[b, t]`` when given) or it is new token ``r = j - lengths[b]`` with ``new_mask[b, t, r]``
    (causal, tree or all-visible among the new tokens).

    Args:
        lengths: ``[B]`` committed lengths before the write.
        used: number of slots the attention reads (``max(lengths) + T``).
        new_mask: ``[B, T, T]`` or ``[T, T]`` bool visibility among the new tokens.
        visible_prefix: ``[B, T]`` committed entries each new query may see (training replays many verify blocks
            against one cached sequence, each seeing only the context before its own anchor); default all.
    Returns:
        ``[B, 1, T, used]`` bool mask for ``scaled_dot_product_attention``.
    """
    T = new_mask.shape[-1]
    if new_mask.dim() == 2:
        new_mask = new_mask.expand(lengths.shape[0], T, T)
    j = torch.arange(used, device=lengths.device)  # [used]
    rel = j[None, :] - lengths[:, None]  # [B, used]
    committed = (rel < 0)[:, None, :]  # [B, 1, used]
    if visible_prefix is not None:
        committed = committed & (j[None, None, :] < visible_prefix[:, :, None])  # [B, T, used]
    is_new = (rel >= 0) & (rel < T)
    idx = rel.clamp(0, T - 1)[:, None, :].expand(-1, T, -1)  # [B, T, used]
    new_vis = new_mask.gather(2, idx) & is_new[:, None, :]  # [B, T, used]
    return (committed | new_vis)[:, None]  # [B, 1, T, used]
