"""The drafter's and the target's serving passes as self-contained modules with explicit caches, for the ONNX export.

Three graphs, each a pure function of its inputs (no state, no host reads), sharing one attention form: the new
tokens' queries over ``[cache ; new]`` keys with a visibility mask built from per-row lengths and the new tokens' own
mask, so a chain, a D²SD tree, a drafter block and a prefill are all the same graph.

- ``drafter_ingest``: target features of committed tokens and their positions -> the drafter's context K/V of those
  tokens (per layer, to append at each row's length) and the fused context ``hidden_norm(fc(f))``.
- ``drafter_draft``: block embeddings, positions, the new tokens' mask, the drafter's context cache and per-row
  lengths -> final-normed hidden states and block logits (the target's LM head, borrowed, is part of the graph).
- ``target_verify``: new token ids, positions, the new tokens' mask, the target's KV cache and per-row lengths ->
  logits at the new tokens, the requested feature layers, and the new tokens' K/V.

Cache layout: ``[L, B, H_kv, S, Dh]`` with row ``b`` valid below ``lengths[b]``; the runtime backends append the
returned K/V (:mod:`specdraft.runtime.backends.onnx`).

Two flavours of attention: **decomposed** (standard ops: ``repeat_interleave`` for GQA, a masked softmax; runs in any
ONNX runtime) and **fused** (the new K/V scattered into the cache at ``lengths + r`` and one ``specdraft`` custom-op
node, ``SpeculativeAttention``, the Triton kernel's contract; a TensorRT plugin serves it).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdraft.export.custom_ops import retrace_fusion_op, speculative_attention_op
from specdraft.kernels.retrace_fusion import retrace_fusion_reference
from specdraft.kernels.speculative_attention import pack_mask
from specdraft.runtime.models.dflash import DFlashDrafter
from specdraft.runtime.models.layers import AttentionProjections, rope_cos_sin
from specdraft.runtime.models.retrace import ReTraceDrafter
from specdraft.runtime.models.target import TargetLM


def cached_attention(attn: AttentionProjections, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor,
                     new_mask: torch.Tensor) -> torch.Tensor:
    """``q [B, H, T, Dh]`` over ``[cache (valid below lengths) ; new]`` -> ``[B, T, dim]`` (standard ops only).

    ``cache_k/v [B, H_kv, S, Dh]``, ``k_new/v_new [B, H_kv, T, Dh]``, ``lengths [B]``, ``new_mask [B, T, T]`` bool.
    A query that sees nothing returns zeros, as the speculative-attention reference does."""
    B, H, T, Dh = q.shape
    S = cache_k.shape[2]
    group = H // cache_k.shape[1]
    k = torch.cat([cache_k, k_new], dim=2).repeat_interleave(group, dim=1)  # [B, H, S + T, Dh]
    v = torch.cat([cache_v, v_new], dim=2).repeat_interleave(group, dim=1)
    committed = torch.arange(S, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    visible = torch.cat([committed[:, None, :].expand(B, T, S), new_mask], dim=2)  # [B, T, S + T]
    scores = (q.float() @ k.float().transpose(-1, -2)) * Dh ** -0.5  # [B, H, T, S + T]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible[:, None], probs, 0.0)  # rows that see nothing: 0, not NaN
    out = (probs @ v.float()).to(q.dtype)  # [B, H, T, Dh]
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, H * Dh))


def fused_cached_attention(attn: AttentionProjections, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor,
                           new_mask: torch.Tensor) -> torch.Tensor:
    """:func:`cached_attention` through the ``SpeculativeAttention`` custom op (same arguments and result)."""
    B, H, T, Dh = q.shape
    Hkv = cache_k.shape[1]
    slots = (lengths[:, None] + torch.arange(T, device=q.device))[:, None, :, None].expand(B, Hkv, T, Dh)
    room = cache_k.new_zeros(B, Hkv, T, Dh)
    k = torch.cat([cache_k, room], dim=2).scatter(2, slots, k_new)  # [B, H_kv, S + T, Dh] new at lengths + r
    v = torch.cat([cache_v, room], dim=2).scatter(2, slots, v_new)
    out = speculative_attention_op(q, k, v, lengths, pack_mask(new_mask), Dh ** -0.5)  # [B, H, T, Dh]
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, H * Dh))


ATTENTION = {"decomposed": cached_attention, "fused": fused_cached_attention}


class DrafterIngest(nn.Module):
    """``(features [B, T, F] fp32, positions [B, T]) -> (k [L, B, H_kv, T, Dh], v [...], fused [B, T, D])``.

    The feature path (``fc`` over the concatenated target layers, then ``hidden_norm``) runs in fp32 whatever the
    export's dtype: real targets' hidden states spike above 2e4 (Qwen3-8B), and their sum over several layers
    overflows fp16 (TensorRT Edge-LLM keeps this projection in fp32 for the same reason)."""

    input_names = ("features", "positions")
    output_names = ("k", "v", "fused")

    def __init__(self, drafter: DFlashDrafter):
        super().__init__()
        self.drafter = drafter
        self.fc = copy.deepcopy(drafter.fc).float()

    def forward(self, features: torch.Tensor, positions: torch.Tensor):
        dtype = self.drafter.fc.weight.dtype
        fused = self.drafter.hidden_norm(self.fc(features.float())).to(dtype)  # [B, T, D], normed in fp32
        kv = self.drafter.context_kv(features, positions, fused)
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]), fused


PRIOR_INPUTS = ("prior_hidden", "prior_signals", "prior_valid", "prior_shift")


def fuse_prior(drafter: ReTraceDrafter, flavour: str, x, hidden, signals, valid, shift):
    """ReTrace's gated residual from the previous round's rejected suffix into the block's embeddings ``x``."""
    opts = drafter.config.retrace
    w = drafter.fusion_weights()
    lo = 0 if opts.gate_anchor else 1
    if flavour == "fused":
        return retrace_fusion_op(x, hidden, signals, valid, shift, w.ln_weight, w.ln_bias, w.w_in, w.b_in, w.w_go,
                                 w.b_go, lo, int(opts.use_correction), w.ln_eps)
    return retrace_fusion_reference(x, hidden, signals, valid, shift, w, lo, opts.use_correction)


class DrafterDraft(nn.Module):
    """``(block_embeds [B, Q, D], positions [B, Q], new_mask [B, Q, Q], cache_k/v [L, B, H_kv, S, Dh], lengths [B]
    [, prior_hidden [B, Q, Hd], prior_signals [B, Q, C], prior_valid [B, Q], prior_shift [B]])
    -> (hidden [B, Q, D], logits [B, Q, V])``. A ReTrace drafter takes the previous round's retained suffix (the
    prior) and fuses it into the block first; its next prior is built from ``hidden`` and the verify pass."""

    output_names = ("hidden", "logits")

    def __init__(self, drafter: DFlashDrafter, flavour: str = "decomposed"):
        super().__init__()
        self.drafter, self.flavour = drafter, flavour
        self.lm_head = drafter.borrowed[1]
        self.attention = ATTENTION[flavour]
        self.retrace = isinstance(drafter, ReTraceDrafter)
        self.input_names = ("block_embeds", "positions", "new_mask", "cache_k", "cache_v", "lengths") + (
            PRIOR_INPUTS if self.retrace else ())

    def forward(self, block_embeds, positions, new_mask, cache_k, cache_v, lengths, prior_hidden=None,
                prior_signals=None, prior_valid=None, prior_shift=None):
        d = self.drafter
        if self.retrace:
            block_embeds = fuse_prior(d, self.flavour, block_embeds, prior_hidden, prior_signals, prior_valid,
                                      prior_shift)
        cos, sin = rope_cos_sin(positions, d.inv_freq, block_embeds.dtype)
        h = block_embeds
        for i, layer in enumerate(d.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
            h = h + self.attention(layer.self_attn, q, k, v, cache_k[i], cache_v[i], lengths, new_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = d.norm(h)
        return hidden, self.lm_head(hidden)


class TargetVerify(nn.Module):
    """``(tokens [B, T], positions [B, T], new_mask [B, T, T], cache_k/v [L, B, H_kv, S, Dh], lengths [B])
    -> (logits [B, T, V], features [B, T, F] fp32, k [L, B, H_kv, T, Dh], v [...])`` for fixed ``feature_layers``."""

    input_names = ("tokens", "positions", "new_mask", "cache_k", "cache_v", "lengths")
    output_names = ("logits", "features", "k", "v")

    def __init__(self, target: TargetLM, feature_layers: tuple[int, ...], flavour: str = "decomposed"):
        super().__init__()
        self.target, self.feature_layers = target, tuple(feature_layers)
        self.attention = ATTENTION[flavour]

    def forward(self, tokens, positions, new_mask, cache_k, cache_v, lengths):
        t = self.target
        x = t.model.embed_tokens(tokens)  # [B, T, D]
        cos, sin = rope_cos_sin(positions, t.inv_freq, x.dtype)
        feats, ks, vs = {}, [], []
        last = len(t.model.layers) - 1
        for i, layer in enumerate(t.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            ks.append(k)
            vs.append(v)
            x = x + self.attention(layer.self_attn, q, k, v, cache_k[i], cache_v[i], lengths, new_mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.feature_layers:
                feats[i] = t.model.norm(x) if i == last else x
        features = torch.cat([feats[i].float() for i in self.feature_layers], dim=-1) if self.feature_layers else \
            x.new_zeros(*x.shape[:2], 0, dtype=torch.float32)  # fp32: the drafter's feature path (DrafterIngest)
        return t.lm_head(t.model.norm(x)), features, torch.stack(ks), torch.stack(vs)


def example_inputs(kind: str, module: nn.Module, batch: int = 2, new: int = 3, context: int = 5):
    """Example inputs (for tracing and tests) of one graph: ``batch`` rows, ``new`` new tokens, ``context`` slots."""
    if kind == "drafter_ingest":
        d = module.drafter
        F = d.fc.in_features
        return (torch.randn(batch, new, F),
                torch.arange(new)[None, :].repeat(batch, 1) + context)
    g = torch.Generator().manual_seed(0)
    prior = ()
    if kind == "drafter_draft":
        c = module.drafter.config
        L, Hkv, Dh, D, dtype = c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.hidden_size, \
            module.drafter.fc.weight.dtype
        first = torch.randn(batch, new, D, generator=g).to(dtype)
        if module.retrace:
            w = module.drafter.fusion_weights()
            C = w.ln_weight.shape[0]
            Hd = w.w_in.shape[1] - C
            prior = (torch.randn(batch, new, Hd, generator=g).to(dtype), torch.randn(batch, new, C, generator=g).to(
                dtype), torch.rand(batch, new, generator=g) < 0.5, torch.ones(batch, dtype=torch.long))
    else:
        a = module.target.args
        L, Hkv, Dh, dtype = a.num_hidden_layers, a.num_key_value_heads, a.head_dim, module.target.lm_head.weight.dtype
        first = torch.randint(0, a.vocab_size, (batch, new), generator=g)
    lengths = torch.tensor([context - i % 2 for i in range(batch)])
    positions = lengths[:, None] + torch.arange(new)
    mask = torch.ones(new, new, dtype=torch.bool).tril().expand(batch, new, new).contiguous()
    cache = torch.randn(2, L, batch, Hkv, context, Dh, generator=g).to(dtype)
    return (first, positions, mask, cache[0], cache[1], lengths, *prior)


GRAPHS = {"drafter_ingest": DrafterIngest, "drafter_draft": DrafterDraft, "target_verify": TargetVerify}
