"""One losslessness harness for every decoding path, and drafters with controllable acceptance to run it at.

A decoding path (the chain engine with a DFlash or ReTrace drafter, later the tree, the kernels and each backend) is
lossless when its greedy output equals the target's alone token for token and its sampled output is distributed
exactly as the target's (Leviathan et al. 2023, arXiv:2211.17192). The harness checks both where bugs hide:

- :func:`check_greedy`: batch 1 and a ragged batch of 8+ rows (different prompt lengths, per-row caps, a stop token
  inside an accepted run), each against the target alone, and the batch against its rows decoded one at a time
  (tokens and accept lengths); it also checks that the run exercised full-block, partial and zero acceptance.
- :func:`sampling_pvalues`: chi-square goodness of fit of the joint distribution of several generated tokens against
  the target's exact joint distribution, enumerated on a tiny vocabulary with an independent implementation of
  temperature / top-k / top-p (:func:`reference_probs`). Three tables: the first tokens, the first round's last
  draft slot with its bonus token, and the last tokens (always emitted after the first round, by rounds that carry
  whatever state the drafter keeps).

- :func:`check_conformance`: an executor (the static path, an exported backend) reproduces the eager engine's greedy
  rounds, request by request: the drafts it verified, their acceptance, the next token.

Its power is shown in ``tests/runtime/test_lossless.py`` and ``tests/runtime/test_static_decode.py``: it fails on
the deliberately wrong rules in :data:`WRONG_RULES`, :data:`TREE_WRONG_RULES` and :data:`EXECUTOR_WRONG_RULES`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from specdraft.runtime import d2sd, one_pass, rounds, static_decode, tree
from specdraft.runtime.decode import GenerationConfig, RowResult, generate
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.sampling import SamplingParams, sample_from_probs
from specdraft.runtime.static_decode import StaticDecoder
from tests.helpers import chi2_pvalue, make_target

# ---- a reference sampler, written apart from runtime/sampling.py ---------------------------------------------------


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (keep the smallest prefix of the sorted tokens whose mass reaches top_p),
    written row by row with Python loops so it shares no code or trick with the runtime's vectorised version."""
    flat = logits.double().reshape(-1, logits.shape[-1])
    out = torch.zeros_like(flat)
    for r in range(flat.shape[0]):
        z = (flat[r] / params.temperature).tolist()
        order = sorted(range(len(z)), key=lambda i: -z[i])
        keep = order[: params.top_k] if params.top_k > 0 else order
        m = max(z[i] for i in keep)
        w = {i: pow(2.718281828459045, z[i] - m) for i in keep}
        total = sum(w.values())
        kept, mass = [], 0.0
        for i in keep:  # descending
            if mass >= params.top_p:
                break
            kept.append(i)
            mass += w[i] / total
        norm = sum(w[i] for i in kept)
        for i in kept:
            out[r, i] = w[i] / norm
    return out.view(logits.shape)


@torch.no_grad()
def exact_joint(target, prompt: list[int], length: int, params: SamplingParams) -> torch.Tensor:
    """``p(t_0 .. t_{length-1} | prompt)`` under the target alone with ``params``, as a ``[V] * length`` tensor,
    enumerated level by level (one batched forward per level)."""
    V = target.args.vocab_size
    prefixes = [[]]
    probs = torch.ones(1, dtype=torch.float64)
    for _ in range(length):
        ids = torch.tensor([prompt + p for p in prefixes])
        nxt = reference_probs(target(ids).logits[:, -1], params)  # [n, V]
        probs = (probs[:, None] * nxt).flatten()
        prefixes = [p + [t] for p in prefixes for t in range(V)]
    return probs.view(*([V] * length))


# ---- drafters with controllable acceptance -----------------------------------------------------------------------


class _Rows:
    """Per-row committed text that follows the engine's compaction (``select_rows``); wraps an inner cache."""

    def __init__(self, history: list[list[int]], inner=None):
        self.history, self.inner = history, inner

    @property
    def grow_to(self) -> int:
        """The inner cache's bound when it grows as a deferred drafter catches up (an AttributeError without one)."""
        return self.inner.grow_to

    @grow_to.setter
    def grow_to(self, length: int) -> None:
        self.inner.grow_to = length

    def select_rows(self, rows: torch.Tensor) -> None:
        self.history = [self.history[i] for i in rows.tolist()]
        if self.inner is not None:
            self.inner.select_rows(rows)

    def cat_rows(self, other: "_Rows") -> None:
        self.history = self.history + other.history
        if self.inner is not None:
            self.inner.cat_rows(other.inner)


class _State:
    """Cross-round state: the inner drafter's (the history is kept in the cache)."""

    def __init__(self, inner):
        self.inner = inner

    def select(self, rows: torch.Tensor) -> "_State":
        return _State(self.inner.select(rows) if self.inner is not None else None)

    def blank(self, n: int) -> "_State":
        return _State(self.inner.blank(n) if self.inner is not None else None)

    def cat(self, other: "_State") -> "_State":
        return _State(self.inner.cat(other.inner) if self.inner is not None else None)


class ControlledDrafter:
    """A :class:`~specdraft.runtime.drafter.Drafter` whose acceptance is set, not learnt.

    It knows the committed text of every row (the prompts it is given plus what the engine commits) and asks the
    target itself for the continuation: along the target's greedy path, slot ``k`` proposes

    - ``mode="mix"``: ``log(alpha * p_target(. | text, path_<k) + (1 - alpha) * u)`` with ``u`` uniform (or the inner
      drafter's distribution): a tempered copy of the target, accepted often under sampling;
    - ``mode="oracle"``: the path token itself with probability ``right`` (else another token), a point mass: greedy
      acceptance is right with that probability per slot, so full, partial and zero acceptance all occur.

    With ``inner`` (a real DFlash/ReTrace drafter) every engine call also runs the inner drafter: its caches, its
    ingest, its cross-round state and its hidden states; its distribution is mixed in with weight ``1 - alpha``.

    As D²SD's second drafter (``draft_branches``) it continues each branch's known tokens; with ``alternative`` the
    first slot it drafts takes the target's SECOND most likely token (a branch that differs from the first draft's
    greedy path, which a tree under sampling can then accept).
    """

    def __init__(self, target, prompts: list[list[int]], block_size: int = 4, mode: str = "mix", alpha: float = 0.8,
                 right: float = 0.85, inner=None, seed: int = 0, alternative: bool = False, runner_up: bool = False):
        self.target, self.prompts, self.mode, self.alpha, self.right, self.inner = (target, prompts, mode, alpha,
                                                                                    right, inner)
        self.runner_up = runner_up
        self.V = target.args.vocab_size
        self._block_size = inner.block_size if inner is not None else block_size
        self.config = inner.config if inner is not None else type("Cfg", (), {"mask_token_id": self.V - 1})()
        self.seed, self.alternative = seed, alternative

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.inner.target_layer_ids if self.inner is not None else (0,)

    def new_cache(self, batch_size: int, max_len: int) -> _Rows:
        """Rows for the next ``batch_size`` of its prompts: all of them for a static batch, or the requests a
        continuous-batching engine admits (in the prompts' order) group by group."""
        start = getattr(self, "_admitted", 0)
        assert start + batch_size <= len(self.prompts), "ControlledDrafter decodes exactly the prompts it was given"
        self._admitted = (start + batch_size) % len(self.prompts)
        inner = self.inner.new_cache(batch_size, max_len) if self.inner is not None else None
        return _Rows([list(p) for p in self.prompts[start:start + batch_size]], inner)

    def ingest(self, cache: _Rows, ctx_features, counts):
        return self.inner.ingest(cache.inner, ctx_features, counts) if self.inner is not None else None

    def block_embeds(self, block_tokens: torch.Tensor, state):
        self._anchors = block_tokens[:, 0].tolist()
        self._blocks = block_tokens.tolist()
        if self.inner is not None:
            return self.inner.block_embeds(block_tokens, state.inner if state is not None else None)
        return torch.zeros(*block_tokens.shape, 1)

    @torch.no_grad()
    def draft_hidden(self, cache: _Rows, block_embeds: torch.Tensor):
        self._cache = cache
        inner_hidden = self.inner.draft_hidden(cache.inner, block_embeds) if self.inner is not None else None
        self._path_p, self._texts = self._paths([h + [a] for h, a in zip(cache.history, self._anchors)], [[]] * len(
            self._anchors))
        return inner_hidden if inner_hidden is not None else block_embeds

    @torch.no_grad()
    def draft_branches(self, cache: _Rows, block_embeds: torch.Tensor):
        """D²SD's second draft: ``J`` blocks per row whose leading slots hold known tokens (the rest mask tokens);
        each continues the target's greedy path after the row's text, the anchor and its known tokens."""
        self._cache = cache
        b, J = block_embeds.shape[:2]
        inner_hidden = self.inner.draft_branches(cache.inner, block_embeds) if self.inner is not None else None
        mask_id = self.config.mask_token_id
        blocks = [self._blocks[i * J:(i + 1) * J] for i in range(b)]
        self._anchors = [rows[0][0] for rows in blocks]
        texts, known = [], []
        for h, rows in zip(cache.history, blocks):
            for blk in rows:
                n = next((k for k, t in enumerate(blk[1:]) if t == mask_id), len(blk) - 1)
                texts.append(h + [blk[0]])
                known.append(blk[1:1 + n])
        path_p, path_texts = self._paths(texts, known, self.alternative)
        self._path_p = path_p.view(b, J, *path_p.shape[1:])  # [b, J, K, V]
        self._texts = path_texts
        return inner_hidden if inner_hidden is not None else block_embeds

    def _paths(self, texts: list[list[int]], known: list[list[int]], alternative: bool = False):
        """Per text: ``[K, V]`` target distributions along its greedy path, the first tokens forced to ``known``
        (one-hot there) and, with ``alternative``, the next one to the target's runner-up (one-hot); and a key per
        (text, slot) that seeds the oracle's right/wrong draws."""
        K = self.block_size - 1
        keys = [tuple(t + kn) for t, kn in zip(texts, known)]
        path_p = []
        for k in range(K):
            p = _next_probs(self.target, texts)  # [n, V]
            for i, kn in enumerate(known):
                if k < len(kn):
                    p[i] = torch.nn.functional.one_hot(torch.tensor(kn[k]), self.V).float()
                elif alternative and k == len(kn):
                    p[i] = torch.nn.functional.one_hot(p[i].topk(2).indices[1], self.V).float()
            path_p.append(p)
            texts = [t + [int(p[i].argmax())] for i, t in enumerate(texts)]
        return torch.stack(path_p, 1), keys  # [n, K, V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self._path_p  # [..., K, V]
        if self.mode == "oracle":
            tok = p.argmax(-1).flatten(0, -2)  # [n, K]
            scale = torch.full(tok.shape, 30.0)
            right_tok = tok.clone()
            for i in range(tok.shape[0]):
                for k in range(tok.shape[1]):
                    # right or wrong as a function of the row's text alone, so a row decodes the same in any batch
                    u = random.Random(f"{self.seed}/{self._texts[i]}/{k}").random()
                    if u >= self.right:
                        tok[i, k] = (tok[i, k] + 1 + int(u * 1e6) % (self.V - 2)) % (self.V - 1)
                        scale[i, k] = 1.5  # a wrong draft is a less confident one (D²SD branches there)
            point = torch.nn.functional.one_hot(tok.view(p.shape[:-1]), self.V).float() * scale.view(
                p.shape[:-1])[..., None]  # [..., K, V]
            if self.runner_up:  # a wrong draft's second choice is the path token (a one-pass tree's sibling)
                wrong = (tok != right_tok).float().view(p.shape[:-1])[..., None]
                point = point + wrong * torch.nn.functional.one_hot(right_tok.view(p.shape[:-1]), self.V).float()
            return point + self.inner.logits(hidden).float() if self.inner is not None else point
        other = torch.full_like(p, 1.0 / self.V)
        if self.inner is not None:
            other = self.inner.logits(hidden).float().softmax(-1)
        return (self.alpha * p + (1 - self.alpha) * other).log()

    def next_round_state(self, state, hidden, draft_tokens, num_accepted, target_logits, target_context):
        for i, (a, d, n) in enumerate(zip(self._anchors, draft_tokens.tolist(), num_accepted.tolist())):
            self._cache.history[i] += [a] + d[:n]  # the anchor and the accepted drafts are now committed
        inner = None
        if self.inner is not None:
            inner = self.inner.next_round_state(state.inner if state is not None else None, hidden, draft_tokens,
                                                num_accepted, target_logits, target_context)
        return _State(inner) if inner is not None else None


@torch.no_grad()
def _next_probs(target, texts: list[list[int]]) -> torch.Tensor:
    """The target's next-token distribution after each text ``[b, V]`` (texts grouped by length, no padding)."""
    out = torch.empty(len(texts), target.args.vocab_size)
    by_len: dict[int, list[int]] = {}
    for i, t in enumerate(texts):
        by_len.setdefault(len(t), []).append(i)
    for rows in by_len.values():
        out[rows] = target(torch.tensor([texts[i] for i in rows])).logits[:, -1].float().softmax(-1)
    return out


# ---- the harness ------------------------------------------------------------------------------------------------

DrafterFactory = Callable[[list[list[int]]], object]
"""``prompts -> drafter`` (controlled drafters need the prompts; real ones ignore them), or ``prompts -> (drafter,
TreeDrafting)`` for a D²SD path."""


def run(target, prompts, gen: GenerationConfig, factory: DrafterFactory, generator=None,
        engine: Callable | None = None) -> list[RowResult]:
    """Decode ``prompts`` with the decoding path the factory builds for them, through ``engine`` (a callable with
    :func:`~specdraft.runtime.decode.generate`'s signature; default that engine)."""
    built = factory(prompts)
    drafter, tree = built if isinstance(built, tuple) else (built, None)
    engine = engine or generate
    return engine(target, prompts, gen, drafter=drafter, generator=generator, tree=tree)


def block_size_of(factory: DrafterFactory, prompts) -> int:
    built = factory(prompts)
    return (built[0] if isinstance(built, tuple) else built).block_size


def acceptance_profile(results: list[RowResult], block_size: int) -> dict:
    """tau (tokens emitted per round) and how many rounds accepted every draft, some, or none (from the drafts
    accepted, so a round cut short by a stop token or a cap is not counted as a rejection)."""
    emitted = [a for r in results for a in r.accept_lengths]
    accepted = [a for r in results for a in r.accepted]
    K = block_size - 1
    return {"tau": sum(emitted) / max(len(emitted), 1), "full": sum(a == K for a in accepted),
            "partial": sum(0 < a < K for a in accepted), "none": sum(a == 0 for a in accepted),
            "rounds": len(emitted)}


def _ar(target, prompts, caps, stop=()):
    gen = GenerationConfig(max_new_tokens=caps, stop_token_ids=stop)
    return [r.tokens for r in generate(target, prompts, gen)]


def check_greedy(target, factory: DrafterFactory, prompts: list[list[int]], caps: list[int],
                 engine: Callable | None = None) -> dict:
    """Greedy equality at batch 1 and on the ragged batch ``prompts`` (8+ rows, per-row ``caps``), and again with a
    stop token that the free run emits inside an accepted run. Returns counts; the caller asserts on them:
    ``mismatches`` (rows differing from the target alone or from one-row decoding) must be 0."""
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) > 1 and len(set(caps)) > 1
    mismatches = 0
    expected = _ar(target, prompts, caps)
    for p, cap, exp in zip(prompts[:2], caps, expected):
        mismatches += run(target, [p], GenerationConfig(max_new_tokens=cap), factory, engine=engine)[0].tokens != exp
    batch = run(target, prompts, GenerationConfig(max_new_tokens=caps), factory, engine=engine)
    profile = acceptance_profile(batch, block_size_of(factory, prompts[:1]))
    mismatches += sum(r.tokens != e for r, e in zip(batch, expected))
    singles = [run(target, [p], GenerationConfig(max_new_tokens=c), factory, engine=engine)[0]
               for p, c in zip(prompts, caps)]
    mismatches += sum(r.tokens != s.tokens or r.accept_lengths != s.accept_lengths for r, s in zip(batch, singles))
    stop = _stop_inside_accepted_run(batch)
    stopped = run(target, prompts, GenerationConfig(max_new_tokens=caps, stop_token_ids=(stop,)), factory,
                  engine=engine)
    expected_stop = _ar(target, prompts, caps, (stop,))
    mismatches += sum(r.tokens != e for r, e in zip(stopped, expected_stop))
    return {"mismatches": mismatches, **profile, "stopped_rows": sum(r.finish_reason == "stop" for r in stopped),
            "branch_wins": sum(w > 0 for r in batch for w in r.winner)}


def round_trace(target, prompts, gen: GenerationConfig, factory: DrafterFactory, engine: Callable | None = None,
                generator=None) -> tuple[list[RowResult], list[list[tuple]]]:
    """Decode through ``engine`` (default the eager engine) with an observer; returns the results and, per request,
    each verify round's ``(drafts verified, accepted, next token, tree nodes, winning candidate)``."""
    built = factory(prompts)
    drafter, tree = built if isinstance(built, tuple) else (built, None)
    trace: list[list[tuple]] = [[] for _ in prompts]

    def observe(rec) -> None:
        b = rec.draft_tokens.shape[0]
        nodes = rec.nodes.tolist() if rec.nodes is not None else [0] * b
        winner = rec.winner.tolist() if rec.winner is not None else [0] * b
        for r, d, a, t, n, c in zip(rec.rows.tolist(), rec.draft_tokens.tolist(), rec.num_accepted.tolist(),
                                    rec.next_tokens.tolist(), nodes, winner):
            trace[r].append((tuple(d), a, t, n, c))

    results = (engine or generate)(target, prompts, gen, drafter=drafter, generator=generator, tree=tree,
                                   observer=observe)
    return results, trace


DecodingPath = tuple[object, DrafterFactory, Callable | None]
"""``(target, factory, engine)``: a decoding path on one executor (engine None: the eager engine)."""


def check_conformance(path: DecodingPath, reference: DecodingPath, prompts: list[list[int]], caps: list[int]) -> dict:
    """Acceptance conformance: ``path`` reproduces ``reference``'s greedy rounds (usually the eager engine, with the
    models an export came from), request by request and round by round: the drafts verified, how many were accepted,
    the next token, the tree's nodes and winner; on the ragged batch and with a stop token inside an accepted run.
    Output equality cannot see a bug that only loses acceptance (a drafter context left behind by a compaction): this
    can, given a drafter whose drafts follow its context. Returns counts; the caller asserts ``differing_rows == 0``
    and that drafts were accepted."""
    def trace(p: DecodingPath, gen: GenerationConfig):
        return round_trace(p[0], prompts, gen, p[1], p[2])

    free = GenerationConfig(max_new_tokens=caps)
    want = trace(reference, free)
    try:
        stop = _stop_inside_accepted_run(want[0])
    except AssertionError:  # a weak drafter: a token the longest row emits mid-way
        longest = max(want[0], key=lambda r: len(r.tokens)).tokens
        stop = longest[len(longest) // 2]
    stopped = GenerationConfig(max_new_tokens=caps, stop_token_ids=(stop,))
    out = {"rounds": 0, "differing_rows": 0, "accepted": 0}
    for (w_res, w_trace), (res, tr) in ((want, trace(path, free)), (trace(reference, stopped), trace(path, stopped))):
        for w, wt, r, rt in zip(w_res, w_trace, res, tr):
            out["differing_rows"] += (r.tokens, r.accepted, r.accept_lengths, r.finish_reason, rt) != (
                w.tokens, w.accepted, w.accept_lengths, w.finish_reason, wt)
            out["rounds"] += len(rt)
            out["accepted"] += sum(r.accepted)
    return out


def _stop_inside_accepted_run(results: list[RowResult]) -> int:
    """A token some row emitted as an accepted draft that is neither the first nor the last of its round."""
    for r in results:
        pos = 1  # tokens[0] came from the prefill
        for a in r.accept_lengths:
            if a >= 3 and pos + 1 < len(r.tokens) and r.tokens[pos + 1] not in r.tokens[:pos + 1]:
                return r.tokens[pos + 1]
            pos += a
    raise AssertionError("no round accepted 2+ drafts: the drafter is too weak for this check")


@dataclass
class SamplingCheck:
    first: float
    """p-value of the joint of the first ``first_len`` tokens."""
    bonus: float
    """p-value of the joint of tokens ``block_size - 1`` and ``block_size``: the first round's last draft slot and
    its bonus token (emitted by the first round when it accepts every draft)."""
    later: float
    """p-value of the joint of the last ``later_len`` tokens (emitted after the first round)."""
    profile: dict

    @property
    def min_p(self) -> float:
        return min(self.first, self.bonus, self.later)


def sampling_pvalues(target, factory: DrafterFactory, params: SamplingParams, n: int = 12000, first_len: int = 3,
                     later_len: int = 2, draft_sampling: str = "sample", seed: int = 0,
                     prompt: tuple[int, ...] = (1, 2, 3), engine: Callable | None = None) -> SamplingCheck:
    """Decode ``n`` copies of ``prompt`` (i.i.d. rows) and test two joint distributions against the exact target's.

    The generated length is ``1 + block_size + later_len``: the prefill token and at most ``block_size`` tokens of
    the first round come before the last ``later_len`` tokens, so those are always emitted by a later round."""
    prompts = [list(prompt)] * n
    Bk = block_size_of(factory, prompts[:1])
    L = 1 + Bk + later_len
    gen = GenerationConfig(max_new_tokens=L, sampling=params, draft_sampling=draft_sampling)
    res = run(target, prompts, gen, factory, generator=torch.Generator().manual_seed(seed), engine=engine)
    toks = torch.tensor([r.tokens for r in res])  # [n, L]
    assert toks.shape == (n, L)
    joint = exact_joint(target, list(prompt), L, params)  # [V] * L
    V = joint.shape[0]

    def marginal(cols):
        return joint.sum(dim=tuple(i for i in range(L) if i not in cols))

    def counts(cols):
        idx = torch.zeros(n, dtype=torch.long)
        for c in cols:
            idx = idx * V + toks[:, c]
        return torch.bincount(idx, minlength=V ** len(cols))

    tables = [list(range(first_len)), [Bk - 1, Bk], list(range(L - later_len, L))]
    first, bonus, later = (chi2_pvalue(counts(cols), marginal(cols)) for cols in tables)
    profile = {**acceptance_profile(res, Bk), "branch_wins": sum(w > 0 for r in res for w in r.winner)}
    return SamplingCheck(first, bonus, later, profile)


def wrong_rule_caught(patches, monkeypatch, factory: Callable, sampled: bool, alpha: float):
    """Apply a wrong rule's ``patches`` and run the harness on the tree path ``factory(target, mode, block_size)``
    builds: goodness of fit under sampling (``sampled``), else greedy equality. ``(caught, the harness's report)``."""
    for module, attr, wrong in patches:
        monkeypatch.setattr(module, attr, wrong)
    if sampled:
        target = make_target(seed=7, vocab=6, std=0.5)
        got = sampling_pvalues(target, factory(target, "mix", 4), SAMPLING_SETTINGS[0])
        return got.min_p < alpha, got
    target = make_target(seed=3, vocab=48)
    got = check_greedy(target, factory(target, "oracle", 6), RAGGED_PROMPTS, RAGGED_CAPS)
    return got["mismatches"] > 0, got


# ---- deliberately wrong verification rules (the harness must catch each) -------------------------------------------


def _wrong_sampling(bonus_shift: bool = False, all_accepted_slots: bool = False):
    def rule(draft_tokens, draft_probs, target_probs, generator=None):
        B, K = draft_tokens.shape
        p = target_probs[:, :K].gather(-1, draft_tokens[..., None])[..., 0]
        q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
        u = torch.rand(B, K, generator=generator, device=p.device)
        ok = (u * q <= p).long()
        n = ok.sum(1) if all_accepted_slots else ok.cumprod(1).sum(1)
        at = n.clamp(max=K - 1) if bonus_shift else n
        q_pad = torch.cat([draft_probs, draft_probs.new_zeros(B, 1, draft_probs.shape[-1])], dim=1)
        rows = torch.arange(B)
        residual = (target_probs[rows, at] - q_pad[rows, at] * (at == n)[:, None]).clamp_min(0)
        return n, sample_from_probs(residual / residual.sum(-1, keepdim=True), generator)
    return rule


def _wrong_greedy(bonus_shift: bool = False, all_accepted_slots: bool = False):
    def rule(draft_tokens, target_logits):
        t = target_logits.argmax(-1)
        K = draft_tokens.shape[1]
        m = (draft_tokens == t[:, :K]).long()
        n = m.sum(1) if all_accepted_slots else m.cumprod(1).sum(1)
        at = (n + 1).clamp(max=K) if bonus_shift else n
        return n, t.gather(1, at[:, None])[:, 0]
    return rule


_verify_round, _propose = rounds.verify_round, rounds.propose  # the correct rules, before any monkeypatch
_build_tree, _accept_tree = d2sd.build_tree, d2sd.accept_tree


def _sibling_visible_tree(anchor, candidates):
    """A causal mask over the node order instead of the ancestor mask: nodes see their earlier siblings' branches."""
    tree = _build_tree(anchor, candidates)
    N = tree.mask.shape[-1]
    return tree._replace(mask=torch.ones(N, N, dtype=torch.bool).tril().expand_as(tree.mask))


def _bonus_from_the_root(tree, node_targets):
    """The emitted token after the accepted path is the target's token at the root."""
    acc = _accept_tree(tree, node_targets)
    return acc._replace(next_token=node_targets[:, 0])


def _first_candidate_only(tree, node_targets):
    """Verifies the first draft alone (the tree's branches are drafted and scored, never accepted) but keeps the
    accepted length of the best branch."""
    acc = _accept_tree(tree, node_targets)
    return acc._replace(winner=torch.zeros_like(acc.winner), path=acc.path.gather(1, acc.path.new_zeros(
        acc.path.shape)) + torch.arange(acc.path.shape[1]))


def _untruncated_target(draft_tokens, draft_probs, target_logits, params, generator=None):
    """Verifies against the target at the right temperature but without top-k / top-p."""
    plain = SamplingParams(temperature=params.temperature)
    return _verify_round(draft_tokens, draft_probs, target_logits, plain, generator)


def _drafts_sampled_at_t1(draft_logits, params, draft_sampling, generator=None):
    """Samples drafts from the raw softmax but hands verification the processed q (a draw/q mismatch)."""
    tokens, q = _propose(draft_logits, params, draft_sampling, generator)
    if q is None:
        return tokens, q
    return sample_from_probs(draft_logits.float().softmax(-1), generator), q


WRONG_RULES: dict[str, list[tuple[object, str, Callable]]] = {
    "bonus token from the wrong position": [
        (rounds, "accept_greedy", _wrong_greedy(bonus_shift=True)),
        (rounds, "accept_speculative_sampling", _wrong_sampling(bonus_shift=True))],
    "acceptance not stopping at the first rejection": [
        (rounds, "accept_greedy", _wrong_greedy(all_accepted_slots=True)),
        (rounds, "accept_speculative_sampling", _wrong_sampling(all_accepted_slots=True))],
    "truncation applied to the draft side only": [(rounds, "verify_round", _untruncated_target)],
    "drafts drawn from another distribution than the q verified": [(rounds, "propose", _drafts_sampled_at_t1)],
}
"""name -> [(module, attribute, replacement)]: monkeypatch these to break the engine on purpose."""

def _proposals_not_reduced(target_probs, draft_probs, at, before):
    """Every proposal tried against the target's own distribution, and the token after them drawn from it."""
    return torch.zeros(before.shape, dtype=torch.float64, device=at.device), torch.ones(
        at.shape, dtype=torch.float64, device=at.device)


TREE_WRONG_RULES: dict[str, list[tuple[object, str, Callable]]] = {
    "tree mask lets a node see other branches": [(d2sd, "build_tree", _sibling_visible_tree)],
    "no KV compaction (the accepted path's K/V stay where the tree put them)": [
        (KVCache, "move", lambda self, src, dst: None)],
    "token after the accepted path taken at the root": [(d2sd, "accept_tree", _bonus_from_the_root)],
    "accepted path read from the first draft's nodes whatever branch won": [(d2sd, "accept_tree",
                                                                             _first_candidate_only)],
    "sampled drafts: the target's distribution not reduced after a rejected proposal": [
        (tree, "proposal_offsets", _proposals_not_reduced)],
}
"""The same for the D²SD tree path (each passes the chain tests: only a tree round exposes it; the last one only
under sampling with sampled drafts)."""

_build_nodes, _accept_nodes = one_pass.build_nodes, one_pass.accept_nodes


def _siblings_visible(anchor, shape, tokens, max_depth, width=None):
    """A causal mask over the node order instead of the ancestor mask (a node sees every node numbered before it)."""
    tree = _build_nodes(anchor, shape, tokens, max_depth, width)
    N = tree.mask.shape[-1]
    return tree._replace(mask=torch.ones(N, N, dtype=torch.bool).tril().expand_as(tree.mask))


def _nodes_bonus_from_the_root(tree, node_targets, max_depth=None):
    return _accept_nodes(tree, node_targets, max_depth)._replace(next_token=node_targets[:, 0])


def _not_reduced(p, q, rest, live):
    """Every sibling tried against the target's own distribution, and the token after them drawn from it."""
    return rest.new_zeros(*rest.shape[:-1], len(live) + 1), rest.new_ones(*rest.shape[:-1], len(live))


ONE_PASS_WRONG_RULES: dict[str, list[tuple[object, str, Callable]]] = {
    "tree mask lets a node see the nodes numbered before it": [(one_pass, "build_nodes", _siblings_visible)],
    "token after the accepted path taken at the root": [(one_pass, "accept_nodes", _nodes_bonus_from_the_root)],
    "sampled siblings: each tried against q, not q without the earlier draws": [
        (one_pass, "rest_mass", torch.ones_like)],
    "sampled siblings: the target's distribution not reduced after a rejected sibling": [
        (one_pass, "residual_offsets", _not_reduced)],
}
"""The same for one-pass trees (the sampled ones only under sampling with sampled siblings)."""

_static_compact = StaticDecoder._compact


def _drafter_cache_left_behind(self, keep):
    """A bucket move compacts the target's cache only: the moved rows draft from other requests' contexts."""
    dcache, self.dcache = self.dcache, None
    try:
        _static_compact(self, keep)
    finally:
        self.dcache = dcache


_static_carry_prior = StaticDecoder._carry_prior


def _prior_dropped_at_a_bucket_move(bk, prior):
    """ReTrace's prior is kept round to round but not carried into a smaller bucket: moved rows draft as if their
    last round had accepted everything."""
    _static_carry_prior(bk, prior if prior is not None and prior.valid.shape[0] == bk.n else None)


EXECUTOR_WRONG_RULES: dict[str, list[tuple[object, str, Callable]]] = {
    "static path: drafter cache left uncompacted after a bucket move": [
        (StaticDecoder, "_compact", _drafter_cache_left_behind)],
    "static path: frozen rows still commit": [(static_decode, "commit_counts", lambda n_acc, active: n_acc + 1)],
    "static path: ReTrace's prior dropped at a bucket move": [
        (StaticDecoder, "_carry_prior", staticmethod(_prior_dropped_at_a_bucket_move))],
}
"""The same for an executor's bookkeeping: output equality passes under each; acceptance conformance (the first and
the third, the latter with a ReTrace drafter) or a decoder sized exactly for its requests (the second: frozen rows
grow past their caches) catches it."""

SAMPLING_SETTINGS = [SamplingParams(0.7, top_k=4, top_p=0.9), SamplingParams(1.0, top_k=4, top_p=0.9),
                     SamplingParams(1.5, top_k=4, top_p=0.9)]
RAGGED_PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13], [20, 21, 22, 23, 24], [30], [31, 32, 33, 34],
                  [40, 41], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
RAGGED_CAPS = [10, 25, 17, 30, 8, 21, 14, 19, 12]


def power_table() -> list[dict]:
    """What the harness reports for the correct engine and for each wrong rule (``python -m tests.lossless``)."""
    rows = []
    for rule in [None, *WRONG_RULES]:
        saved = [(m, a, getattr(m, a)) for m, a, _ in WRONG_RULES.get(rule, [])]
        for m, a, wrong in WRONG_RULES.get(rule, []):
            setattr(m, a, wrong)
        try:
            gt = make_target(seed=3, vocab=48)
            greedy = check_greedy(gt, lambda p, t=gt: ControlledDrafter(t, p, 5, mode="oracle"), RAGGED_PROMPTS,
                                  RAGGED_CAPS)
            st = make_target(seed=7, vocab=6, std=0.5)
            sampled = sampling_pvalues(st, lambda p, t=st: ControlledDrafter(t, p, 4, mode="mix"), SAMPLING_SETTINGS[0])
        finally:
            for m, a, f in saved:
                setattr(m, a, f)
        rows.append({"rule": rule or "(correct engine)", "greedy_mismatches": greedy["mismatches"],
                     "greedy_tau": round(greedy["tau"], 2), "p_first": sampled.first, "p_bonus": sampled.bonus,
                     "p_later": sampled.later, "sampled_tau": round(sampled.profile["tau"], 2)})
    return rows


if __name__ == "__main__":
    for row in power_table():
        print(row)
