"""What one verify round of :func:`~specdraft.runtime.decode.generate` does, by kind: the target alone
(:class:`PlainRounds`), a drafted block every round (:class:`ChainRounds`), a draft tree every round
(:class:`TreeRounds`), or an adaptive policy's choice of plain and drafted rounds (:class:`AdaptiveRounds`).

Each kind drafts and verifies a round (:meth:`run`), feeds what the round committed to its drafters (:meth:`commit`)
and hears how it went (:meth:`end_round`); the engine around them admits, accepts, emits and compacts the same way
for all of them, so it never asks which kind it was given (:func:`rounds_for` picks one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specdraft.runtime.backlog import Backlog
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.merged import MergedDrafting, samples_drafts
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.phase_clock import PhaseClock, wall_seconds
from specdraft.runtime.policy import AdaptivePolicy
from specdraft.runtime.sampling import SamplingParams, logits_to_probs, sample_from_probs
from specdraft.runtime.verify import accept_greedy, accept_speculative_sampling

MAX_DEFERRED_TOKENS = 32_768
"""Deferred features (prompts and plain rounds, all rows) past which an admission feeds the drafter at once: features
of several target layers take more memory per token than the drafter's own K/V."""


@dataclass
class Job:
    """What every round of one :func:`generate` call shares."""

    target: object
    drafter: object  # a block drafter bound to ``target``, or None (the target alone)
    params: SamplingParams
    draft_sampling: str
    generator: torch.Generator | None
    clock: PhaseClock
    device: torch.device

    @property
    def feature_layers(self) -> Sequence[int]:
        return self.drafter.target_layer_ids if self.drafter is not None else ()


@dataclass
class Round:
    """One verify round's outcome, whatever drafted it."""

    draft_tokens: torch.Tensor  # [b, K] the drafts verified (K = 0: a plain round; trees: the winning candidate)
    draft_logits: torch.Tensor | None  # [b, K, V]
    hidden: torch.Tensor | None  # [b, Bk, D] the drafter's hidden states
    num_accepted: torch.Tensor  # [b]
    next_token: torch.Tensor  # [b] the target's token after the accepted drafts
    features: torch.Tensor | None  # [b, T, F] target features of the verified (trees: accepted) positions
    target_logits: torch.Tensor  # [b, K + 1, V]
    nodes: torch.Tensor | None = None  # [b] trees: nodes verified, root included
    winner: torch.Tensor | None = None  # [b] trees: the candidate holding the accepted path
    drafting: int = 0  # rows that drafted

    def per_row(self) -> list[tuple]:
        """Each row's outcome on the host, as :meth:`Requests.record` takes it: ``(accepted, drafts, next_token,
        verified, nodes, winner)``."""
        b, width = self.num_accepted.shape[0], self.draft_tokens.shape[1]
        nodes = self.nodes.tolist() if self.nodes is not None else [None] * b
        winner = self.winner.tolist() if self.winner is not None else [None] * b
        return list(zip(self.num_accepted.tolist(), self.draft_tokens.tolist(), self.next_token.tolist(), [width] * b,
                        nodes, winner))


class PlainRounds:
    """The target alone: a round verifies no draft and commits the target's next token."""

    second = None  # a second drafter whose context the prefill also fills (D²SD's)
    defer = False  # whether admitted prompts' drafter ingest waits in :attr:`backlog`
    backlog: Backlog | None = None
    drafter_room = 0  # drafter cache slots needed past the target's (a backlog flush's scratch)
    verify_len = 1  # tokens one verify pass holds at most, beyond the anchor's context

    def __init__(self, job: Job):
        self.job = job

    def run(self, state, caches: dict, context: Callable[[], float]) -> Round:
        """Draft and verify one round of the running rows ``state`` (``context``: their mean context, for a kind that
        prices rounds)."""
        return self._plain(state, caches["t"], {})

    def commit(self, state, caches: dict, rnd: Round) -> None:
        """Feed the round's committed tokens to the drafters (after the target cache kept them)."""

    def admitted(self, rows: list[int], backlog: Backlog | None, before: int, caches: dict) -> None:
        """Requests ``rows`` joined the ``before`` running ones (``backlog``: their deferred prompt features)."""

    def end_round(self, ids: list[int], useful: list[int], finished: list[int], rnd: Round) -> None:
        """The round's requests ``ids`` committed ``useful`` of its drafts each; ``finished`` of them ended (after
        compaction)."""

    def _plain(self, state, tcache, split: dict) -> Round:
        job = self.job
        draft_tokens = state.anchor.new_zeros(state.anchor.shape[0], 0)
        out = job.target(state.anchor[:, None], cache=tcache, feature_layers=job.feature_layers, **split)  # [b, 1]
        n_acc, nxt = verify_round(draft_tokens, None, out.logits, job.params, job.generator)
        job.clock.lap("verify")
        return Round(draft_tokens, None, None, n_acc, nxt, out.features, out.logits)

    def _verify(self, state, tcache, drafted: tuple, drafting: int) -> Round:
        job = self.job
        hidden, draft_logits, draft_tokens, draft_probs = drafted
        job.clock.lap("draft")
        out = job.target(torch.cat([state.anchor[:, None], draft_tokens], dim=1), cache=tcache,
                         feature_layers=job.feature_layers)  # verify [anchor, d_1..d_K]
        n_acc, nxt = verify_round(draft_tokens, draft_probs, out.logits, job.params, job.generator)  # [b], [b]
        job.clock.lap("verify")
        return Round(draft_tokens, draft_logits, hidden, n_acc, nxt, out.features, out.logits, drafting=drafting)


class ChainRounds(PlainRounds):
    """A drafted block every round: draft ``[anchor, MASK x K]``, verify ``[anchor, d_1..d_K]``."""

    def __init__(self, job: Job):
        super().__init__(job)
        self.verify_len = job.drafter.block_size

    def run(self, state, caches: dict, context) -> Round:
        job = self.job
        drafted = _draft(job.drafter, caches["d"], state.anchor, state.draft_state, job.params, job.draft_sampling,
                         job.generator)
        return self._verify(state, caches["t"], drafted, state.anchor.shape[0])

    def commit(self, state, caches: dict, rnd: Round) -> None:
        drafter = self.job.drafter
        fused = drafter.ingest(caches["d"], rnd.features, rnd.num_accepted + 1)  # [b, T, D]
        state.draft_state = drafter.next_round_state(state.draft_state, rnd.hidden, rnd.draft_tokens,
                                                     rnd.num_accepted, rnd.target_logits, fused)


class TreeRounds(ChainRounds):
    """A draft tree every round, D²SD's or one-pass, verified in one target pass."""

    def __init__(self, job: Job, tree: TreeDrafting | OnePassDrafting):
        super().__init__(job)
        tree.check(job.drafter)
        self.tree = tree
        self.second = tree.second if tree.second is not job.drafter else None
        self.verify_len = max(tree.max_nodes(self.verify_len), self.verify_len)  # the drafter's block fits too

    def run(self, state, caches: dict, context) -> Round:
        return _tree_round(self.job, self.tree, self.second, state, caches)

    def commit(self, state, caches: dict, rnd: Round) -> None:
        super().commit(state, caches, rnd)
        _commit_second(self.second, state, caches, rnd)


def _tree_round(job: Job, tree, second, state, caches: dict) -> Round:
    """A tree round of every running row (``second``: D²SD's second drafter with a cache of its own, or None)."""
    scache = caches["s"] if second is not None else caches["d"]
    r = tree.round(job.target, job.drafter, caches["d"], scache, caches["t"], state.anchor, job.params,
                   job.feature_layers, job.generator, job.clock, job.draft_sampling)
    return Round(r.draft_tokens, r.draft_logits, r.hidden, r.acceptance.num_accepted, r.acceptance.next_token,
                 r.path_features, r.path_logits, r.num_nodes, r.acceptance.winner, drafting=state.anchor.shape[0])


def _commit_second(second, state, caches: dict, rnd: Round) -> None:
    """After a tree round's first drafter took its committed tokens: the second drafter's turn (D²SD's own)."""
    if state.draft_state is not None:
        raise ValueError("tree drafting needs a first drafter without cross-round state (e.g. dflash)")
    if second is not None:
        second.ingest(caches["s"], rnd.features, rnd.num_accepted + 1)
        second.next_round_state(None, None, rnd.draft_tokens, rnd.num_accepted, rnd.target_logits, None)


class AdaptiveRounds(ChainRounds):
    """An :class:`AdaptivePolicy` choosing each round: a plain round (its features wait in :attr:`backlog`; a
    drafter's cross-round state starts over), or every row drafting the first ``k`` drafts. The
    policy prices rounds by their measured seconds. With a ``tree`` a drafted round is a tree round of every row,
    whole (the policy decides between it and a plain round; the tree's own budget, if measured, sizes it)."""

    defer = True

    def __init__(self, job: Job, policy: AdaptivePolicy, extra_room: int,
                 tree: TreeDrafting | OnePassDrafting | None = None):
        super().__init__(job)
        self.tree = tree
        if tree is not None:
            tree.check(job.drafter)
            self.second = tree.second if tree.second is not job.drafter else None
            self.verify_len = max(tree.max_nodes(self.verify_len), self.verify_len)
            if not policy.whole_rounds:
                raise ValueError("tree rounds are drafted whole: the policy must price them so (whole_rounds)")
        self.policy, self.drafter_room = policy, extra_room
        self.backlog = Backlog()
        self.fresh: set[int] = set()  # requests admitted since the last drafted round (the policy probes them)
        # a plain round's features wait in the backlog as the layers' outputs (concatenated once, when a row is fed)
        self.split = {"concat_features": False} if isinstance(job.target, TargetLM) else {}
        self.started = self.flushed = 0.0
        policy.new_job()

    def admitted(self, rows: list[int], backlog: Backlog | None, before: int, caches: dict) -> None:
        self.backlog.cat_rows(backlog, before, len(rows))
        self.fresh.update(rows)
        if self.backlog.tokens > MAX_DEFERRED_TOKENS:
            self.backlog.flush(self.job.drafter, caches["d"], second=self._second_feed(caches))

    def run(self, state, caches: dict, context) -> Round:
        job, policy = self.job, self.policy
        if job.device.type == "cuda":
            torch.cuda.synchronize()
        self.started, self.flushed = time.perf_counter(), 0.0
        b, ids = state.rows.numel(), state.rows.tolist()
        policy.at_context(context())  # priced at the rows' mean context
        if not policy.draft_this_round(ids, len(self.fresh)):
            rnd = self._plain(state, caches["t"], self.split)
            if self.tree is not None:  # a plain round of a tree job verifies the root alone
                rnd.nodes, rnd.winner = torch.ones_like(rnd.num_accepted), torch.zeros_like(rnd.num_accepted)
            return rnd
        self.fresh.clear()
        self._flush(caches)  # plain rounds' features, deferred until drafting resumes
        if self.tree is not None:
            rnd = _tree_round(job, self.tree, self.second, state, caches)
            first = rnd.draft_logits.argmax(-1)  # [b, K] the first drafter's own block
            policy.whole(draft_confidence(rnd.draft_logits, first, None))
            return rnd
        hidden, draft_logits, draft_tokens, draft_probs = _draft(
            job.drafter, caches["d"], state.anchor, state.draft_state, job.params, job.draft_sampling, job.generator)
        k = policy.verify_len(draft_confidence(draft_logits, draft_tokens, draft_probs))
        # verify only the first k drafts: a block of k drafts, just as lossless
        probs = None if draft_probs is None else draft_probs[:, :k]
        drafted = (hidden, draft_logits[:, :k], draft_tokens[:, :k], probs)
        return self._verify(state, caches["t"], drafted, b)

    def commit(self, state, caches: dict, rnd: Round) -> None:
        if rnd.draft_tokens.shape[1] == 0:
            self.backlog.add(rnd.features)  # a plain round: the drafter catches up when drafting resumes
            if state.draft_state is not None:  # ReTrace's rejected suffix is the block before this round's token
                state.draft_state = state.draft_state.blank(len(state.anchor))
        else:
            super().commit(state, caches, rnd)
            if self.tree is not None:
                _commit_second(self.second, state, caches, rnd)

    def end_round(self, ids: list[int], useful: list[int], finished: list[int], rnd: Round) -> None:
        self.fresh.difference_update(finished)
        width = rnd.draft_tokens.shape[1]
        if width > 0:  # drafts past a row's end count as rejected
            self.policy.observe(torch.tensor(useful), ids)
        # the round's rows, drafting rows and verified width, as the cost model prices them
        seconds = time.perf_counter() - self.started - self.flushed
        self.policy.observe_seconds(len(ids), rnd.drafting, width, seconds, self.flushed)

    def _flush(self, caches: dict) -> None:
        """Feed the drafter every row's deferred features, timed apart from the round."""
        if self.backlog.tokens:
            clock = self.job.clock
            clock.lap("draft")
            self.flushed += wall_seconds(lambda: self.backlog.flush(self.job.drafter, caches["d"],
                                                                    self._second_feed(caches)), self.job.device)
            clock.lap("flush")


    def _second_feed(self, caches: dict) -> tuple | None:
        """D²SD's second drafter and its cache, fed what the first is fed; None without one."""
        return (self.second, caches["s"]) if self.second is not None else None


def rounds_for(job: Job, tree: TreeDrafting | OnePassDrafting | MergedDrafting | None, policy: AdaptivePolicy | None,
               extra_room: int) -> PlainRounds:
    """The round kind for a job: the target alone without a drafter, else a tree, a policy's or a chain's rounds
    (``extra_room``: the drafter cache slots a backlog flush may write past the target's). A merged tree of sampled
    drafts is its one-pass tree (:func:`~specdraft.runtime.merged.samples_drafts`)."""
    if tree is not None and job.drafter is None:
        raise ValueError("tree drafting needs a first drafter")
    if policy is not None and job.drafter is None:
        raise ValueError("an adaptive policy chooses when to draft: it needs a drafter")
    if job.drafter is None:
        return PlainRounds(job)
    if isinstance(tree, MergedDrafting) and samples_drafts(job.params, job.draft_sampling):
        tree = tree.one_pass()  # no second drafter to feed
    if policy is not None:
        return AdaptiveRounds(job, policy, extra_room, tree)
    return TreeRounds(job, tree) if tree is not None else ChainRounds(job)


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
                 params: SamplingParams, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_accepted [b], next_token [b])`` for drafts ``[b, K]`` against the verify logits ``[b, K + 1, V]``:
    greedy verification at T=0, speculative sampling otherwise (deterministic drafts verify as ``q = one_hot``)."""
    if params.greedy:
        return accept_greedy(draft_tokens, target_logits)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_logits.shape[-1]).float()
    return accept_speculative_sampling(draft_tokens, draft_probs, logits_to_probs(target_logits, params), generator)
