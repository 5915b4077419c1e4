"""benchmarks/target_step.py: the target's training step timed under each attention implementation, paired."""

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from target_step import main  # noqa: E402

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")

TINY = ["target.tiny.vocab_size=64", "target.tiny.hidden_size=32", "target.tiny.intermediate_size=48",
        "target.tiny.num_layers=1", "target.tiny.num_heads=2", "target.tiny.num_kv_heads=1", "target.tiny.seq_len=16",
        "target.tiny.batch_size=2"]


def test_times_each_implementation_and_pairs_them_with_the_first(tmp_path):
    report = main([CONFIG, *TINY, "--repeats", "2", "--steps", "1", "--out", str(tmp_path / "r.json")])
    assert set(report["step_s"]) == {"sdpa", "eager"} and all(len(v) == 2 for v in report["step_s"].values())
    assert all(s > 0 for v in report["step_s"].values() for s in v)
    eager, sdpa = report["step_s"]["eager"], report["step_s"]["sdpa"]
    paired = [e / s for e, s in zip(eager, sdpa)]  # each repeat's eager step over the same repeat's sdpa step
    assert report["ratio_to_sdpa"]["eager"]["median"] == pytest.approx(statistics.median(paired), rel=0.02, abs=1e-3)
    assert report["ratio_to_sdpa"]["eager"]["min"] <= report["ratio_to_sdpa"]["eager"]["max"]
    assert (tmp_path / "r.json").is_file()
