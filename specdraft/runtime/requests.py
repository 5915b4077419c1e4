"""Each request's output as rounds commit it, and what ends a request (a stop token, its cap): one record for every
decode engine (:func:`~specdraft.runtime.decode.generate`, the static path of
:mod:`~specdraft.runtime.static_decode`), so both emit and count alike."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from specdraft.runtime.sampling import SamplingParams


@dataclass
class GenerationConfig:
    max_new_tokens: int | Sequence[int] = 128
    """Per-request cap (an int for all rows or one per row)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    draft_sampling: str = "sample"
    """Under T>0: 'sample' draws drafts from the drafter's processed distribution; 'greedy' drafts its argmax."""


@dataclass
class RowResult:
    tokens: list[int]
    """Generated tokens (stop token excluded)."""
    accept_lengths: list[int]
    """Tokens emitted per target verify round: accepted drafts + 1, or fewer when a stop token or the length cap
    ended the row inside the round (a stop token counts). ``1 + sum == len(tokens) + (finish_reason == "stop")``."""
    finish_reason: str
    time_s: float
    accepted: list[int] = field(default_factory=list)
    """Drafts the target accepted per verify round (what acceptance rates count; not cut by stops or caps)."""
    nodes: list[int] = field(default_factory=list)
    """Trees: nodes per round (root included, after deduplication); empty for chain decoding."""
    winner: list[int] = field(default_factory=list)
    """D²SD: the candidate holding the accepted path per round (0 = the first draft, j = the second drafter's
    j-th branch by prefix length; the first draft wins ties)."""
    verified: list[int] = field(default_factory=list)
    """Drafts verified per round: the block's K, or what an adaptive policy chose (0 = a plain decoding round)."""

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


class Requests:
    """The requests of one decode call: their results so far (:attr:`results`, in arrival order), their caps and
    stop tokens, and when each was admitted (``time_s`` runs from there to the request's end)."""

    def __init__(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 on_result: Callable[[int, RowResult], None] | None = None):
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every request needs at least one token")
        n = len(prompts)
        caps = config.max_new_tokens
        self.max_new = [caps] * n if isinstance(caps, int) else list(caps)
        self.stop = set(config.stop_token_ids)
        self.results = [RowResult([], [], "", 0.0) for _ in range(n)]
        self.done = [False] * n
        self.prompt_len = [len(p) for p in prompts]
        self._admitted = [0.0] * n
        self._on_result = on_result

    def admit(self, rows: Sequence[int]) -> None:
        """Requests ``rows`` start now (their clock starts)."""
        now = time.perf_counter()
        for r in rows:
            self._admitted[r] = now

    def emit(self, row: int, tokens: list[int]) -> int:
        """Append committed ``tokens`` to a request until a stop token or its cap; returns how many it emitted (a stop
        token counts: it was generated). A request that ends here is done and reported to ``on_result``."""
        emitted, reason = self._append(row, tokens)
        if reason is not None:
            self._finish(row, reason)
        return emitted

    def record(self, row: int, accepted: int, drafts: list[int], next_token: int, verified: int,
               nodes: int | None = None, winner: int | None = None) -> int:
        """A round's outcome for a request: ``accepted`` of its ``verified`` ``drafts`` and the target's
        ``next_token`` (trees: ``nodes`` verified, the ``winner`` candidate). Returns the drafts it committed (not
        those past its stop token or cap)."""
        out = self.results[row]
        out.accepted.append(accepted)
        out.verified.append(verified)
        if nodes is not None:
            out.nodes.append(nodes)
            out.winner.append(winner)
        emitted, reason = self._append(row, drafts[:accepted] + [next_token])
        out.accept_lengths.append(emitted)  # a + 1 unless cut short
        if reason is not None:  # reported with the round recorded whole
            self._finish(row, reason)
        return emitted - 1

    def _append(self, row: int, tokens: list[int]) -> tuple[int, str | None]:
        """Append ``tokens`` until a stop token or the cap: how many were emitted, and why the request ended (None:
        it runs on)."""
        out = self.results[row]
        for i, t in enumerate(tokens):
            if t in self.stop:
                return i + 1, "stop"
            out.tokens.append(t)
            if len(out.tokens) >= self.max_new[row]:
                return i + 1, "length"
        return len(tokens), None

    def _finish(self, row: int, reason: str) -> None:
        out = self.results[row]
        out.finish_reason, out.time_s = reason, time.perf_counter() - self._admitted[row]
        self.done[row] = True
        if self._on_result is not None:
            self._on_result(row, out)

    def mean_context(self, rows: list[int]) -> float:
        """Requests ``rows``' mean context (prompt and generated tokens)."""
        return sum(len(self.results[r].tokens) + self.prompt_len[r] - 1 for r in rows) / len(rows)
