"""The compiled kernels on a GPU at real sizes (``pytest -m gpu``; skipped with a reason elsewhere)."""

import pytest
import torch

from specdraft.kernels.dispatch import HAVE_TRITON
from specdraft.kernels.lm_head_argmax import lm_head_argmax_reference, lm_head_argmax_triton
from specdraft.kernels.retrace_fusion import FusionWeights, retrace_fusion_reference, retrace_fusion_triton
from specdraft.kernels.speculative_attention import (
    pack_mask,
    speculative_attention_reference,
    speculative_attention_triton,
)
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.merged import MergedDrafting
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.static_decode import StaticDecoder, StaticEngine
from tests.helpers import make_drafter, make_target, requires_cuda, retrace_from
from tests.lossless import check_conformance
from tests.runtime.test_static_adaptive import pattern

pytestmark = [pytest.mark.gpu, requires_cuda,
              pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")]


@pytest.mark.parametrize(("B", "L", "T"), [(1, 4096, 16), (1, 4000, 80), (8, 1023, 33), (3, 0, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_speculative_attention_at_qwen3_8b_shapes(B, L, T, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, 32, T, 128, generator=g).to("cuda", dtype)
    k = torch.randn(B, 8, L + T + 5, 128, generator=g).to("cuda", dtype)
    v = torch.randn(B, 8, L + T + 5, 128, generator=g).to("cuda", dtype)
    lengths = torch.tensor([max(L - 7 * b, 0) for b in range(B)], device="cuda")
    mask = (torch.rand(B, T, T, generator=g) < 0.5).tril().to("cuda") | torch.eye(T, dtype=torch.bool, device="cuda")
    bits = pack_mask(mask)
    got = speculative_attention_triton(q, k, v, lengths, bits, 128 ** -0.5)
    want = speculative_attention_reference(q, k, v, lengths, bits, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lo", [1, 0])
def test_retrace_fusion_at_qwen3_8b_shapes(lo):
    g = torch.Generator().manual_seed(0)
    b, Bk, E, W = 8, 16, 4096, 4096
    C, Hd = 2 * E + 4, 2 * E

    def r(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to("cuda", torch.bfloat16)

    w = FusionWeights(r(C, std=0.1) + 1, r(C, std=0.1), 1e-5, r(W, Hd + C, std=(Hd + C) ** -0.5), r(W, std=0.1),
                      r(2 * E, W, std=W ** -0.5), r(2 * E, std=0.1))
    n = torch.randint(0, Bk, (b,), generator=g).cuda()
    valid = torch.arange(Bk, device="cuda")[None, :] > n[:, None]
    x, hidden, signals = r(b, Bk, E), r(b, Bk, Hd), r(b, Bk, C)
    got = retrace_fusion_triton(x, hidden, signals, valid, n + 1, w, lo)
    want = retrace_fusion_reference(x.float(), hidden.float(), signals.float(), valid, n + 1,
                                    FusionWeights(*(t.float() if torch.is_tensor(t) else t for t in w)), lo)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_cuda_graph_decode_equals_eager_decode():
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
    gen = GenerationConfig(max_new_tokens=[10, 25, 17, 30, 8, 21, 14, 19, 12])
    target = make_target(seed=7, vocab=6, std=1.0).cuda()
    drafter = make_drafter(target, seed=2, block_size=4).cuda().bind_target(target.model.embed_tokens, target.lm_head)
    want = [r.tokens for r in generate(target, prompts, gen)]
    for d in (drafter, None):  # fp32: the graphed rounds decode the target's own greedy output
        graphed = StaticDecoder(target, d, 16, 80, graphs=True)
        assert [r.tokens for r in graphed.generate(prompts, gen)] == want
        assert [r.tokens for r in graphed.generate(prompts, gen)] == want  # replayed graphs, second batch
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    graphed = StaticEngine(target, drafter, 16, graphs=True)
    eager = StaticEngine(target, drafter, 16, graphs=False)
    counts = check_conformance((target, lambda p: drafter, graphed), (target, lambda p: drafter, eager), prompts,
                               gen.max_new_tokens)
    assert counts["differing_rows"] == 0, counts  # bf16: capture changes nothing, round for round
    heads = StaticDecoder(target, drafter, 16, 80, graphs=True, argmax_heads=True).generate(prompts, gen)
    want = eager(target, prompts, gen, drafter=drafter)
    assert [r.tokens for r in heads] == [r.tokens for r in want]  # no logits, same tokens (ties aside: none here)


@pytest.mark.parametrize("kind", ["d2sd", "merged", "one_pass"])
def test_cuda_graph_tree_rounds_are_the_eager_static_rounds(kind):
    """D²SD, merged and one-pass trees on the CUDA-graph path: the first draft, D²SD's branches,
    the tree's verify pass (at its fixed node budget) and the commit replay as graphs, and every round equals the same
    static rounds run eagerly."""
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
    caps = [10, 25, 17, 30, 8, 21, 14, 19, 12]
    target = make_target(seed=7, vocab=6, std=1.0).cuda()
    bind = (target.model.embed_tokens, target.lm_head)
    first = make_drafter(target, seed=2, block_size=5, std=0.3).cuda().bind_target(*bind)
    second = convert_drafter(make_drafter(target, seed=5, block_size=5, std=0.3), "vp").cuda().bind_target(*bind)
    tree = {"d2sd": TreeDrafting(second, 2), "merged": MergedDrafting(TreeDrafting(second, 2), 12),
            "one_pass": OnePassDrafting(12)}[kind]
    graphed = StaticEngine(target, first, 16, graphs=True, tree=tree)
    eager = StaticEngine(target, first, 16, graphs=False, tree=tree)
    counts = check_conformance((target, lambda p: (first, tree), graphed), (target, lambda p: (first, tree), eager),
                               prompts, caps)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts
    gen = GenerationConfig(max_new_tokens=caps)
    got = graphed(target, prompts, gen, drafter=first, tree=tree)
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, prompts, gen)]  # fp32: the target's output


def test_cuda_graph_retrace_rounds_are_the_eager_static_rounds():
    """ReTrace on the CUDA-graph path: the draft graph fuses the prior from its bucket's buffers (the fused kernel),
    the commit graph returns the fused verify context, and every round equals the same static rounds run eagerly."""
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
    caps = [10, 25, 17, 30, 8, 21, 14, 19, 12]
    target = make_target(seed=7, vocab=6, std=1.0).cuda()
    drafter = retrace_from(make_drafter(target, seed=2, block_size=4, std=0.3), active=True).cuda().bind_target(
        target.model.embed_tokens, target.lm_head)
    graphed = StaticEngine(target, drafter, 16, graphs=True)
    eager = StaticEngine(target, drafter, 16, graphs=False)
    counts = check_conformance((target, lambda p: drafter, graphed), (target, lambda p: drafter, eager), prompts, caps)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts


@pytest.mark.parametrize(("kind", "heads"), [("dflash", False), ("dflash", True), ("retrace", False),
                                             ("one_pass", False), ("one_pass", True), ("d2sd", True)])
def test_cuda_graph_adaptive_rounds_are_the_eager_static_rounds(kind, heads):
    """The adaptive policy on the CUDA-graph path, a fixed pattern of drafted and plain rounds: the plain rounds'
    verify and commit replay as graphs of their own (their own memory pool) between the drafted rounds' graphs, and
    every round equals the same static rounds run eagerly; with the fused argmax heads greedy jobs take (the draft
    keeping its logits for the policy) too."""
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
    caps = [10, 25, 17, 30, 8, 21, 14, 19, 12]
    target = make_target(seed=7, vocab=6, std=1.0).cuda()
    bind = (target.model.embed_tokens, target.lm_head)
    first = make_drafter(target, seed=2, block_size=5, std=0.3)
    first = (retrace_from(first, active=True) if kind == "retrace" else first).cuda().bind_target(*bind)
    second = convert_drafter(make_drafter(target, seed=5, block_size=5, std=0.3), "vp").cuda().bind_target(*bind)
    tree = {"one_pass": OnePassDrafting(12), "d2sd": TreeDrafting(second, 2)}.get(kind)
    graphed, eager = (StaticEngine(target, first, 16, graphs=g, tree=tree, policy=pattern(), argmax_heads=heads)
                      for g in (True, False))

    def engine(static):
        return lambda *args, **kwargs: static(*args, **kwargs, policy=static.policy)
    counts = check_conformance((target, lambda p: (first, tree), engine(graphed)),
                               (target, lambda p: (first, tree), engine(eager)), prompts, caps)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts
    gen = GenerationConfig(max_new_tokens=caps)
    got = engine(graphed)(target, prompts, gen, drafter=first, tree=tree)
    assert [r.tokens for r in got] == [r.tokens for r in generate(target, prompts, gen)]  # fp32: the target's output
    assert 0 in {v for r in got for v in r.verified}  # plain rounds replayed


def test_lm_head_argmax_at_qwen3_vocabulary():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 4096, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(151936, 4096, generator=g) * 4096 ** -0.5).to("cuda", torch.bfloat16)
    got, want = lm_head_argmax_triton(h, w), lm_head_argmax_reference(h, w)
    logits = torch.nn.functional.linear(h.float(), w.float())
    gap = (logits.gather(1, want[:, None]) - logits.gather(1, got[:, None])).abs()[:, 0]
    assert bool(((got == want) | (gap <= 2 ** -6 * logits.abs().amax(-1))).all())
