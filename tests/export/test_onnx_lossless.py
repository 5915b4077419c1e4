"""The losslessness harness through the ONNX Runtime backend: drafts with pinned acceptance (the harness's oracle,
wrapping the exported drafter) verified by the exported target give the target's greedy output, at batch 1 and on a
ragged batch with stop tokens; sampled output fits the exact distribution of the exported target; the adaptive
policy's rounds through the exported models are lossless too."""

import pytest

from specdraft.runtime.backends.onnx import OnnxDrafter, OnnxTarget, load_manifest
from specdraft.runtime.calibration import Calibration
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.policy import AdaptivePolicy
from tests.lossless import SAMPLING_SETTINGS, ControlledDrafter, check_conformance, check_greedy, sampling_pvalues
from tests.runtime.test_policy import costs

ALPHA = 1e-3
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5], [0], [1, 1, 1, 3], [1, 0], [5, 5, 1]]
CAPS = [10, 25, 17, 30, 8, 21, 14, 19, 12]


def test_greedy_with_pinned_acceptance_through_onnx_runtime(exported):
    _, _, out = exported
    target, inner = OnnxTarget(out), OnnxDrafter(out)
    counts = check_greedy(target, lambda p: ControlledDrafter(target, p, mode="oracle", inner=inner), PROMPTS, CAPS)
    assert counts["mismatches"] == 0
    assert counts["full"] > 0 and counts["partial"] > 0 and counts["none"] > 0  # every acceptance pattern occurs
    assert counts["stopped_rows"] > 0


@pytest.mark.slow
def test_sampled_output_through_onnx_runtime_fits_the_target(exported):
    _, _, out = exported
    if load_manifest(out)["flavour"] == "fused":
        pytest.skip("acceptance does not depend on the flavour; the fused graphs' outputs are tested above and in "
                    "test_onnx.py")
    target, inner = OnnxTarget(out), OnnxDrafter(out)
    check = sampling_pvalues(target, lambda p: ControlledDrafter(target, p, mode="mix", inner=inner),
                             SAMPLING_SETTINGS[0], n=6000)
    assert check.min_p > ALPHA, check
    assert check.profile["full"] + check.profile["partial"] > 0


def test_the_adaptive_policy_through_onnx_runtime(exported):
    """The adaptive planner on the ONNX Runtime executor: its rounds are the torch engine's under the same planner,
    round for round (the widths it verifies follow acceptance, not timings: ``measured=False``), and plain rounds
    (their features deferred) with requests joining mid-way decode the target's output."""
    torch_target, torch_drafter, out = exported
    target, inner = OnnxTarget(out), OnnxDrafter(out)
    widths = []

    def engine(*args, per_token=0.2, **kwargs):  # a fresh policy per call, as each decode job builds one
        policy = AdaptivePolicy(costs(per_token), Calibration(bins=1, table=[[0.5]] * 3), measured=False)
        results = generate(*args, **kwargs, policy=policy)
        widths.extend(v for r in results for v in r.verified)
        return results

    counts = check_conformance(
        (target, lambda p: ControlledDrafter(target, p, mode="oracle", inner=inner), engine),
        (torch_target, lambda p: ControlledDrafter(torch_target, p, mode="oracle", inner=torch_drafter), engine),
        PROMPTS, CAPS)
    assert counts["differing_rows"] == 0 and counts["accepted"] > 0, counts
    assert 0 < max(widths) < 3, sorted(set(widths))  # rounds narrower than the block
    gen = GenerationConfig(max_new_tokens=CAPS)
    want = [r.tokens for r in generate(torch_target, PROMPTS, gen)]
    got = engine(target, PROMPTS, gen, drafter=inner, slots=3, prefill_chunk=2)
    assert [r.tokens for r in got] == want
    widths.clear()
    got = engine(target, PROMPTS, gen, drafter=inner, per_token=5.0, slots=3, prefill_chunk=2)
    assert [r.tokens for r in got] == want and set(widths) == {0}  # verification never pays: plain throughout
