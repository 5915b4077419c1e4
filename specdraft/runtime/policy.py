"""How much to speculate: a speculation policy that knows what a round costs on this machine.

Speculation pays when the tokens a round commits per second beat plain decoding's. A round with ``b`` rows that
verifies ``k`` drafts costs a drafter round ``D(b)`` plus a target pass over ``k + 1`` new tokens per row
``T(b, k + 1)`` and commits ``sum_rows E_r(k)`` tokens, ``E_r(k) = 1 + sum_{j<=k} prod_{i<=j} a_{r,i}`` with ``a_{r,i}``
the chance that slot ``i`` is accepted given the slots before it. Plain decoding commits ``b`` tokens per ``T(b, 1)``.

- Costs: :class:`~specdraft.runtime.cost_model.CostModel` (``T`` and ``D`` measured on the machine at two cache
  lengths), priced at the rows' mean cache length (:meth:`AdaptivePolicy.at_context`) and rescaled by the running
  ratio of each kind's (plain, drafted) measured round seconds to the model's.
- Acceptance: :class:`~specdraft.runtime.calibration.Calibration` maps the drafter's per-slot confidence to an
  acceptance probability (the width of a drafted round); whether to draft is judged on the running requests' own
  records of committed drafts (easy requests end first), a request without one starting from the population's.
- Exploring: while drafting does not pay, plain rounds run; a retry after ``retry_every`` of them (the wait doubling
  while retries fail) or a probe of new requests drafts for every row, and together they cost at most
  ``explore_share`` of the plain rounds' seconds.

A plain row feeds the drafter nothing: its target features wait, and the drafter ingests them in one pass when it next
drafts for the row (the engine's deferred ingest). Only how much is drafted and verified changes: verifying the first
``k`` drafts of a block is speculative decoding with a block of ``k`` drafts (``k = 0``: plain decoding), so the output
stays lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specdraft.runtime.calibration import Calibration
from specdraft.runtime.cost_model import CostModel, priced_context


def conditional_acceptance(accept: np.ndarray) -> np.ndarray:
    """``[K]``: the chance slot ``j`` is accepted given the slots before it were, over a round's rows with per-slot
    acceptance probabilities ``accept`` ``[b, K]`` (rows weighted by their chance of reaching the slot)."""
    accept = np.asarray(accept, dtype=np.float64)
    reach = np.cumprod(np.concatenate([np.ones_like(accept[:, :1]), accept[:, :-1]], axis=1), axis=1)  # [b, K]
    return (reach * accept).sum(0) / np.maximum(reach.sum(0), 1e-12)


def expected_committed(accept: np.ndarray) -> np.ndarray:
    """``[b, K + 1]``: expected tokens a round commits per row when it verifies ``k = 0..K`` drafts, from per-slot
    acceptance probabilities ``accept`` ``[b, K]`` (the bonus / correction token included)."""
    run = np.cumprod(np.asarray(accept, dtype=np.float64), axis=1)  # [b, K] chance the first j drafts are all accepted
    return np.concatenate([np.ones_like(run[:, :1]), 1 + run.cumsum(1)], axis=1)


@dataclass
class AdaptivePolicy:
    """Per round: whether to draft, and how many drafts to verify (see the module docstring)."""

    costs: CostModel
    calibration: Calibration = field(default_factory=Calibration)
    retry_every: int = 8
    """Plain rounds before drafting is tried again; each failing retry doubles the wait, up to ``max_retry_every``."""
    max_retry_every: int = 64
    explore_share: float = 0.005
    """Exploring rounds (retries and probes) cost at most this share of the plain rounds' seconds: each plain round
    earns this share of its seconds, and an exploring round runs once its extra seconds over a plain round are
    earned."""
    smoothing: float = 0.3
    """Weight of the latest round in the running per-slot acceptance."""
    cost_smoothing: float = 0.1
    """Weight of the latest round in the running ratio of measured to modelled seconds (:meth:`observe_seconds`)."""
    whole_rounds: bool = False
    """Drafted rounds verify their whole draft (tree rounds, static shapes): priced at the full width only."""
    measured: bool = True
    """Rescale the cost model by the rounds' measured seconds (False: the cost model alone, for synthetic machines)."""
    bounded: bool = True
    """After a plain round, decide first on an upper bound of the drafted rate over any requests, kept while the
    acceptance stands (:meth:`_ceiling_rate`): the same decisions as the exact rate's, a plain round's in a few
    lookups. False: the exact rate every round."""
    accept: list[float] = field(default_factory=list)
    """Running acceptance of slot ``j + 1`` given the slots before it, from drafted rounds (empty: none yet)."""
    population: list[float] = field(default_factory=list)
    """The same over every row of every drafted round (older rounds weighted down by ``population_decay``; a slot
    starts from 8 rows' worth of its calibrated prediction): what a request's own record starts from and drifts to."""
    population_decay: float = 0.95
    drift: float = 0.9
    """Each round since a request last drafted keeps this share of its own record's weight against one round's worth
    of the population's: a request that stopped drafting is retried for free where drafting pays on average."""
    width: int = 0
    skipped: int = 0
    wait: int = 0
    """Plain rounds before the next retry (0: ``retry_every``)."""

    def __post_init__(self):
        self._exploring = True  # the last drafted round was a first round, a retry or a probe (not known to pay)
        self._predicted: list[float] = []  # the last drafted round's predicted acceptance per slot (conditional)
        self._predicted_rows = np.zeros((0, 0))  # [m, K] the same for each of its rows
        self._drafting = 0  # the rows that drafted in it
        self._credit = 0.0  # seconds of exploring the plain rounds have earned (explore_share), not yet spent
        self._charged: float | None = None  # the modelled extra seconds the due exploring round was charged, or None
        self._records: dict[int, tuple] = {}  # request -> ([accepted, reached] [2, K] per slot, round) (this job)
        self._round = 0  # draft_this_round calls
        self._version = 0  # bumped whenever an acceptance changes
        self._ceiling: tuple = (None, None, {})  # (key, [K + 1] committed a row, {(rows, context): rate})
        # per slot [accepted, reached], decayed per drafted round (a given population counts as 8 rows' worth)
        self._population_counts: list[list[float]] = [[8.0 * p, 8.0] for p in self.population]
        self._scale: dict[str, float] = {}  # running measured / modelled seconds of "plain" / "drafted" rounds
        self._context = 0  # the context the rounds are priced at (0: the cost model's own)
        self._context_range = (0.0, 0.0)  # the contexts priced at it
        self._priced = self.costs  # the cost model at that context

    def at_context(self, context: float) -> None:
        """Price the next rounds against ``context`` tokens of cache a row (the running requests' mean), rounded to
        an eighth of an octave (at least 16 tokens): :meth:`CostModel.at`."""
        lo, hi = self._context_range
        if lo <= context < hi:  # the bucket of the last round (a row's context grows by a few tokens a round)
            return
        self._context = priced_context(context)
        i = round(8 * math.log2(self._context))  # 32: 2 ** (32 / 8) = 16 tokens, the least
        self._context_range = (2 ** ((i - 0.5) / 8) if i > 32 else 0.0, 2 ** ((i + 0.5) / 8))
        self._priced = self.costs.at(self._context)

    def new_job(self) -> None:
        """Forget the requests' own records (a decode call numbers its requests from 0); what was learnt of the
        drafter and the machine stays."""
        self._records, self._version = {}, self._version + 1
        self._charged = None  # a round of a job that ended before it was measured is charged nothing more

    def draft_this_round(self, rows: list[int], fresh: int = 0) -> bool:
        """Whether the running requests ``rows`` draft this round: False while no width of drafted round commits more
        tokens per second than plain decoding, at the rounds' measured costs and each request's own record. Drafting
        is retried after ``wait`` plain rounds, and new requests are probed once ``fresh`` rows (admitted since the
        last drafted round) are half the batch, after ``retry_every`` plain rounds; either only once
        :attr:`explore_share` of the plain rounds' seconds pays for its extra seconds."""
        b = len(rows)
        self._exploring = True
        self._round += 1
        if len(self._records) > 2 * b + 64:  # ended requests: forget them
            kept = set(rows)
            self._records = {r: e for r, e in self._records.items() if r in kept}
        if not self.accept:
            return True
        plain = self._priced.target(b, 1) * self.measured_ratio("plain")  # seconds of a plain round
        scale = self.measured_ratio("drafted")
        if self.bounded and self.skipped and self._ceiling_rate(b) * (1 + 1e-9) / scale < b / plain:
            spec = 0.0  # no request could pay: decided without a pass over the rows' records
        else:
            spec = self._drafted_rate(rows) / scale
        if spec >= b / plain:
            self.skipped, self.wait, self._exploring = 0, 0, False
            return True
        extra = self._exploring_extra(b)
        retry = self.skipped >= (self.wait or self.retry_every)
        probe = 2 * fresh >= b and self.skipped >= self.retry_every
        if (retry or probe) and self._credit >= extra * (1 - 1e-9):
            if retry:  # while retries fail, each waits twice as long (a probe leaves the wait)
                self.wait = min(2 * (self.wait or self.retry_every), max(self.max_retry_every, self.retry_every))
            self.skipped = 0
            self._credit -= extra
            self._charged = extra
            return True
        self.skipped += 1
        self._credit = min(self._credit + self.explore_share * plain, 2 * extra)
        return False

    def _exploring_extra(self, b: int) -> float:
        """Seconds an exploring round costs over a plain round (at the last drafted width: an estimate of when the
        next is due, the measured seconds being what it is charged)."""
        drafted = self._priced.drafter(b) + self._priced.target(b, max(self.width, 1) + 1)
        plain = self._priced.target(b, 1)
        return max(drafted * self.measured_ratio("drafted") - plain * self.measured_ratio("plain"), 0.0)

    def measured_ratio(self, kind: str) -> float:
        """Measured / modelled seconds of ``kind`` rounds (``plain`` or ``drafted``); a kind not measured yet: as the
        other, or as modelled."""
        return self._scale.get(kind) or self._scale.get("plain" if kind == "drafted" else "drafted") or 1.0

    def observe_seconds(self, b: int, drafting: int, width: int, seconds: float, flushed: float = 0.0) -> None:
        """A round's measured wall seconds: ``b`` rows, of which ``drafting`` drafted (0: a plain round), verifying
        ``width`` drafts; ``flushed``: further seconds it fed the drafter features that waited (an exploring round's
        are charged to the exploring budget, with what it took over a plain round). The running ratio to the modelled
        seconds rescales the model for what it does not time and for the machine's drift; one slow round moves it by
        at most a factor ``1 + cost_smoothing``."""
        if drafting and self._exploring:
            self._credit -= flushed
            if self._charged is not None and self.measured:  # what it took over a plain round, not its price
                plain = self._priced.target(b, 1) * self.measured_ratio("plain")
                self._credit -= max(seconds - plain, 0.0) - self._charged
            self._charged = None
        if not self.measured:
            return
        kind = "drafted" if drafting else "plain"
        model = (self._priced.drafter(drafting) if drafting else 0.0) + self._priced.target(b, width + 1)
        ratio, old = seconds / max(model, 1e-12), self._scale.get(kind)
        self._scale[kind] = min(ratio, 2.0) if old is None else old + self.cost_smoothing * (min(ratio, 2 * old) - old)

    def verify_len(self, confidence: torch.Tensor) -> int:
        """Drafts to verify (0..K) given the drafted block's per-slot confidences ``[b, K]``: the width that maximises
        the pass's expected committed tokens per second (the drafter's round is paid by now)."""
        accept = self.calibration.predict(confidence.cpu().double().numpy())  # [b, K]
        tokens = expected_committed(accept).sum(0)  # [K + 1]
        rate = tokens / self._priced.drafted(accept.shape[0], len(tokens) - 1)  # [K + 1] tokens per second
        best = int(rate.argmax())
        return self._choose(accept, best if rate[best] > rate[-1] else len(rate) - 1)

    def whole(self, confidence: torch.Tensor) -> None:
        """A drafted round that verified its whole draft (a tree round), its first drafter's per-slot confidences
        ``[b, K]``: the round's width is ``K``, as :meth:`observe` then reads it."""
        accept = self.calibration.predict(confidence.cpu().double().numpy())  # [b, K]
        self._choose(accept, accept.shape[1])

    def _choose(self, accept: np.ndarray, width: int) -> int:
        """Take ``width`` as the round's width for the drafting rows' predicted acceptance ``accept`` ``[m, K]``."""
        self.width = width
        self._predicted_rows = accept
        self._predicted = conditional_acceptance(accept).tolist()  # [K]
        self._drafting = accept.shape[0]
        if self.width == 0:  # nothing verified: observe() will not be called
            self._blend_predicted()
        return self.width

    def _blend_predicted(self) -> None:
        """Move the running and population acceptance of the slots this round did not verify toward their predicted
        acceptance (a row's worth of population evidence for each drafting row): a burst's deep slots, verified once,
        must not keep narrow rounds drafting, nor stand for every new request."""
        accept = list(self.accept)
        for j in range(self.width, len(self._predicted)):
            if j < len(accept):
                accept[j] += self.smoothing * (self._predicted[j] - accept[j])
            elif j == len(accept):
                accept.append(self._predicted[j])
        self.accept = accept
        counts = [list(c) for c in self._population_counts]  # new lists, as in observe()
        for j in range(self.width, min(len(counts), len(self._predicted))):
            counts[j] = [counts[j][0] + self._drafting * self._predicted[j], counts[j][1] + self._drafting]
        self._population_counts = counts
        self.population = [hit / reached for hit, reached in counts]
        self._version += 1

    def _drafted_rate(self, rows: list[int]) -> float:
        """Expected committed tokens per second of a drafted round of the requests ``rows`` at its best width, each at
        its own record drifted toward the population's acceptance (:meth:`_prior`) by the rounds since it drafted."""
        prior = self._prior(max(self.costs.tokens) - 1)  # [K]
        counts = self._row_counts(rows, prior)  # [b, 2, K]
        return self._best_rate(expected_committed(counts[:, 0] / counts[:, 1]).sum(0), len(rows))

    def _ceiling_rate(self, b: int) -> float:
        """An upper bound of :meth:`_drafted_rate` for any ``b`` requests: every slot at the highest acceptance any
        known request's record or the population has (a drifting record stays between the two), kept while the
        acceptance stands (requests ending do not change it)."""
        key = (tuple(self.accept), self._version)
        if self._ceiling[0] != key:
            top = self._prior(max(self.costs.tokens) - 1)  # [K]
            if self._records:
                own = np.stack([c for c, _ in self._records.values()])  # [r, 2, K] accepted, reached
                top = np.maximum(own[:, 0] / own[:, 1], top).max(0)
            self._ceiling = (key, expected_committed(top[None])[0], {})  # [K + 1] a row
        _, committed, rates = self._ceiling
        if (b, self._context) not in rates:
            rates[b, self._context] = self._best_rate(committed * b, b)
        return rates[b, self._context]

    def _best_rate(self, committed: np.ndarray, b: int) -> float:
        """Committed tokens per second of a drafted round of ``b`` rows at its best width 1..K, given the round's
        expected committed tokens by width ``[K + 1]``."""
        rates = committed[1:] / self._priced.drafted(b, len(committed) - 1)[1:]  # [K] by width 1..K
        return float(rates[-1] if self.whole_rounds else rates.max())

    def _row_counts(self, rows: list[int], prior: np.ndarray) -> np.ndarray:
        """``[m, 2, K]``: each request's accepted and reached counts per slot, drifted toward one round's worth of
        ``prior`` by the rounds since it last drafted; one round's worth of ``prior`` for a request without a record."""
        start = np.stack([prior, np.ones_like(prior)])  # [2, K]
        counts = np.repeat(start[None], len(rows), axis=0)  # [m, 2, K]
        entries = [self._records.get(r) for r in rows]
        have = [i for i, e in enumerate(entries) if e is not None]
        if have:
            own = np.stack([entries[i][0] for i in have])  # [h, 2, K]
            age = np.array([max(self._round - entries[i][1] - 1, 0) for i in have], dtype=np.float64)
            w = (self.drift ** age)[:, None, None]  # [h, 1, 1]
            counts[have] = w * own + (1 - w) * start
        return counts

    def _accept(self, K: int) -> np.ndarray:
        """``[K]``: the running acceptance, slots never verified taking the last verified slot's (before any round was
        observed: the last drafted round's prediction)."""
        accept = self.accept or self._predicted or [0.0]
        return np.array(accept[:K] + [accept[-1]] * (K - len(accept)))

    def _prior(self, K: int) -> np.ndarray:
        """``[K]``: what a request without a record starts from: the population's acceptance of the slots it verified,
        the running acceptance of the others."""
        return np.concatenate([np.array(self.population[:K], dtype=np.float64), self._accept(K)[len(self.population):]])

    def observe(self, num_accepted: torch.Tensor, rows: list[int]) -> None:
        """A drafted round's accepted drafts ``[m]`` of the requests ``rows``: the running, population and each
        request's own acceptance of the ``width`` verified slots (accepted over reached, older rounds weighted down by
        ``1 - smoothing``; a request's record starting from one round's worth of the population's), from realised
        outcomes (an over-confident drafter must not talk the policy into drafting); the slots past them from the
        round's prediction (a request's record from its own; :meth:`_blend_predicted`)."""
        n = num_accepted.cpu().numpy()
        K = max(self.costs.tokens) - 1
        if self.width > 0 and (self.population or self.accept):
            prior = self._prior(K)
            own = self._row_counts(rows, prior)  # [m, 2, K]
            slot = np.arange(1, K + 1)
            by_row = self._predicted_rows if len(self._predicted_rows) == len(rows) else np.zeros((len(rows), 0))
            drafted = min(by_row.shape[1], K)  # slots the round predicted
            past = (slot > self.width) & (slot <= drafted)  # [K] predicted, not verified
            predicted = np.pad(by_row[:, :drafted], ((0, 0), (0, K - drafted)))  # [m, K] each row's prediction
            reached = ((n[:, None] >= slot - 1) & (slot <= self.width)) | past  # [m, K]
            hit = np.where(past, predicted, reached & (n[:, None] >= slot))  # [m, K]: a prediction where not verified
            decay = np.where(reached, 1 - self.smoothing, 1.0)[:, None]  # [m, 1, K]: older rounds count less
            own = own * decay + np.stack([hit, reached], axis=1)
            self._records.update((r, (c, self._round)) for r, c in zip(rows, own))
        accept = list(self.accept)  # new lists: copies of a policy (dataclasses.replace) must not share them
        counts = [[c * self.population_decay for c in slot] for slot in self._population_counts]
        at_least = np.bincount(np.clip(n, 0, None), minlength=self.width + 1)[::-1].cumsum()[::-1].tolist()  # n >= j
        for j in range(1, self.width + 1):
            reached = at_least[j - 1]
            if reached == 0:
                break
            hits = at_least[j] if j < len(at_least) else 0
            if j > len(accept):
                accept.append(hits / reached)
            else:
                accept[j - 1] += self.smoothing * (hits / reached - accept[j - 1])
            if j > len(counts):  # a slot first verified: 8 rows' worth of its calibrated prediction to start from
                guess = self._predicted[j - 1] if j <= len(self._predicted) else hits / reached
                counts.append([8.0 * guess, 8.0])
            counts[j - 1] = [counts[j - 1][0] + hits, counts[j - 1][1] + reached]
        self.accept, self._population_counts = accept, counts
        self.population = [hit / reached for hit, reached in counts]
        self._blend_predicted()
