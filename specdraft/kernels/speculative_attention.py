"""Speculative attention: the new tokens of a round (a verify chain, a D²SD tree or a drafter block) attend to their
row's committed KV cache and to each other through a per-row visibility bitmask (causal for a chain, the ancestor mask
for a tree, all-visible for a drafter block). Flash-attention style (online softmax, fp32 accumulation; Dao et al.,
arXiv:2205.14135); one program per (query tile, row, KV head) serves every query head of its GQA group, so a row's
committed context is read once per KV head for all the tree's nodes when they fit one tile (the point of cascade
attention, as in FlashInfer).

Layout (the runtime's :class:`~specdraft.runtime.kv_cache.KVCache`): ``k_cache``/``v_cache`` ``[B, H_kv, S, D]`` hold
row ``b``'s committed entries at slots ``0..lengths[b]-1`` and the new tokens' entries, already written, at slots
``lengths[b] + r`` for ``r < T``. New query ``t`` sees slot ``j`` iff ``j < lengths[b]`` or ``j = lengths[b] + r``
with bit ``r`` of ``new_mask[b, t]``. A query that sees nothing returns zeros.
"""

from __future__ import annotations

import os

import torch

from specdraft.kernels.dispatch import GPUTarget, tl, triton, wants_triton

# ---- the bitmask ------------------------------------------------------------------------------------------------


_POW2 = {torch.device("cpu"): torch.tensor([1 << i for i in range(32)], dtype=torch.int64)}
"""Bit weights per device (products, not shifts, so the packing exports to ONNX ops TensorRT's parser takes: it has
no BitShift). A device's copy is made on its first use, outside any CUDA graph capture (warm-ups run first)."""


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _POW2:
        _POW2[device] = _POW2[torch.device("cpu")].to(device)
    return _POW2[device]


def pack_mask(new_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]`` bool -> ``[B, T, W]`` int32 words, bit ``r % 32`` of word ``r // 32`` (``W = ceil(T / 32)``)."""
    B, T, _ = new_mask.shape
    W = (T + 31) // 32
    padded = torch.nn.functional.pad(new_mask.to(torch.int64), (0, 32 * W - T)).view(B, T, W, 32)
    words = (padded * _bit_weights(new_mask.device)).sum(-1)  # [B, T, W] in 0..2^32-1
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_mask(bits: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: ``[B, T, W]`` int32 -> ``[B, T, T]`` bool."""
    r = torch.arange(T, device=bits.device)
    return ((bits.to(torch.int64)[..., r // 32] >> (r % 32)) & 1).bool()


# ---- reference ----------------------------------------------------------------------------------------------------


def dense_visibility(lengths: torch.Tensor, mask_bits: torch.Tensor, T: int) -> torch.Tensor:
    """The reference's dense mask ``[B, T, max(lengths) + T]``: committed slots, then the new tokens' bits."""
    B = lengths.shape[0]
    used = int(lengths.max()) + T
    new_mask = unpack_mask(mask_bits, T)  # [B, T, T]
    rel = torch.arange(used, device=lengths.device)[None, :] - lengths[:, None]  # [B, used]
    idx = rel.clamp(0, T - 1)[:, None, :].expand(B, T, used)  # [B, T, used]
    return (rel < 0)[:, None, :] | (new_mask.gather(2, idx) & ((rel >= 0) & (rel < T))[:, None, :])


def speculative_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    lengths: torch.Tensor, mask_bits: torch.Tensor, scale: float,
                                    plan: "AttentionPlan | None" = None) -> torch.Tensor:
    """Eager PyTorch: a dense ``[B, T, S]`` mask and ``scaled_dot_product_attention`` (fp32 math, output in
    ``q.dtype``). Same arguments as the kernel (``plan`` shares the dense mask between layers); returns
    ``[B, H, T, D]``."""
    B, H, T, D = q.shape
    if T == 0:
        return q.new_zeros(B, H, 0, D)
    plan = plan if plan is not None else AttentionPlan(lengths, mask_bits, T)
    visible = plan.visible()  # [B, T, used]
    used = visible.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k_cache[:, :, :used].float(), v_cache[:, :, :used].float(),
        attn_mask=None if plan.everything_visible() else visible[:, None], scale=scale,
        enable_gqa=H != k_cache.shape[1])  # [B, H, T, D]
    seen = plan.seen()  # [B, T] a query that sees nothing returns zeros (SDPA would give NaN)
    if seen is not None:
        out = torch.where(seen[:, None, :, None], out, 0.0)
    return out.to(q.dtype)


# ---- kernel -------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _online_update(s, v, m_i, l_i, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])  # [M, N] (0 where masked)
        alpha = tl.exp(m_i - m_safe)  # [M] (0 while nothing was seen)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _attend(Q, K, V, Out, Lens, Bits, T, W, Hkv, scale,
                sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
                G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // Hkv
        kvh = pid_bh % Hkv
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] over the group's G * T (head, token) pairs
        row_ok = rows < G * T
        t = rows % T
        h = kvh * G + rows // T
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + b * sqb + h[:, None] * sqh + t[:, None] * sqt + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, Dp]
        if UPCAST:
            q = q.to(tl.float32)
        length = tl.load(Lens + b).to(tl.int32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * skb + kvh * skh
        v_base = V + b * svb + kvh * svh
        for start in range(0, length, BLOCK_N):  # the committed context: read once for the whole tile
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < length
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)  # [N, Dp]
            v = tl.load(v_base + n[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
            s = tl.where(n_ok[None, :] & row_ok[:, None], s, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, PRECISION, UPCAST)
        for start in range(0, T, BLOCK_N):  # the new tokens, through the bitmask
            r = start + tl.arange(0, BLOCK_N)
            r_ok = r < T
            kv_mask = r_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + (length + r)[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + (length + r)[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
            word = tl.load(Bits + b * T * W + t[:, None] * W + (r // 32)[None, :],
                           mask=row_ok[:, None] & r_ok[None, :], other=0)  # [M, N]
            seen = ((word >> (r % 32)[None, :]) & 1) != 0
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(seen & r_ok[None, :] & row_ok[:, None], s, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, PRECISION, UPCAST)
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(Out + b * sob + h[:, None] * soh + t[:, None] * sot + d[None, :], out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


    @triton.jit
    def _speculative_attention_kernel(Q, K, V, Out, Lens, Bits, T, W, Hkv, scale,
                                      sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
                                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                                      UPCAST: tl.constexpr):
        _attend(Q, K, V, Out, Lens, Bits, T, W, Hkv, scale, sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh,
                sot, G, D, BLOCK_D, BLOCK_M, BLOCK_N, PRECISION, UPCAST)

    @triton.jit
    def _speculative_attention_aot_kernel(Q, K, V, Lens, Bits, T, W, Hkv, S, Out,
                                          SCALE: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                          BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                          PRECISION: tl.constexpr):
        """Entry point for ahead-of-time compilation (a TensorRT plugin): TensorRT's argument order (inputs, int32
        scalars, outputs), contiguous tensors, strides from the shapes (int64), the scale a compile-time constant."""
        t, s, w = T.to(tl.int64), S.to(tl.int64), Hkv.to(tl.int64)
        h = w * G
        _attend(Q, K, V, Out, Lens, Bits, T, W, Hkv, SCALE, h * t * D, t * D, D, w * s * D, s * D, D,
                w * s * D, s * D, D, h * t * D, t * D, D, G, D, BLOCK_D, BLOCK_M, BLOCK_N, PRECISION, False)


def speculative_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 lengths: torch.Tensor, mask_bits: torch.Tensor, scale: float,
                                 block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """The Triton kernel (same contract as :func:`speculative_attention_reference`)."""
    B, H, T, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    q = q.contiguous()
    G = H // Hkv
    # Triton's interpreter computes tl.dot of bf16 operands wrongly (garbage, checked with triton 3.7.1): there the
    # operands go to fp32 first; compiled kernels keep bf16 tensor-core dots
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    block_m = max(16, min(block_m, triton.next_power_of_2(G * T)))
    grid = (triton.cdiv(G * T, block_m), B * Hkv)
    _speculative_attention_kernel[grid](
        q, k_cache, v_cache, out, lengths.to(torch.int32).contiguous(), mask_bits.contiguous(), T,
        mask_bits.shape[-1], Hkv, scale, *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *out.stride()[:3], G=G, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        UPCAST=interpreted and q.dtype == torch.bfloat16)
    return out


AOT_BLOCK_M, AOT_BLOCK_N = 64, 64


def compile_aot(dtype: str, head_dim: int, group: int, scale: float, arch: int = 90, block_m: int = AOT_BLOCK_M,
                block_n: int = AOT_BLOCK_N):
    """Compile the kernel ahead of time for a TensorRT plugin: returns Triton's compiled kernel (``.asm["ptx"]``,
    ``.metadata.name``, ``.metadata.num_warps``, ``.metadata.shared``). ``dtype`` is ``fp16``, ``bf16`` or ``fp32``;
    ``arch`` the SM version (90 = Hopper). Launch with grid ``(cdiv(group * T, block_m), B * H_kv)``."""
    ptr = f"*{dtype}"
    signature = {"Q": ptr, "K": ptr, "V": ptr, "Lens": "*i64", "Bits": "*i32", "T": "i32", "W": "i32", "Hkv": "i32",
                 "S": "i32", "Out": ptr, "SCALE": "constexpr", "G": "constexpr", "D": "constexpr",
                 "BLOCK_D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "PRECISION": "constexpr"}
    constexprs = {"SCALE": float(scale), "G": group, "D": head_dim,
                  "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    src = triton.compiler.ASTSource(fn=_speculative_attention_aot_kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32))


# ---- launcher -----------------------------------------------------------------------------------------------------


class AttentionPlan:
    """What every layer of one forward shares: the per-row lengths, the packed bitmask and (built on first use by
    the reference) the dense mask. Build it once per forward with :func:`plan_attention`."""

    def __init__(self, lengths: torch.Tensor, bits: torch.Tensor, T: int):
        self.lengths, self.bits, self.T = lengths, bits, T
        self._visible: torch.Tensor | None = None
        self._facts: tuple[bool, torch.Tensor | None] | None = None

    def visible(self) -> torch.Tensor:
        """The dense mask ``[B, T, max(lengths) + T]``."""
        if self._visible is None:
            self._visible = dense_visibility(self.lengths, self.bits, self.T)
        return self._visible

    def _read_facts(self) -> tuple[bool, torch.Tensor | None]:
        if self._facts is None:  # one host read per forward, not per layer
            visible = self.visible()
            seen = visible.any(-1)  # [B, T]
            self._facts = (bool(visible.all()), None if bool(seen.all()) else seen)
        return self._facts

    def everything_visible(self) -> bool:
        """Every query sees every slot of the dense mask (equal lengths, all-visible new tokens): no mask needed."""
        return self._read_facts()[0]

    def seen(self) -> torch.Tensor | None:
        """``[B, T]`` whether each query sees any slot, or None when all do."""
        return self._read_facts()[1]


def plan_attention(lengths: torch.Tensor, new_mask: torch.Tensor) -> AttentionPlan:
    """Check and pack ``new_mask`` (``[B, T, T]`` or ``[T, T]`` bool) for rows of committed ``lengths`` ``[B]``."""
    B = lengths.shape[0]
    T = new_mask.shape[-1]
    if new_mask.dim() == 2:
        new_mask = new_mask.expand(B, T, T)
    if new_mask.shape != (B, T, T) or new_mask.dtype != torch.bool:
        raise ValueError(f"new_mask must be bool [B, T, T] = [{B}, {T}, {T}], got {new_mask.dtype} "
                         f"{tuple(new_mask.shape)}")
    return AttentionPlan(lengths, pack_mask(new_mask), T)


def speculative_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                          new_mask: torch.Tensor | None = None, scale: float | None = None,
                          plan: AttentionPlan | None = None) -> torch.Tensor:
    """Attention of ``T`` new queries per row over the committed cache and the new tokens (see the module doc).

    Args:
        q: ``[B, H, T, D]`` queries (post norm and RoPE).
        k_cache, v_cache: ``[B, H_kv, S, D]`` cache buffers with the new entries written at ``lengths[b] + r``;
            ``H % H_kv == 0``; the last dimension contiguous.
        lengths: ``[B]`` committed lengths (before the new entries).
        new_mask: ``[B, T, T]`` (or ``[T, T]``) bool visibility among the new tokens.
        scale: softmax scale (default ``D ** -0.5``).
        plan: :func:`plan_attention` of ``(lengths, new_mask)``, shared by the layers of one forward (then
            ``lengths`` and ``new_mask`` are read from it).
    Returns:
        ``[B, H, T, D]`` in ``q.dtype``; the Triton kernel on CUDA (or when forced), the reference otherwise.
    """
    B, H, T, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[-1] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit queries "
                         f"{tuple(q.shape)}")
    if H % k_cache.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {k_cache.shape[1]} KV heads")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the cache's last dimension must be contiguous")
    plan = plan if plan is not None else plan_attention(lengths, new_mask)
    if plan.T != T or plan.lengths.shape[0] != B:
        raise ValueError(f"the attention plan is for {plan.lengths.shape[0]} rows of {plan.T} new tokens, the queries "
                         f"are {B} x {T}")
    scale = D ** -0.5 if scale is None else scale
    if wants_triton(q, k_cache, v_cache):
        return speculative_attention_triton(q, k_cache, v_cache, plan.lengths, plan.bits, scale)
    return speculative_attention_reference(q, k_cache, v_cache, plan.lengths, plan.bits, scale, plan)


__all__ = ["pack_mask", "speculative_attention", "speculative_attention_reference", "speculative_attention_triton",
           "unpack_mask"]
