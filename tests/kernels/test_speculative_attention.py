"""Speculative attention: the Triton kernel (interpreted on a CPU) against its reference on small odd shapes, and the
reference against plain attention over the concatenated sequence."""

import pytest
import torch

from specdraft.kernels.dispatch import HAVE_TRITON, use_kernels
from specdraft.kernels.speculative_attention import (
    context_splits,
    pack_mask,
    speculative_attention,
    speculative_attention_reference,
    speculative_attention_triton,
    unpack_mask,
)

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")


def _case(B, H, Hkv, T, D, lengths, kind, dtype=torch.float32, seed=0, S=None):
    g = torch.Generator().manual_seed(seed)
    S = S or max(lengths) + T + 3
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    if kind == "causal":
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    elif kind == "all":
        mask = torch.ones(B, T, T, dtype=torch.bool)
    else:  # a random tree: each node's parent is an earlier node (or none); the mask holds its ancestors and itself
        mask = torch.zeros(B, T, T, dtype=torch.bool)
        for b in range(B):
            for t in range(T):
                parent = int(torch.randint(-1, t, (1,), generator=g)) if t else -1
                mask[b, t, t] = True
                if parent >= 0:
                    mask[b, t] |= mask[b, parent]
    return q, k, v, torch.tensor(lengths), mask


def test_bitmask_round_trips_across_word_boundaries():
    m = torch.rand(3, 70, 70, generator=torch.Generator().manual_seed(0)) < 0.5
    bits = pack_mask(m)
    assert bits.shape == (3, 70, 3) and bits.dtype == torch.int32
    assert torch.equal(unpack_mask(bits, 70), m)


def test_reference_equals_attention_over_the_whole_sequence():
    # one row, causal new tokens: the same as causal attention over [context; new]
    q, k, v, lengths, mask = _case(1, 4, 2, 5, 8, [7], "causal")
    got = speculative_attention_reference(q, k, v, lengths, pack_mask(mask), 8 ** -0.5)
    full_q = torch.cat([torch.zeros(1, 4, 7, 8), q], dim=2)
    kk, vv = k[:, :, :12].repeat_interleave(2, 1), v[:, :, :12].repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(full_q, kk, vv, is_causal=True)[:, :, 7:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


SHAPES = [  # (B, H, Hkv, T, D, lengths, kind): tile remainders, one-token rows, GQA 1/2/4, trees
    (2, 4, 4, 5, 8, [3, 11], "causal"),
    (3, 4, 2, 1, 16, [0, 7, 70], "causal"),
    (2, 8, 2, 13, 24, [17, 66], "tree"),
    (1, 2, 1, 37, 8, [5], "tree"),
    (2, 4, 1, 6, 8, [9, 1], "all"),
]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}H{s[1]}kv{s[2]}T{s[3]}D{s[4]}{s[6]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_equals_reference(shape, dtype):
    B, H, Hkv, T, D, lengths, kind = shape
    q, k, v, lens, mask = _case(B, H, Hkv, T, D, lengths, kind, dtype)
    bits = pack_mask(mask)
    want = speculative_attention_reference(q, k, v, lens, bits, D ** -0.5)
    got = speculative_attention_triton(q, k, v, lens, bits, D ** -0.5, block_m=16, block_n=16)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_triton
def test_launcher_dispatch_and_empty_rounds():
    q, k, v, lens, mask = _case(2, 4, 2, 3, 8, [4, 6], "causal")
    with use_kernels("reference"):
        ref = speculative_attention(q, k, v, lens, mask)
    with use_kernels("triton"):
        tri = speculative_attention(q, k, v, lens, mask)
        assert speculative_attention(q[:, :, :0], k, v, lens, mask[:, :0, :0]).shape == (2, 4, 0, 8)
    torch.testing.assert_close(tri, ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="KV heads"):
        speculative_attention(q[:, :3], k, v, lens, mask)
    with pytest.raises(ValueError, match="new_mask"):
        speculative_attention(q, k, v, lens, mask.int())


@needs_triton
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_context_split_kernel_equals_the_reference(splits, dtype):
    """Split over the committed context (flash-decoding), each split's partial softmax combined: rows shorter than a
    split, an empty row, a tree whose nodes see only part of the new tokens, within the kernel's tolerance."""
    for B, H, Hkv, T, D, lengths, kind in [(3, 4, 2, 5, 8, [70, 0, 9], "tree"), (1, 8, 2, 16, 16, [130], "causal")]:
        q, k, v, lens, mask = _case(B, H, Hkv, T, D, lengths, kind, dtype, S=160)
        bits = pack_mask(mask)
        want = speculative_attention_reference(q, k, v, lens, bits, D ** -0.5)
        got = speculative_attention_triton(q, k, v, lens, bits, D ** -0.5, block_m=16, block_n=16, splits=splits)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_context_is_split_only_where_tiles_leave_multiprocessors_idle():
    # batch 1, 8 KV heads, 16 new tokens of a 4-query group: 8 tiles on an H200's 132 SMs, a 4k context
    assert context_splits(8, 4096, 132) == 8  # each split still reads 512 slots
    assert context_splits(8, 65536, 132) == 17
    assert context_splits(8 * 32, 4096, 132) == 1  # batch 32 fills the GPU without splitting
    assert context_splits(8, 600, 132) == 1  # a short context: the reduction would cost more
