"""DFlash block-diffusion drafter (Chen, Liang, Liu, "DFlash", arXiv:2602.06036, §4.1 and A.3).

A block ``[anchor, MASK x K]`` (``K = Bk - 1`` draft slots) is denoised in ONE forward pass. Target hidden states of the
committed context (outputs of ``target_layer_ids``) are fused once, ``H_t = hidden_norm(fc([H_l1; ...; H_ln]))``, and
injected into the K/V of every draft layer (KV injection): queries come from the block only, keys/values are ``[ctx ;
block]``, attention is non-causal over the block, positions are absolute. The drafter owns no embedding and no LM head:
it borrows the (frozen) target's. Weight names and ``config.json`` keys follow z-lab/dflash so checkpoints move both
ways."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specdraft.kernels.speculative_attention import plan_attention
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.models.layers import AttentionProjections, RMSNorm, SwiGLU, rope_cos_sin, rope_inv_freq
from specdraft.runtime.models.registry import register_drafter


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter: uniform from layer 1 to ``N - 3`` (z-lab convention)."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = max(num_target_layers - 4, 0)
    return [int(round(1 + i * span / (num_features - 1))) for i in range(num_features)]


@dataclass
class DFlashConfig:
    """Drafter architecture; serialised as a z-lab style HF ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    target_hidden_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    target_model_type: str = ""
    """The target's architecture (qwen3, llama, ...); ``model_type`` names the drafter's own layers (Qwen3-style,
    as z-lab's DFlash drafters, whatever the target)."""
    extra: dict = field(default_factory=dict)

    def to_hf_config(self) -> dict:
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,  # transformers 5
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,  # transformers 4.x (vLLM, SGLang)
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            **({"target_model_type": self.target_model_type} if self.target_model_type else {}),
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "torch_dtype": "float32",
            **self.extra,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DFlashConfig":
        dcfg = cfg.get("dflash_config") or {}
        heads = cfg["num_attention_heads"]
        n_layers = cfg["num_hidden_layers"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 1e6))
        ids = dcfg.get("target_layer_ids") or build_target_layer_ids(cfg["num_target_layers"], n_layers)
        mask_id = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_id is None:
            raise ValueError("drafter config has no dflash_config.mask_token_id")
        known = {f for f in cls.__dataclass_fields__} | {
            "architectures", "model_type", "rope_parameters", "attention_bias", "tie_word_embeddings",
            "layer_types", "dflash_config", "torch_dtype", "dtype"}
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            num_target_layers=cfg["num_target_layers"],
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            target_layer_ids=list(ids), mask_token_id=int(mask_id), block_size=cfg.get("block_size", 16),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            target_model_type=cfg.get("target_model_type", ""),
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def as_dict(self) -> dict:
        return asdict(self)


class DraftLayer(nn.Module):
    """Qwen3 pre-norm decoder layer whose K/V take the fused target context in front of the block."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = AttentionProjections(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                              c.head_dim, qk_norm=True, bias=False, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        q, k, v = self.self_attn.qkv(self.input_layernorm(h), cos, sin)  # [B, H, Q, Dh], [B, Hkv, Q, Dh] x2
        k = torch.cat([ctx_k, k], dim=2)  # [B, Hkv, S + Q, Dh]
        v = torch.cat([ctx_v, v], dim=2)
        h = h + self.self_attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(self, h, cos, sin, cache: KVCache, layer_idx: int, slots, plan):
        """Inference: the block's K/V are written into the context cache's scratch at ``slots`` (never committed:
        :meth:`DFlashDrafter.ingest` overwrites them) and the block attends through the speculative-attention
        launcher."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(h), cos, sin)  # [B, H, Q, Dh], [B, Hkv, Q, Dh] x2
        cache.write(layer_idx, k, v, slots)
        h = h + self.self_attn.attend_cached(q, cache.k[layer_idx], cache.v[layer_idx], plan)
        return h + self.mlp(self.post_attention_layernorm(h))


@register_drafter("dflash", hf_names=("DFlashDraftModel",))
class DFlashDrafter(nn.Module):
    """The DFlash drafter. Call :meth:`bind_target` before use (it borrows the target's embedding and LM head)."""

    config_class = DFlashConfig
    options_class = None
    """The dataclass of this architecture's own options (``drafter.<arch>`` in the pipeline), or None."""
    wants_verify_context = False
    """Whether :meth:`next_round_state` reads the fused context of the verify pass's rejected slots too."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        n_feat = len(config.target_layer_ids)
        self.fc = nn.Linear(n_feat * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self._borrowed: tuple[nn.Module, nn.Module] | None = None

    @classmethod
    def config_from_backbone(cls, backbone: DFlashConfig, options=None) -> DFlashConfig:
        """This architecture's config on a DFlash backbone (DFlash itself takes no options)."""
        return backbone

    # ---- borrowed target parts -------------------------------------------------------------------------
    @property
    def borrowed(self) -> tuple[nn.Module, nn.Module]:
        """The bound target's ``(embed_tokens, lm_head)``."""
        if self._borrowed is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target(embed_tokens, lm_head)")
        return self._borrowed

    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "DFlashDrafter":
        """Borrow the target's embedding and LM head (not registered: never saved, never trained here)."""
        self._borrowed = (embed_tokens, lm_head)
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._borrowed is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target(embed_tokens, lm_head)")
        return self._borrowed[0](tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._borrowed is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target(embed_tokens, lm_head)")
        # flattened to 2-D: a strided block slice ``hidden[:, 1:]`` would otherwise go through a slow batched matmul
        flat = self._borrowed[1](hidden.reshape(-1, hidden.shape[-1]))  # [B * Q, V]
        return flat.view(*hidden.shape[:-1], flat.shape[-1])  # [B, Q, V]

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=std / math.sqrt(2 * len(self.layers)) if name.endswith("o_proj.weight")
                                or name.endswith("down_proj.weight") else std)
            else:
                nn.init.ones_(p)

    # ---- core -------------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def fuse_context(self, ctx_features: torch.Tensor) -> torch.Tensor:
        """``H_t = hidden_norm(fc([H_l1; ...; H_ln]))``: ``[B, T, n_feat * D_t] -> [B, T, D]``."""
        return self.hidden_norm(self.fc(ctx_features))

    def context_kv(self, ctx_features: torch.Tensor, ctx_positions: torch.Tensor, fused: torch.Tensor | None = None):
        """Per-layer context K/V from target features.

        Args:
            ctx_features: ``[B, T, n_feat * D_t]`` target layer outputs of committed tokens.
            ctx_positions: ``[B, T]`` their absolute positions.
            fused: ``fuse_context(ctx_features)`` when the caller already has it.
        Returns:
            list over layers of ``(k, v)``, each ``[B, H_kv, T, Dh]`` (post k_norm, post RoPE).
        """
        c = self.fuse_context(ctx_features) if fused is None else fused  # [B, T, D]
        cos, sin = self._rope(ctx_positions, c.dtype)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, ctx_kv, mask) -> torch.Tensor:
        """Denoise blocks in one pass.

        Args:
            block_embeds: ``[B, Q, D]`` embeddings of the block tokens (anchor + MASKs; several blocks may be
                concatenated along Q for training). ReTrace-style fusion edits these before the call.
            block_positions: ``[B, Q]`` absolute positions.
            ctx_kv: per-layer ``(k, v)`` of the context, ``[B, H_kv, S, Dh]``.
            mask: ``[B, 1, Q, S + Q]`` bool visibility (``None`` = everything visible).
        Returns:
            ``[B, Q, D]`` final-normed hidden states (feed :meth:`logits`).
        """
        cos, sin = self._rope(block_positions, block_embeds.dtype)
        h = block_embeds
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, ck, cv, mask)
        return self.norm(h)

    # ---- engine hooks (cross-round state; DFlash keeps none, ReTrace carries the rejected suffix) ----------
    def block_embeds(self, block_tokens: torch.Tensor, state=None) -> torch.Tensor:
        """Input embeddings of a block ``[b, Bk] -> [b, Bk, D]`` given the cross-round state."""
        return self.embed(block_tokens)

    def next_round_state(self, state, hidden, draft_tokens, num_accepted, target_logits, target_context):
        """State carried into the next round from this round's draft and verify outputs (no extra forward);
        ``target_context`` ``[b, Bk, D]`` is what :meth:`ingest` returned for the verify pass's features."""
        return None

    # ---- inference with a context-only cache -----------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        p = self.fc.weight
        c = self.config
        return KVCache(c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim, p.dtype, p.device)

    def ingest(self, cache: KVCache, ctx_features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first ``counts[b]`` rows of ``ctx_features`` ``[B, T, F]`` to each row's context cache.

        Only the first ``max(counts)`` rows are projected to K/V (after a verify pass that is the longest accepted
        prefix, usually a few of the ``Bk`` rows; a fixed-shape cache projects all ``T``, reading nothing on the
        host). Returns the fused context ``[B, T', D]``: all ``T`` rows when the drafter keeps cross-round state from
        the rejected slots (:attr:`wants_verify_context`), else ``T'``.
        """
        B, T, _ = ctx_features.shape
        if cache.fixed_shape:
            T_kv = T
        else:
            cache.check_room(T)
            T_kv = min(T, int(counts.max()))
            if not self.wants_verify_context and B > 1 and 2 * int(counts.sum()) < B * T_kv:  # mostly padding
                return self.ingest_packed(cache, ctx_features[:, :T_kv], counts)
        fused = self.fuse_context(ctx_features if self.wants_verify_context else ctx_features[:, :T_kv])  # [B, T', D]
        slots = cache.lengths[:, None] + torch.arange(T_kv, device=ctx_features.device)  # [B, T_kv]
        for i, (k, v) in enumerate(self.context_kv(ctx_features[:, :T_kv], slots, fused[:, :T_kv])):
            cache.write(i, k, v, slots)
        cache.commit(counts)
        return fused

    def ingest_packed(self, cache: KVCache, ctx_features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`ingest` projecting only real tokens, packed into one sequence (a backlog flush, where padding would
        be most of the work). Returns the fused context ``[B, T, D]`` (zeros past a row's count)."""
        B, T, _ = ctx_features.shape
        cache.check_room(T)  # a clear error, not an index out of range, when a backlog outgrows the cache
        real = torch.arange(T, device=counts.device) < counts[:, None]  # [B, T]
        i, cols = real.nonzero(as_tuple=True)  # [N], [N] row-major: each row's tokens in order
        slots = cache.lengths[i] + cols  # [N]
        packed = self.fuse_context(ctx_features[i, cols][None])  # [1, N, D]
        for layer, (k, v) in enumerate(self.context_kv(None, slots[None], packed)):  # [1, H_kv, N, Dh] each
            cache.write_packed(layer, k[0], v[0], i, slots)
        cache.commit(counts)
        fused = packed.new_zeros(B, T, packed.shape[-1])  # [B, T, D]
        fused[i, cols] = packed[0]
        return fused

    def forward_cached(self, cache: KVCache, block_embeds: torch.Tensor, positions: torch.Tensor,
                       new_mask: torch.Tensor) -> torch.Tensor:
        """Denoise ``Q`` new tokens per row against the row's cached context (inference).

        Args:
            cache: the context cache; the new tokens' K/V go to its scratch slots ``lengths[b] + r`` (lengths are
                not changed).
            block_embeds: ``[B, Q, D]``.
            positions: ``[B, Q]`` absolute positions.
            new_mask: ``[Q, Q]`` (or ``[B, Q, Q]``) bool visibility among the new tokens.
        Returns:
            ``[B, Q, D]`` final-normed hidden states.
        """
        Q = block_embeds.shape[1]
        if not cache.fixed_shape:
            cache.check_room(Q)
        slots = cache.lengths[:, None] + torch.arange(Q, device=block_embeds.device)  # [B, Q]
        plan = plan_attention(cache.lengths, new_mask)  # shared by every layer
        cos, sin = self._rope(positions, block_embeds.dtype)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer.forward_cached(h, cos, sin, cache, i, slots, plan)
        return self.norm(h)

    def draft_hidden(self, cache: KVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[B, Bk, D]`` of one block per row, anchored right after each row's cached context (the
        block is all-visible to itself)."""
        B, Bk, _ = block_embeds.shape
        dev = block_embeds.device
        positions = cache.lengths[:, None] + torch.arange(Bk, device=dev)  # [B, Bk]
        return self.forward_cached(cache, block_embeds, positions, torch.ones(Bk, Bk, dtype=torch.bool, device=dev))

    def draft_branches(self, cache: KVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[b, J, Bk, D]`` of ``J`` blocks per row in one pass, each anchored right after the row's
        context and blind to the others (D²SD's batched second draft: the context K/V are read once per row, as
        training lays several blocks side by side)."""
        b, J, Bk, D = block_embeds.shape
        dev = block_embeds.device
        positions = (cache.lengths[:, None] + torch.arange(Bk, device=dev)).repeat(1, J)  # [b, J * Bk]
        block_id = torch.arange(J, device=dev).repeat_interleave(Bk)  # [J * Bk]
        same_block = block_id[:, None] == block_id[None, :]  # [J * Bk, J * Bk] block-diagonal
        return self.forward_cached(cache, block_embeds.reshape(b, J * Bk, D), positions, same_block).view(b, J, Bk, -1)
