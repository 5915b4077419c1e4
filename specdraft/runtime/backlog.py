"""Target features not yet fed to the drafter (an adaptive policy's deferred ingest): :class:`Backlog`, kept per row
as views of the passes that made them, fed in one batched pass when drafting resumes."""

from __future__ import annotations

import torch


class Backlog:
    """Target features not yet fed to the drafter: under an adaptive policy, plain rounds and the prefill of admitted
    prompts defer the drafter's ingest, and the whole backlog goes in one batched pass when drafting resumes (a row
    that never drafts again never pays for it). Kept per row, as views; plain rounds in a :class:`_Run`, one entry per
    round for every row, each row holding its place in it: deferring, admissions and compactions copy no features and
    a plain round costs one append, and a flush copies each piece once, into the batch it feeds."""

    def __init__(self):
        self.rows: list[list[_Piece | _RunRow]] = []  # per batch row, its deferred features in order
        self.tokens = 0  # deferred entries, all rows
        self._run: _Run | None = None  # the run plain rounds add to, while the rows stand

    def add(self, features: torch.Tensor | tuple[torch.Tensor, ...], counts: torch.Tensor | None = None) -> None:
        """Defer ``features`` ``[b, t, F]`` (or the feature layers' outputs ``[b, t, D]`` each, in order, not yet
        concatenated), of which row ``i`` holds its first ``counts[i]`` (default all: a plain round's, added whole to
        the run). Split layers' outputs are kept as views (a padded prefill chunk stays alive until its rows are fed
        or finished); a concatenated tensor's rows with counts are copied."""
        layers = features if isinstance(features, tuple) else (features,)
        if not self.rows:
            self.rows = [[] for _ in range(layers[0].shape[0])]
        if counts is None:
            run = self._run
            if run is None or isinstance(run.entries[0], tuple) != isinstance(features, tuple):
                run = self._run = _Run()
                for i, row in enumerate(self.rows):
                    row.append(_RunRow(run, i))
            run.entries.append(features)
            run.length += layers[0].shape[1]
            self.tokens += layers[0].shape[0] * layers[0].shape[1]
            return
        self._run = None
        for i, (row, c) in enumerate(zip(self.rows, counts.tolist())):
            if c:
                # the layers' outputs as views (the padded chunk is kept, nothing copied); of a concatenated
                # tensor, each row's piece is a copy (a verify pass's [b, T, F] is not kept for its first tokens)
                row.append(tuple(x[i, :c] for x in layers) if len(layers) > 1 else layers[0][i, :c].clone())
        self.tokens += int(counts.sum())

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep``."""
        self._run = None  # the rows move: later plain rounds start a run of their own
        order = keep.tolist()
        kept = set(order)
        self.tokens -= sum(_piece_len(x) for i, row in enumerate(self.rows) if i not in kept for x in row)
        self.rows = [self.rows[i] for i in order] if self.rows else []

    def cat_rows(self, other: "Backlog", rows: int, other_rows: int) -> None:
        """Append ``other``'s ``other_rows`` rows after this backlog's ``rows`` (requests admitted by continuous
        batching)."""
        self._run = None
        self.rows = (self.rows or [[] for _ in range(rows)]) + (other.rows or [[] for _ in range(other_rows)])
        self.tokens += other.tokens

    def flush(self, drafter, cache, second: tuple | None = None) -> None:
        """Feed every row its deferred features in order (``ingest`` of ``[b, n, F]``, each row's entries first).
        ``second``: a second ``(drafter, cache)`` fed the same features (D²SD's)."""
        self._run = None
        counts = [sum(_piece_len(x) for x in row) for row in self.rows]
        self.tokens -= sum(counts)
        if max(counts, default=0) == 0:
            return
        parts = next(x for row in self.rows for x in row)
        parts = parts.run.entries[0] if isinstance(parts, _RunRow) else parts
        parts = parts if isinstance(parts, tuple) else (parts,)  # the feature layers' outputs, or all of them
        feats = parts[0].new_zeros(len(self.rows), max(counts), sum(x.shape[-1] for x in parts))  # [b, n, F]
        for j, row in enumerate(self.rows):
            _write_row(feats[j], row)
        self.rows = [[] for _ in self.rows]
        counts = torch.tensor(counts, device=feats.device)
        drafter.ingest(cache, feats, counts)
        if second is not None:
            second[0].ingest(second[1], feats, counts)


_Piece = torch.Tensor | tuple[torch.Tensor, ...]
"""One deferred stretch of a row: ``[t, F]``, or the feature layers' ``[t, D]`` each (to be concatenated)."""


class _Run:
    """Plain rounds' features for every row of the batch as it stood when the run began: entries ``[b, t, F]`` (or the
    feature layers' ``[b, t, D]`` each), ``length`` entries per row; a row's part is cut out when it is fed."""

    __slots__ = ("entries", "length", "_whole")

    def __init__(self):
        self.entries: list[_Piece] = []
        self.length = 0
        self._whole: _Piece | None = None  # the entries concatenated, once the first row is fed

    def piece(self, row: int) -> _Piece:
        """Row ``row``'s entries: ``[length, F]`` (or ``[length, D]`` per layer)."""
        if self._whole is None:
            e = self.entries
            if isinstance(e[0], tuple):
                self._whole = tuple(p[0] if len(e) == 1 else torch.cat(p, 1) for p in zip(*e))  # [b, length, D] each
            else:
                self._whole = e[0] if len(e) == 1 else torch.cat(e, 1)  # [b, length, F]
        w = self._whole
        return tuple(x[row] for x in w) if isinstance(w, tuple) else w[row]


class _RunRow:
    """A row's place in a :class:`_Run` (its index in the batch when the run began)."""

    __slots__ = ("run", "row")

    def __init__(self, run: _Run, row: int):
        self.run, self.row = run, row


def _piece_len(piece: _Piece | _RunRow) -> int:
    if isinstance(piece, _RunRow):
        return piece.run.length
    return (piece[0] if isinstance(piece, tuple) else piece).shape[0]


def _write_row(out: torch.Tensor, pieces: list[_Piece | _RunRow]) -> None:
    """Copy a row's pieces in order into ``out`` ``[n, F]`` (consecutive ``[t, F]`` pieces in one concatenation,
    split pieces layer by layer into their column ranges)."""
    at, run = 0, []
    for piece in [*pieces, None]:
        if isinstance(piece, _RunRow):
            piece = piece.run.piece(piece.row)
        if isinstance(piece, torch.Tensor):
            run.append(piece)
            continue
        if run:  # the plain rounds' [1, F] pieces since the last split one
            n = sum(x.shape[0] for x in run)
            out[at:at + n] = run[0] if len(run) == 1 else torch.cat(run)
            at, run = at + n, []
        if piece is not None:
            n, col = piece[0].shape[0], 0
            for x in piece:  # [t, D]
                out[at:at + n, col:col + x.shape[-1]] = x
                col += x.shape[-1]
            at += n
