"""benchmarks/bench_spread.py: cell-by-cell differences of speedups between two bench runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_spread import main  # noqa: E402


def _run(path, adaptive_tps):
    cell = {"suite": "math", "temperature": 0.0, "batch_size": 8, "batching": "static"}
    rows = [{**cell, "method": "ar", "tokens_per_s": 100.0},
            {**cell, "method": "dflash", "policy": "adaptive", "tokens_per_s": adaptive_tps}]
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def test_reports_the_difference_of_speedups_over_ar(tmp_path):
    rows = main([_run(tmp_path / "a.json", 95.0), _run(tmp_path / "b.json", 90.0)])
    assert len(rows) == 1 and rows[0]["method"] == "adaptive" and rows[0]["cells"] == 1
    assert rows[0]["median_abs_diff"] == pytest.approx(0.05) == rows[0]["max_abs_diff"]
