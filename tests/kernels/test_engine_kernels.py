"""The decode engine with the kernels forced on (interpreted on a CPU) decodes exactly what the reference path does:
the target's verify passes (chain and D²SD tree) run through the speculative-attention kernel."""

import pytest

from specdraft.kernels.dispatch import HAVE_TRITON, use_kernels
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from tests.helpers import make_drafter, make_target

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")


@pytest.mark.slow
@pytest.mark.parametrize("path", ["ar", "chain", "tree"])
def test_greedy_decoding_with_kernels_equals_the_reference_path(path):
    target = make_target(seed=3, vocab=48)
    first = make_drafter(target, seed=4, block_size=5)
    second = convert_drafter(make_drafter(target, seed=5, block_size=5), "vp")
    tree = TreeDrafting(second, 2) if path == "tree" else None
    drafter = None if path == "ar" else first
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4]]
    gen = GenerationConfig(max_new_tokens=[9, 6, 11])
    with use_kernels("reference"):
        want = generate(target, prompts, gen, drafter=drafter, tree=tree)
    with use_kernels("triton"):
        got = generate(target, prompts, gen, drafter=drafter, tree=tree)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.accept_lengths for r in got] == [r.accept_lengths for r in want]
    assert [r.tokens for r in want] == [r.tokens for r in generate(target, prompts, gen)]  # and the target's own
