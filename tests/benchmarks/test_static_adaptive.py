"""benchmarks/static_adaptive.py decodes AR, fixed and adaptive DFlash through static engines: at T=0 no request
differs from AR's, the adaptive job decodes plainly where verifying cannot pay and drafts where it is free, and every
cell reports τ, tokens/s and the ratios to AR."""

import sys
from pathlib import Path

import pytest

from tests.helpers import bigram_oracle
from tests.runtime.test_static_adaptive import whole

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from static_adaptive import compare  # noqa: E402


@pytest.mark.parametrize(("per_token", "plain"), [(0.0, False), (5.0, True)], ids=["free", "never-pays"])
def test_the_adaptive_static_job_decodes_as_ar_and_drafts_only_where_it_pays(per_token, plain):
    target, oracle = bigram_oracle(2)
    prompts = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4], [2, 2], [3, 1, 4, 1, 5]]
    report = compare(target, oracle, {0.0: whole(per_token), 1.0: whole(per_token)}, {"s": prompts}, batch_size=2,
                     max_new_tokens=12)
    assert not report["graphs"]  # a CPU runs the static rounds without graphs
    assert [c["temperature"] for c in report["cells"]] == [0.0, 1.0]
    for cell in report["cells"]:
        assert cell["ar_tokens_per_s"] > 0 and cell["fixed_over_ar"] > 0 and cell["adaptive_over_ar"] > 0
        assert (cell["adaptive_plain_share"] > 0.5) == plain, cell
        if cell["temperature"] == 0:
            assert cell["differing_requests"] == 0 and (plain or cell["adaptive_tau"] > 2), cell
