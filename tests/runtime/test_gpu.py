"""CUDA paths (run with `pytest -m gpu` on a GPU machine; skipped with a reason on CPU)."""

import pytest
import torch

from specdraft.runtime.cost_model import extend_costs, measure_costs
from specdraft.runtime.d2sd import TreeDrafting
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.drafter_io import convert_drafter
from specdraft.runtime.node_budget import NodeBudget, budget_choices
from specdraft.runtime.one_pass import OnePassDrafting
from specdraft.runtime.sampling import SamplingParams
from tests.helpers import PROMPTS, make_drafter, make_target, requires_cuda
from tests.runtime.test_one_pass import check_walk_law
from tests.runtime.test_tree import check_sampled_walk_law

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_cuda_fp32_greedy_speculative_equals_ar_in_ragged_batches():
    target = make_target(seed=3, vocab=12).cuda()
    drafter = make_drafter(target, seed=4).cuda().bind_target(target.model.embed_tokens, target.lm_head)
    prompts = [[t % 11 for t in p] for p in PROMPTS]
    gen = GenerationConfig(max_new_tokens=[10, 25, 17, 30, 8, 21, 14, 19])
    spec = generate(target, prompts, gen, drafter=drafter)
    ar = generate(target, prompts, gen)
    assert [r.tokens for r in spec] == [r.tokens for r in ar]


def test_cuda_bf16_sampling_runs_with_device_generator():
    target = make_target(seed=5, vocab=32).to("cuda", torch.bfloat16)
    drafter = make_drafter(target, seed=6).to("cuda", torch.bfloat16)
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    g = torch.Generator(device="cuda").manual_seed(0)
    res = generate(target, PROMPTS[:4], GenerationConfig(max_new_tokens=20, sampling=SamplingParams(1.0, top_p=0.9)),
                   drafter=drafter, generator=g)
    assert all(len(r.tokens) == 20 and all(0 <= t < 32 for t in r.tokens) for r in res)


@pytest.mark.parametrize("branches", [1, 4])
def test_cuda_d2sd_greedy_equals_ar_in_ragged_batches(branches):
    target = make_target(seed=3, vocab=12).cuda()
    first = make_drafter(target, seed=4).cuda().bind_target(target.model.embed_tokens, target.lm_head)
    second = convert_drafter(make_drafter(target, seed=5), "vp").cuda().bind_target(target.model.embed_tokens,
                                                                                   target.lm_head)
    prompts = [[t % 11 for t in p] for p in PROMPTS]
    gen = GenerationConfig(max_new_tokens=[10, 25, 17, 30, 8, 21, 14, 19])
    timings: dict = {}
    spec = generate(target, prompts, gen, drafter=first, tree=TreeDrafting(second, branches), timings=timings)
    assert [r.tokens for r in spec] == [r.tokens for r in generate(target, prompts, gen)]
    assert set(timings) >= {"draft", "second_draft", "tree", "verify", "compaction", "commit"}


def test_cuda_sampled_walk_is_recursive_rejection_sampling():
    check_walk_law(0, "cuda")


def test_cuda_d2sd_sampled_walk_is_multi_candidate_speculative_sampling():
    check_sampled_walk_law(0, "cuda")


def test_cuda_one_pass_with_a_measured_budget_greedy_equals_ar_and_samples_on_device():
    """Chain rounds without a tree and tree rounds, the budget priced by passes timed on the GPU."""
    target = make_target(seed=3, vocab=12).cuda()
    drafter = make_drafter(target, seed=4).cuda().bind_target(target.model.embed_tokens, target.lm_head)
    prompts = [[t % 11 for t in p] for p in PROMPTS]
    gen = GenerationConfig(max_new_tokens=[10, 25, 17, 30, 8, 21, 14, 19])
    choices = budget_choices(drafter.block_size, 24)
    costs = extend_costs(measure_costs(target, drafter, rows=(1, 8), repeats=1), target, drafter, (), choices, 1)
    tree = OnePassDrafting(24, budget=NodeBudget(choices, costs))
    assert [r.tokens for r in generate(target, prompts, gen, drafter=drafter, tree=tree)] == [
        r.tokens for r in generate(target, prompts, gen)]
    g = torch.Generator(device="cuda").manual_seed(0)
    res = generate(target, prompts, GenerationConfig(max_new_tokens=20, sampling=SamplingParams(1.0)),
                   drafter=drafter, tree=tree, generator=g)
    assert all(len(r.tokens) == 20 and all(0 <= t < 12 for t in r.tokens) for r in res)
