"""Greedy tokens without logits: the fused LM head + argmax kernel (interpreted on a CPU) against its reference,
ties included, and the static decode path's greedy heads: the eager engine's rounds, round for round."""

import pytest
import torch

from specdraft.kernels.dispatch import HAVE_TRITON, use_kernels
from specdraft.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_reference, lm_head_argmax_triton
from specdraft.runtime.decode import GenerationConfig
from specdraft.runtime.sampling import SamplingParams
from specdraft.runtime.static_decode import StaticDecoder, StaticEngine
from tests.helpers import make_drafter, make_target
from tests.lossless import check_conformance

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")


@needs_triton
@pytest.mark.parametrize(("N", "D", "V"), [(1, 16, 300), (7, 24, 129), (33, 40, 1000), (5, 8, 17)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_equals_reference(N, D, V, dtype):
    g = torch.Generator().manual_seed(N + V)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = torch.randn(V, D, generator=g).mul(D ** -0.5).to(dtype)
    got = lm_head_argmax_triton(h, w, block_m=16, block_v=64, block_k=16)
    want = lm_head_argmax_reference(h, w)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the accumulation order differs: a differing pick must be a tie of the materialised logits within an ulp
        logits = torch.nn.functional.linear(h.float(), w.float())
        picked, best = logits.gather(1, got[:, None])[:, 0], logits.gather(1, want[:, None])[:, 0]
        ulp = best.abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
        assert bool(((got == want) | ((best - picked).abs() <= 2 * ulp + 1e-6)).all())
        assert (got == want).float().mean() > 0.9


@needs_triton
def test_ties_break_to_the_lowest_token_like_torch():
    w = torch.zeros(300, 8)
    w[[5, 77, 250], 0] = 1.0  # three tied maxima in different tiles, and ties inside a tile
    w[[6, 7], 0] = 1.0
    h = torch.zeros(3, 8)
    h[:, 0] = torch.tensor([1.0, 1.0, -1.0])
    got = lm_head_argmax_triton(h, w, block_v=64)
    assert torch.equal(got, lm_head_argmax_reference(h, w))
    assert got.tolist()[:2] == [5, 5]


def test_launcher_shapes_and_checks():
    h, w = torch.randn(2, 3, 8), torch.randn(50, 8)
    with use_kernels("reference"):
        assert lm_head_argmax(h, w).shape == (2, 3)
    with pytest.raises(ValueError, match="LM head"):
        lm_head_argmax(h, w.half())


@needs_triton
def test_static_decoding_with_argmax_heads_equals_decoding_with_logits():
    target = make_target(seed=7, vocab=6, std=1.0)
    drafter = make_drafter(target, seed=2, block_size=4, std=0.3)  # its drafts follow its context
    prompts, caps = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4]], [10, 6, 12]
    heads = StaticEngine(target, drafter, 4, argmax_heads=True, graphs=False)
    with use_kernels("triton"):
        counts = check_conformance((target, lambda p: drafter, heads), (target, lambda p: drafter, None), prompts,
                                   caps)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts  # the eager engine's rounds
    with pytest.raises(ValueError, match="greedily"):
        StaticDecoder(target, drafter, 4, 40, graphs=False, argmax_heads=True).generate(
            prompts, GenerationConfig(max_new_tokens=2, sampling=SamplingParams(temperature=1.0)))
