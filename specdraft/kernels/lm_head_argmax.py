"""Greedy tokens without logits: the LM head and the argmax over the vocabulary fused, so greedy verification (and
greedy drafting) never materialises ``[rows, V]`` logits (``V`` = 151,936 for Qwen3).

The kernel tiles the vocabulary: each program computes ``hidden @ W[tile]^T`` for a tile of rows with fp32
accumulation, rounds the logits to the output dtype (so ties are the ties of materialised logits) and keeps the tile's
maximum and its first index; a second, tiny reduction over tiles keeps the first tile reaching the maximum. Both
steps break ties towards the lowest token id, as ``torch.argmax`` does.
"""

from __future__ import annotations

import os

import torch

from specdraft.kernels.dispatch import tl, triton, wants_triton


def lm_head_argmax_reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``argmax(hidden @ weight^T)`` with the logits materialised in ``hidden.dtype``: ``[N, D], [V, D] -> [N]``."""
    return torch.nn.functional.linear(hidden, weight).argmax(-1)


if triton is not None:

    @triton.jit
    def _lm_head_argmax_kernel(H, Wt, MaxOut, IdxOut, N, V, D, n_tiles,
                               BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_v = tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < N
        v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = v < V
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < D
            h = tl.load(H + m[:, None].to(tl.int64) * D + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(Wt + v[None, :].to(tl.int64) * D + k[:, None], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(h, w, input_precision=PRECISION)
        logits = acc.to(MaxOut.dtype.element_ty).to(tl.float32)  # the ties of materialised logits
        logits = tl.where(v_ok[None, :], logits, float("-inf"))
        best = tl.max(logits, 1)  # [M]
        first = tl.min(tl.where(logits == best[:, None], v[None, :], V), 1)  # lowest id reaching the max
        tl.store(MaxOut + m * n_tiles + pid_v, best.to(MaxOut.dtype.element_ty), mask=m_ok)
        tl.store(IdxOut + m * n_tiles + pid_v, first, mask=m_ok)


def lm_head_argmax_triton(hidden: torch.Tensor, weight: torch.Tensor, block_m: int = 16, block_v: int = 128,
                          block_k: int = 64) -> torch.Tensor:
    """The fused kernel (same contract as :func:`lm_head_argmax_reference`)."""
    N, D = hidden.shape
    V = weight.shape[0]
    if N == 0:
        return torch.zeros(0, dtype=torch.long, device=hidden.device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    n_tiles = triton.cdiv(V, block_v)
    best = torch.empty(N, n_tiles, dtype=hidden.dtype, device=hidden.device)  # [N, tiles]
    idx = torch.empty(N, n_tiles, dtype=torch.int32, device=hidden.device)
    _lm_head_argmax_kernel[(triton.cdiv(N, block_m), n_tiles)](
        hidden.contiguous(), weight.contiguous(), best, idx, N, V, D, n_tiles, BLOCK_M=block_m, BLOCK_V=block_v,
        BLOCK_K=block_k, PRECISION="ieee" if hidden.dtype == torch.float32 or interpreted else "tf32",
        UPCAST=interpreted and hidden.dtype == torch.bfloat16)
    tile = best.argmax(-1, keepdim=True)  # [N, 1] the first tile reaching the maximum
    return idx.gather(1, tile)[:, 0].long()


def lm_head_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Greedy token of each hidden state: ``[..., D]`` and the LM head's ``[V, D]`` weight -> ``[...]`` token ids,
    equal to ``argmax(linear(hidden, weight))`` (ties to the lowest id); the kernel on CUDA, the reference elsewhere."""
    if hidden.shape[-1] != weight.shape[1] or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden {tuple(hidden.shape)} {hidden.dtype} does not fit an LM head "
                         f"{tuple(weight.shape)} {weight.dtype}")
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    if wants_triton(flat, weight):
        out = lm_head_argmax_triton(flat, weight)
    else:
        out = lm_head_argmax_reference(flat, weight)
    return out.view(hidden.shape[:-1])


__all__ = ["lm_head_argmax", "lm_head_argmax_reference", "lm_head_argmax_triton"]
