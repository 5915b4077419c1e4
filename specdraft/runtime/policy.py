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
from specdraft.runtime.cost_model import CostModel

MEMO_LIMIT = 4096
"""Entries a memo of prices keeps across context buckets before it starts again."""


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
    """Rounds of plain decoding before drafting is tried again; each retry that still finds drafting not paying
    doubles the wait, up to ``max_retry_every`` (a drafter that pays again resets it)."""
    max_retry_every: int = 64
    explore_share: float = 0.005
    """Exploring rounds (retries and new-request probes) cost at most this share of the plain rounds' seconds: each
    plain round earns this share of its seconds, and an exploring round runs only once its extra seconds over a
    plain round (and the features it fed the drafter last time) are earned (where a drafted round costs several
    plain ones, as with many rows on a CPU, exploring is rarer; a drafter that never pays then costs about this
    share over plain decoding)."""
    smoothing: float = 0.3
    """Weight of the latest round in the running per-slot acceptance."""
    cost_smoothing: float = 0.1
    """Weight of the latest round in the running ratio of measured to modelled seconds (:meth:`observe_seconds`)."""
    whole_rounds: bool = False
    """Drafted rounds verify their whole draft (tree rounds): a drafted round is priced at the full width only, and
    :meth:`whole` records each such round's width as the block's."""
    measured: bool = True
    """Rescale the cost model by the rounds' measured seconds (False: decide from the cost model alone, as tests that
    pin decisions on a synthetic machine do)."""
    accept: list[float] = field(default_factory=list)
    """Running acceptance of slot ``j + 1`` given the slots before it were accepted, from realised rounds (empty:
    none drafted yet)."""
    population: list[float] = field(default_factory=list)
    """The same over every row of every drafted round (weighted by rows, the older rounds' by ``population_decay``
    per round; a slot starts from 8 rows' worth of the calibrated prediction, so the few rows of a job's first round
    do not decide alone): what a request's own record starts from and drifts back to."""
    population_decay: float = 0.95
    drift: float = 0.9
    """Each round since a request last drafted keeps this share of its own evidence's weight against one round's worth
    of the population's acceptance: a request's acceptance drifts, and where drafting pays on average a stretch of
    rejections is retried for free (a drafter that recovers, as at the end of an answer, is not missed)."""
    width: int = 0
    skipped: int = 0
    wait: int = 0
    """Plain rounds before the next retry (0: ``retry_every``)."""

    def __post_init__(self):
        # memos of prices, keyed by the context they were priced at (a job's rows sweep the same contexts request
        # after request: a new context bucket every few rounds at one row must not price every width again)
        self._rate_memo: dict = {}
        self._seconds_memo: dict[tuple[int, int, int], np.ndarray] = {}  # (context, rows, K) -> by width
        self._exploring = True  # the last drafted round was a first round, a retry or a probe (not known to pay)
        self._predicted: list[float] = []  # the last drafted round's predicted acceptance per slot (conditional)
        self._drafting = 0  # the rows that drafted in it
        self._credit = 0.0  # seconds of exploring the plain rounds have earned (explore_share), not yet spent
        self._charged: float | None = None  # the modelled extra seconds the due exploring round was charged, or None
        self._row_accept: dict[int, tuple] = {}  # request -> ([accepted, reached] [2, K] per slot, round) (this job)
        self._round = 0  # draft_this_round calls
        self._row_version = 0  # bumped whenever a request's acceptance changes
        self._stretch: list | None = None  # what a plain stretch holds while it goes on (see _still_plain)
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
        i = max(round(8 * math.log2(max(context, 1.0))), 32)  # 2 ** (32 / 8) = 16 tokens
        self._context_range = (2 ** ((i - 0.5) / 8) if i > 32 else 0.0, 2 ** ((i + 0.5) / 8))
        bucket = round(2 ** (i / 8))
        if bucket != self._context:
            self._context, self._priced = bucket, self.costs.at(bucket)
            ceilings = [self._rate_memo["ceiling"][2]] if self._rate_memo.get("ceiling") else []
            for memo in (self._seconds_memo, *ceilings):
                if len(memo) > MEMO_LIMIT:
                    memo.clear()

    def new_job(self) -> None:
        """Forget the requests' own acceptance (a decode call numbers its requests from 0); what was learnt of the
        drafter and the machine stays."""
        self._row_accept, self._row_version = {}, self._row_version + 1
        self._charged = None  # a round of a job that ended before it was measured is charged nothing more

    def draft_this_round(self, b: int, fresh: int = 0, rows: list[int] | None = None) -> bool:
        """False while the running acceptance (each request's own where ``rows``, the ``b`` running requests, are
        given and it has one) says no width of drafted round commits more tokens per second than plain decoding, at
        the rounds' measured costs (plain rounds then run). Drafting is retried after ``retry_every`` plain rounds,
        then after twice as many while retries keep failing, and new requests are probed once ``fresh`` rows (still
        running, admitted since the last drafted round) are half the batch, after ``retry_every`` plain rounds;
        either only once :attr:`explore_share` of the plain rounds' seconds pays for its extra seconds."""
        self._exploring = True
        self._round += 1
        if rows is not None and len(self._row_accept) > 2 * len(rows) + 64:  # ended requests: forget them
            kept = set(rows)
            self._row_accept = {r: e for r, e in self._row_accept.items() if r in kept}
        if self._still_plain(b, fresh, rows):
            return False
        self._stretch = None
        if not self.accept:
            return True
        if rows is None and 2 * fresh >= b and self.population:
            # new requests are half the batch: they start from the acceptance drafted requests had on average, not
            # from the last rounds of the ones before them (with ``rows``, each request without its own does)
            self.accept = list(self.population)
        plain = self._priced.target(b, 1) * self.measured_ratio("plain")
        scale = self.measured_ratio("drafted")
        # the requests' acceptance drifts with every round: bounded by the drift's end points, a round after a plain
        # one that cannot pay at the bound is decided without the exact rate (a plain round's decision stays a few
        # dict lookups; after a drafted round, which changed the acceptance, the exact rate is computed at once); the
        # bound over these rows is asked only where one over any rows (kept while requests end) could pay
        ceiling = (None if rows is None or self.skipped == 0
                   else self._ceiling_rate(b) / scale)
        if (ceiling is None or (ceiling >= b / plain
                                and self._drafted_rate(b, rows, True) / scale >= b / plain)):
            spec = self._drafted_rate(b, rows) / scale
        else:
            spec = 0.0
        if spec >= b / plain:
            self.skipped, self.wait, self._exploring = 0, 0, False
            return True
        extra = self._exploring_extra(b)
        due = self._exploring_due(b, fresh, extra)
        if due is not None:
            if due == "retry":  # while retries fail, the next waits twice as long (a probe leaves the wait)
                self.wait = min(2 * (self.wait or self.retry_every), max(self.max_retry_every, self.retry_every))
            self.skipped = 0
            self._credit -= extra
            self._charged = extra
            return True
        self._count_plain(plain, extra)
        if ceiling is not None and ceiling < b / plain:
            self._stretch = [b, fresh, self.accept, self.population, self._row_version, {}]
        return False

    def _still_plain(self, b: int, fresh: int, rows: list[int] | None) -> bool:
        """A round of a plain stretch: begun by a plain round decided on the bound over any rows (the ceiling), and
        going on while the rows' count, the new requests and the acceptance stand, that bound still below plain
        decoding's rate at the round's context and measured costs, and neither a retry nor a probe is due. Plain, as
        :meth:`draft_this_round` would decide, without its pass over the acceptance (the ceiling is memoised by the
        rows' count and context): a plain round's decision stays a few lookups."""
        st = self._stretch
        if (st is None or rows is None or st[0] != b or st[1] != fresh or st[2] is not self.accept
                or st[3] is not self.population or st[4] != self._row_version):
            return False
        ceiling = st[5].get(self._context)  # by context: the acceptance, hence the ceiling's key, stands
        if ceiling is None:
            ceiling = st[5][self._context] = self._ceiling_rate(b)
        plain = self._priced.target(b, 1) * self.measured_ratio("plain")
        if ceiling / self.measured_ratio("drafted") >= b / plain:
            return False
        extra = self._exploring_extra(b)
        if self._exploring_due(b, fresh, extra) is not None:
            return False
        self._count_plain(plain, extra)
        return True

    def _exploring_due(self, b: int, fresh: int, extra: float) -> str | None:
        """``"retry"`` or ``"probe"`` where one is due (after ``wait`` plain rounds, or ``retry_every`` once new
        requests are half the batch) and the plain rounds have earned its ``extra`` seconds; else None."""
        if self._credit < extra * (1 - 1e-9):
            return None
        if self.skipped >= (self.wait or self.retry_every):
            return "retry"
        if 2 * fresh >= b and self.skipped >= self.retry_every:
            return "probe"
        return None

    def _count_plain(self, plain: float, extra: float) -> None:
        """A plain round of ``plain`` seconds: one more skipped, and its share of exploring credit earned."""
        self.skipped += 1
        self._credit = min(self._credit + self.explore_share * plain, 2 * extra)

    def _exploring_extra(self, b: int) -> float:
        """Seconds an exploring round costs over a plain round (it is assumed to verify the last drafted width: an
        estimate of when the next is due, the measured seconds being what it is charged)."""
        drafted = self._priced.drafter(b) + self._priced.target(b, max(self.width, 1) + 1)
        plain = self._priced.target(b, 1)
        return max(drafted * self.measured_ratio("drafted") - plain * self.measured_ratio("plain"), 0.0)

    def measured_ratio(self, kind: str) -> float:
        """Measured / modelled seconds of ``kind`` rounds (``plain`` or ``drafted``); a kind not measured yet: as the
        other, or as modelled."""
        return self._scale.get(kind) or self._scale.get("plain" if kind == "drafted" else "drafted") or 1.0

    def observe_seconds(self, b: int, drafting: int, width: int, seconds: float, flushed: float = 0.0) -> None:
        """A round's measured wall seconds: ``b`` rows, of which ``drafting`` drafted (0: a plain round), verifying
        ``width`` drafts; ``flushed``: further seconds it fed the drafter the features that waited (not a cost of the
        round's kind; an exploring round's is charged to the exploring budget, and with ``measured`` a retry or probe
        is charged what it measured over a plain round, not the extra it was priced at). The running ratio to what the
        cost model prices such a round at rescales the model: what it does not time (sampling, verification, commit,
        the drafter's ingest of the accepted tokens) and how far the machine runs from when it was measured. One
        slow round moves the ratio by at most a factor ``1 + cost_smoothing``."""
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
        the pass's expected committed tokens per second (the
        drafter's round is paid by now; plain decoding, k = 0, still costs it this round). Slots past the chosen
        width will not be verified: their predicted acceptance is this round's evidence for them in the running
        acceptance (realised outcomes update the verified ones in :meth:`observe`), so a burst's long-gone acceptance
        of deep slots cannot keep narrow rounds drafting."""
        accept = self.calibration.predict(confidence.cpu().double().numpy())  # [m, K]
        return self._choose(accept, self._width(accept))

    def whole(self, confidence: torch.Tensor) -> None:
        """A drafted round that verified its whole draft (a tree round), its first drafter's per-slot confidences
        ``[b, K]``: the round's width is ``K``, as :meth:`observe` then reads it."""
        accept = self.calibration.predict(confidence.cpu().double().numpy())  # [b, K]
        self._choose(accept, accept.shape[1])

    def _width(self, accept: np.ndarray) -> int:
        """The width that maximises a pass's expected committed tokens per second for the rows' predicted acceptance
        ``accept`` ``[b, K]`` (see :meth:`verify_len`)."""
        b = accept.shape[0]
        tokens = expected_committed(accept).sum(0)  # [K + 1]
        rate = tokens / self._round_seconds(b, len(tokens) - 1)  # [K + 1] expected committed tokens per second
        best = int(rate.argmax())
        return best if rate[best] > rate[-1] else len(rate) - 1

    def _choose(self, accept: np.ndarray, width: int) -> int:
        """Take ``width`` as the round's width for the drafting rows' predicted acceptance ``accept`` ``[m, K]``."""
        self.width = width
        self._predicted = conditional_acceptance(accept).tolist()  # [K]
        self._drafting = accept.shape[0]
        if self.width == 0:  # nothing verified: observe() will not be called
            self._blend_predicted()
        return self.width

    def _blend_predicted(self) -> None:
        """Move the running acceptance of the slots this round did not verify toward their predicted acceptance
        (slots never seen before take it as it is), and add the prediction to the population's evidence of those
        slots it has, a row's worth for each row that drafted: a burst's deep slots, verified once, must not stand
        for every request that starts from the population while later rounds, predicted to fail sooner, verify fewer
        slots."""
        accept = list(self.accept)
        for j in range(self.width, len(self._predicted)):
            if j < len(accept):
                accept[j] += self.smoothing * (self._predicted[j] - accept[j])
            elif j == len(accept):
                accept.append(self._predicted[j])
        self.accept = accept
        if self.width < len(self._population_counts):
            counts = [list(c) for c in self._population_counts]  # new lists, as in observe()
            for j in range(self.width, min(len(counts), len(self._predicted))):
                counts[j] = [counts[j][0] + self._drafting * self._predicted[j], counts[j][1] + self._drafting]
            self._population_counts = counts
            self.population = [hit / reached for hit, reached in counts]

    def _drafted_rate(self, b: int, rows: list[int] | None = None, bound: bool = False) -> float:
        """Expected committed tokens per second of a drafted round of ``b`` rows (requests ``rows``: each at its own
        running acceptance, or the population's before it has one; else all at the running acceptance) at its best
        width (kept until an acceptance or the rows change: plain rounds ask it every round). ``bound``: an upper
        bound that holds however many rounds pass, each request's slot at the higher of its own acceptance and the
        population's (the drift moves a request's acceptance between the two; committed tokens grow with every
        slot's acceptance), kept until an acceptance or the rows change."""
        which = "bound" if bound else "rate"
        drift = None if rows is None else (tuple(rows), self._row_version, None if bound else self._round // 4)
        key = (b, tuple(self.accept), drift, self._context)
        if self._rate_memo.get(which) is None or self._rate_memo[which][0] != key:
            K = max(self.costs.tokens) - 1
            if rows is None:
                committed = expected_committed(self._accept(K)[None])[0] * b  # [K + 1]
            else:
                prior = self._prior(K)  # [K]
                counts = self._row_counts(rows, prior, drifted=not bound)  # [b, 2, K]
                committed = expected_committed(self._own(counts, prior, bound)).sum(0)  # [K + 1]
            rate = self._best_rate(committed, b)
            self._rate_memo[which] = (key, rate)
        return self._rate_memo[which][1]

    def _ceiling_rate(self, b: int) -> float:
        """An upper bound of :meth:`_drafted_rate` ``(b, rows, bound=True)`` for any ``b`` running requests: every
        slot of every row at the highest acceptance any known request or the population has (kept until an acceptance
        changes, not when requests end: a plain round of many rows, some ending in most rounds, decides on it without
        a pass over its rows)."""
        key = (tuple(self.accept), tuple(self.population), self._row_version)
        if self._rate_memo.get("ceiling") is None or self._rate_memo["ceiling"][0] != key:
            K = max(self.costs.tokens) - 1
            top = self._prior(K)  # [K]
            if self._row_accept:
                own = np.stack([c for c, _ in self._row_accept.values()])  # [r, 2, K] accepted, reached
                top = self._own(own, top, bound=True).max(0)
            # [K + 1] a row; rates by rows and context
            self._rate_memo["ceiling"] = (key, expected_committed(top[None])[0], {})
        _, committed, rates = self._rate_memo["ceiling"]
        if (b, self._context) not in rates:
            rates[b, self._context] = self._best_rate(committed * b, b)
        return rates[b, self._context]

    def _best_rate(self, committed: np.ndarray, b: int) -> float:
        """Committed tokens per second of a drafted round of ``b`` rows at its best width 1..K, given the round's
        expected committed tokens by width ``[K + 1]``."""
        rates = committed[1:] / self._round_seconds(b, len(committed) - 1)[1:]  # [K] by width 1..K
        return float(rates[-1] if self.whole_rounds else rates.max())

    def _round_seconds(self, b: int, K: int) -> np.ndarray:
        """``[K + 1]``: modelled seconds of a drafted round of ``b`` rows verifying ``k = 0..K`` drafts (memoised:
        plain rounds ask it every round)."""
        key = (self._context, b, K)
        if key not in self._seconds_memo:
            self._seconds_memo[key] = np.array(
                [self._priced.drafter(b) + self._priced.target(b, k + 1) for k in range(K + 1)])
        return self._seconds_memo[key]

    def _own(self, counts: np.ndarray, prior: np.ndarray, bound: bool = False) -> np.ndarray:
        """``[m, K]``: the acceptance a decision takes for each request from its ``counts`` ``[m, 2, K]`` (``bound``: at
        least the population's ``prior``, an upper bound however the record drifts toward it)."""
        own = counts[:, 0] / counts[:, 1]  # [m, K]
        return np.maximum(own, prior) if bound else own

    def _row_counts(self, rows: list[int], prior: np.ndarray, drifted: bool = True) -> np.ndarray:
        """``[m, 2, K]``: each request's own accepted and reached counts per slot, drifted toward one round's worth of
        ``prior`` by the rounds since it last drafted (``drifted=False``: as they were when it last drafted); one
        round's worth of ``prior`` for a request that has not drafted."""
        start = np.stack([prior, np.ones_like(prior)])  # [2, K]
        counts = np.repeat(start[None], len(rows), axis=0)  # [m, 2, K]
        entries = [self._row_accept.get(r) for r in rows]
        have = [i for i, e in enumerate(entries) if e is not None]
        if have and not drifted:
            counts[have] = np.stack([entries[i][0] for i in have])
        elif have:
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
        """``[K]``: what a request that has not drafted yet starts from: the population's acceptance of the slots it
        verified, the running acceptance (calibrated predictions past the verified slots) of the others."""
        return np.concatenate([np.array(self.population[:K], dtype=np.float64), self._accept(K)[len(self.population):]])

    def observe(self, num_accepted: torch.Tensor, rows: list[int] | None = None) -> None:
        """Update the running per-slot acceptance with a drafted round's accepted drafts ``[b]``: the ``self.width``
        verified slots from realised outcomes (an over-confident drafter must not talk the policy into drafting), the
        slots past them from the round's calibrated prediction (nothing else is known of them, and the width was
        chosen because they did not pay). With ``rows`` (the requests that drafted), each request's own running
        acceptance of the verified slots too (accepted over reached, older rounds weighted down by ``1 - smoothing``
        per round), starting from one round's worth of the population's: the requests that remain are not the
        average of those that drafted before (easy ones end first)."""
        n = num_accepted.cpu().numpy()
        K = max(self.costs.tokens) - 1
        if rows is not None and self.width > 0 and (self.population or self.accept):
            prior = self._prior(K)
            own = self._row_counts(rows, prior)  # [m, 2, K]
            slot = np.arange(1, K + 1)
            reached = (n[:, None] >= slot - 1) & (slot <= self.width)  # [m, K]
            hit = reached & (n[:, None] >= slot)
            decay = np.where(reached, 1 - self.smoothing, 1.0)[:, None]  # [m, 1, K]: older rounds count less
            own = own * decay + np.stack([hit, reached], axis=1)
            self._row_accept.update((r, (c, self._round)) for r, c in zip(rows, own))
            self._row_version += 1
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
