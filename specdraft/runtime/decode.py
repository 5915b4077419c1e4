"""The decode engine: lossless speculative decoding over ragged batches (DFlash loop, arXiv:2602.06036 §2).

One round per active row: draft a block ``[anchor, MASK x K]`` (its input embeddings may carry the drafter's
cross-round state, e.g. ReTrace's rejected suffix) -> verify ``[anchor, d_1..d_K]`` in ONE target
pass -> accept ``a`` drafts + one target token -> commit (each row's target cache grows by ``a + 1``) -> feed the
``a + 1`` committed tokens' target features to the drafter's context cache (right away, so the next round starts
drafting at once). The AR baseline (no drafter) is the same
loop with a block of one token, so speedups compare like with like. Finished rows are compacted away so they stop
costing compute; stop tokens and ``max_new_tokens`` are per row. With ``tree=`` a round drafts and verifies a D²SD
prefix tree instead of one block (:mod:`specdraft.runtime.d2sd`); everything around the round is shared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specdraft.runtime.d2sd import TreeDrafting, tree_round
from specdraft.runtime.drafter import Drafter, RoundRecord
from specdraft.runtime.models.target import TargetLM
from specdraft.runtime.phase_clock import PhaseClock
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


def _pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts], device=device)
    out = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    return out, lens


@torch.inference_mode()
def generate(target: TargetLM, prompts: Sequence[Sequence[int]], config: GenerationConfig,
             drafter: Drafter | None = None, generator: torch.Generator | None = None,
             observer: Callable[[RoundRecord], None] | None = None, tree: TreeDrafting | None = None,
             timings: dict[str, float] | None = None, policy: AdaptivePolicy | None = None) -> list[RowResult]:
    """Decode a batch of prompts with the target alone (``drafter=None``) or speculatively.

    Args:
        target: the verifying target LM.
        prompts: token id lists (ragged).
        config: lengths, sampling, stop tokens.
        drafter: a block drafter bound to ``target`` (a :class:`Drafter`), or ``None`` for AR.
        generator: RNG for sampling (on the target's device).
        observer: called once per verify round with its :class:`RoundRecord` (analysis, on-policy rollouts).
        tree: D²SD tree drafting (needs ``drafter``, a first drafter without cross-round state).
        timings: when given, wall seconds per round phase are added to it (draft, second_draft, tree, verify,
            compaction, commit), synchronising the device at each phase boundary.
        policy: chain rounds only: an :class:`AdaptivePolicy` choosing whether to draft and how many drafts to
            verify each round (None: the whole block every round).
    Returns:
        one :class:`RowResult` per prompt, in order.
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every request needs at least one token")
    if tree is not None:
        if drafter is None:
            raise ValueError("tree drafting needs a first drafter")
        tree.check(drafter)
    if policy is not None and (drafter is None or tree is not None):
        raise ValueError("an adaptive policy chooses chain rounds: it needs a drafter and no tree")
    dev = target.lm_head.weight.device
    B = len(prompts)
    block = drafter.block_size if drafter is not None else 1
    verify_len = tree.max_nodes(block) if tree is not None else block
    max_new = [config.max_new_tokens] * B if isinstance(config.max_new_tokens, int) else list(config.max_new_tokens)
    stop = set(config.stop_token_ids)
    params = config.sampling
    feature_layers = drafter.target_layer_ids if drafter is not None else ()
    start = time.perf_counter()

    tokens, lens = _pad(prompts, dev)
    max_len = int(lens.max()) + max(max_new) + verify_len + 1
    tcache = target.new_cache(B, max_len)
    out = target(tokens, cache=tcache, feature_layers=feature_layers, logits_at=(lens - 1)[:, None])
    tcache.crop(lens)
    first = sample(out.logits[:, 0], params, generator)  # [B]
    dcache = drafter.new_cache(B, max_len) if drafter is not None else None
    if drafter is not None:
        drafter.ingest(dcache, out.features, lens)  # the prompt's target features -> the drafter's context cache
    second = tree.second if tree is not None and tree.second is not drafter else None
    scache = dcache if tree is not None and second is None else None
    if second is not None:
        scache = second.new_cache(B, max_len)
        second.ingest(scache, out.features, lens)
    state = _State(rows=torch.arange(B, device=dev), anchor=first)
    clock = PhaseClock(timings, dev)

    generated: list[list[int]] = [[] for _ in range(B)]
    accept_lengths: list[list[int]] = [[] for _ in range(B)]
    accepted: list[list[int]] = [[] for _ in range(B)]
    nodes: list[list[int]] = [[] for _ in range(B)]
    winners: list[list[int]] = [[] for _ in range(B)]
    verified: list[list[int]] = [[] for _ in range(B)]
    results: list[RowResult | None] = [None] * B

    def emit(row: int, new_tokens: list[int]) -> int:
        """Append committed tokens to a row until a stop token or its cap; returns how many it emitted (a stop token
        counts: it was generated) and records the row's result when it is finished."""
        for i, t in enumerate(new_tokens):
            if t in stop:
                results[row] = RowResult(generated[row], accept_lengths[row], "stop", time.perf_counter() - start,
                                         accepted[row], nodes[row], winners[row], verified[row])
                return i + 1
            generated[row].append(t)
            if len(generated[row]) >= max_new[row]:
                results[row] = RowResult(generated[row], accept_lengths[row], "length", time.perf_counter() - start,
                                         accepted[row], nodes[row], winners[row], verified[row])
                return i + 1
        return len(new_tokens)

    for r, t in enumerate(first.tolist()):
        emit(r, [t])
    done = [res is not None for res in results]
    keep = [i for i, d in enumerate(done) if not d]
    _compact(state, tcache, dcache, keep, B, scache if second is not None else None)

    while state.rows.numel() > 0:
        b = state.rows.numel()
        clock.lap("commit")
        tree_nodes = tree_winner = None
        if tree is not None:
            rnd = tree_round(target, drafter, tree, dcache, scache, tcache, state.anchor, params, feature_layers,
                             generator, clock, config.draft_sampling)
            draft_tokens, draft_logits, hidden = rnd.draft_tokens, rnd.draft_logits, rnd.hidden
            n_acc, nxt, target_logits = rnd.acceptance.num_accepted, rnd.acceptance.next_token, rnd.path_logits
            features, tree_nodes, tree_winner = rnd.path_features, rnd.tree.num_nodes, rnd.acceptance.winner
        elif drafter is not None and (policy is None or policy.draft_this_round(b)):
            blk = torch.full((b, block), drafter.config.mask_token_id, dtype=torch.long, device=dev)
            blk[:, 0] = state.anchor
            hidden = drafter.draft_hidden(dcache, drafter.block_embeds(blk, state.draft_state))  # [b, Bk, D]
            draft_logits = drafter.logits(hidden[:, 1:])  # [b, K, V]
            draft_tokens, draft_probs = propose(draft_logits, params, config.draft_sampling, generator)
            if policy is not None:  # verify only the first k drafts: a block of k drafts, just as lossless
                k = policy.verify_len(draft_confidence(draft_logits, draft_tokens, draft_probs))
                draft_tokens, draft_logits = draft_tokens[:, :k], draft_logits[:, :k]
                draft_probs = draft_probs[:, :k] if draft_probs is not None else None
            clock.lap("draft")
            out = target(torch.cat([state.anchor[:, None], draft_tokens], dim=1), cache=tcache,
                         feature_layers=feature_layers)  # verify [anchor, d_1..d_K]
            n_acc, nxt = verify_round(draft_tokens, draft_probs, out.logits, params, generator)  # [b], [b]
            features, target_logits = out.features, out.logits
            clock.lap("verify")
        else:  # the target alone, or a plain round of an adaptive policy (features still feed the drafter)
            draft_tokens = state.anchor.new_zeros(b, 0)
            draft_logits = hidden = None
            out = target(state.anchor[:, None], cache=tcache, feature_layers=feature_layers)  # [b, 1]
            n_acc, nxt = verify_round(draft_tokens, None, out.logits, params, generator)
            features, target_logits = out.features, out.logits
            clock.lap("verify")
        if observer is not None:
            observer(RoundRecord(state.rows, draft_tokens, draft_logits, hidden, n_acc, nxt, target_logits,
                                 tree_nodes, tree_winner))
        tcache.crop(tcache.lengths + n_acc + 1)  # anchor + accepted drafts are now committed
        if drafter is not None:  # the committed tokens' target features join the drafter's context
            fused = drafter.ingest(dcache, features, n_acc + 1)  # [b, T, D]
            state.draft_state = drafter.next_round_state(state.draft_state, hidden, draft_tokens, n_acc,
                                                         target_logits, fused)
            if tree is not None and state.draft_state is not None:
                raise ValueError("tree drafting needs a first drafter without cross-round state (e.g. dflash)")
        if second is not None:
            second.ingest(scache, features, n_acc + 1)
            second.next_round_state(None, None, draft_tokens, n_acc, target_logits, None)
        state.anchor = nxt
        if policy is not None and draft_tokens.shape[1] > 0:
            policy.observe(float(n_acc.float().mean()) + 1)
        keep = []
        tree_nodes = tree_nodes.tolist() if tree_nodes is not None else [0] * b
        tree_winner = tree_winner.tolist() if tree_winner is not None else [0] * b
        for i, (row, a, d, t) in enumerate(zip(state.rows.tolist(), n_acc.tolist(), draft_tokens.tolist(),
                                               nxt.tolist())):
            accepted[row].append(a)
            verified[row].append(len(d))
            if tree is not None:
                nodes[row].append(tree_nodes[i])
                winners[row].append(tree_winner[i])
            accept_lengths[row].append(emit(row, d[:a] + [t]))  # what the round emitted (a + 1 unless cut short)
            if results[row] is None:
                keep.append(i)
        _compact(state, tcache, dcache, keep, b, scache if second is not None else None)
    clock.lap("commit")
    return results  # type: ignore[return-value]


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


def _compact(state: _State, tcache, dcache, keep: list[int], current: int, scache=None) -> None:
    if len(keep) == current:
        return
    idx = torch.tensor(keep, dtype=torch.long, device=state.rows.device)
    state.select(idx)
    for cache in (tcache, dcache, scache):
        if cache is not None:
            cache.select_rows(idx)
