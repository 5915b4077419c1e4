"""The losslessness harness through the ONNX Runtime backend: drafts with pinned acceptance (the harness's oracle,
wrapping the exported drafter) verified by the exported target give the target's greedy output, at batch 1 and on a
ragged batch with stop tokens; sampled output fits the exact distribution of the exported target."""

import pytest

from specdraft.runtime.backends.onnx import OnnxDrafter, OnnxTarget, load_manifest
from tests.lossless import SAMPLING_SETTINGS, ControlledDrafter, check_greedy, sampling_pvalues

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
