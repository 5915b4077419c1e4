"""The GPU decode path: static-shape rounds, captured in CUDA graphs, one set per batch-size bucket.

The engine of :mod:`specdraft.runtime.decode` reallocates as rows finish and reads lengths on the host to size each
pass; a CUDA graph (NVIDIA, "CUDA Graphs"; as gpt-fast and vLLM use them for decoding) needs neither. Here the
caches are allocated once for ``max_batch`` rows and ``max_len`` slots; a batch of ``b`` rows runs in the smallest
bucket ``n >= b`` (the first ``n`` rows of every buffer, so a bucket's tensors keep their addresses from call to
call); rows past ``b``, and rows that finished, stay in the bucket as frozen padding (their lengths stop growing,
their outputs are ignored) until the active rows fit a smaller bucket, when they are copied to the front in place.
Every pass reads lengths on the device only: attention goes through the speculative-attention kernel, which loops
over each row's own length, and ``KVCache.fixed_shape`` turns off the host-side room checks.

A chain round is three captured graphs around two small eager steps::

    draft   (anchor -> the drafter's block logits)       graph
    propose (argmax, or sample from the processed q)      eager, no host sync
    verify  ([anchor, drafts] -> target logits, features) graph
    accept  (greedy or speculative sampling)              eager, no host sync
    commit  (lengths += accepted + 1, drafter ingest)     graph

and one host synchronisation reads the accepted tokens. A D²SD round (``tree=``) adds the second drafter's
branches as a graph of their own, builds the tree eagerly and verifies it at a fixed node budget (the tree's
``max_nodes``, padding nodes included, so the verify pass keeps its shape), and moves the accepted path's K/V and
features into place before the commit graph::

    draft, propose  (the first draft)                     graph, eager
    branch          (J blocks -> the second drafter's logits) graph
    tree            (candidates -> the prefix tree)       eager, no host sync
    verify          (tree nodes -> target logits, features) graph
    accept, move    (the tree walk, KV compaction)        eager, no host sync (sampled drafts: one)
    commit                                                graph

Acceptance is the engine's own functions (:func:`~specdraft.runtime.rounds.propose`,
:func:`~specdraft.runtime.rounds.verify_round`, :mod:`specdraft.runtime.d2sd`'s candidates and tree walk), so the
rules that make decoding lossless are shared, not copied. Without CUDA (or with ``graphs=False``) the same static
rounds run eagerly: the CPU tests check the static-shape logic, the GPU tests the capture.

A one-pass round (``tree=`` a fixed-budget :class:`~specdraft.runtime.one_pass.OnePassDrafting`) is the D²SD round
without the branch step: the best-first tree of the first draft's distributions, eagerly, at its node budget.
A merged round (:class:`~specdraft.runtime.merged.MergedDrafting`) is the D²SD round whose tree is the best nodes of
its branches and the one-pass tree, padded to the fixed ``max_nodes`` (of sampled drafts: the one-pass round, padded
alike).

With an adaptive policy (``policy=``, pricing whole rounds) each round is either the drafted round above, for every
row, or a plain round: the target's one-token pass and the drafter's ingest of its features, two graphs of their
own::

    plain_verify  (anchor -> target logits, features)     graph
    accept        (the target's token)                     eager, no host sync
    plain_commit  (lengths += 1, drafter ingest)           graph

The policy decides on the host between rounds (from the last round's host sync: no extra one), and hears each round's
accepted drafts and wall seconds.

Scope: chains with a DFlash, VP or ReTrace drafter or none (AR), D²SD trees and fixed-budget one-pass and merged
trees of stateless drafters, under a fixed or an adaptive policy. ReTrace's prior (the rejected suffix it carries
into the next round) lives in fixed-shape buffers of each bucket: the draft step fuses it into every slot (slots no
prior lands on add zero), the commit step returns the drafter's fused view of the verify pass, and the next prior is
built eagerly from the round's outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from specdraft.kernels.lm_head_argmax import lm_head_argmax
from specdraft.runtime import d2sd, merged, one_pass
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.drafter import Drafter, RoundRecord
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.models.dflash import DFlashDrafter
from specdraft.runtime.models.retrace import Prior, ReTraceDrafter
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.requests import GenerationConfig, Requests, RowResult
from specdraft.runtime.rounds import draft_confidence, propose, verify_round
from specdraft.runtime.sampling import logits_to_probs, sample
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
    """The static input/output buffers of one bucket and its round steps (graphed or plain callables)."""

    n: int
    tcache: KVCache  # the target cache's first n rows
    anchor: torch.Tensor  # [n] input of draft
    verify_tokens: torch.Tensor  # [n, Bk] input of a chain's verify
    counts: torch.Tensor  # [n] input of commit: tokens each row commits (0 for frozen rows)
    features: torch.Tensor | None  # [n, Bk, F] the committed tokens' target features, read by commit
    prior: Prior | None = None  # ReTrace: the rejected suffix each row carries, [n, Bk, ...] buffers read by draft
    branch_blocks: torch.Tensor | None = None  # [n, J, Bk] input of branch (trees)
    tree_tokens: torch.Tensor | None = None  # [n, N] input of a tree's verify
    tree_depth: torch.Tensor | None = None  # [n, N]
    tree_mask: torch.Tensor | None = None  # [n, N, N]
    plain_features: torch.Tensor | None = None  # [n, 1, F] a plain round's target features, read by plain_commit
    draft: Callable[[], tuple[torch.Tensor, ...]] | None = None
    branch: Callable[[], tuple[torch.Tensor, ...]] | None = None
    verify: Callable[[], tuple[torch.Tensor, ...]] | None = None
    commit: Callable[[], tuple[torch.Tensor, ...]] | None = None
    plain_verify: Callable[[], tuple[torch.Tensor, ...]] | None = None  # an adaptive policy's plain round
    plain_commit: Callable[[], tuple[torch.Tensor, ...]] | None = None


class _Round(NamedTuple):
    """One round's outcome for every bucket row (frozen rows' are ignored)."""

    draft_tokens: torch.Tensor  # [n, K] the drafts verified (a tree's: the winning candidate)
    draft_logits: torch.Tensor | None  # [n, K, V] the (first) drafter's logits; None under argmax heads or for AR
    num_accepted: torch.Tensor  # [n]
    next_token: torch.Tensor  # [n]
    target_logits: torch.Tensor | None  # [n, K + 1, V] (a tree's: along the winner's path); None under argmax heads
    nodes: torch.Tensor | None = None  # [n] a tree's real nodes
    winner: torch.Tensor | None = None  # [n] the candidate holding the accepted path
    hidden: torch.Tensor | None = None  # [n, Bk, D] ReTrace: the drafter's hidden states of the block
    confidence: torch.Tensor | None = None  # [n, K] with a policy: the drafter's probability of each of its drafts


def slots_needed(prompts: Sequence[Sequence[int]], caps: Sequence[int], block: int,
                 tree: TreeDrafting | OnePassDrafting | MergedDrafting | None = None) -> int:
    """Cache slots a batch needs: its longest request, a verify pass (a block, or the tree's node budget) and a
    drafter block of scratch past it."""
    verify = tree.max_nodes(block) if tree is not None else block
    return max(len(p) + c for p, c in zip(prompts, caps)) + verify + block


class StaticDecoder:
    """Static-shape speculative (or AR) decoding with CUDA graphs per batch-size bucket.

    Args:
        target: the verifying target LM (bf16 on CUDA for serving).
        drafter: a block drafter bound to ``target`` (DFlash, VP, ReTrace), or None for AR.
        max_batch: rows the caches hold (the largest bucket used).
        max_len: cache slots per row; a request needs :func:`slots_needed` of them.
        buckets: batch sizes with their own graphs (a batch runs in the smallest bucket that holds it).
        graphs: capture CUDA graphs (default: when the target is on CUDA); otherwise the static rounds run eagerly.
        argmax_heads: greedy decoding only: the verify step (and a chain's draft step) returns greedy tokens from the
            fused LM-head argmax (:func:`~specdraft.kernels.lm_head_argmax.lm_head_argmax`) and never materialises
            logits (a tree's first draft keeps its logits: its confidences place the branches; so does a chain's
            under a policy, which reads them).
        tree: tree rounds, verified at the tree's fixed node budget: D²SD's (a stateless second drafter), one-pass
            or merged (a fixed budget).
        policy: an :class:`AdaptivePolicy` pricing whole rounds (``whole_rounds``) choosing, each round, between a
            drafted round of every row (the block or the tree, as without a policy) and a plain round: the target's
            one-token pass and the drafter's ingest of its features, two more graphs per bucket (in a memory pool of
            their own, as they replay in either order with the drafted round's).
    """

    def __init__(self, target: TargetLM, drafter: Drafter | None, max_batch: int, max_len: int,
                 buckets: Sequence[int] = BUCKETS, graphs: bool | None = None, argmax_heads: bool = False,
                 tree: TreeDrafting | OnePassDrafting | MergedDrafting | None = None,
                 policy: AdaptivePolicy | None = None):
        dev = target.lm_head.weight.device
        self.check_drafter(drafter)
        if policy is not None:
            if drafter is None:
                raise ValueError("an adaptive policy chooses when to draft: it needs a drafter")
            if not policy.whole_rounds:
                raise ValueError("the static path verifies whole blocks and trees: the policy must price its rounds "
                                 "so (whole_rounds=True)")
        if tree is not None:
            if isinstance(tree, (OnePassDrafting, MergedDrafting)) and tree.budget is not None:
                raise ValueError("the static path verifies a fixed node budget per bucket; a measured budget runs on "
                                 "the eager engine")
            if drafter is None:
                raise ValueError("tree drafting needs a first drafter")
            tree.check(drafter)
            self.check_drafter(tree.second)
        self.target, self.drafter, self.tree, self.dev = target, drafter, tree, dev
        self.one_pass = tree if isinstance(tree, OnePassDrafting) else None
        self._round = self._chain_round if tree is None else self._one_pass_round if self.one_pass is not None \
            else self._merged_round if isinstance(tree, MergedDrafting) else self._tree_round
        self.block = drafter.block_size if drafter is not None else 1
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch, self.max_len = max_batch, max_len
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        if self.graphs and dev.type != "cuda":
            raise ValueError("CUDA graphs need the target on a CUDA device")
        self.stateful = isinstance(drafter, ReTraceDrafter)
        if self.stateful and (argmax_heads or tree is not None):
            raise ValueError("a ReTrace drafter's prior reads the verify logits and has no meaning in a tree: "
                             "argmax_heads=False, no tree")
        self.argmax_heads = argmax_heads
        # a tree's first draft keeps its logits (its confidences place the branches), and so does a chain's under a
        # policy (it reads the drafter's confidence in its drafts); the target's passes still take the argmax heads
        self.draft_heads = argmax_heads and tree is None and policy is None
        self.feature_layers = drafter.target_layer_ids if drafter is not None else ()
        self.tcache = target.new_cache(max_batch, max_len)
        self.dcache = drafter.new_cache(max_batch, max_len) if drafter is not None else None
        # a second drafter of its own keeps its own context; the first drafter re-drafting (the ablation) shares it
        self.second = tree.second if tree is not None and tree.second is not drafter else None
        self.scache = self.second.new_cache(max_batch, max_len) if self.second is not None else None
        for cache in self._caches():
            cache.fixed_shape = True
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.policy = policy
        self.plain_pool = torch.cuda.graph_pool_handle() if self.graphs and policy is not None else None
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def check_drafter(drafter: Drafter | None) -> None:
        """Refuse, in one line, a drafter the static path cannot run."""
        stateless = getattr(type(drafter), "next_round_state", None) is DFlashDrafter.next_round_state
        if drafter is not None and not stateless and not isinstance(drafter, ReTraceDrafter):
            raise ValueError(f"{type(drafter).__name__} keeps cross-round state the static path cannot hold: it runs "
                             "drafters (dflash, vp); use the eager engine")

    def _caches(self) -> list[KVCache]:
        return [c for c in (self.tcache, self.dcache, self.scache) if c is not None]

    # ---- the round steps of one bucket --------------------------------------------------------------------------
    def _bucket(self, n: int) -> _Bucket:
        if n in self._buckets:
            return self._buckets[n]
        Bk, dev, tree = self.block, self.dev, self.tree
        feat = None
        if self.drafter is not None:
            F = len(self.feature_layers) * self.target.args.hidden_size
            feat = torch.zeros(n, Bk, F, dtype=self.target.lm_head.weight.dtype, device=dev)
        tcache = _rows(self.tcache, n)
        bk = _Bucket(n, tcache, torch.zeros(n, dtype=torch.long, device=dev),
                     torch.zeros(n, Bk, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
                     feat)
        dcache = _rows(self.dcache, n) if self.dcache is not None else None
        scache = _rows(self.scache, n) if self.scache is not None else dcache
        drafter, target, second = self.drafter, self.target, tree.second if tree is not None else None
        draft_heads = self.draft_heads
        if self.stateful:
            bk.prior = drafter.empty_prior(n)
        if tree is not None:
            N = tree.max_nodes(Bk)
            if self.one_pass is None:
                bk.branch_blocks = torch.zeros(n, tree.num_branches, Bk, dtype=torch.long, device=dev)
            bk.tree_tokens = torch.zeros(n, N, dtype=torch.long, device=dev)
            bk.tree_depth = torch.zeros(n, N, dtype=torch.long, device=dev)
            bk.tree_mask = torch.eye(N, dtype=torch.bool, device=dev).repeat(n, 1, 1)

        def draft():
            blk = torch.full((n, Bk), drafter.config.mask_token_id, dtype=torch.long, device=dev)
            blk[:, 0] = bk.anchor
            embeds = drafter.block_embeds(blk, bk.prior, fixed_shape=True) if self.stateful else \
                drafter.block_embeds(blk, None)  # [n, Bk, D]
            hidden = drafter.draft_hidden(dcache, embeds)  # [n, Bk, D]
            if draft_heads:
                return (lm_head_argmax(hidden[:, 1:], drafter.borrowed[1].weight),)  # [n, K] tokens
            if self.stateful:  # the next prior retains the block's hidden states
                return drafter.logits(hidden[:, 1:]), hidden  # [n, K, V], [n, Bk, D]
            return (drafter.logits(hidden[:, 1:]),)  # [n, K, V]

        def branch():
            J = bk.branch_blocks.shape[1]
            embeds = second.block_embeds(bk.branch_blocks.flatten(0, 1), None)  # [n * J, Bk, D]
            hidden = second.draft_branches(scache, embeds.view(n, J, Bk, -1))  # [n, J, Bk, D]
            return (second.logits(hidden[:, :, 1:]),)  # [n, J, K, V]

        def heads(out):
            if self.argmax_heads:
                return lm_head_argmax(out.hidden, target.lm_head.weight)  # [n, T] tokens
            return out.logits  # [n, T, V]

        def verify():
            out = target(bk.verify_tokens, cache=tcache, feature_layers=self.feature_layers,
                         return_logits=not self.argmax_heads)
            if bk.features is not None:
                bk.features.copy_(out.features)
            return (heads(out),)

        def verify_tree():
            out = target(bk.tree_tokens, cache=tcache, positions=tcache.lengths[:, None] + bk.tree_depth,
                         new_mask=bk.tree_mask, feature_layers=self.feature_layers,
                         return_logits=not self.argmax_heads)
            return heads(out), out.features  # [n, N, V] (or [n, N] tokens), [n, N, F]

        def commit():
            tcache.commit(bk.counts)
            fused = drafter.ingest(dcache, bk.features, bk.counts) if drafter is not None else None  # [n, Bk, D]
            if self.second is not None:
                self.second.ingest(scache, bk.features, bk.counts)
            return (fused,) if self.stateful else ()  # ReTrace: the drafter's view of the verify pass

        def plain_verify():
            out = target(bk.anchor[:, None], cache=tcache, feature_layers=self.feature_layers,
                         return_logits=not self.argmax_heads)
            bk.plain_features.copy_(out.features)
            return (heads(out),)  # [n, 1, V] (or [n, 1] tokens)

        def plain_commit():
            tcache.commit(bk.counts)
            drafter.ingest(dcache, bk.plain_features, bk.counts)  # the drafter's context keeps up, one token a row
            if self.second is not None:
                self.second.ingest(scache, bk.plain_features, bk.counts)
            return ()

        # captured in the order they replay: graphs sharing one memory pool are only safe so
        steps = {**({"draft": draft} if drafter is not None else {}),
                 **({"branch": branch} if tree is not None and self.one_pass is None else {}),
                 "verify": verify_tree if tree is not None else verify, "commit": commit}
        plain = {"plain_verify": plain_verify, "plain_commit": plain_commit} if self.policy is not None else {}
        if plain:
            bk.plain_features = torch.zeros(n, 1, feat.shape[-1], dtype=feat.dtype, device=dev)
        if self.graphs:
            saved = [c.lengths.clone() for c in self._caches()]

            def restore():
                for c, s in zip(self._caches(), saved):
                    c.lengths.copy_(s)
            steps = {k: _Graphed(fn, self.pool, restore) for k, fn in steps.items()}
            plain = {k: _Graphed(fn, self.plain_pool, restore) for k, fn in plain.items()}
        for k, fn in {**steps, **plain}.items():
            setattr(bk, k, fn)
        self._buckets[n] = bk
        return bk

    def _chain_round(self, bk: _Bucket, config: GenerationConfig, generator) -> _Round:
        params, draft_logits, draft_probs, hidden = config.sampling, None, None, None
        if self.drafter is None:
            draft_tokens = bk.anchor.new_zeros(bk.n, 0)
        elif self.draft_heads:
            draft_tokens = bk.draft()[0].clone()  # a graph output: the next replay overwrites it
        else:
            draft_logits, *rest = bk.draft()  # ReTrace's draft step returns the block's hidden states too
            hidden = rest[0] if rest else None
            draft_tokens, draft_probs = propose(draft_logits, params, config.draft_sampling, generator)
        confidence = draft_confidence(draft_logits, draft_tokens, draft_probs) if self.policy is not None else None
        bk.verify_tokens.copy_(torch.cat([bk.anchor[:, None], draft_tokens], dim=1))
        (verified,) = bk.verify()
        if self.argmax_heads:
            return _Round(draft_tokens, None, *accept_greedy_tokens(draft_tokens, verified), None,
                          confidence=confidence)
        return _Round(draft_tokens, draft_logits, *verify_round(draft_tokens, draft_probs, verified, params,
                                                                generator), verified, hidden=hidden,
                      confidence=confidence)

    def _plain_round(self, bk: _Bucket, config: GenerationConfig, generator) -> _Round:
        """An adaptive policy's plain round: the target's next token after each anchor, no draft (a tree job's
        verifies its root alone)."""
        draft_tokens = bk.anchor.new_zeros(bk.n, 0)
        (verified,) = bk.plain_verify()  # [n, 1, V] (or [n, 1] tokens)
        if self.argmax_heads:
            acc, logits = accept_greedy_tokens(draft_tokens, verified), None
        else:
            acc, logits = verify_round(draft_tokens, None, verified, config.sampling, generator), verified
        ones = torch.ones_like(bk.anchor) if self.tree is not None else None
        return _Round(draft_tokens, None, *acc, logits, ones, None if ones is None else 0 * ones)

    def _tree_round(self, bk: _Bucket, config: GenerationConfig, generator) -> _Round:
        params, tree, K = config.sampling, self.tree, self.block - 1
        sampled = not params.greedy and config.draft_sampling == "sample"
        (logits,) = bk.draft()  # [n, K, V]
        first, first_q = d2sd.draw_tokens(logits, params, sampled, generator)  # [n, K], [n, K, V] or None
        lengths, blocks = d2sd.branch_blocks(bk.anchor, first, logits, tree)  # [n, J], [n, J, Bk]
        bk.branch_blocks.copy_(blocks)
        (branch_logits,) = bk.branch()  # [n, J, K, V]
        cands = d2sd.merge_candidates(first, first_q, logits, None, lengths, branch_logits, tree, params, sampled,
                                      generator)
        candidates = cands.tokens  # [n, J + 1, K]
        t = d2sd.build_tree(bk.anchor, candidates).trimmed(tree.max_nodes(self.block))  # every candidate's node
        verified, features = self._verify_tree(bk, t)  # [n, N, V] (or [n, N] tokens), [n, N, F]
        if self.argmax_heads:
            acc = d2sd.accept_tree(t, verified)  # the target's greedy token at every node
        else:
            acc = d2sd.verify_tree(t, verified, params, generator, cands)
        self._move_path(bk, acc.path, features)
        winner = candidates.gather(1, acc.winner[:, None, None].expand(-1, 1, K))[:, 0]  # [n, K]
        path_logits = None if self.argmax_heads else verified.gather(
            1, acc.path[:, :, None].expand(-1, -1, verified.shape[-1]))  # [n, K + 1, V]
        return _Round(winner, logits, acc.num_accepted, acc.next_token, path_logits, t.num_nodes, acc.winner)

    def _one_pass_round(self, bk: _Bucket, config: GenerationConfig, generator,
                        drafting: OnePassDrafting | None = None, nodes: int | None = None) -> _Round:
        """A one-pass round of ``drafting`` (default the job's), its tree padded to ``nodes`` (default its own)."""
        params, drafting, K = config.sampling, drafting or self.one_pass, self.block - 1
        sampled = not params.greedy and config.draft_sampling == "sample"
        (logits,) = bk.draft()  # [n, K, V]
        q = logits_to_probs(logits, params) if sampled else logits.float().softmax(-1)  # [n, K, V]
        shape, ranked = one_pass.tree_shape(q, drafting)  # N - 1 nodes (padding where no path is left)
        tokens = one_pass.node_tokens(shape, ranked, q if sampled else None, generator)  # [n, N - 1]
        shape, tokens = merged.padded(shape, tokens, (nodes or drafting.nodes) - 1)
        t = one_pass.build_nodes(bk.anchor, shape, tokens, K, width=ranked.shape[-1])
        return self._walk_nodes(bk, t, logits, q if sampled else None, config, generator)

    def _merged_round(self, bk: _Bucket, config: GenerationConfig, generator) -> _Round:
        params, tree, K = config.sampling, self.tree, self.block - 1
        if merged.samples_drafts(params, config.draft_sampling):  # the one-pass tree, in the bucket's verify shape
            return self._one_pass_round(bk, config, generator, tree.one_pass(), tree.max_nodes(self.block))
        (logits,) = bk.draft()  # [n, K, V]
        first = logits.argmax(-1)  # [n, K] a merged tree drafts ranked tokens
        lengths, blocks = d2sd.branch_blocks(bk.anchor, first, logits, tree.branches)  # [n, J], [n, J, Bk]
        bk.branch_blocks.copy_(blocks)
        (branch_logits,) = bk.branch()  # [n, J, K, V]
        cands = d2sd.merge_candidates(first, None, logits, None, lengths, branch_logits, tree.branches, params, False,
                                      generator)
        q1 = merged.walk_probs(logits, params)  # [n, K, V]
        one, ranked = merged.one_pass_part(q1, tree.nodes, tree.keep_chain)
        shape, tokens = merged.merged_shape(bk.anchor, cands, one, ranked, q1,
                                            merged.walk_probs(cands.branch_logits, params), tree.keep_chain)
        N = tree.max_nodes(self.block)  # the bucket's verify shape (padding nodes past the tree's)
        shape, tokens = merged.padded(shape, tokens, N - 1)
        t = one_pass.build_nodes(bk.anchor, shape, tokens, K, width=N - 1)
        return self._walk_nodes(bk, t, logits, None, config, generator)

    def _walk_nodes(self, bk: _Bucket, t, logits: torch.Tensor, q: torch.Tensor | None, config: GenerationConfig,
                    generator) -> _Round:
        """Verify the node tree ``t`` and walk it (siblings drawn without replacement from ``q``; None: ranked
        tokens, the walk following the target's token): the end of a one-pass or merged round."""
        params, K = config.sampling, self.block - 1
        verified, features = self._verify_tree(bk, t)  # [n, N, V] (or [n, N] tokens), [n, N, F]
        if self.argmax_heads:
            acc = one_pass.accept_nodes(t, verified, max_depth=K)  # the target's greedy token at every node
        elif q is not None:
            acc = one_pass.accept_nodes_sampled(t, logits_to_probs(verified, params), q, generator)
        else:
            acc = one_pass.accept_nodes(t, sample(verified, params, generator), max_depth=K)
        path = acc.path[:, :K + 1]  # [n, K + 1] past the accepted path: its last node
        path = torch.cat([path, path[:, -1:].expand(-1, K + 1 - path.shape[1])], 1)
        self._move_path(bk, path, features)
        path_logits = None if self.argmax_heads else verified.gather(
            1, path[:, :, None].expand(-1, -1, verified.shape[-1]))  # [n, K + 1, V]
        draft_tokens = t.tokens.gather(1, path[:, 1:])  # [n, K] the accepted path first
        return _Round(draft_tokens, logits, acc.num_accepted, acc.next_token, path_logits, t.num_nodes, acc.winner)

    @staticmethod
    def _verify_tree(bk: _Bucket, tree) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify step over ``tree``'s nodes (its tokens, depths and mask copied into the bucket's buffers)."""
        bk.tree_tokens.copy_(tree.tokens)
        bk.tree_depth.copy_(tree.depth)
        bk.tree_mask.copy_(tree.mask)
        return bk.verify()

    def _move_path(self, bk: _Bucket, path: torch.Tensor, features: torch.Tensor) -> None:
        """Move each row's path ``[n, K + 1]`` of tree nodes into the slots after its context (KV compaction) and its
        target features into the commit step's buffer."""
        at = bk.tcache.lengths[:, None]  # [n, 1]
        bk.tcache.move(at + path, at + torch.arange(path.shape[1], device=self.dev))
        bk.features.copy_(features.gather(1, path[:, :, None].expand(-1, -1, features.shape[-1])))  # [n, Bk, F]

    @staticmethod
    def _carry_prior(bk: _Bucket, prior: Prior | None) -> None:
        """Write ``prior`` (of the first ``m <= n`` rows; None: none) into the bucket's buffers, the rest empty."""
        m = 0 if prior is None else prior.valid.shape[0]
        for buf, new in zip(bk.prior, prior or bk.prior):
            if m:
                buf[:m] = new
            buf[m:] = 0
        bk.prior.shift[m:] = bk.prior.valid.shape[1]  # lands past the block: nothing

    def bucket_for(self, b: int) -> int:
        for n in self.buckets:
            if n >= b:
                return n
        raise ValueError(f"{b} rows do not fit the static decoder's {self.max_batch} batch slots")

    def _compact(self, keep: list[int]) -> None:
        """Copy rows ``keep`` to the front of every persistent buffer, in place."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
        m = len(keep)
        for cache in self._caches():
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
        requests = Requests(prompts, config)
        B, dev, params, max_new = len(prompts), self.dev, config.sampling, requests.max_new
        need = slots_needed(prompts, max_new, self.block, self.tree)
        if need > self.max_len:
            raise ValueError(f"a request needs {need} cache slots (prompt + max_new_tokens + a verify pass + a block),"
                             f" the static decoder has {self.max_len}")
        if self.argmax_heads and not params.greedy:
            raise ValueError("argmax heads decode greedily: sampling needs the logits (argmax_heads=False)")
        n = self.bucket_for(B)
        requests.admit(range(B))
        for cache in self._caches():
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
        for d, cache in ((self.drafter, self.dcache), (self.second, self.scache)):
            if d is not None:
                d.ingest(_rows(cache, B), out.features, lens)

        done = requests.done
        for r, t in enumerate(first.tolist()):
            requests.emit(r, [t])
        slots = list(range(B))  # bucket slot -> request row; slots past len(slots) are padding
        anchor = first  # [len(slots)]
        if self.stateful:  # a first round carries no prior
            self._carry_prior(self._bucket(n), None)
        active = torch.zeros(n, dtype=torch.bool, device=dev)
        active[:B] = torch.tensor([not d for d in done], device=dev)
        policy = self.policy
        if policy is not None:
            policy.new_job()
        fresh = {r for r in range(B) if not done[r]}  # requests no drafted round has run for yet (the policy probes)
        while not all(done[r] for r in slots):
            live = [i for i, r in enumerate(slots) if not done[r]]
            moved = self.bucket_for(len(live)) < n
            if moved:  # the active rows fit a smaller bucket: move them to the front
                self._compact(live)
                if self.stateful:
                    at = torch.tensor(live, device=dev)
                    carried = Prior(*(t[at] for t in self._bucket(n).prior))
                    self._carry_prior(self._bucket(self.bucket_for(len(live))), carried)
                anchor = anchor[torch.tensor(live, device=dev)]
                slots = [slots[i] for i in live]
                live = list(range(len(slots)))
                n = self.bucket_for(len(live))
                active = torch.zeros(n, dtype=torch.bool, device=dev)
                active[:len(slots)] = True
            bk = self._bucket(n)
            bk.anchor.zero_()
            bk.anchor[:len(slots)] = anchor
            ids = [slots[i] for i in live]  # the round's requests
            if policy is not None and moved and dev.type == "cuda":
                torch.cuda.synchronize()  # the compaction's copies are not the round's seconds
            drafted, started = True, time.perf_counter()  # (after the last round's host sync)
            if policy is not None:
                policy.at_context(requests.mean_context(ids))  # priced at the rows' mean context
                drafted = policy.draft_this_round(ids, len(fresh))
            rnd = self._round(bk, config, generator) if drafted else self._plain_round(bk, config, generator)
            bk.counts.copy_(commit_counts(rnd.num_accepted, active))
            committed = bk.commit() if drafted else bk.plain_commit()
            if self.stateful:  # the rejected suffix each row carries into its next round (none after a plain one)
                prior = self.drafter.next_round_state(None, rnd.hidden, rnd.draft_tokens, rnd.num_accepted,
                                                      rnd.target_logits, committed[0]) if drafted else None
                self._carry_prior(bk, prior)
            anchor = rnd.next_token[:len(slots)].clone()
            zeros = torch.zeros_like(rnd.num_accepted)
            host = torch.cat([torch.stack([rnd.num_accepted, rnd.next_token, zeros if rnd.nodes is None else rnd.nodes,
                                           zeros if rnd.winner is None else rnd.winner], 1), rnd.draft_tokens],
                             dim=1)[:len(slots)].tolist()  # the sync
            if observer is not None:
                at = torch.tensor(live, dtype=torch.long, device=dev)  # [b] bucket slots of the running rows
                run = rnd._replace(**{k: v[at] for k, v in rnd._asdict().items() if v is not None and k != "hidden"})
                observer(RoundRecord(torch.tensor([slots[i] for i in live], device=dev), run.draft_tokens,
                                     run.draft_logits, None, run.num_accepted, run.next_token, run.target_logits,
                                     nodes=run.nodes, winner=run.winner))
            useful = []  # the drafts each request committed
            for i in live:
                a, t, nodes, winner, d = *host[i][:4], host[i][4:]
                useful.append(requests.record(slots[i], a, d, t, len(d),
                                              *((nodes, winner) if self.tree is not None else ())))
            finished = [i for i in live if done[slots[i]]]
            if finished:
                active[torch.tensor(finished, device=dev)] = False
            if policy is not None:
                if drafted:
                    at = torch.tensor(live, dtype=torch.long, device=dev)
                    confidence = rnd.confidence if rnd.confidence is not None else draft_confidence(
                        rnd.draft_logits, rnd.draft_logits.argmax(-1), None)  # [n, K] a tree's: its first draft's
                    policy.whole(confidence[at])
                    policy.observe(torch.tensor(useful), ids)
                    fresh.clear()
                fresh.difference_update(slots[i] for i in finished)
                width = rnd.draft_tokens.shape[1]
                policy.observe_seconds(len(ids), len(ids) if drafted else 0, width, time.perf_counter() - started)
        return requests.results


class StaticEngine:
    """A callable with :func:`~specdraft.runtime.decode.generate`'s signature over one :class:`StaticDecoder`, rebuilt
    (caches reallocated, graphs recaptured) only when a batch needs more rows or cache slots than it has; slots are
    rounded up to ``slot_step`` so growing requests rebuild rarely.

    Args:
        target, drafter, tree, policy: as :class:`StaticDecoder`; calls must pass the same models, tree and policy.
        max_batch: the batch size of the job (the largest bucket).
        argmax_heads: greedy jobs: tokens from the fused LM-head argmax, no logits.
        graphs: as :class:`StaticDecoder`.
    """

    def __init__(self, target: TargetLM, drafter: Drafter | None, max_batch: int, argmax_heads: bool = False,
                 graphs: bool | None = None, buckets: Sequence[int] = BUCKETS, slot_step: int = 256,
                 tree: TreeDrafting | OnePassDrafting | MergedDrafting | None = None,
                 policy: AdaptivePolicy | None = None):
        StaticDecoder.check_drafter(drafter)
        self.target, self.drafter, self.tree, self.policy, self.max_batch = target, drafter, tree, policy, max_batch
        self.argmax_heads, self.graphs, self.buckets, self.slot_step = argmax_heads, graphs, buckets, slot_step
        self.decoder: StaticDecoder | None = None

    def __call__(self, target: TargetLM, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 drafter: Drafter | None = None, generator: torch.Generator | None = None,
                 tree: TreeDrafting | OnePassDrafting | MergedDrafting | None = None,
                 observer: Callable[[RoundRecord], None] | None = None, policy: AdaptivePolicy | None = None,
                 **_) -> list[RowResult]:
        if target is not self.target or drafter is not self.drafter or policy is not self.policy:
            raise ValueError("a StaticEngine decodes with the target, drafter and policy it was built for")
        if tree != self.tree:
            raise ValueError("a StaticEngine decodes the rounds it was built for: pass the tree it was built with "
                             "(or none, for chains), or build another")
        caps = [config.max_new_tokens] * len(prompts) if isinstance(config.max_new_tokens, int) else \
            list(config.max_new_tokens)
        need = slots_needed(prompts, caps, drafter.block_size if drafter is not None else 1, tree)
        d = self.decoder
        if d is None or need > d.max_len or len(prompts) > d.max_batch:
            slots = -(-need // self.slot_step) * self.slot_step
            self.decoder = None  # free the old caches and graphs first
            d = self.decoder = StaticDecoder(self.target, self.drafter, max(self.max_batch, len(prompts)), slots,
                                             self.buckets, self.graphs, self.argmax_heads, tree, self.policy)
        return d.generate(prompts, config, generator, observer)
