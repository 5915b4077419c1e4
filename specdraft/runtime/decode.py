"""The decode engine: lossless speculative decoding over ragged batches (DFlash loop, arXiv:2602.06036 §2).

One round per active row: draft a block ``[anchor, MASK x K]`` (its input embeddings may carry the drafter's
cross-round state, e.g. ReTrace's rejected suffix) -> verify ``[anchor, d_1..d_K]`` in ONE target
pass -> accept ``a`` drafts + one target token -> commit (each row's target cache grows by ``a + 1``) -> feed the
``a + 1`` committed tokens' target features to the drafter's context cache (right away, so the next round starts
drafting at once). The AR baseline (no drafter) is the same
loop with a block of one token, so speedups compare like with like. Finished rows are compacted away so they stop
costing compute; stop tokens and ``max_new_tokens`` are per row. With ``tree=`` a round drafts and verifies a tree
instead of one block: D²SD's (:mod:`specdraft.runtime.d2sd`) or a one-pass tree (:mod:`specdraft.runtime.one_pass`);
everything around the round is shared.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdraft.runtime.backlog import Backlog
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.drafter import Drafter, RoundRecord
from specdraft.runtime.explore import explorers, explores_rows, scatter_rows, verifies_apart, verify_apart
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.phase_clock import PhaseClock, wall_seconds
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.sampling import SamplingParams, logits_to_probs, sample, sample_from_probs
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling


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
    """D²SD: tree nodes per round (root included, after deduplication); empty for chain decoding."""
    winner: list[int] = field(default_factory=list)
    """D²SD: the candidate holding the accepted path per round (0 = the first draft, j = the second drafter's
    j-th branch by prefix length; the first draft wins ties)."""
    verified: list[int] = field(default_factory=list)
    """Drafts verified per round: the block's K, or what an adaptive policy chose (0 = a plain decoding round)."""

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


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


MAX_DEFERRED_TOKENS = 32_768
"""Deferred features (prompts and plain rounds, all rows) past which an admission feeds the drafter at once: features
of several target layers take more memory per token than the drafter's own K/V."""


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
        tree: tree rounds, D²SD's or one-pass (needs ``drafter``, a first drafter without cross-round state).
        timings: when given, wall seconds per round phase are added to it (prefill, draft, second_draft, tree,
            verify, compaction, commit), synchronising the device at each phase boundary.
        policy: chain rounds only: an :class:`AdaptivePolicy` choosing whether to draft and how many drafts to
            verify each round (None: the whole block every round).
        slots: continuous batching: at most ``slots`` requests decode at once, and when one finishes the next in
            ``prompts`` is prefilled into its own cache rows and joins the running batch (Orca, OSDI'22). ``None``
            decodes every prompt as one static batch.
        prefill_chunk: with ``slots``, requests admitted while others are decoding are prefilled ``prefill_chunk``
            prompt tokens per round (Sarathi, arXiv:2308.16369); ``None`` prefills a prompt in one pass.
        on_result: called with ``(index, result)`` as each request finishes (a batch job writes it right away).
    Returns:
        one :class:`RowResult` per prompt, in order. ``time_s`` runs from the request's admission to its end.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every request needs at least one token")
    if tree is not None:
        if drafter is None:
            raise ValueError("tree drafting needs a first drafter")
        tree.check(drafter)
    if policy is not None and (drafter is None or tree is not None):
        raise ValueError("an adaptive policy chooses chain rounds: it needs a drafter and no tree")
    if slots is not None and slots < 1 or prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError("slots and prefill_chunk must be positive")
    dev = target.lm_head.weight.device
    B = len(prompts)
    S = B if slots is None else min(slots, B)
    block = drafter.block_size if drafter is not None else 1
    verify_len = max(tree.max_nodes(block), block) if tree is not None else block  # the drafter's block fits too
    max_new = [config.max_new_tokens] * B if isinstance(config.max_new_tokens, int) else list(config.max_new_tokens)
    stop = set(config.stop_token_ids)
    params = config.sampling
    feature_layers = drafter.target_layer_ids if drafter is not None else ()
    longest = max(len(p) for p in prompts)
    chunk = prefill_chunk or longest
    max_len = max(max(len(p) + m for p, m in zip(prompts, max_new)) + verify_len + 1, longest + min(chunk, longest))
    # a backlog flush writes max(counts) slots on every row (a prompt and the plain rounds), past a short row's end
    # (scratch): room for that
    drafter_len = max_len + (longest + max(max_new) if policy is not None else 0)
    second = tree.second if tree is not None and tree.second is not drafter else None
    clock = PhaseClock(timings, dev)
    if policy is not None:
        policy.new_job()

    generated: list[list[int]] = [[] for _ in range(B)]
    accept_lengths: list[list[int]] = [[] for _ in range(B)]
    accepted: list[list[int]] = [[] for _ in range(B)]
    nodes: list[list[int]] = [[] for _ in range(B)]
    winners: list[list[int]] = [[] for _ in range(B)]
    verified: list[list[int]] = [[] for _ in range(B)]
    results: list[RowResult | None] = [None] * B
    admitted = [0.0] * B
    cache_offset = [len(p) - 1 for p in prompts]  # a row's cache: its prompt and generated tokens but the anchor

    def finish(row: int, reason: str) -> None:
        fresh.discard(row)
        results[row] = RowResult(generated[row], accept_lengths[row], reason, time.perf_counter() - admitted[row],
                                 accepted[row], nodes[row], winners[row], verified[row])
        if on_result is not None:
            on_result(row, results[row])

    def emit(row: int, new_tokens: list[int]) -> tuple[int, str | None]:
        """Append committed tokens to a row until a stop token or its cap; returns how many it emitted (a stop token
        counts: it was generated) and why the row finished (None while it runs)."""
        for i, t in enumerate(new_tokens):
            if t in stop:
                return i + 1, "stop"
            generated[row].append(t)
            if len(generated[row]) >= max_new[row]:
                return i + 1, "length"
        return len(new_tokens), None

    fresh: set[int] = set()  # running requests admitted since the last drafted round (an adaptive policy probes them)
    opening: set[int] = set()  # running requests whose next round is their first (an adaptive policy prices it apart)
    explored = 0  # exploring rounds so far (the plain rows they draft for take turns)
    queue = deque(range(B))
    state = _State(rows=torch.zeros(0, dtype=torch.long, device=dev), anchor=torch.zeros(0, dtype=torch.long,
                                                                                         device=dev))
    caches: dict[str, object] = {}  # "t": target, "d": drafter, "s": second drafter (D²SD), rows as in ``state``
    pending: _Prefill | None = None
    backlog = Backlog()

    def admit() -> None:
        """Fill free slots from the queue: start a prefill, advance it one chunk (all of it when no row is running,
        as nothing would stall), and move its unfinished rows into the running batch when it completes."""
        nonlocal pending
        while True:
            running = state.rows.numel()
            if pending is None:
                free = S - running
                if free <= 0 or not queue:
                    return
                take = [queue.popleft() for _ in range(min(free, len(queue)))]
                now = time.perf_counter()
                for r in take:
                    admitted[r] = now
                # under a policy the drafter's ingest of a joining group is deferred: its drafter cache rows are never
                # written before admission copies their committed entries (none), so one slot each stands in for them
                placeholder = policy is not None and bool(caches)
                pending = _Prefill(take, prompts, target, drafter, second, feature_layers, max_len,
                                   1 if placeholder else drafter_len, dev, defer=policy is not None)
            complete = pending.step(chunk if running else pending.tokens.shape[1])
            clock.lap("prefill")
            if not complete:
                return
            group, pending = pending, None
            first = sample(group.last_logits, params, generator)  # [n]
            keep = []
            for i, (r, t) in enumerate(zip(group.rows, first.tolist())):
                reason = emit(r, [t])[1]
                if reason is None:
                    keep.append(i)
                else:
                    finish(r, reason)
            new = _State(rows=torch.tensor(group.rows, dtype=torch.long, device=dev), anchor=first)
            new_caches = {"t": group.tcache, "d": group.dcache, "s": group.scache}
            _compact(new, new_caches, keep, len(group.rows), group.backlog)
            if not keep:
                continue
            if group.backlog is not None:
                backlog.cat_rows(group.backlog, running, len(keep))
            if policy is not None:
                fresh.update(group.rows[i] for i in keep)
                opening.update(group.rows[i] for i in keep)
            if not caches:
                state.rows, state.anchor, state.draft_state = new.rows, new.anchor, new.draft_state
                caches.update(new_caches)
                if slots is not None:  # room for every slot once: admissions then copy only their own rows
                    for cache in caches.values():
                        if hasattr(cache, "reserve"):
                            cache.reserve(S)
            else:
                state.extend(new)
                for key, cache in new_caches.items():
                    if cache is not None:
                        caches[key].cat_rows(cache)
            if backlog.tokens > MAX_DEFERRED_TOKENS:
                backlog.flush(drafter, caches["d"])
            clock.lap("compaction")

    cuda = dev.type == "cuda"
    # a plain round's features wait in the backlog as the layers' outputs (concatenated once, when a row is fed)
    plain_split = {"concat_features": False} if policy is not None and isinstance(target, TargetLM) else {}
    flushed, fed = 0.0, 0  # this round's seconds feeding the drafter deferred features, and their entries

    def flush(rows: torch.Tensor | None = None) -> None:
        nonlocal flushed, fed
        if backlog.tokens:
            clock.lap("draft")
            waiting = backlog.tokens
            flushed += wall_seconds(lambda: backlog.flush(drafter, caches["d"], rows), dev)
            fed += waiting - backlog.tokens
            clock.lap("flush")

    admit()
    while state.rows.numel() > 0:
        tcache, dcache, scache = caches["t"], caches["d"], caches["s"]
        b = state.rows.numel()
        clock.lap("commit")
        if policy is not None:  # the policy prices rounds by their measured seconds
            if cuda:
                torch.cuda.synchronize()
            started, flushed, fed = time.perf_counter(), 0.0, 0
        tree_nodes = tree_winner = widths = None
        apart = False  # an exploring round's explorers verify in a pass of their own rows
        m = 0  # rows that drafted this round
        ids = state.rows.tolist()  # the running requests
        if policy is not None:  # priced against the rows' mean cache length, the tokens left, the features waiting
            made = sum(len(generated[r]) for r in ids)
            policy.before_round((made + sum(cache_offset[r] for r in ids)) / b, sum(max_new[r] for r in ids) - made,
                                backlog.tokens)
        if tree is not None:
            rnd = tree.round(target, drafter, dcache, scache if second is not None else dcache, tcache, state.anchor,
                             params, feature_layers, generator, clock, config.draft_sampling)
            draft_tokens, draft_logits, hidden = rnd.draft_tokens, rnd.draft_logits, rnd.hidden
            n_acc, nxt, target_logits = rnd.acceptance.num_accepted, rnd.acceptance.next_token, rnd.path_logits
            features, tree_nodes, tree_winner = rnd.path_features, rnd.num_nodes, rnd.acceptance.winner
        elif drafter is not None and (m := b if policy is None else policy.draft_rows(b, len(fresh), ids, opening)) > 0:
            # m rows draft (fewer than b: an exploring round, when the drafter can draft for a subset of rows)
            widths = None  # [b] drafts each row verifies, when only a few rows drafted
            if m < b and not explores_rows(drafter, dcache):
                m = b
            if m < b:
                # an adaptive policy exploring: a few rows draft (new requests first), the others decode plainly
                few = explorers(m, state.rows, fresh, explored)  # [m]
                explored += 1
                fresh.clear()  # a probe of some new requests stands for all of them, as a full round did
                flush(few)
                part = _draft(drafter, dcache.gather_rows(few, block), state.anchor[few], None, params,
                              config.draft_sampling, generator)
                conf = draft_confidence(*part[1:])  # [m, K]
                k, apart = (policy.explore_len(conf, rows=b) if verifies_apart(tcache)
                            else (policy.verify_len(conf, rows=b), False))
                widths = torch.zeros(b, dtype=torch.long, device=dev)
                widths[few] = k
                own_drafts = part[2][:, :k]  # [m, k] (a pass apart verifies these, not their padded rows)
                hidden, draft_logits, draft_tokens, draft_probs = (
                    None if x is None else scatter_rows(x[:, :k] if i else x, few, b) for i, x in enumerate(part))
            else:
                fresh.clear()
                flush()  # plain rounds' features, deferred until drafting resumed
                hidden, draft_logits, draft_tokens, draft_probs = _draft(
                    drafter, dcache, state.anchor, state.draft_state, params, config.draft_sampling, generator)
                if policy is not None:  # verify only the first k drafts: a block of k drafts, just as lossless
                    k = policy.verify_len(draft_confidence(draft_logits, draft_tokens, draft_probs))
                    draft_tokens, draft_logits = draft_tokens[:, :k], draft_logits[:, :k]
                    draft_probs = draft_probs[:, :k] if draft_probs is not None else None
            clock.lap("draft")
            if apart:  # the explorers' drafts in a pass of their own rows, after every row's plain pass
                out = verify_apart(target, tcache, state.anchor, few, own_drafts, feature_layers)
            else:
                out = target(torch.cat([state.anchor[:, None], draft_tokens], dim=1), cache=tcache,
                             feature_layers=feature_layers)  # verify [anchor, d_1..d_K]
            n_acc, nxt = verify_round(draft_tokens, draft_probs, out.logits, params, generator, widths)  # [b], [b]
            features, target_logits = out.features, out.logits
            clock.lap("verify")
        else:  # the target alone, or a plain round of an adaptive policy (its features wait in the backlog)
            draft_tokens = state.anchor.new_zeros(b, 0)
            draft_logits = hidden = None
            out = target(state.anchor[:, None], cache=tcache, feature_layers=feature_layers, **plain_split)  # [b, 1]
            n_acc, nxt = verify_round(draft_tokens, None, out.logits, params, generator)
            features, target_logits = out.features, out.logits
            clock.lap("verify")
        if observer is not None:
            observer(RoundRecord(state.rows, draft_tokens, draft_logits, hidden, n_acc, nxt, target_logits,
                                 tree_nodes, tree_winner, widths))
        tcache.crop(tcache.lengths + n_acc + 1)  # anchor + accepted drafts are now committed
        if drafter is not None and tree is None and draft_tokens.shape[1] == 0:
            backlog.add(features)  # a plain round: the drafter catches up when drafting resumes
        elif widths is not None:  # a few rows drafted: they ingest now, the others' features wait like a plain round's
            drafted = widths > 0  # [b]
            drafter.ingest(dcache, features, torch.where(drafted, n_acc + 1, 0))
            backlog.add(features[:, :1], (~drafted).long())
        elif drafter is not None:  # the committed tokens' target features join the drafter's context
            fused = drafter.ingest(dcache, features, n_acc + 1)  # [b, T, D]
            state.draft_state = drafter.next_round_state(state.draft_state, hidden, draft_tokens, n_acc,
                                                         target_logits, fused)
            if tree is not None and state.draft_state is not None:
                raise ValueError("tree drafting needs a first drafter without cross-round state (e.g. dflash)")
        if second is not None:
            second.ingest(scache, features, n_acc + 1)
            second.next_round_state(None, None, draft_tokens, n_acc, target_logits, None)
        state.anchor = nxt
        keep, useful = [], []  # useful: drafts each row committed (accepted ones past its stop token or cap are not)
        tree_nodes = tree_nodes.tolist() if tree_nodes is not None else [0] * b
        tree_winner = tree_winner.tolist() if tree_winner is not None else [0] * b
        row_widths = widths.tolist() if widths is not None else [draft_tokens.shape[1]] * b
        for i, (row, a, d, t) in enumerate(zip(ids, n_acc.tolist(), draft_tokens.tolist(),
                                               nxt.tolist())):
            accepted[row].append(a)
            verified[row].append(row_widths[i])
            if tree is not None:
                nodes[row].append(tree_nodes[i])
                winners[row].append(tree_winner[i])
            emitted, reason = emit(row, d[:a] + [t])
            useful.append(emitted - 1)
            accept_lengths[row].append(emitted)  # what the round emitted (a + 1 unless cut short)
            if reason is None:
                keep.append(i)
            else:
                finish(row, reason)
        if policy is not None and draft_tokens.shape[1] > 0:  # drafts past a row's end count as rejected
            drafting = [i for i, w in enumerate(row_widths) if w > 0]
            policy.observe(torch.tensor([useful[i] for i in drafting]), [ids[i] for i in drafting], opening)
        opening.clear()
        _compact(state, caches, keep, b, backlog)
        if policy is not None:  # the round's rows, drafting rows and verified width, as the cost model prices them
            policy.observe_seconds(b, m, draft_tokens.shape[1], time.perf_counter() - started - flushed, flushed, fed)
        clock.lap("commit")  # the round's bookkeeping is not the admission's prefill
        admit()
    clock.lap("commit")
    return results  # type: ignore[return-value]


def _draft(drafter, cache, anchor: torch.Tensor, draft_state, params: SamplingParams, draft_sampling: str,
           generator: torch.Generator | None):
    """One block per row against ``cache``: ``(hidden [b, Bk, D], draft_logits [b, K, V], draft_tokens [b, K],
    draft_probs [b, K, V] or None)``."""
    blk = torch.full((anchor.shape[0], drafter.block_size), drafter.config.mask_token_id, dtype=torch.long,
                     device=anchor.device)
    blk[:, 0] = anchor
    hidden = drafter.draft_hidden(cache, drafter.block_embeds(blk, draft_state))  # [b, Bk, D]
    draft_logits = drafter.logits(hidden[:, 1:])  # [b, K, V]
    return (hidden, draft_logits, *propose(draft_logits, params, draft_sampling, generator))


def draft_confidence(draft_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``[b, K]``: the drafter's probability of each of its drafts (under the distribution they were drawn from, or
    its plain softmax for argmax drafts)."""
    q = draft_probs if draft_probs is not None else torch.softmax(draft_logits.float(), -1)
    return q.gather(-1, draft_tokens[..., None])[..., 0]


def propose(draft_logits: torch.Tensor, params: SamplingParams, draft_sampling: str = "sample",
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens ``[b, K]`` from the drafter's logits ``[b, K, V]`` and the distribution ``q`` they were drawn from
    (``[b, K, V]``, processed exactly as the target's will be), or ``None`` for deterministic (argmax) drafts."""
    if params.greedy or draft_sampling == "greedy":
        return draft_logits.argmax(-1), None
    q = logits_to_probs(draft_logits, params)
    return sample_from_probs(q, generator), q


def verify_round(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 params: SamplingParams, generator: torch.Generator | None = None,
                 widths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_accepted [b], next_token [b])`` for drafts ``[b, K]`` against the verify logits ``[b, K + 1, V]``:
    greedy verification at T=0, speculative sampling otherwise (deterministic drafts verify as ``q = one_hot``).
    ``widths`` ``[b]``: drafts each row verifies, when rows differ (padding past them)."""
    if params.greedy:
        return accept_greedy(draft_tokens, target_logits, widths)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_logits.shape[-1]).float()
    return accept_speculative_sampling(draft_tokens, draft_probs, logits_to_probs(target_logits, params), generator,
                                       widths)


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
