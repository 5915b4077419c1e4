"""ReTrace fusion: the rejected suffix of the previous round, aligned by the hard shift, refined and gated into the
next block's input embeddings, ``x_s + m_s * sigmoid(W_g u_s + b_g) * (W_o u_s + b_o)`` with
``u_s = SiLU(W_in [h_src; LN(c_src)] + b_in)`` and ``src = s + shift`` (``m_s``: a retained slot lands on ``s``).
The model and its options are in :mod:`specdraft.runtime.models.retrace`.

Two Triton kernels, each a GEMM with the rest fused into its prologue or epilogue:

- ``refine``: the alignment gather (rows are read from the retained state at ``src``, never copied), the
  LayerNorm of the correction signals (two passes over the row's signals, fp32 statistics), the concatenation
  (two K loops into one accumulator), the refiner GEMM, bias and SiLU -> ``u [rows, W]``;
- ``gate_out``: both halves of ``[W_g; W_o] u`` in one pass over ``u``, then bias, sigmoid gate, landing mask and the
  residual add into the block's embeddings.

Why not one kernel: the second GEMM needs the whole ``u`` row (``W`` wide) of every slot before any output column,
so one kernel would keep ``W`` fp32 accumulators per row on chip or recompute ``u`` per output tile. The split
writes and re-reads ``u`` once (``rows * W`` elements), against ``(h + c) * W + 2 * W * E`` weight elements both
kernels must stream anyway; ``benchmarks/kernels.py`` reports that share and the time of both paths.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdraft.kernels.dispatch import tl, triton, wants_triton


class FusionWeights(NamedTuple):
    """The fusion's parameters (``nn.Linear`` layouts: ``[out, in]``)."""

    ln_weight: torch.Tensor  # [C] LayerNorm of the correction signals
    ln_bias: torch.Tensor  # [C]
    ln_eps: float
    w_in: torch.Tensor  # [W, Hd + C] refiner
    b_in: torch.Tensor  # [W]
    w_go: torch.Tensor  # [2E, W] gate rows then output rows
    b_go: torch.Tensor  # [2E]


# ---- reference ----------------------------------------------------------------------------------------------------


def landing(valid: torch.Tensor, shift: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For new slots ``lo..Bk-1``: the old slot landing on each (clamped into the block) and whether a retained slot
    is there, ``[b, Bk - lo]`` each."""
    Bk = valid.shape[1]
    src = torch.arange(lo, Bk, device=valid.device)[None, :] + shift[:, None]  # [b, n]
    present = (src < Bk) & valid.gather(1, src.clamp(max=Bk - 1))
    return src.clamp(max=Bk - 1), present


def retrace_fusion_reference(x: torch.Tensor, hidden: torch.Tensor, signals: torch.Tensor, valid: torch.Tensor,
                             shift: torch.Tensor, weights: FusionWeights, lo: int = 1,
                             use_correction: bool = True) -> torch.Tensor:
    """Eager PyTorch (same arguments as :func:`retrace_fusion`)."""
    b, Bk, E = x.shape
    src, present = landing(valid, shift, lo)  # [b, n] each

    def take(t):  # [b, Bk, C] -> [b, n, C]
        return t.gather(1, src[..., None].expand(-1, -1, t.shape[-1]))

    h = take(hidden)  # [b, n, Hd]
    C = weights.ln_weight.shape[0]
    c = take(signals) if use_correction else h.new_zeros(b, src.shape[1], C)  # [b, n, C]
    c = F.layer_norm(c, (C,), weights.ln_weight, weights.ln_bias, weights.ln_eps)
    u = F.silu(F.linear(torch.cat([h, c], dim=-1), weights.w_in, weights.b_in))  # [b, n, W]
    gate, out = F.linear(u, weights.w_go, weights.b_go).chunk(2, dim=-1)  # [b, n, E] each
    delta = present[..., None].to(u.dtype) * torch.sigmoid(gate) * out  # [b, n, E]
    return x + F.pad(delta, (0, 0, lo, 0)).to(x.dtype)


# ---- kernels ------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _slots(pid_m, Shift, M, n_new, lo, Bk, BLOCK_M: tl.constexpr):
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] over (row, new slot) pairs
        m_ok = m < M
        row = m // n_new
        slot = lo + m % n_new
        src = slot + tl.load(Shift + row, mask=m_ok, other=0).to(tl.int32)
        return m, m_ok, row, slot, src

    @triton.jit
    def _refine_kernel(Hid, Sig, Shift, LnW, LnB, Win, Bin, U, M, n_new, lo, Bk, Hd, C, W, eps,
                       USE_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m, m_ok, row, slot, src = _slots(pid_m, Shift, M, n_new, lo, Bk, BLOCK_M)
        src = tl.minimum(src, Bk - 1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < W
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        h_row = Hid + (row * Bk + src).to(tl.int64) * Hd  # [M] the retained state, gathered in place
        for k0 in range(0, Hd, BLOCK_K):  # [h_src] @ W_in[:, :Hd]^T
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < Hd
            a = tl.load(h_row[:, None] + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
            w = tl.load(Win + n[None, :] * (Hd + C) + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        c_row = Sig + (row * Bk + src).to(tl.int64) * C
        mean = tl.zeros([BLOCK_M], tl.float32)
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if USE_C:  # LayerNorm statistics in two passes (fp32), as torch computes them
            total = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, C, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                c = tl.load(c_row[:, None] + k[None, :], mask=m_ok[:, None] & (k < C)[None, :], other=0.0)
                total += tl.sum(c.to(tl.float32), 1)
            mean = total / C
            sq = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, C, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                ok = m_ok[:, None] & (k < C)[None, :]
                c = tl.load(c_row[:, None] + k[None, :], mask=ok, other=0.0).to(tl.float32)
                dev = tl.where(ok, c - mean[:, None], 0.0)
                sq += tl.sum(dev * dev, 1)
            rstd = 1.0 / tl.sqrt(sq / C + eps)
        for k0 in range(0, C, BLOCK_K):  # [LN(c_src)] @ W_in[:, Hd:]^T
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < C
            ok = m_ok[:, None] & k_ok[None, :]
            lw = tl.load(LnW + k, mask=k_ok, other=0.0).to(tl.float32)
            lb = tl.load(LnB + k, mask=k_ok, other=0.0).to(tl.float32)
            if USE_C:
                c = tl.load(c_row[:, None] + k[None, :], mask=ok, other=0.0).to(tl.float32)
                cn = (c - mean[:, None]) * rstd[:, None] * lw[None, :] + lb[None, :]  # [M, K]
            else:  # LN of the zero signals is its bias
                cn = tl.zeros([BLOCK_M, BLOCK_K], tl.float32) + lb[None, :]
            cn = tl.where(ok, cn, 0.0)
            w = tl.load(Win + n[None, :] * (Hd + C) + Hd + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(cn, w.to(tl.float32), input_precision=PRECISION)
            else:
                acc += tl.dot(cn.to(w.dtype), w, input_precision=PRECISION)
        acc += tl.load(Bin + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        u = acc * tl.sigmoid(acc)  # SiLU
        tl.store(U + m[:, None].to(tl.int64) * W + n[None, :], u.to(U.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gate_out_kernel(U, Wgo, Bgo, X, Out, Valid, Shift, M, n_new, lo, Bk, W, E,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m, m_ok, row, slot, src = _slots(pid_m, Shift, M, n_new, lo, Bk, BLOCK_M)
        lands = src < Bk
        present = lands & (tl.load(Valid + row * Bk + tl.minimum(src, Bk - 1), mask=m_ok, other=0) != 0)  # [M]
        e = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        e_ok = e < E
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_o = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, W, BLOCK_K):  # one pass over u feeds both halves
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < W
            u = tl.load(U + m[:, None].to(tl.int64) * W + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = k_ok[:, None] & e_ok[None, :]
            wg = tl.load(Wgo + e[None, :] * W + k[:, None], mask=wmask, other=0.0)  # [K, N]
            wo = tl.load(Wgo + (E + e)[None, :] * W + k[:, None], mask=wmask, other=0.0)
            if UPCAST:
                u, wg, wo = u.to(tl.float32), wg.to(tl.float32), wo.to(tl.float32)
            acc_g += tl.dot(u, wg, input_precision=PRECISION)
            acc_o += tl.dot(u, wo, input_precision=PRECISION)
        g = acc_g + tl.load(Bgo + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        o = acc_o + tl.load(Bgo + E + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        delta = tl.where(present[:, None], tl.sigmoid(g) * o, 0.0)  # [M, N]
        at = (row * Bk + slot).to(tl.int64)[:, None] * E + e[None, :]
        ok = m_ok[:, None] & e_ok[None, :]
        x = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + at, (x + delta).to(Out.dtype.element_ty), mask=ok)


def retrace_fusion_triton(x: torch.Tensor, hidden: torch.Tensor, signals: torch.Tensor, valid: torch.Tensor,
                          shift: torch.Tensor, weights: FusionWeights, lo: int = 1, use_correction: bool = True,
                          block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The two Triton kernels (same contract as :func:`retrace_fusion_reference`)."""
    b, Bk, E = x.shape
    n_new = Bk - lo
    out = x.clone()  # slots before ``lo`` pass through
    M = b * n_new
    if M == 0:
        return out
    dtype = weights.w_in.dtype
    hidden, signals = hidden.to(dtype).contiguous(), signals.to(dtype).contiguous()
    Hd, C, W = hidden.shape[-1], signals.shape[-1], weights.w_in.shape[0]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    precision = "ieee" if dtype == torch.float32 or interpreted else "tf32"
    upcast = interpreted and dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (see attention)
    shift = shift.to(torch.int32).contiguous()
    u = torch.empty(M, W, dtype=dtype, device=x.device)  # [b * n, W] the one intermediate
    _refine_kernel[(triton.cdiv(M, block_m), triton.cdiv(W, block_n))](
        hidden, signals, shift, weights.ln_weight.contiguous(), weights.ln_bias.contiguous(),
        weights.w_in.contiguous(), weights.b_in.contiguous(), u, M, n_new, lo, Bk, Hd, C, W, weights.ln_eps,
        USE_C=use_correction, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        UPCAST=upcast)
    _gate_out_kernel[(triton.cdiv(M, block_m), triton.cdiv(E, block_n))](
        u, weights.w_go.contiguous(), weights.b_go.contiguous(), x.contiguous(), out,
        valid.to(torch.int8).contiguous(), shift, M, n_new, lo, Bk, W, E, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast)
    return out


# ---- launcher -----------------------------------------------------------------------------------------------------


def retrace_fusion(x: torch.Tensor, hidden: torch.Tensor, signals: torch.Tensor, valid: torch.Tensor,
                   shift: torch.Tensor, weights: FusionWeights, lo: int = 1,
                   use_correction: bool = True) -> torch.Tensor:
    """The block's input embeddings with the previous round's rejected suffix fused in (hard alignment).

    Args:
        x: ``[b, Bk, E]`` embeddings of the block tokens.
        hidden: ``[b, Bk, Hd]`` retained drafter state per OLD slot.
        signals: ``[b, Bk, C]`` correction signals per old slot (read only when ``use_correction``).
        valid: ``[b, Bk]`` bool, old slot was rejected.
        shift: ``[b]`` accepted drafts + 1 (old slot ``s`` lands on new slot ``s - shift``).
        weights: :class:`FusionWeights`; ``w_in`` is ``[W, Hd + C]``, ``w_go`` ``[2E, W]``.
        lo: first new slot that may receive a prior (1, or 0 when the anchor is fused too).
        use_correction: refine with the signals (False: with the retained state alone, ``LN(0)``).
    Returns:
        ``[b, Bk, E]`` in ``x.dtype``; every slot is computed, with no host synchronisation.
    """
    b, Bk, E = x.shape
    C = weights.ln_weight.shape[0]
    Hd = hidden.shape[-1]
    if hidden.shape[:2] != (b, Bk) or signals.shape[:2] != (b, Bk) or valid.shape != (b, Bk) or shift.shape != (b,):
        raise ValueError(f"prior shapes hidden {tuple(hidden.shape)}, signals {tuple(signals.shape)}, valid "
                         f"{tuple(valid.shape)}, shift {tuple(shift.shape)} do not fit a block {tuple(x.shape)}")
    if weights.w_in.shape[1] != Hd + C or signals.shape[-1] != C:
        raise ValueError(f"refiner weight {tuple(weights.w_in.shape)} does not take [h {Hd}; c {C}]")
    if weights.w_go.shape != (2 * E, weights.w_in.shape[0]):
        raise ValueError(f"gate/out weight {tuple(weights.w_go.shape)} is not [2E, W] = [{2 * E}, "
                         f"{weights.w_in.shape[0]}]")
    if not 0 <= lo < Bk:
        raise ValueError(f"lo={lo} is outside a block of {Bk}")
    if wants_triton(x, hidden, weights.w_in):
        return retrace_fusion_triton(x, hidden, signals, valid, shift, weights, lo, use_correction)
    return retrace_fusion_reference(x, hidden, signals, valid, shift, weights, lo, use_correction)


__all__ = ["FusionWeights", "landing", "retrace_fusion", "retrace_fusion_reference", "retrace_fusion_triton"]
