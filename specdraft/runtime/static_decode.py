"""The GPU decode path: static-shape rounds, captured in CUDA graphs, one set per batch-size bucket.

The engine of :mod:`specdraft.runtime.decode` reallocates as rows finish and reads lengths on the host to size each
pass; a CUDA graph (NVIDIA, "CUDA Graphs"; as gpt-fast and vLLM use them for decoding) needs neither. Here the
caches are allocated once for ``max_batch`` rows and ``max_len`` slots; a batch of ``b`` rows runs in the smallest
bucket ``n >= b`` (the first ``n`` rows of every buffer, so a bucket's tensors keep their addresses from call to
call); rows past ``b``, and rows that finished, stay in the bucket as frozen padding (their lengths stop growing,
their outputs are ignored) until the active rows fit a smaller bucket, when they are copied to the front in place.
Every pass reads lengths on the device only: attention goes through the speculative-attention kernel, which loops
over each row's own length, and ``KVCache.fixed_shape`` turns off the host-side room checks.

One round is three captured graphs around two small eager steps::

    draft   (anchor -> the drafter's block logits)       graph
    propose (argmax, or sample from the processed q)      eager, no host sync
    verify  ([anchor, drafts] -> target logits, features) graph
    accept  (greedy or speculative sampling)              eager, no host sync
    commit  (lengths += accepted + 1, drafter ingest)     graph

and one host synchronisation reads the accepted tokens. Acceptance is the engine's own functions
(:func:`~specdraft.runtime.decode.propose`, :func:`~specdraft.runtime.decode.verify_round`), so the rules that make
decoding lossless are shared, not copied. Without CUDA (or with ``graphs=False``) the same static rounds run eagerly:
the CPU tests check the static-shape logic, the GPU tests the capture.

Scope: chain decoding with a stateless drafter (DFlash, VP) or none (AR). D²SD trees and drafters with cross-round
state (ReTrace) run in the eager engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdraft.kernels.lm_head_argmax import lm_head_argmax
from specdraft.runtime.decode import GenerationConfig, RowResult, propose, verify_round
from specdraft.runtime.drafter import Drafter, RoundRecord
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.models.dflash import DFlashDrafter
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.sampling import sample
from specdraft.runtime.verify import accept_greedy_tokens

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def commit_counts(num_accepted: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``[n]`` tokens each bucket row commits: its accepted drafts and the next token, none for a frozen row (finished
    or padding: its caches were sized for its request only; a frozen row that kept growing would write past them)."""
    return (num_accepted + 1) * active


def _rows(cache: KVCache, n: int) -> KVCache:
    """The first ``n`` rows of a persistent cache, as a fixed-shape cache of views (same addresses every call)."""
    view = KVCache.__new__(KVCache)
    view.k = [k[:n] for k in cache.k]
    view.v = [v[:n] for v in cache.v]
    view._kb, view._vb = view.k, view.v
    view.lengths = cache.lengths[:n]
    view.max_len = cache.max_len
    view.fixed_shape = True
    view.grow_to = 0
    return view


class _Graphed:
    """``fn()`` captured once in a CUDA graph after a warm-up on a side stream (which compiles the Triton kernels);
    calling it replays the graph and returns the tensors ``fn`` returned at capture (overwritten by each replay).
    ``restore`` runs after the warm-up, before capture: it undoes the warm-up's effect on persistent state."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]], pool, restore: Callable[[], None]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
                restore()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()
        restore()  # capture does not run the kernels, but keep the contract simple

    def __call__(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


@dataclass
class _Bucket:
    """The static input/output buffers of one bucket and its three round steps (graphed or plain callables)."""

    n: int
    anchor: torch.Tensor  # [n] input of draft
    verify_tokens: torch.Tensor  # [n, Bk] input of verify
    counts: torch.Tensor  # [n] input of commit: tokens each row commits (0 for frozen rows)
    features: torch.Tensor | None  # [n, Bk, F] written by verify, read by commit
    draft: Callable[[], tuple[torch.Tensor, ...]] | None = None
    verify: Callable[[], tuple[torch.Tensor, ...]] | None = None
    commit: Callable[[], tuple[torch.Tensor, ...]] | None = None


class StaticDecoder:
    """Static-shape speculative (or AR) decoding with CUDA graphs per batch-size bucket.

    Args:
        target: the verifying target LM (bf16 on CUDA for serving).
        drafter: a stateless block drafter bound to ``target``, or None for AR.
        max_batch: rows the caches hold (the largest bucket used).
        max_len: cache slots per row; a request needs ``prompt + max_new_tokens + 2 * block_size`` of them.
        buckets: batch sizes with their own graphs (a batch runs in the smallest bucket that holds it).
        graphs: capture CUDA graphs (default: when the target is on CUDA); otherwise the static rounds run eagerly.
        argmax_heads: greedy decoding only: the draft and verify steps return greedy tokens from the fused LM-head
            argmax (:func:`~specdraft.kernels.lm_head_argmax.lm_head_argmax`) and never materialise logits.
    """

    def __init__(self, target: TargetLM, drafter: Drafter | None, max_batch: int, max_len: int,
                 buckets: Sequence[int] = BUCKETS, graphs: bool | None = None, argmax_heads: bool = False):
        dev = target.lm_head.weight.device
        self.check_drafter(drafter)
        self.target, self.drafter, self.dev = target, drafter, dev
        self.block = drafter.block_size if drafter is not None else 1
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch, self.max_len = max_batch, max_len
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        if self.graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need the target on a CUDA device")
        self.argmax_heads = argmax_heads
        self.feature_layers = drafter.target_layer_ids if drafter is not None else ()
        self.tcache = target.new_cache(max_batch, max_len)
        self.tcache.fixed_shape = True
        self.dcache = drafter.new_cache(max_batch, max_len) if drafter is not None else None
        if self.dcache is not None:
            self.dcache.fixed_shape = True
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def check_drafter(drafter: Drafter | None) -> None:
        """Refuse, in one line, a drafter the static path cannot run."""
        stateless = getattr(type(drafter), "next_round_state", None) is DFlashDrafter.next_round_state
        if drafter is not None and not stateless:
            raise ValueError(f"{type(drafter).__name__} keeps cross-round state: the static path runs stateless "
                             "drafters (dflash, vp); use the eager engine")

    # ---- the three round steps of one bucket ----------------------------------------------------------------------
    def _bucket(self, n: int) -> _Bucket:
        if n in self._buckets:
            return self._buckets[n]
        Bk, dev = self.block, self.dev
        feat = None
        if self.drafter is not None:
            F = len(self.feature_layers) * self.target.args.hidden_size
            feat = torch.zeros(n, Bk, F, dtype=self.target.lm_head.weight.dtype, device=dev)
        bk = _Bucket(n, torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, Bk, dtype=torch.long, device=dev),
                     torch.zeros(n, dtype=torch.long, device=dev), feat)
        tcache = _rows(self.tcache, n)
        dcache = _rows(self.dcache, n) if self.dcache is not None else None
        drafter, target = self.drafter, self.target

        def draft():
            blk = torch.full((n, Bk), drafter.config.mask_token_id, dtype=torch.long, device=dev)
            blk[:, 0] = bk.anchor
            hidden = drafter.draft_hidden(dcache, drafter.block_embeds(blk, None))  # [n, Bk, D]
            if self.argmax_heads:
                return (lm_head_argmax(hidden[:, 1:], drafter.borrowed[1].weight),)  # [n, K] tokens
            return (drafter.logits(hidden[:, 1:]),)  # [n, K, V]

        def verify():
            out = target(bk.verify_tokens, cache=tcache, feature_layers=self.feature_layers,
                         return_logits=not self.argmax_heads)
            if bk.features is not None:
                bk.features.copy_(out.features)
            if self.argmax_heads:
                return (lm_head_argmax(out.hidden, target.lm_head.weight),)  # [n, Bk] tokens
            return (out.logits,)  # [n, Bk, V]

        def commit():
            tcache.commit(bk.counts)
            if drafter is not None:
                drafter.ingest(dcache, bk.features, bk.counts)
            return ()

        # captured in the order they replay (draft, verify, commit): graphs sharing one memory pool are only safe so
        steps = {**({"draft": draft} if drafter is not None else {}), "verify": verify, "commit": commit}
        if self.graphs:
            saved = [c.lengths.clone() for c in (self.tcache, self.dcache) if c is not None]

            def restore():
                for c, s in zip((c for c in (self.tcache, self.dcache) if c is not None), saved):
                    c.lengths.copy_(s)
            steps = {k: _Graphed(fn, self.pool, restore) for k, fn in steps.items()}
        for k, fn in steps.items():
            setattr(bk, k, fn)
        self._buckets[n] = bk
        return bk

    def bucket_for(self, b: int) -> int:
        for n in self.buckets:
            if n >= b:
                return n
        raise ValueError(f"{b} rows do not fit the static decoder's {self.max_batch} batch slots")

    def _compact(self, keep: list[int]) -> None:
        """Copy rows ``keep`` to the front of every persistent buffer, in place."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
        m = len(keep)
        for cache in (self.tcache, self.dcache):
            if cache is None:
                continue
            for buf in (*cache.k, *cache.v):
                buf[:m] = buf.index_select(0, idx)
            cache.lengths[:m] = cache.lengths.index_select(0, idx)

    # ---- decoding ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 generator: torch.Generator | None = None,
                 observer: Callable[[RoundRecord], None] | None = None) -> list[RowResult]:
        """Decode a batch (same contract as :func:`~specdraft.runtime.decode.generate`; the observer's records hold
        the running rows only, with ``hidden`` None, and ``draft_logits``/``target_logits`` None under argmax heads)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every request needs at least one token")
        B, Bk, dev, params = len(prompts), self.block, self.dev, config.sampling
        max_new = [config.max_new_tokens] * B if isinstance(config.max_new_tokens, int) else list(config.max_new_tokens)
        need = max(len(p) + m for p, m in zip(prompts, max_new)) + 2 * Bk
        if need > self.max_len:
            raise ValueError(f"a request needs {need} cache slots (prompt + max_new_tokens + 2 blocks), the static "
                             f"decoder has {self.max_len}")
        if self.argmax_heads and not params.greedy:
            raise ValueError("argmax heads decode greedily: sampling needs the logits (argmax_heads=False)")
        n = self.bucket_for(B)
        stop = set(config.stop_token_ids)
        start = time.perf_counter()
        for cache in (self.tcache, self.dcache):
            if cache is not None:
                cache.lengths.zero_()

        # prefill (eager: one pass per request batch)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        tokens = torch.zeros(B, int(lens.max()), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        tcache = _rows(self.tcache, B)
        out = self.target(tokens, cache=tcache, feature_layers=self.feature_layers, logits_at=(lens - 1)[:, None])
        tcache.crop(lens)
        first = sample(out.logits[:, 0], params, generator)  # [B]
        if self.drafter is not None:
            self.drafter.ingest(_rows(self.dcache, B), out.features, lens)

        generated: list[list[int]] = [[] for _ in range(B)]
        accept_lengths: list[list[int]] = [[] for _ in range(B)]
        accepted: list[list[int]] = [[] for _ in range(B)]
        results: list[RowResult | None] = [None] * B

        def emit(row: int, new_tokens: list[int]) -> int:
            for i, t in enumerate(new_tokens):
                if t in stop:
                    results[row] = RowResult(generated[row], accept_lengths[row], "stop", time.perf_counter() - start,
                                             accepted[row])
                    return i + 1
                generated[row].append(t)
                if len(generated[row]) >= max_new[row]:
                    results[row] = RowResult(generated[row], accept_lengths[row], "length",
                                             time.perf_counter() - start, accepted[row])
                    return i + 1
            return len(new_tokens)

        for r, t in enumerate(first.tolist()):
            emit(r, [t])
        slots = list(range(B))  # bucket slot -> request row; slots past len(slots) are padding
        anchor = first  # [len(slots)]
        active = torch.zeros(n, dtype=torch.bool, device=dev)
        active[:B] = torch.tensor([res is None for res in results], device=dev)
        while any(results[r] is None for r in slots):
            live = [i for i, r in enumerate(slots) if results[r] is None]
            if self.bucket_for(len(live)) < n:  # the active rows fit a smaller bucket: move them to the front
                self._compact(live)
                anchor = anchor[torch.tensor(live, device=dev)]
                slots = [slots[i] for i in live]
                n = self.bucket_for(len(live))
                active = torch.zeros(n, dtype=torch.bool, device=dev)
                active[:len(slots)] = True
            bk = self._bucket(n)
            bk.anchor.zero_()
            bk.anchor[:len(slots)] = anchor
            draft_logits = None
            if self.drafter is None:
                draft_tokens, draft_probs = bk.anchor.new_zeros(n, 0), None
            elif self.argmax_heads:
                (draft_tokens,), draft_probs = bk.draft(), None
                draft_tokens = draft_tokens.clone()  # a graph output: the next replay overwrites it
            else:
                (draft_logits,) = bk.draft()
                draft_tokens, draft_probs = propose(draft_logits, params, config.draft_sampling, generator)
            bk.verify_tokens.copy_(torch.cat([bk.anchor[:, None], draft_tokens], dim=1))
            (verified,) = bk.verify()
            if self.argmax_heads:
                n_acc, nxt = accept_greedy_tokens(draft_tokens, verified)  # [n] each
            else:
                n_acc, nxt = verify_round(draft_tokens, draft_probs, verified, params, generator)
            bk.counts.copy_(commit_counts(n_acc, active))
            bk.commit()
            anchor = nxt[:len(slots)].clone()
            host = torch.cat([n_acc[:, None], nxt[:, None], draft_tokens], dim=1)[:len(slots)].tolist()  # the sync
            if observer is not None:
                live = [i for i, r in enumerate(slots) if results[r] is None]
                at = torch.tensor(live, dtype=torch.long, device=dev)  # [b] bucket slots of the running rows
                observer(RoundRecord(torch.tensor([slots[i] for i in live], device=dev), draft_tokens[at],
                                     None if draft_logits is None else draft_logits[at], None, n_acc[at], nxt[at],
                                     None if self.argmax_heads else verified[at]))
            finished = []
            for i, r in enumerate(slots):
                if results[r] is not None:
                    continue
                a, t, d = host[i][0], host[i][1], host[i][2:]
                accepted[r].append(a)
                accept_lengths[r].append(emit(r, d[:a] + [t]))
                if results[r] is not None:
                    finished.append(i)
            if finished:
                active[torch.tensor(finished, device=dev)] = False
        return results  # type: ignore[return-value]




class StaticEngine:
    """A callable with :func:`~specdraft.runtime.decode.generate`'s signature over one :class:`StaticDecoder`, rebuilt
    (caches reallocated, graphs recaptured) only when a batch needs more rows or cache slots than it has; slots are
    rounded up to ``slot_step`` so growing requests rebuild rarely.

    Args:
        target, drafter: as :class:`StaticDecoder`; calls must pass the same models.
        max_batch: the batch size of the job (the largest bucket).
        argmax_heads: greedy jobs: tokens from the fused LM-head argmax, no logits.
        graphs: as :class:`StaticDecoder`.
    """

    def __init__(self, target: TargetLM, drafter: Drafter | None, max_batch: int, argmax_heads: bool = False,
                 graphs: bool | None = None, buckets: Sequence[int] = BUCKETS, slot_step: int = 256):
        StaticDecoder.check_drafter(drafter)
        self.target, self.drafter, self.max_batch = target, drafter, max_batch
        self.argmax_heads, self.graphs, self.buckets, self.slot_step = argmax_heads, graphs, buckets, slot_step
        self.decoder: StaticDecoder | None = None

    def __call__(self, target: TargetLM, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 drafter: Drafter | None = None, generator: torch.Generator | None = None, tree=None,
                 observer: Callable[[RoundRecord], None] | None = None, **_) -> list[RowResult]:
        if target is not self.target or drafter is not self.drafter:
            raise ValueError("a StaticEngine decodes with the target and drafter it was built for")
        if tree is not None:
            raise ValueError("the static path decodes chains: D²SD trees run in the eager engine")
        caps = [config.max_new_tokens] * len(prompts) if isinstance(config.max_new_tokens, int) else \
            list(config.max_new_tokens)
        block = drafter.block_size if drafter is not None else 1
        need = max(len(p) + c for p, c in zip(prompts, caps)) + 2 * block
        d = self.decoder
        if d is None or need > d.max_len or len(prompts) > d.max_batch:
            slots = -(-need // self.slot_step) * self.slot_step
            self.decoder = None  # free the old caches and graphs first
            d = self.decoder = StaticDecoder(self.target, self.drafter, max(self.max_batch, len(prompts)), slots,
                                             self.buckets, self.graphs, self.argmax_heads)
        return d.generate(prompts, config, generator, observer)
