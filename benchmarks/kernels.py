"""Kernel timings at Qwen3-8B shapes (random weights): each kernel against its eager reference and, for speculative
attention, against ``scaled_dot_product_attention`` with an explicit dense mask; achieved memory bandwidth as a share
of the device's peak (bytes the kernel must move: the row's K/V up to its length plus the new tokens, queries and
outputs, over the median time).

    python benchmarks/kernels.py [--device cuda] [--dtype bfloat16] [--peak-gbps 4800] [--out kernels.json]

On a CPU only the reference is timed (the Triton kernel would run interpreted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdraft.kernels.speculative_attention import (
    pack_mask,
    speculative_attention_reference,
    speculative_attention_triton,
)

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


def _tree_mask(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, t] = True
            if t:
                mask[b, t] |= mask[b, int(torch.randint(0, t, (1,), generator=g))]
    return mask


def _time(fn, device: str, repeats: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
        row["reference_s"] = _time(lambda: speculative_attention_reference(q, k, v, lengths, bits, scale), device,
                                   repeats)
        row["sdpa_masked_s"] = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, scale=scale, enable_gqa=True), device, repeats)
        if device == "cuda":
            row["triton_s"] = _time(lambda: speculative_attention_triton(q, k, v, lengths, bits, scale), device,
                                    repeats)
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
              "head_dim": HEAD_DIM, "speculative_attention": bench_attention(args.device, dtype, peak, args.repeats)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
