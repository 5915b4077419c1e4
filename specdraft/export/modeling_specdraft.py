"""Self-contained transformers modeling code for specdraft's drafter exports (DFlash, arXiv:2602.06036; ReTrace).

Copied next to ``config.json`` by every export, with an ``auto_map``, so that
``AutoModel.from_pretrained(export_dir, trust_remote_code=True)`` builds the drafter without specdraft installed. It
imports only torch and transformers. The drafter owns no embedding and no LM head: callers embed the block with the
target's ``embed_tokens`` and score the returned hidden states with the target's ``lm_head``.

``DFlashDraftModel.forward(noise_embedding, target_hidden, position_ids, attention_mask=None)`` follows the reference
DFlash signature: ``noise_embedding`` ``[B, Q, D]`` embeds the block(s) (anchor + mask tokens), ``target_hidden``
``[B, S, n_feat * D_t]`` holds the target's layer outputs of the committed context, ``position_ids`` ``[B, S + Q]``
are the absolute positions of context then block, ``attention_mask`` ``[B, 1, Q, S + Q]`` (bool, True = visible) or
None (everything visible). Queries come from the block only; keys and values are ``[context ; block]``.
``ReTraceDraftModel`` adds ``fusion_delta``, the gated residual a rejected suffix adds to the next block's inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]  # x [B, H, T, Dh], cos/sin [B, T, Dh]


class DraftAttention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim)

    def forward(self, h, ctx, cos, sin, mask):
        S = ctx.shape[1]
        kv_in = torch.cat([ctx, h], dim=1)  # [B, S + Q, D]: the context enters K/V without the layer's input norm
        q = self.q_norm(self._heads(self.q_proj(h), self.n_heads)).transpose(1, 2)  # [B, H, Q, Dh]
        k = self.k_norm(self._heads(self.k_proj(kv_in), self.n_kv)).transpose(1, 2)  # [B, H_kv, S + Q, Dh]
        v = self._heads(self.v_proj(kv_in), self.n_kv).transpose(1, 2)
        q, k = _rope(q, cos[:, S:], sin[:, S:]), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        B, _, Q, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, h, ctx, cos, sin, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DraftLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash.get("target_layer_ids") or [])
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = getattr(config, "block_size", 16)
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * target_hidden, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise ValueError("this export keeps no draft KV cache: pass the whole context's target_hidden (and its "
                             "positions) on every call")
        ctx = self.hidden_norm(self.fc(target_hidden))  # [B, S, D]
        cos, sin = self.rotary_emb(noise_embedding, position_ids)  # [B, S + Q, Dh]
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, attention_mask)
        return self.norm(h)


class ReTraceDraftModel(DFlashDraftModel):
    """DFlash plus ReTrace's fusion parameters; ``forward`` is the backbone on inputs that may already carry
    :meth:`fusion_delta` (added to ``noise_embedding``)."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        opts = getattr(config, "retrace_config", None) or {}
        D = config.hidden_size
        self.alignment = opts.get("alignment", "hard")
        self.use_correction = opts.get("use_correction", True)
        self.gate_anchor = opts.get("gate_anchor", False)
        width = opts.get("refiner_width") or D
        c_dim = 2 * D + 4
        h_dim = 2 * D if opts.get("embed_drafted", True) else D
        self.retrace_norm_c = nn.LayerNorm(c_dim)
        self.retrace_refiner = nn.Linear(h_dim + c_dim, width)
        self.retrace_gate_out = nn.Linear(width, 2 * D)
        self.retrace_log_width = nn.Parameter(torch.zeros(()))
        self.post_init()

    def fusion_delta(self, hidden: torch.Tensor, signals: torch.Tensor, valid: torch.Tensor,
                     shift: torch.Tensor) -> torch.Tensor:
        """``m * g * W_o u`` per new slot ``[b, Bk, D]`` from the previous block's retained state ``hidden``
        ``[b, Bk, h_dim]``, correction ``signals`` ``[b, Bk, 2D + 4]``, rejected slots ``valid`` ``[b, Bk]`` and
        ``shift = n + 1`` ``[b]`` (old slot ``s`` lands on new slot ``s - shift``)."""
        b, Bk, _ = hidden.shape
        c = signals if self.use_correction else signals.new_zeros(signals.shape)
        u = F.silu(self.retrace_refiner(torch.cat([hidden, self.retrace_norm_c(c)], dim=-1)))  # [b, Bk, W]
        new = torch.arange(Bk, device=hidden.device)
        src = new[None, :] + shift[:, None]  # [b, Bk]
        present = (src < Bk) & valid.gather(1, src.clamp(max=Bk - 1))
        if self.alignment == "hard":
            aligned = u.gather(1, src.clamp(max=Bk - 1)[..., None].expand(-1, -1, u.shape[-1]))
        else:
            offset = (new[None, None, :] - (new[None, :, None] - shift[:, None, None])).float()  # [b, old, new]
            sigma = F.softplus(self.retrace_log_width) + 0.1
            logits = (-(offset ** 2) / (2 * sigma ** 2)).masked_fill(~valid[:, :, None], float("-inf"))
            w = torch.nan_to_num(torch.softmax(logits, dim=1), nan=0.0)
            aligned = torch.einsum("bon,boe->bne", w.to(u.dtype), u)
        if not self.gate_anchor:
            present = present & (new[None, :] > 0)
        gate, out = self.retrace_gate_out(aligned).chunk(2, dim=-1)
        return present[..., None].to(u.dtype) * torch.sigmoid(gate) * out


class VPDraftModel(DFlashDraftModel):
    """D²SD's variable-prefix drafter: DFlash's weights and forward; its ``noise_embedding`` carries the anchor and
    the first ``l`` known tokens before the mask tokens (``vp_config`` records how it was trained)."""
