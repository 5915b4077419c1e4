"""Test builders: tiny random targets and drafters from configs, and a seconds-sized world on disk (never
downloaded). Import them from here; ``conftest.py`` only turns some into fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy import stats
from transformers import Qwen3Config, Qwen3ForCausalLM

from specdraft.pipeline.corpora import math_docs
from specdraft.pipeline.jsonl import write_jsonl
from specdraft.pipeline.tokenizer import train_tokenizer
from specdraft.pipeline.world import World
from specdraft.runtime.cost_model import CostModel
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import build_drafter, convert_drafter, drafter_config_for_target
from specdraft.runtime.models.dflash import DFlashDrafter
from specdraft.runtime.models.retrace import ReTraceOptions
from specdraft.runtime.models.target import TargetArgs, TargetLM
from specdraft.runtime.node_budget import NodeBudget, budget_choices

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU (pytest -m gpu on a GPU box)")


def tiny_target_args(vocab: int = 64, layers: int = 4, model_type: str = "qwen3", tied: bool = True) -> TargetArgs:
    return TargetArgs(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=tied)


def make_target(seed: int = 0, vocab: int = 64, layers: int = 4, std: float = 0.3, **kw) -> TargetLM:
    """A random tiny target with peaked distributions (large init) so greedy paths are well separated."""
    torch.manual_seed(seed)
    t = TargetLM(tiny_target_args(vocab, layers, **kw))
    for p in t.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=std)
    return t.eval()


def make_drafter(target: TargetLM, seed: int = 1, block_size: int = 6, layers: int = 2,
                 mask_token_id: int | None = None, std: float | None = None):
    """A random DFlash drafter bound to ``target``; with ``std`` its own matrices are drawn at that scale, so that its
    drafts follow its context (at the default init they hardly depend on it: a drafter context gone wrong would not
    show)."""
    torch.manual_seed(seed)
    mask = target.args.vocab_size - 1 if mask_token_id is None else mask_token_id
    d = build_drafter(drafter_config_for_target(target.args, mask, num_layers=layers, block_size=block_size,
                                                num_features=2))
    if std is not None:
        for p in d.parameters():  # the target's embedding and head are bound after, untouched
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=std)
    return d.bind_target(target.model.embed_tokens, target.lm_head).eval()


def build_tiny_world(root):
    """A seconds-sized world on disk: BPE tokenizer, random tiny Qwen3 target (transformers save_pretrained),
    ShareGPT data (math problems with their worked answers) and a held-out math prompt file."""
    root = Path(root)
    docs = math_docs(160, seed=0)
    tok = train_tokenizer([d.prompt + "\n" + d.response for d in docs], 400, root / "target")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, tie_word_embeddings=True, initializer_range=0.3))
    model.save_pretrained(str(root / "target"))
    write_jsonl(root / "data.jsonl", [{"id": f"m{i}", "conversations": [
        {"role": "user", "content": d.prompt}, {"role": "assistant", "content": d.response}]}
        for i, d in enumerate(docs[:120])])
    write_jsonl(root / "bench" / "math.jsonl", [{"id": f"h{i}", "prompt": d.prompt} for i, d in enumerate(docs[120:])])
    write_jsonl(root / "heldin.jsonl", [{"id": f"m{i}", "domain": "math", "prompt": d.prompt}
                                        for i, d in enumerate(docs[:120])])
    return World(root / "target", root / "heldin.jsonl", root / "bench", {})


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13], [20, 21, 22, 23, 24], [30], [31, 32, 33, 34], [40, 41]]


def ar(target, prompts, max_new, **kw):
    return [r.tokens for r in generate(target, prompts, GenerationConfig(max_new_tokens=max_new, **kw))]


def exact_two_token_dist(target, prompt, V):
    """p(t1, t2 | prompt) by enumeration with the target alone (T=1)."""
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2 = target(seqs).logits[:, -1].softmax(-1)  # [V, V]
    return (p1[:, None] * p2).flatten()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (cells expected below ``min_expected`` pooled)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:  # an outcome the distribution rules out (e.g. outside top-k / top-p)
        return 0.0
    exp = probs / probs.sum() * counts.sum()
    big = exp >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    if ex[-1] == 0:  # nothing pooled: a count there would be impossible under probs
        if obs[-1] > 0:
            return 0.0
        obs, ex = obs[:-1], ex[:-1]
    return float(stats.chisquare(obs.numpy(), ex.numpy()).pvalue)


def retrace_from(backbone, active: bool, seed: int = 0, **opts):
    """A ReTrace drafter on ``backbone``: zero-init fusion (== the backbone), or with ``active`` a "trained" one
    (open gates, non-zero output projection)."""
    torch.manual_seed(seed)
    r = convert_drafter(backbone, "retrace", ReTraceOptions(**opts))
    if active:
        torch.nn.init.normal_(r.retrace_gate_out.weight, std=0.5)  # [W_g ; W_o], W_o no longer zero
        torch.nn.init.zeros_(r.retrace_gate_out.bias)
    return r.eval()


class BigramOracle(DFlashDrafter):
    """A real DFlash drafter (its caches, ingest and draft pass all run) whose logits are replaced by a pinned guess
    of the target's next tokens. Against a target whose attention output projections are zero, the next token is a
    fixed function of the current one (a bigram map), so the guess is exact: slot ``k`` proposes the map's ``k``-th
    iterate of the anchor while ``k <= right`` and a wrong token after, pinning ``right`` accepted drafts per round
    (``runner_up``: the right token is the wrong slots' second likeliest, where a tree's sibling finds it)."""

    def pin(self, bigram: torch.Tensor, right: int, runner_up: bool = False):
        self.bigram, self.right, self.runner_up = bigram, right, runner_up
        return self

    def block_embeds(self, block_tokens, state=None):
        self._anchor = block_tokens[:, 0]
        return super().block_embeds(block_tokens, state)

    def logits(self, hidden):
        super().logits(hidden)  # the real LM head runs too
        K, V = hidden.shape[1], self.bigram.shape[0]
        tok, out, true = self._anchor, [], []
        for k in range(K):
            tok = self.bigram[tok]
            out.append(tok if k < self.right else (tok + 1) % V)
            true.append(tok)
        one_hot = torch.nn.functional.one_hot
        logits = one_hot(torch.stack(out, 1), V).float() * 20  # [b, K, V]
        return logits + one_hot(torch.stack(true, 1), V).float() * 10 if self.runner_up else logits


def bigram_target(V=6):
    target = make_target(seed=7, vocab=V, std=1.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        bigram = target(torch.arange(V)[:, None]).logits[:, 0].argmax(-1)  # [V] next token of each token
    return target, bigram


def bigram_oracle(right: int, block_size: int = 4, V: int = 6, runner_up: bool = False):
    """``(target, drafter)``: a bigram target and a :class:`BigramOracle` pinned to ``right`` accepted drafts."""
    target, bigram = bigram_target(V)
    oracle = make_drafter(target, seed=2, block_size=block_size)
    oracle.__class__ = BigramOracle
    return target, oracle.pin(bigram, right, runner_up)


def priced_budget(block_size: int, nodes: int, cost) -> NodeBudget:
    """A measured :class:`NodeBudget` up to ``nodes`` over a synthetic machine: a verify pass of ``n`` tokens on
    ``rows`` rows takes ``cost(rows, n)`` seconds at any context (rows measured at powers of two up to 16 384)."""
    choices = budget_choices(block_size, nodes)
    rows = [1 << i for i in range(15)]
    return NodeBudget(choices, CostModel(rows, list(choices), [[cost(r, n) for n in choices] for r in rows],
                                         [0.0] * len(rows)))
