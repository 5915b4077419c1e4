"""What a round costs on this machine: target passes by rows x new tokens and drafter rounds by rows, measured at two
cache lengths (:func:`measure_costs`; rows and token counts added later by :func:`extend_costs`), and priced at a
round's context (:class:`CostModel`). The adaptive policy (:mod:`specdraft.runtime.policy`) prices its choices with
it, and a measured node budget (:mod:`specdraft.runtime.node_budget`) its trees: a tree's verify pass over ``n`` nodes
is a target pass of ``n`` new tokens (the same attention, with the tree's mask in place of the causal one)."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from specdraft.runtime.phase_clock import wall_seconds

RETIRED = ("ingest_s",)
"""Fields that caches written by earlier versions hold and the model no longer reads."""


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through ``(xs, ys)``, extended linearly past both ends (never below 0)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def priced_context(context: float) -> int:
    """``context`` rounded to an eighth of an octave (at least 16 tokens): the contexts a model is priced at (a row's
    context grows by a few tokens a round; :meth:`CostModel.at` keeps a model per context priced)."""
    return round(2 ** (max(round(8 * math.log2(max(context, 1.0))), 32) / 8))


@dataclass
class CostModel:
    """Seconds per target pass on a ``rows`` x ``tokens`` grid and per drafter round by ``rows``, against a cache of
    ``context`` tokens a row; with ``short`` (the same grid measured against a shorter cache), at any context by
    :meth:`at`. A pass's attention over the cache adds a cost that grows with the context but not with the new tokens,
    so it weighs most on a plain pass: one model measured at one context misprices plain against drafted rounds at
    another by more than any one factor per kind can mend."""

    rows: list[int]
    tokens: list[int]
    target_s: list[list[float]]
    """``[len(rows)][len(tokens)]`` seconds of one target pass with that many rows and new tokens per row."""
    drafter_s: list[float]
    """``[len(rows)]`` seconds of one drafter round (block embeds, draft pass, logits) and its context ingest."""
    key: dict = field(default_factory=dict)
    """What the costs were measured for (device, dtype, models, versions)."""
    context: int = 0
    """Tokens of cache a row the costs were measured against (0: not recorded; the costs then hold at any context)."""
    short: dict = field(default_factory=dict)
    """``{"context", "target_s", "drafter_s"}``: the same measured against a shorter cache (empty: not measured)."""

    def __post_init__(self):
        # (rows, tokens) -> seconds; (rows, 0): the drafter's round
        self._memo: dict[tuple[int, int], float] = {}
        self._at: dict[int, CostModel] = {}  # context -> the costs priced at it
        self._rounds: dict[tuple[int, int], np.ndarray] = {}  # (rows, K) -> seconds of a drafted round by width

    def target(self, b: int, t: int) -> float:
        if (b, t) not in self._memo:
            self._memo[b, t] = _interp(self.rows, [_interp(self.tokens, row, t) for row in self.target_s], b)
        return self._memo[b, t]

    def drafter(self, b: int) -> float:
        if (b, 0) not in self._memo:
            self._memo[b, 0] = _interp(self.rows, self.drafter_s, b)
        return self._memo[b, 0]

    def drafted(self, b: int, K: int) -> np.ndarray:
        """``[K + 1]``: seconds of a drafted round of ``b`` rows, a drafter round and the target's pass, verifying
        ``k = 0..K`` drafts (kept: a policy asks it every round)."""
        if (b, K) not in self._rounds:
            self._rounds[b, K] = np.array([self.drafter(b) + self.target(b, k + 1) for k in range(K + 1)])
        return self._rounds[b, K]

    def at(self, context: int) -> "CostModel":
        """The costs against ``context`` tokens of cache a row: linear in the context through the two measured
        contexts (below the shorter one, at most halving its costs; past the longer one, not falling); these costs
        where only one was measured."""
        if not self.short or not self.context or self.short["context"] == self.context:
            return self
        if context not in self._at:
            c0, c1 = self.short["context"], self.context
            w = (context - c0) / (c1 - c0)

            def line(near: float, far: float) -> float:
                if w > 1 and far < near:  # timing noise: a cost falling with the context is not extended
                    return far
                return max(near + w * (far - near), 0.5 * near)

            target_s = [[line(n, f) for n, f in zip(near, far)] for near, far in zip(self.short["target_s"],
                                                                                    self.target_s)]
            drafter_s = [line(n, f) for n, f in zip(self.short["drafter_s"], self.drafter_s)]
            self._at[context] = CostModel(self.rows, self.tokens, target_s, drafter_s, self.key, context)
        return self._at[context]

    def up_to(self, tokens: int) -> "CostModel":
        """The costs of target passes of at most ``tokens`` new tokens (a drafter's block: the adaptive policy drafts
        at most one, and takes its widest from the model; a cache also holds a node budget's larger passes)."""
        keep = [i for i, t in enumerate(self.tokens) if t <= tokens]
        if len(keep) == len(self.tokens):
            return self
        short = dict(self.short)
        if short:
            short["target_s"] = [[row[i] for i in keep] for row in short["target_s"]]
        return CostModel(self.rows, [self.tokens[i] for i in keep], [[row[i] for i in keep] for row in self.target_s],
                         self.drafter_s, self.key, self.context, short)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, saved: dict) -> "CostModel":
        """A model from the fields :meth:`save` writes (those of :data:`RETIRED` dropped)."""
        return cls(**{k: v for k, v in saved.items() if k not in RETIRED})


@torch.inference_mode()
def measure_costs(target, drafter, rows=(1, 8, 32, 64), tokens=(1, 2, 4, 8, 16), context: int = 256,
                  repeats: int = 3, short_context: int = 64) -> CostModel:
    """Time target passes of up to a drafter's block of new tokens (``tokens`` past it dropped: :func:`extend_costs`
    adds them) and drafter rounds against a ``context``-token cache and, where ``short_context`` is shorter, against
    one of ``short_context`` tokens too (median of ``repeats``)."""
    dev = target.lm_head.weight.device
    tokens = sorted({t for t in tokens if t <= drafter.block_size} | {1, drafter.block_size})
    target_s, drafter_s = _measure_at(target, drafter, rows, tokens, context, repeats)
    short = {}
    if 0 < short_context < context:
        near = _measure_at(target, drafter, rows, tokens, short_context, repeats)
        short = {"context": short_context, "target_s": near[0], "drafter_s": near[1]}
    key = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "dtype": str(target.lm_head.weight.dtype), "torch": torch.__version__,
           "context": context}
    return CostModel(list(rows), tokens, target_s, drafter_s, key, context, short)


@torch.inference_mode()
def extend_costs(costs: CostModel, target, drafter, rows=(), tokens=(), repeats: int = 3) -> CostModel:
    """``costs`` with what it lacks of ``rows`` (target passes of its token counts and drafter rounds) and of target
    passes of ``tokens`` new tokens (a node budget's; at every row) measured at its contexts; itself when it lacks
    nothing."""
    new_rows = sorted(set(rows) - set(costs.rows))
    new_tokens = sorted(set(tokens) - set(costs.tokens))
    if not new_rows and not new_tokens:
        return costs
    all_rows, all_tokens = sorted({*costs.rows, *new_rows}), sorted({*costs.tokens, *new_tokens})

    def grid(target_s: list[list[float]], drafter_s: list[float], context: int) -> tuple[list, list]:
        t = {(r, n): target_s[i][j] for i, r in enumerate(costs.rows) for j, n in enumerate(costs.tokens)}
        d = dict(zip(costs.rows, drafter_s))
        if new_tokens:
            added = _measure_at(target, drafter, costs.rows, new_tokens, context, repeats, with_drafter=False)[0]
            t |= {(r, n): added[i][j] for i, r in enumerate(costs.rows) for j, n in enumerate(new_tokens)}
        if new_rows:
            added, drafted = _measure_at(target, drafter, new_rows, all_tokens, context, repeats)
            t |= {(r, n): added[i][j] for i, r in enumerate(new_rows) for j, n in enumerate(all_tokens)}
            d |= dict(zip(new_rows, drafted))
        return [[t[r, n] for n in all_tokens] for r in all_rows], [d[r] for r in all_rows]

    short = dict(costs.short)
    if short:
        short["target_s"], short["drafter_s"] = grid(short["target_s"], short["drafter_s"], short["context"])
    target_s, drafter_s = grid(costs.target_s, costs.drafter_s, costs.context)
    return CostModel(all_rows, all_tokens, target_s, drafter_s, costs.key, costs.context, short)


def _measure_at(target, drafter, rows, tokens, context: int, repeats: int,
                with_drafter: bool = True) -> tuple[list, list]:
    """``(target_s [len(rows)][len(tokens)], drafter_s [len(rows)])`` against a ``context``-token cache (no drafter
    rounds timed without ``with_drafter``: ``drafter_s`` empty)."""
    dev = target.lm_head.weight.device
    V = target.args.vocab_size
    K = drafter.block_size - 1

    def timed(fn) -> float:
        out = [wall_seconds(fn, dev) for _ in range(repeats + 1)][1:]  # the first call warms up
        return sorted(out)[len(out) // 2]

    g = torch.Generator(device="cpu").manual_seed(0)
    target_s, drafter_s = [], []
    for b in rows:
        ctx = torch.randint(0, V, (b, context), generator=g).to(dev)
        cache = target.new_cache(b, context + max([*tokens, K + 1]) + 1)
        out = target(ctx, cache=cache, feature_layers=drafter.target_layer_ids)
        cache.crop(torch.full((b,), context, device=dev))
        row = []
        for t in tokens:
            new = torch.randint(0, V, (b, t), generator=g).to(dev)

            def verify(new=new):
                target(new, cache=cache, feature_layers=drafter.target_layer_ids)
                cache.crop(torch.full((b,), context, device=dev))

            row.append(timed(verify))
        target_s.append(row)
        if not with_drafter:
            continue
        lens = torch.full((b,), context, device=dev)
        dcache = drafter.new_cache(b, context + 2 * (K + 2) + 1)
        drafter.ingest(dcache, out.features, lens)
        verified = target(ctx[:, :K + 1], cache=None, feature_layers=drafter.target_layer_ids)  # [b, K + 1, *]
        feats, one = verified.features, torch.ones(b, dtype=torch.long, device=dev)
        carried = [None]  # a drafter's cross-round state (ReTrace's prior: a round rejected at its first draft)

        def draft_round():
            blk = torch.full((b, K + 1), drafter.config.mask_token_id, dtype=torch.long, device=dev)
            blk[:, 0] = ctx[:, -1]
            hidden = drafter.draft_hidden(dcache, drafter.block_embeds(blk, carried[0]))  # [b, K + 1, D]
            drafts = drafter.logits(hidden[:, 1:]).argmax(-1)  # [b, K]
            fused = drafter.ingest(dcache, feats, one)  # room: repeats + 2 tokens
            carried[0] = drafter.next_round_state(None, hidden, drafts, one - 1, verified.logits, fused)

        draft_round()  # the state a drafted round carries into the next, timed from there
        drafter_s.append(timed(draft_round))
    return target_s, drafter_s
