"""benchmarks/target_step.py: the target's training step timed under each attention implementation, paired."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from target_step import main  # noqa: E402

TINY = ["target.tiny.vocab_size=64", "target.tiny.hidden_size=32", "target.tiny.intermediate_size=48",
        "target.tiny.num_layers=1", "target.tiny.num_heads=2", "target.tiny.num_kv_heads=1", "target.tiny.seq_len=16",
        "target.tiny.batch_size=2"]


def test_times_each_implementation_and_pairs_them_with_the_first(tmp_path):
    report = main(["configs/tiny.yaml", *TINY, "--repeats", "2", "--steps", "1", "--out", str(tmp_path / "r.json")])
    assert set(report["step_s"]) == {"sdpa", "eager"} and all(len(v) == 2 for v in report["step_s"].values())
    assert all(s > 0 for v in report["step_s"].values() for s in v)
    assert report["ratio_to_sdpa"]["sdpa"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert report["ratio_to_sdpa"]["eager"]["min"] > 0 and (tmp_path / "r.json").is_file()
