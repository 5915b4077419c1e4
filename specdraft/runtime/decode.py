"""The decode engine: lossless speculative decoding over ragged batches (DFlash loop, arXiv:2602.06036 §2).

One round per active row: draft a block ``[anchor, MASK x K]`` (its input embeddings may carry the drafter's
cross-round state, e.g. ReTrace's rejected suffix) -> verify ``[anchor, d_1..d_K]`` in ONE target
pass -> accept ``a`` drafts + one target token -> commit (each row's target cache grows by ``a + 1``) -> feed the
``a + 1`` committed tokens' target features to the drafter's context cache (right away, so the next round starts
drafting at once). The AR baseline (no drafter) is the same
loop with a block of one token, so speedups compare like with like. Finished rows are compacted away so they stop
costing compute; stop tokens and ``max_new_tokens`` are per row. With ``tree=`` a round drafts and verifies a tree
instead of one block: D²SD's (:mod:`specdraft.runtime.d2sd`) or a one-pass tree (:mod:`specdraft.runtime.one_pass`);
with ``policy=`` an adaptive policy chooses each round. What a round drafts and verifies is its kind's
(:mod:`specdraft.runtime.rounds`); admission, acceptance, emission and compaction around it are shared.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdraft.runtime.backlog import Backlog
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.drafter import Drafter, RoundRecord
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.phase_clock import PhaseClock
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.requests import GenerationConfig, Requests, RowResult
from specdraft.runtime.rounds import Job, rounds_for
from specdraft.runtime.sampling import sample

__all__ = ["GenerationConfig", "RowResult", "generate"]

@dataclass
class _State:
    """Device tensors of the active rows (all indexed by active slot)."""

    rows: torch.Tensor  # [b] original row index
    anchor: torch.Tensor  # [b] last committed token, not yet in the target cache
    draft_state: object = None  # drafter's cross-round state (ReTrace: the rejected suffix), or None

    def select(self, keep: torch.Tensor) -> None:
        self.rows, self.anchor = self.rows[keep], self.anchor[keep]
        if self.draft_state is not None:
            self.draft_state = self.draft_state.select(keep)

    def extend(self, new: "_State") -> None:
        """Append newly admitted rows (their drafter state is fresh: ``None``, or the state's ``blank`` rows)."""
        old_n, new_n = self.rows.numel(), new.rows.numel()
        a, b = self.draft_state, new.draft_state
        if a is not None or b is not None:
            a = a if a is not None else b.blank(old_n)
            b = b if b is not None else a.blank(new_n)
            self.draft_state = a.cat(b)
        self.rows, self.anchor = torch.cat([self.rows, new.rows]), torch.cat([self.anchor, new.anchor])


def _drafter_cache(drafter, rows: int, length: int, deferred: bool):
    """The drafter's context cache for ``rows`` requests being admitted, room for ``length`` slots: allocated now, or,
    when the ingest is deferred and the cache can grow (:attr:`KVCache.grow_to`), one slot growing up to ``length``
    when the drafter first catches up (a job that never drafts holds no drafter context; one that does, the slots its
    catch-up and rounds need)."""
    if deferred:
        cache = drafter.new_cache(rows, 1)
        if hasattr(cache, "grow_to"):
            cache.grow_to = length
            return cache
    return drafter.new_cache(rows, length)


def _pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts], device=device)
    out = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    return out, lens


class _Prefill:
    """Requests being prefilled into their own cache rows, ``chunk`` prompt tokens per :meth:`step`, before they
    join the running batch (chunked prefill: a long prompt does not stall the running rows for its whole length)."""

    def __init__(self, rows: list[int], prompts: Sequence[Sequence[int]], target: TargetLM, drafter, second,
                 feature_layers, max_len: int, drafter_len: int, dev, defer: bool = False):
        self.rows = rows
        self.backlog = Backlog() if defer else None
        """Set: the drafter's ingest of the prompts waits here (an adaptive policy may never draft for them)."""
        self.tokens, self.lens = _pad([prompts[r] for r in rows], dev)  # [n, P], [n]
        self.target, self.drafter, self.second, self.feature_layers = target, drafter, second, feature_layers
        n = len(rows)
        self.tcache = target.new_cache(n, max_len)
        self.dcache = _drafter_cache(drafter, n, drafter_len, defer) if drafter is not None else None
        self.scache = second.new_cache(n, drafter_len) if second is not None else None
        self.done = 0  # prompt tokens prefilled (per row: min(done, lens[b]))
        self.last_logits: torch.Tensor | None = None  # [n, V] each row's logits after its last prompt token

    def step(self, chunk: int) -> bool:
        """Prefill the next ``chunk`` prompt tokens of every row; True when every prompt is in the caches."""
        lo, hi = self.done, min(self.done + chunk, self.tokens.shape[1])
        counts = (self.lens - lo).clamp(0, hi - lo)  # [n] real tokens of each row in this chunk
        before = self.tcache.lengths
        # deferred: the layers' outputs as they are (the backlog copies each row's real tokens once, not the padded
        # concatenation and then the rows)
        split = {"concat_features": False} if self.backlog is not None and isinstance(self.target, TargetLM) else {}
        out = self.target(self.tokens[:, lo:hi], cache=self.tcache, feature_layers=self.feature_layers,
                          logits_at=(counts - 1).clamp(min=0)[:, None], **split)  # logits [n, 1, V]
        self.tcache.crop(before + counts)  # padding past a prompt's end was written to scratch only
        if self.backlog is not None:
            self.backlog.add(out.features, counts)
        else:
            for d, cache in ((self.drafter, self.dcache), (self.second, self.scache)):
                if d is not None:
                    d.ingest(cache, out.features, counts)  # the prompt's target features -> the drafter's context
        ends_here = (counts > 0) & (self.lens <= hi)  # [n]
        if self.last_logits is None:
            self.last_logits = out.logits.new_zeros(len(self.rows), out.logits.shape[-1])
        self.last_logits[ends_here] = out.logits[ends_here, 0]
        self.done = hi
        return hi >= self.tokens.shape[1]


class _Admission:
    """Continuous batching: fills free slots from the queue of requests, prefilling each group into cache rows of
    its own (``chunk`` prompt tokens a call while others run) and moving it into the running batch when complete."""

    def __init__(self, prompts: Sequence[Sequence[int]], requests: Requests, job, rounds, slots: int, chunk: int,
                 max_len: int, drafter_len: int, reserve: bool):
        self.prompts, self.requests, self.job, self.rounds = prompts, requests, job, rounds
        self.slots, self.chunk, self.max_len, self.drafter_len = slots, chunk, max_len, drafter_len
        self.queue = deque(range(len(prompts)))
        self.pending: _Prefill | None = None
        self.reserve = reserve  # continuous batching: room for every slot once, then admissions copy their rows

    def __call__(self, state: _State, caches: dict) -> None:
        """Start a prefill, advance it one chunk (all of it when no row is running, as nothing would stall), and
        move its unfinished rows into ``state`` and ``caches`` when it completes; again while slots are free."""
        job, rounds = self.job, self.rounds
        while True:
            running = state.rows.numel()
            if self.pending is None:
                free = self.slots - running
                if free <= 0 or not self.queue:
                    return
                take = [self.queue.popleft() for _ in range(min(free, len(self.queue)))]
                self.requests.admit(take)
                # a deferred drafter ingest never writes a joining group's drafter cache rows before admission copies
                # their committed entries (none), so one slot each stands in for them
                placeholder = rounds.defer and bool(caches)
                self.pending = _Prefill(take, self.prompts, job.target, job.drafter, rounds.second,
                                        job.feature_layers, self.max_len, 1 if placeholder else self.drafter_len,
                                        job.device, defer=rounds.defer)
            complete = self.pending.step(self.chunk if running else self.pending.tokens.shape[1])
            job.clock.lap("prefill")
            if not complete:
                return
            group, self.pending = self.pending, None
            first = sample(group.last_logits, job.params, job.generator)  # [n]
            for r, t in zip(group.rows, first.tolist()):
                self.requests.emit(r, [t])
            keep = [i for i, r in enumerate(group.rows) if not self.requests.done[r]]
            new = _State(rows=torch.tensor(group.rows, dtype=torch.long, device=job.device), anchor=first)
            new_caches = {"t": group.tcache, "d": group.dcache, "s": group.scache}
            _compact(new, new_caches, keep, len(group.rows), group.backlog)
            if not keep:
                continue
            if not caches:
                state.rows, state.anchor, state.draft_state = new.rows, new.anchor, new.draft_state
                caches.update(new_caches)
                for cache in caches.values():
                    if self.reserve and hasattr(cache, "reserve"):
                        cache.reserve(self.slots)
            else:
                state.extend(new)
                for key, cache in new_caches.items():
                    if cache is not None:
                        caches[key].cat_rows(cache)
            rounds.admitted([group.rows[i] for i in keep], group.backlog, running, caches)
            job.clock.lap("compaction")


@torch.inference_mode()
def generate(target: TargetLM, prompts: Sequence[Sequence[int]], config: GenerationConfig,
             drafter: Drafter | None = None, generator: torch.Generator | None = None,
             observer: Callable[[RoundRecord], None] | None = None,
             tree: TreeDrafting | OnePassDrafting | None = None,
             timings: dict[str, float] | None = None, policy: AdaptivePolicy | None = None,
             slots: int | None = None, prefill_chunk: int | None = None,
             on_result: Callable[[int, RowResult], None] | None = None) -> list[RowResult]:
    """Decode prompts with the target alone (``drafter=None``) or speculatively.

    Args:
        target: the verifying target LM.
        prompts: token id lists (ragged), in arrival order.
        config: lengths, sampling, stop tokens.
        drafter: a block drafter bound to ``target`` (a :class:`Drafter`), or ``None`` for AR.
        generator: RNG for sampling (on the target's device).
        observer: called once per verify round with its :class:`RoundRecord` (analysis, on-policy rollouts).
        tree: tree rounds, D²SD's, one-pass or merged (needs ``drafter``, a first drafter without cross-round state).
        timings: when given, wall seconds per round phase are added to it (prefill, draft, second_draft, tree,
            budget (a measured tree budget's choice), verify, walk (a tree's), compaction, commit), synchronising the
            device at each phase boundary.
        policy: an :class:`AdaptivePolicy` choosing whether to draft and how many drafts to verify each round
            (with ``tree``: a whole tree round or a plain one; None: the whole block or tree every round).
        slots: continuous batching: at most ``slots`` requests decode at once, and when one finishes the next in
            ``prompts`` is prefilled into its own cache rows and joins the running batch (Orca, OSDI'22). ``None``
            decodes every prompt as one static batch.
        prefill_chunk: with ``slots``, requests admitted while others are decoding are prefilled ``prefill_chunk``
            prompt tokens per round (Sarathi, arXiv:2308.16369); ``None`` prefills a prompt in one pass.
        on_result: called with ``(index, result)`` as each request finishes (a batch job writes it right away).
    Returns:
        one :class:`RowResult` per prompt, in order. ``time_s`` runs from the request's admission to its end.
    """
    requests = Requests(prompts, config, on_result)
    if slots is not None and slots < 1 or prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("slots and prefill_chunk must be positive")
    dev = target.lm_head.weight.device
    job = Job(target, drafter, config.sampling, config.draft_sampling, generator, PhaseClock(timings, dev), dev)
    longest, most = max(requests.prompt_len), max(requests.max_new)
    # a backlog flush writes max(counts) slots on every row (a prompt and the plain rounds), past a short row's end
    # (scratch): room for that
    rounds = rounds_for(job, tree, policy, longest + most)
    chunk = prefill_chunk or longest
    max_len = max(max(n + m for n, m in zip(requests.prompt_len, requests.max_new)) + rounds.verify_len + 1,
                  longest + min(chunk, longest))
    admit = _Admission(prompts, requests, job, rounds, min(slots or len(prompts), len(prompts)), chunk, max_len,
                       max_len + rounds.drafter_room, reserve=slots is not None)
    state = _State(rows=torch.zeros(0, dtype=torch.long, device=dev), anchor=torch.zeros(0, dtype=torch.long,
                                                                                         device=dev))
    caches: dict[str, object] = {}  # "t": target, "d": drafter, "s": second drafter (D²SD), rows as in ``state``

    admit(state, caches)
    while state.rows.numel() > 0:
        job.clock.lap("commit")
        rnd = rounds.run(state, caches, lambda: requests.mean_context(state.rows.tolist()))
        if observer is not None:
            observer(RoundRecord(state.rows, rnd.draft_tokens, rnd.draft_logits, rnd.hidden, rnd.num_accepted,
                                 rnd.next_token, rnd.target_logits, rnd.nodes, rnd.winner))
        tcache = caches["t"]
        tcache.crop(tcache.lengths + rnd.num_accepted + 1)  # anchor + accepted drafts are now committed
        rounds.commit(state, caches, rnd)
        state.anchor = rnd.next_token
        ids = state.rows.tolist()  # the round's requests
        useful = [requests.record(row, *outcome) for row, outcome in zip(ids, rnd.per_row())]
        keep = [i for i, row in enumerate(ids) if not requests.done[row]]
        _compact(state, caches, keep, len(ids), rounds.backlog)
        rounds.end_round(ids, useful, [row for row in ids if requests.done[row]], rnd)
        job.clock.lap("commit")  # the round's bookkeeping is not the admission's prefill
        admit(state, caches)
    job.clock.lap("commit")
    return requests.results


def _compact(state: _State, caches: dict[str, object], keep: list[int], current: int,
             backlog: Backlog | None = None) -> None:
    """Drop finished rows from the state and every cache, so they stop costing compute (rows keep no order)."""
    if len(keep) == current:
        return
    n, kept = len(keep), set(keep)
    tail = [i for i in keep if i >= n]  # kept rows past the new end fill the holes left by finished ones
    order = [i if i in kept else tail.pop() for i in range(n)]  # swap-remove: caches copy one row per hole
    idx = torch.tensor(order, dtype=torch.long, device=state.rows.device)
    state.select(idx)
    if backlog is not None:
        backlog.select(idx)
    for cache in caches.values():
        if cache is not None:
            cache.select_rows(idx)
