"""benchmarks/sampling_cost.py: both samplers draw from the same distribution, and the report has a row per size."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sampling_cost import exponential_race, main  # noqa: E402

from specdraft.runtime.sampling import sample_from_probs  # noqa: E402


def test_both_samplers_draw_the_same_distribution_and_the_report_has_every_size():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2]).expand(40_000, 5).contiguous()
    g = torch.Generator().manual_seed(0)
    for sampler in (sample_from_probs, exponential_race):
        freq = torch.bincount(sampler(probs, g), minlength=5) / 40_000
        assert freq[0] == freq[2] == 0 and torch.allclose(freq, probs[0], atol=0.01)
    rows = main(["--rows", "1,4", "--drafts", "3", "--vocab", "64", "--repeats", "1"])
    assert [r["rows"] for r in rows] == [1, 4] and all(r["inverse_cdf_ms"] > 0 for r in rows)
