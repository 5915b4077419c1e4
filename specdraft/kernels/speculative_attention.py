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

import functools
import os
from dataclasses import dataclass

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
                Acc, Ms, Ls, CHUNK,
                G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, NSPLIT: tl.constexpr):
        """One program: a tile of a KV group's (head, token) queries over split ``program_id(2)`` of the committed
        context (all of it when ``NSPLIT == 1``) and, in the last split, the new tokens. One split normalises into
        ``Out``; several write their unnormalised ``acc``, max and sum to ``Acc``/``Ms``/``Ls`` for
        :func:`_combine_splits`."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)
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
        lo = pid_s * CHUNK
        hi = length
        if NSPLIT > 1:
            hi = tl.minimum(lo + CHUNK, length)
        for start in range(lo, hi, BLOCK_N):  # the committed context: read once for the whole tile
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)  # [N, Dp]
            v = tl.load(v_base + n[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
            s = tl.where(n_ok[None, :] & row_ok[:, None], s, float("-inf"))
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, PRECISION, UPCAST)
        if pid_s == NSPLIT - 1:
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
        if NSPLIT == 1:
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            tl.store(Out + b * sob + h[:, None] * soh + t[:, None] * sot + d[None, :], out.to(Out.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            H = Hkv * G
            row = ((pid_s * (tl.num_programs(1) // Hkv) + b) * H + h) * T + t  # [M] into [NSPLIT, B, H, T]
            tl.store(Acc + row[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(Ms + row, m_i, mask=row_ok)
            tl.store(Ls + row, l_i, mask=row_ok)

    @triton.jit
    def _combine_splits(Acc, Ms, Ls, Out, rows_total, H, T, sob, soh, sot, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        NSPLIT: tl.constexpr):
        """One program per (row, head, token): the splits' partial softmaxes rescaled to their common max and
        normalised (flash-decoding's reduction); a query that saw nothing gets zeros."""
        r = tl.program_id(0)  # over B * H * T
        s = tl.arange(0, NSPLIT)
        d = tl.arange(0, BLOCK_D)
        m = tl.load(Ms + s * rows_total + r)  # [NSPLIT]
        l_s = tl.load(Ls + s * rows_total + r)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp(m - m_safe)  # [NSPLIT] (0 for a split that saw nothing)
        l_sum = tl.sum(w * l_s, 0)
        acc = tl.load(Acc + (s * rows_total + r)[:, None] * BLOCK_D + d[None, :])  # [NSPLIT, Dp]
        out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum > 0, l_sum, 1.0)  # [Dp]
        out = tl.where(l_sum > 0, out, 0.0)
        b, rest = r // (H * T), r % (H * T)
        tl.store(Out + b * sob + (rest // T) * soh + (rest % T) * sot + d, out.to(Out.dtype.element_ty), mask=d < D)

    @triton.jit
    def _speculative_attention_kernel(Q, K, V, Out, Lens, Bits, T, W, Hkv, scale,
                                      sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot,
                                      Acc, Ms, Ls, CHUNK,
                                      G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                                      UPCAST: tl.constexpr, NSPLIT: tl.constexpr):
        _attend(Q, K, V, Out, Lens, Bits, T, W, Hkv, scale, sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh,
                sot, Acc, Ms, Ls, CHUNK, G, D, BLOCK_D, BLOCK_M, BLOCK_N, PRECISION, UPCAST, NSPLIT)

    @triton.jit
    def _speculative_attention_aot_kernel(Q, K, V, Lens, Bits, T, W, Hkv, S, Out,
                                          SCALE: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                                          BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                          PRECISION: tl.constexpr):
        """Entry point for ahead-of-time compilation (a TensorRT plugin): TensorRT's argument order (inputs, int32
        scalars, outputs), contiguous tensors, strides from the shapes (int64), the scale a compile-time constant,
        one split (an AOT plugin is one kernel: no reduction pass)."""
        t, s, w = T.to(tl.int64), S.to(tl.int64), Hkv.to(tl.int64)
        h = w * G
        _attend(Q, K, V, Out, Lens, Bits, T, W, Hkv, SCALE, h * t * D, t * D, D, w * s * D, s * D, D,
                w * s * D, s * D, D, h * t * D, t * D, D, Out, Out, Out, 0, G, D, BLOCK_D, BLOCK_M, BLOCK_N,
                PRECISION, False, 1)


SPLIT_MIN_SLOTS = 512
"""Context slots a split reads at least (fewer: the reduction costs more than the parallelism gains)."""
MAX_SPLITS = 32


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def context_splits(programs: int, slots: int, sms: int) -> int:
    """How many ways to split the committed context (flash-decoding) when ``programs`` tiles leave ``sms``
    multiprocessors idle: enough splits to fill them, each over at least :data:`SPLIT_MIN_SLOTS` of the ``slots``
    (from shapes only, so a CUDA graph captures the same launch every replay)."""
    if programs >= sms or slots < 2 * SPLIT_MIN_SLOTS:
        return 1
    return max(1, min(-(-sms // programs), slots // SPLIT_MIN_SLOTS, MAX_SPLITS))


def speculative_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 lengths: torch.Tensor, mask_bits: torch.Tensor, scale: float,
                                 block_m: int = 64, block_n: int = 64, splits: int | None = None) -> torch.Tensor:
    """The Triton kernel (same contract as :func:`speculative_attention_reference`). ``splits``: ways to split the
    committed context (default: :func:`context_splits` on CUDA, none elsewhere)."""
    B, H, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
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
    if splits is None:
        splits = context_splits(grid[0] * grid[1], S, _sm_count(q.device.index or 0)) if q.is_cuda else 1
    splits = triton.next_power_of_2(max(1, splits))  # the reduction's split axis is a power-of-two range
    chunk = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if splits > 1:
        acc = torch.empty(splits, B, H, T, BLOCK_D, dtype=torch.float32, device=q.device)
        ms = torch.empty(splits, B, H, T, dtype=torch.float32, device=q.device)
        ls = torch.empty_like(ms)
    else:
        acc = ms = ls = out  # not read: one split normalises into out
    _speculative_attention_kernel[(*grid, splits)](
        q, k_cache, v_cache, out, lengths.to(torch.int32).contiguous(), mask_bits.contiguous(), T,
        mask_bits.shape[-1], Hkv, scale, *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *out.stride()[:3], acc, ms, ls, chunk, G=G, D=D, BLOCK_D=BLOCK_D, BLOCK_M=block_m,
        BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        UPCAST=interpreted and q.dtype == torch.bfloat16, NSPLIT=splits)
    if splits > 1:
        _combine_splits[(B * H * T,)](acc, ms, ls, out, B * H * T, H, T, *out.stride()[:3], D=D, BLOCK_D=BLOCK_D,
                                      NSPLIT=splits)
    return out


AOT_ARGS = ("Q", "K", "V", "Lens", "Bits", "T", "W", "Hkv", "S", "Out")
"""The AOT kernel's parameters as TensorRT's AOT launch passes them: inputs, int32 scalars, outputs."""
AOT_SHARED_LIMIT = 48 * 1024
"""Shared memory a launch gets without opting in (``cuFuncSetAttribute``), which TensorRT's AOT launch is not known
to do: the AOT kernel's tiles are chosen to stay within it."""
AOT_TILES = ((64, 64, 2), (64, 32, 2), (32, 32, 2), (32, 32, 1), (16, 32, 1), (16, 16, 1))
"""``(BLOCK_M, BLOCK_N, num_stages)`` tried in order; the first whose shared memory fits :data:`AOT_SHARED_LIMIT`."""


@dataclass(frozen=True)
class AotKernel:
    """A kernel compiled ahead of time for a TensorRT plugin: PTX with exactly :data:`AOT_ARGS` as parameters."""

    name: str
    ptx: str
    num_warps: int
    shared: int
    block_m: int
    """Launch with grid ``(cdiv(group * T, block_m), B * H_kv)`` and ``num_warps * 32`` threads."""


def entry_params(ptx: str, name: str) -> list[str]:
    """The parameter declarations of PTX entry ``name``, in order."""
    head = f".entry {name}("
    if head not in ptx:
        raise ValueError(f"no entry {name} in the PTX")
    return [p.strip() for p in ptx.split(head, 1)[1].split(")", 1)[0].split(",") if p.strip()]


def strip_scratch_params(ptx: str, name: str, keep: int) -> str:
    """``ptx`` with entry ``name`` declaring its first ``keep`` parameters only. Triton (>= 3.3) appends scratch
    pointers (global, then profile) that TensorRT's AOT launch does not pass; they may go only when the kernel never
    reads them (no scratch memory), which is checked."""
    params = entry_params(ptx, name)
    dropped = [p.split()[-1] for p in params[keep:]]
    body = ptx.split(f".entry {name}(", 1)[1].split(")", 1)[1]
    used = [d for d in dropped if d in body]
    if used:
        raise ValueError(f"{name} reads {', '.join(used)}: it needs scratch memory, which TensorRT does not pass")
    head = f".entry {name}("
    before, rest = ptx.split(head, 1)
    after = rest.split(")", 1)[1]
    return before + head + "\n\t" + ",\n\t".join(params[:keep]) + "\n)" + after


def compile_aot(dtype: str, head_dim: int, group: int, scale: float, arch: int = 90) -> AotKernel:
    """Compile the kernel ahead of time for a TensorRT plugin (no GPU needed). ``dtype`` is ``fp16``, ``bf16`` or
    ``fp32``; ``arch`` the SM version (90 = Hopper). The tiles are the first of :data:`AOT_TILES` whose shared memory
    fits :data:`AOT_SHARED_LIMIT`; the PTX's parameters are exactly :data:`AOT_ARGS`."""
    ptr = f"*{dtype}"
    types = {"Q": ptr, "K": ptr, "V": ptr, "Lens": "*i64", "Bits": "*i32", "T": "i32", "W": "i32", "Hkv": "i32",
             "S": "i32", "Out": ptr}
    signature = {**{a: types[a] for a in AOT_ARGS}, **dict.fromkeys(
        ("SCALE", "G", "D", "BLOCK_D", "BLOCK_M", "BLOCK_N", "PRECISION"), "constexpr")}
    for block_m, block_n, stages in AOT_TILES:
        constexprs = {"SCALE": float(scale), "G": group, "D": head_dim,
                      "BLOCK_D": max(16, triton.next_power_of_2(head_dim)), "BLOCK_M": block_m, "BLOCK_N": block_n,
                      "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
        src = triton.compiler.ASTSource(fn=_speculative_attention_aot_kernel, signature=signature,
                                        constexprs=constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_stages": stages})
        if kernel.metadata.shared <= AOT_SHARED_LIMIT:
            break
    else:
        raise ValueError(f"speculative attention at head dim {head_dim} ({dtype}) needs {kernel.metadata.shared} "
                         f"bytes of shared memory at its smallest tiles, above {AOT_SHARED_LIMIT}")
    name = kernel.metadata.name
    ptx = strip_scratch_params(kernel.asm["ptx"], name, len(AOT_ARGS))
    return AotKernel(name, ptx, kernel.metadata.num_warps, kernel.metadata.shared, block_m)


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
