"""ReTrace fusion: the Triton kernels (interpreted on a CPU) against their reference on odd shapes and every option,
the reference against the model's own ``fusion_delta``, and ReTrace decoding with the kernels forced on."""

import pytest
import torch

from specdraft.kernels.dispatch import HAVE_TRITON, use_kernels
from specdraft.kernels.retrace_fusion import (
    FusionWeights,
    landing,
    retrace_fusion,
    retrace_fusion_reference,
    retrace_fusion_triton,
)
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.models.retrace import build_prior, verify_stats
from tests.helpers import make_drafter, make_target, retrace_from

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")


def _case(b, Bk, E, Hd, C, W, n_accepted, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    weights = FusionWeights(r(C, std=0.3) + 1, r(C, std=0.1), 1e-5, r(W, Hd + C, std=(Hd + C) ** -0.5), r(W, std=0.1),
                            r(2 * E, W, std=W ** -0.5), r(2 * E, std=0.1))
    n = torch.tensor(n_accepted)
    valid = torch.arange(Bk)[None, :] > n[:, None]  # [b, Bk] rejected slots
    signals = r(b, Bk, C)
    signals[..., -4:] = signals[..., -4:].abs()  # scalars, as build_prior lays them out
    return r(b, Bk, E), r(b, Bk, Hd), signals, valid, n + 1, weights


SHAPES = [  # (b, Bk, E, Hd, C, W, accepted per row): tile remainders, full acceptance, nothing accepted
    (3, 5, 8, 16, 20, 8, [0, 2, 4]),
    (2, 16, 24, 48, 52, 24, [1, 15]),
    (1, 7, 40, 40, 84, 20, [3]),
    (4, 4, 16, 32, 36, 16, [0, 0, 1, 3]),
]
TOLERANCE = {torch.float32: 3e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{s[0]}Bk{s[1]}E{s[2]}W{s[5]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_equals_reference(shape, dtype):
    b, Bk, E, Hd, C, W, n = shape
    x, hidden, signals, valid, shift, w = _case(b, Bk, E, Hd, C, W, n, dtype)
    for lo, use_correction in [(1, True), (0, True), (1, False)]:
        want = retrace_fusion_reference(x.float(), hidden.float(), signals.float(), valid, shift,
                                        FusionWeights(*(t.float() if torch.is_tensor(t) else t for t in w)), lo,
                                        use_correction)
        got = retrace_fusion_triton(x, hidden, signals, valid, shift, w, lo, use_correction, block_m=16,
                                    block_n=16, block_k=16)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        _, present = landing(valid, shift, lo)  # [b, Bk - lo]
        fused = torch.cat([torch.zeros(b, lo, dtype=torch.bool), present], dim=1)  # [b, Bk]
        assert torch.equal(got[~fused], x[~fused])  # the anchor and slots nothing lands on pass through exactly
        assert fused.any() and not torch.allclose(got[fused].float(), x[fused].float())


def test_reference_equals_the_models_fusion():
    target = make_target()
    for opts in [{}, {"use_correction": False}, {"gate_anchor": True}, {"refiner_width": 16, "embed_drafted": False}]:
        r = retrace_from(make_drafter(target), active=True, **opts)
        Bk, D, V = r.block_size, r.config.hidden_size, r.config.vocab_size
        g = torch.Generator().manual_seed(1)
        drafts = torch.randint(0, V, (3, Bk - 1), generator=g)
        stats = verify_stats(torch.randn(3, Bk, V, generator=g), drafts)
        prior = build_prior(torch.randn(3, Bk, D, generator=g), drafts, torch.tensor([0, 2, Bk - 1]), stats,
                            torch.randn(3, Bk, D, generator=g), r.embed, r.config.retrace.embed_drafted)
        x = torch.randn(3, Bk, D, generator=g)
        got = retrace_fusion_reference(x, prior.hidden, prior.signals, prior.valid, prior.shift, r.fusion_weights(),
                                       lo=0 if r.config.retrace.gate_anchor else 1,
                                       use_correction=r.config.retrace.use_correction)
        with torch.no_grad():
            torch.testing.assert_close(got, x + r.fusion_delta(prior), rtol=1e-5, atol=1e-6)


def test_launcher_checks_shapes():
    x, hidden, signals, valid, shift, w = _case(2, 5, 8, 16, 20, 8, [0, 1])
    with pytest.raises(ValueError, match="refiner weight"):
        retrace_fusion(x, hidden[..., :-1], signals, valid, shift, w)
    with pytest.raises(ValueError, match="prior shapes"):
        retrace_fusion(x, hidden, signals, valid[:1], shift, w)
    with pytest.raises(ValueError, match="outside a block"):
        retrace_fusion(x, hidden, signals, valid, shift, w, lo=5)


@needs_triton
def test_retrace_decoding_with_kernels_equals_the_reference_path():
    target = make_target(seed=3, vocab=12)
    r = retrace_from(make_drafter(target, seed=4), active=True)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9], [4]]
    gen = GenerationConfig(max_new_tokens=[8, 5, 9])
    with use_kernels("reference"):
        want = generate(target, prompts, gen, drafter=r)
    with use_kernels("triton"):
        got = generate(target, prompts, gen, drafter=r)
    assert [x.tokens for x in got] == [x.tokens for x in want] == [x.tokens for x in generate(target, prompts, gen)]
    assert [x.accepted for x in got] == [x.accepted for x in want]
    assert any(a > 0 for x in want for a in x.accepted)  # the drafter gets drafts accepted
