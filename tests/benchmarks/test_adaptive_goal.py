"""benchmarks/adaptive_goal.py: the adaptive rows of bench runs against the never-below-AR goal."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from adaptive_goal import main  # noqa: E402


def _run(path, cells):
    rows = []
    for (suite, temp, bs), reps in cells.items():
        cell = {"suite": suite, "temperature": temp, "batch_size": bs, "batching": "static"}
        m = sum(reps) / len(reps)
        rows += [{**cell, "method": "ar", "policy": "fixed"},
                 {**cell, "method": "dflash", "policy": "adaptive", "speedup_per_repeat": reps,
                  "speedup_ci95": [m - 0.01, m + 0.01]}]
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def test_pools_the_cells_where_drafting_does_not_pay_and_counts_the_cells_against_the_goal(tmp_path):
    run = _run(tmp_path / "a.json", {("math", 0.0, 1): [2.0, 2.2], ("code", 1.0, 1): [0.96, 0.98],
                                     ("code", 1.0, 8): [0.94, 0.94]})
    out = main(["a", run])["a"]
    off = out["off_paying"]
    assert off["cells"] == 2 and off["pooled"] == pytest.approx(0.955) and off["at_goal"] == 1
    assert off["wholly_below"] == 1 and off["by_batch_size"] == {1: pytest.approx(0.97), 8: pytest.approx(0.94)}
    assert out["all"]["cells"] == 3 and out["all"]["at_goal"] == 2


def test_a_cell_of_one_repeat_is_printed_without_an_interval(tmp_path, capsys):
    path = tmp_path / "one.json"
    cell = {"suite": "code", "temperature": 1.0, "batch_size": 1, "batching": "static"}
    path.write_text(json.dumps({"results": [
        {**cell, "method": "ar", "policy": "fixed"},
        {**cell, "method": "dflash", "policy": "adaptive", "speedup_per_repeat": [0.96],
         "speedup_ci95": [float("nan"), float("nan")]}]}))
    main(["one", str(path)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| code"))
    assert line == "| code | 1 | 1 | static | 0.96 |"
