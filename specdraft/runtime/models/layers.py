"""Building blocks shared by the target forward and the drafters: RMSNorm, RoPE, SwiGLU MLP, attention projections.

q/k/v and gate/up projections are FUSED into one matmul each (as in gpt-fast), while state dicts keep Hugging Face's
Qwen3/Llama names (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``): hooks split the fused weights on
``state_dict()`` and merge the parts on ``load_state_dict()``, so checkpoints load and save unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.kernels.speculative_attention import AttentionPlan, speculative_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fuse_in_state_dict(module: nn.Module, fused: str, parts: list[tuple[str, int]]) -> None:
    """Expose ``module.<fused>`` (an ``nn.Linear`` whose output rows are ``parts`` stacked) under the parts' names."""
    sizes = [n for _, n in parts]

    def split(mod, state_dict, prefix, local_metadata):
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state_dict:
                for (name, _), chunk in zip(parts, state_dict.pop(key).split(sizes, dim=0)):
                    state_dict[f"{prefix}{name}.{kind}"] = chunk

    def merge(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name, _ in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(merge)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        fuse_in_state_dict(self, "gate_up_proj", [("gate_proj", hidden), ("up_proj", hidden)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.hidden, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]``; supports default and Llama-3 (``rope_type: llama3``) scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq.float()
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, 1, T, head_dim]`` for absolute ``positions`` ``[B, T]`` (HF rotate-half layout)."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, T, Dh/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, Dh]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, Dh]`` by per-position angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionProjections(nn.Module):
    """q/k/v/o projections with optional Qwen3 per-head QK-norm."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool, bias: bool,
                 eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_size, self.kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.qkv_proj = nn.Linear(dim, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        fuse_in_state_dict(self, "qkv_proj", [("q_proj", self.q_size), ("k_proj", self.kv_size),
                                              ("v_proj", self.kv_size)])
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated, normed ``q [B, H, T, Dh]`` and ``k, v [B, H_kv, T, Dh]`` from one fused matmul."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self._rotate_q(q, cos, sin), *self._rotate_kv(k, v, cos, sin)

    def attend_cached(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: AttentionPlan) -> torch.Tensor:
        """New queries ``[B, H, T, Dh]`` over a KV cache that already holds their own entries at ``lengths[b] + r``,
        through the speculative-attention launcher (the Triton kernel on CUDA) -> ``[B, T, dim]``."""
        out = speculative_attention(q, k_cache, v_cache, plan.lengths, plan=plan)  # [B, H, T, Dh]
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values only (context features injected into a drafter's K/V never form queries)."""
        w = self.qkv_proj.weight[self.q_size:]
        b = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        k, v = F.linear(x, w, b).split(self.kv_size, dim=-1)
        return self._rotate_kv(k, v, cos, sin)

    def _rotate_q(self, q, cos, sin):
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, Dh]

    def _rotate_kv(self, k, v, cos, sin):
        B, T, _ = k.shape
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), cos, sin), v  # [B, H_kv, T, Dh] each

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool = False) -> torch.Tensor:
        """SDPA with GQA; ``q`` ``[B, H, T, Dh]``, ``k/v`` ``[B, H_kv, S, Dh]`` -> ``[B, T, dim]``."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=self.n_heads != self.n_kv_heads)  # [B, H, T, Dh]
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
