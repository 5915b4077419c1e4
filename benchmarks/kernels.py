"""Kernel timings at Qwen3-8B shapes (random weights): each kernel against its eager reference and, for speculative
attention, against ``scaled_dot_product_attention`` with an explicit dense mask; achieved memory bandwidth as a share
of the device's peak (bytes the kernel must move: the row's K/V up to its length plus the new tokens, queries and
outputs, over the median time). ReTrace fusion reports the share of its traffic that the split into two kernels adds
(the ``u`` round trip); the LM-head argmax reports the logits bytes it avoids. The sampled trees (no kernels of
their own: torch ops with a host read or two) report the one-pass siblings' draw and walk and D²SD's walk at Qwen3's
vocabulary.

    python benchmarks/kernels.py [--device cuda] [--dtype bfloat16] [--peak-gbps 4800] [--out kernels.json]

On a CPU only the reference is timed (the Triton kernel would run interpreted).
"""

from __future__ import annotations

import argparse
import json

import torch

from specdraft.kernels.lm_head_argmax import lm_head_argmax_reference, lm_head_argmax_triton
from specdraft.kernels.retrace_fusion import FusionWeights, retrace_fusion_reference, retrace_fusion_triton
from specdraft.kernels.speculative_attention import (
    pack_mask,
    speculative_attention_reference,
    speculative_attention_triton,
)
from specdraft.pipeline.measure import median_seconds, write_report
from specdraft.runtime.d2sd import TreeDrafting, merge_candidates
from specdraft.runtime.one_pass import OnePassDrafting, accept_nodes_sampled, build_nodes, node_tokens, tree_shape
from specdraft.runtime.sampling import SamplingParams, sample_from_probs
from specdraft.runtime.tree import accept_tree_sampled, build_tree, prefix_lengths

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "L4": 300.0}
"""Datasheet HBM/GDDR bandwidth by device-name fragment (GB/s)."""

CASES = [  # (name, batch, context, new tokens, mask kind)
    ("chain16 bs1 ctx4k", 1, 4096, 16, "causal"),
    ("tree64 bs1 ctx4k", 1, 4096, 64, "tree"),
    ("tree80 bs1 ctx4k", 1, 4096, 80, "tree"),
    ("chain16 bs8 ctx4k", 8, 4096, 16, "causal"),
    ("tree64 bs8 ctx2k", 8, 2048, 64, "tree"),
]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
HIDDEN, VOCAB, BLOCK = 4096, 151936, 16  # Qwen3-8B, and DFlash's block


def _tree_mask(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, t] = True
            if t:
                mask[b, t] |= mask[b, int(torch.randint(0, t, (1,), generator=g))]
    return mask


def bench_attention(device: str, dtype: torch.dtype, peak_gbps: float | None, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, B, L, T, kind in CASES:
        S = L + T
        q = torch.randn(B, HEADS, T, HEAD_DIM, generator=g).to(device, dtype)
        k = torch.randn(B, KV_HEADS, S, HEAD_DIM, generator=g).to(device, dtype)
        v = torch.randn(B, KV_HEADS, S, HEAD_DIM, generator=g).to(device, dtype)
        lengths = torch.full((B,), L, device=device)
        mask = (torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T) if kind == "causal"
                else _tree_mask(B, T, g)).to(device)
        bits = pack_mask(mask)
        scale = HEAD_DIM ** -0.5
        dense = torch.cat([torch.ones(B, T, L, dtype=torch.bool, device=device), mask], dim=-1)[:, None]
        elem = torch.finfo(dtype).bits // 8
        moved = elem * (2 * B * KV_HEADS * S * HEAD_DIM + 2 * B * HEADS * T * HEAD_DIM)  # K, V read; q read, out write
        row = {"case": name, "batch": B, "context": L, "new_tokens": T, "bytes": moved}
        row["reference_s"] = median_seconds(
            lambda: speculative_attention_reference(q, k, v, lengths, bits, scale), device, repeats)
        row["sdpa_masked_s"] = median_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, scale=scale, enable_gqa=True), device, repeats)
        if device == "cuda":
            row["triton_s"] = median_seconds(
                lambda: speculative_attention_triton(q, k, v, lengths, bits, scale), device, repeats)
            row["triton_gbps"] = moved / row["triton_s"] / 1e9
            row["speedup_vs_sdpa_masked"] = row["sdpa_masked_s"] / row["triton_s"]
            row["speedup_vs_reference"] = row["reference_s"] / row["triton_s"]
            if peak_gbps:
                row["share_of_peak_bandwidth"] = row["triton_gbps"] / peak_gbps
            err = (speculative_attention_triton(q, k, v, lengths, bits, scale).float()
                   - speculative_attention_reference(q, k, v, lengths, bits, scale).float()).abs().max()
            row["max_abs_error_vs_reference"] = float(err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _timed_pair(row: dict, reference, kernel, moved: int, device: str, peak_gbps: float | None, repeats: int):
    row["reference_s"] = median_seconds(reference, device, repeats)
    row["reference_gbps"] = moved / row["reference_s"] / 1e9
    if device == "cuda":
        row["triton_s"] = median_seconds(kernel, device, repeats)
        row["triton_gbps"] = moved / row["triton_s"] / 1e9
        row["speedup_vs_reference"] = row["reference_s"] / row["triton_s"]
        if peak_gbps:
            row["share_of_peak_bandwidth"] = row["triton_gbps"] / peak_gbps
    print(json.dumps(row), flush=True)
    return row


def bench_retrace_fusion(device: str, dtype: torch.dtype, peak_gbps: float | None, repeats: int) -> list[dict]:
    """The fusion at the default width (``W = D``, the drafted token embedded: ``h = 2D``, ``c = 2D + 4``)."""
    g = torch.Generator().manual_seed(0)
    E = W = HIDDEN
    Hd, C = 2 * E, 2 * E + 4

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device, dtype)

    w = FusionWeights(r(C, std=0.1) + 1, r(C, std=0.1), 1e-5, r(W, Hd + C, std=(Hd + C) ** -0.5), r(W, std=0.1),
                      r(2 * E, W, std=W ** -0.5), r(2 * E, std=0.1))
    rows = []
    for b in (1, 8, 32):
        n = torch.randint(0, BLOCK - 1, (b,), generator=g).to(device)
        valid = torch.arange(BLOCK, device=device)[None, :] > n[:, None]
        x, hidden, signals = r(b, BLOCK, E), r(b, BLOCK, Hd), r(b, BLOCK, C)
        elem = torch.finfo(dtype).bits // 8
        M = b * (BLOCK - 1)
        weights = (Hd + C) * W + 2 * E * W
        moved = elem * (weights + M * (Hd + C + 2 * E))  # weights once, gathered prior rows, x read + written
        row = {"case": f"retrace fusion bs{b}", "batch": b, "rows": M, "bytes": moved,
               "u_round_trip_share": 2 * M * W / (weights + M * (Hd + C + 2 * E))}
        rows.append(_timed_pair(row, lambda: retrace_fusion_reference(x, hidden, signals, valid, n + 1, w),
                                lambda: retrace_fusion_triton(x, hidden, signals, valid, n + 1, w), moved, device,
                                peak_gbps, repeats))
    return rows


def bench_lm_head_argmax(device: str, dtype: torch.dtype, peak_gbps: float | None, repeats: int) -> list[dict]:
    """Greedy tokens of a verify block (``BLOCK`` rows per request) at Qwen3's vocabulary."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5).to(device, dtype)
    elem = torch.finfo(dtype).bits // 8
    rows = []
    for b in (1, 8):
        h = torch.randn(b * BLOCK, HIDDEN, generator=g).to(device, dtype)
        moved = elem * (VOCAB * HIDDEN + b * BLOCK * HIDDEN)
        row = {"case": f"lm head argmax bs{b}", "rows": b * BLOCK, "bytes": moved,
               "logits_bytes_avoided": 2 * elem * b * BLOCK * VOCAB}  # written by the GEMM, read by the argmax
        rows.append(_timed_pair(row, lambda: lm_head_argmax_reference(h, weight), lambda: lm_head_argmax_triton(
            h, weight), moved, device, peak_gbps, repeats))
    return rows


def bench_sampled_tree(device: str, repeats: int, nodes: int = 48) -> list[dict]:
    """A sampled one-pass tree round's own work at Qwen3's vocabulary (fp32 distributions, a drafter as peaked as a
    trained one): the siblings' draw without replacement (one a slot) and the walk down the verified tree."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for b in (1, 8, 32):
        q = torch.softmax(torch.randn(b, BLOCK - 1, VOCAB, generator=gen, device=device) * 4, -1)  # [b, K, V]
        p = torch.softmax(torch.randn(b, nodes, VOCAB, generator=gen, device=device) * 4, -1)  # [b, N, V]
        shape, ranked = tree_shape(q, OnePassDrafting(nodes))
        tree = build_nodes(torch.zeros(b, dtype=torch.long, device=device), shape,
                           node_tokens(shape, ranked, q, gen), BLOCK - 1)
        row = {"case": f"sampled tree{nodes} bs{b}", "batch": b, "nodes": nodes,
               "siblings_draw_s": median_seconds(lambda: node_tokens(shape, ranked, q, gen), device, repeats),
               "walk_s": median_seconds(lambda: accept_nodes_sampled(tree, p, q, gen), device, repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def d2sd_sampled_tree(b: int, device: str, gen: torch.Generator, branches: int = 4, vocab: int = VOCAB):
    """A sampled D²SD round's tree (fp32 distributions as peaked as a trained drafter's, Qwen3's vocabulary by
    default): the first draft and ``branches`` re-drafts drawn from their distributions, branching where the first
    draft's confidences put the likely rejections; ``(tree, target_probs [b, N, V], candidates)``."""
    K = BLOCK - 1
    logits = torch.randn(b, K, vocab, generator=gen, device=device) * 4  # [b, K, V]
    q = logits.softmax(-1)
    first = sample_from_probs(q, gen)  # [b, K]
    lengths = prefix_lengths(q.amax(-1), branches)  # [b, J]
    branch_logits = torch.randn(b, branches, K, vocab, generator=gen, device=device) * 4  # [b, J, K, V]
    cands = merge_candidates(first, q, logits, None, lengths, branch_logits, TreeDrafting(None, branches),
                             SamplingParams(1.0), True, gen)
    tree = build_tree(torch.zeros(b, dtype=torch.long, device=device), cands.tokens)
    tree = tree.trimmed(int(tree.num_nodes.max()))
    p = torch.softmax(torch.randn(b, tree.tokens.shape[1], vocab, generator=gen, device=device) * 4, -1)
    return tree, p, cands


def bench_d2sd_walk(device: str, repeats: int) -> list[dict]:
    """D²SD's sampled walk (multi-candidate speculative sampling down the first draft and four branches) at Qwen3's
    vocabulary."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for b in (1, 8, 32):
        tree, p, cands = d2sd_sampled_tree(b, device, gen)
        row = {"case": f"d2sd sampled walk bs{b}", "batch": b, "nodes": tree.tokens.shape[1],
               "walk_s": median_seconds(lambda: accept_tree_sampled(tree, p, cands.probs, cands.proposes, gen),
                                        device, repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peak-gbps", type=float, default=0.0, help="device peak bandwidth (default: by device name)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in device_name), None)
    if args.device == "cpu":
        args.repeats = min(args.repeats, 3)
    report = {"device": device_name, "dtype": args.dtype, "peak_gbps": peak, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "speculative_attention": bench_attention(args.device, dtype, peak, args.repeats),
              "retrace_fusion": bench_retrace_fusion(args.device, dtype, peak, args.repeats),
              "lm_head_argmax": bench_lm_head_argmax(args.device, dtype, peak, args.repeats),
              "sampled_tree": bench_sampled_tree(args.device, args.repeats),
              "d2sd_walk": bench_d2sd_walk(args.device, args.repeats)}
    write_report(report, args.out, echo=False)
    return report


if __name__ == "__main__":
    main()
