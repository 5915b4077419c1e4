"""Lean Qwen3 / Llama forward used both for serving (verification) and for training (target features).

One forward takes tokens, absolute positions, an optional static KV cache with per-row lengths and an optional
visibility mask among the new tokens (causal by default; a tree mask verifies a prefix tree in one pass). It returns
logits (all positions or selected ones) and the hidden states of chosen layers. Feature convention (DFlash, as the
reference code reads transformers' ``output_hidden_states``): layer id ``l`` means ``hidden_states[l + 1]``, the
OUTPUT of decoder layer ``l``, except for the last layer, whose ``hidden_states[N]`` transformers returns after the
final norm.

Sliding-window attention is not implemented: a checkpoint whose ``layer_types`` hold ``sliding_attention`` layers is
refused rather than run with full attention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from specdraft.kernels.speculative_attention import plan_attention
from specdraft.runtime.kv_cache import KVCache, cached_attention_mask
from specdraft.runtime.models.layers import AttentionProjections, RMSNorm, SwiGLU, rope_cos_sin, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2")


@dataclass(frozen=True)
class TargetArgs:
    """Architecture of a target LM, read from its HF ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int | None = None
    """The context the target was trained for (None: not stated)."""

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "TargetArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported target model_type {model_type!r} "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        types = cfg.get("layer_types")
        if types is None and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            types = ["sliding_attention"] * cfg["num_hidden_layers"]  # an older config without layer_types
        sliding = [i for i, t in enumerate(types or []) if t != "full_attention"]
        if sliding and cfg.get("use_sliding_window", True):
            raise ValueError(f"layers {sliding[:8]} use {types[sliding[0]]!r}: sliding-window attention is not "
                             "implemented, and running those layers with full attention would change the target's "
                             "outputs")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
        )


class TargetOutput(NamedTuple):
    logits: torch.Tensor  # [B, T or P, V] (empty when return_logits=False)
    features: torch.Tensor | tuple[torch.Tensor, ...] | None  # [B, T, n_layers * D] (the requested layers'
    # outputs, concatenated), or one [B, T, D] per layer with concat_features=False
    hidden: torch.Tensor | None = None  # [B, T, D] final-normed hidden states (when return_logits=False)


class DecoderLayer(nn.Module):
    def __init__(self, a: TargetArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = AttentionProjections(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                              a.head_dim, a.qk_norm, a.attention_bias, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = SwiGLU(a.hidden_size, a.intermediate_size)

    def forward(self, x, cos, sin, layer_idx: int, cache: KVCache | None, slots, used: int, mask, plan=None):
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
        if cache is not None:
            cache.write(layer_idx, k, v, slots)
            if plan is not None:  # the speculative-attention launcher reads the cache buffers directly
                x = x + self.self_attn.attend_cached(q, cache.k[layer_idx], cache.v[layer_idx], plan)
            else:  # a dense mask (training's visible_prefix)
                k, v = cache.view(layer_idx, used)
                x = x + self.self_attn.attend(q, k, v, mask)
        else:
            x = x + self.self_attn.attend(q, k, v, mask, is_causal=mask is None)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, a: TargetArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class TargetLM(nn.Module):
    """Qwen3/Llama causal LM with HF parameter names (``model.*``, ``lm_head``)."""

    def __init__(self, args: TargetArgs):
        super().__init__()
        self.args = args
        self.model = _Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # fp32 RoPE frequencies, kept out of the state dict and out of ``.to(dtype)`` casts.
        self.inv_freq = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.args.num_hidden_layers, batch_size, self.args.num_key_value_heads, max_len,
                       self.args.head_dim, p.dtype, p.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, positions: torch.Tensor | None = None,
                new_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                logits_at: torch.Tensor | None = None, return_logits: bool = True,
                visible_prefix: torch.Tensor | None = None, concat_features: bool = True) -> TargetOutput:
        """Run the target on new tokens.

        Args:
            tokens: ``[B, T]`` new token ids.
            cache: per-row KV cache; new K/V are written at ``cache.lengths[b] + t`` (the caller commits by
                updating ``cache.lengths``). ``None`` runs a plain causal pass over ``tokens``.
            positions: ``[B, T]`` absolute positions (default ``lengths[b] + t``; a tree passes ``len + depth``).
            new_mask: ``[B, T, T]`` bool visibility among new tokens (default causal).
            feature_layers: decoder layer ids whose outputs are returned, concatenated, in this order.
            logits_at: ``[B, P]`` positions (within ``tokens``) whose logits are computed; default all.
            return_logits: False skips the LM head and returns the final-normed hidden states instead (training
                computes logits only where it needs them: a 150k-vocabulary ``[B, T, V]`` would not fit).
            visible_prefix: ``[B, T]`` cached entries each new token may see (default all committed ones).
            concat_features: False returns the feature layers' outputs as they are, one ``[B, T, D]`` each in
                ``feature_layers`` order (a caller keeping a few rows or tokens of them copies only those).
        """
        if visible_prefix is not None and cache is None:
            raise ValueError("visible_prefix limits what new tokens see of a KV cache: pass the cache too")
        B, T = tokens.shape
        dev = tokens.device
        offsets = cache.lengths if cache is not None else torch.zeros(B, dtype=torch.long, device=dev)
        if positions is None:
            positions = offsets[:, None] + torch.arange(T, device=dev)  # [B, T]
        x = self.model.embed_tokens(tokens)  # [B, T, D]
        if self.inv_freq.device != dev:
            self.inv_freq = self.inv_freq.to(dev)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        slots, used, mask, plan = None, 0, None, None
        if cache is not None:
            if not cache.fixed_shape:
                cache.check_room(T)
            slots = offsets[:, None] + torch.arange(T, device=dev)  # [B, T]
            if new_mask is None:
                new_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            if visible_prefix is not None:
                used = int(offsets.max()) + T
                mask = cached_attention_mask(offsets, used, new_mask, visible_prefix)
            else:
                plan = plan_attention(offsets, new_mask)  # shared by every layer
        elif new_mask is not None:
            mask = new_mask[:, None] if new_mask.dim() == 3 else new_mask
        outputs: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, cache, slots, used, mask, plan)
            if i in feature_layers:
                outputs[i] = self.model.norm(x) if i == last else x  # transformers' hidden_states[N] is normed
        features = tuple(outputs[i] for i in feature_layers) if feature_layers else None
        if features is not None and concat_features:
            features = torch.cat(features, dim=-1)
        if not return_logits:
            return TargetOutput(logits=torch.empty(0, device=dev), features=features, hidden=self.model.norm(x))
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))  # [B, P, D]
        return TargetOutput(logits=self.lm_head(self.model.norm(x)), features=features)


def read_hf_config(path: str | Path) -> dict:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in target path {path}")
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("text_config", cfg) if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES else cfg
