"""benchmarks/batching_bound.py: the static and continuous schedules it prices, on cases worked by hand."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from batching_bound import continuous_seconds, main, static_seconds  # noqa: E402

from specdraft.runtime.cost_model import CostModel  # noqa: E402


def test_schedules_on_hand_worked_jobs():
    flat = lambda b: 1.0  # noqa: E731
    # lengths 1 and 10 in one batch of 2: 10 rounds either way (no request waits to be admitted)
    assert static_seconds([1, 10], 2, flat) == continuous_seconds([1, 10], 2, flat) == 10
    # [10, 1, 1, 1] in batches of 2: 10 + 1 rounds; slots refilled: the three short ones share the second slot
    assert static_seconds([10, 1, 1, 1], 2, flat) == 11 and continuous_seconds([10, 1, 1, 1], 2, flat) == 10
    per_row = lambda b: float(b)  # noqa: E731  (a saturated machine: a round costs its rows)
    assert static_seconds([10, 1, 1, 1], 2, per_row) == continuous_seconds([10, 1, 1, 1], 2, per_row) == 13


def test_reports_the_bound_from_a_cost_file(tmp_path):
    costs = CostModel([1, 64], [1, 2], [[1.0, 1.0], [1.0, 1.0]], [0.1, 0.1])  # flat: the two columns agree
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": {k: getattr(costs, k) for k in ("rows", "tokens", "target_s", "drafter_s")}}))
    rows = main([str(path), "--requests", "40", "--batch-sizes", "1,8"])
    assert [r["batch_size"] for r in rows] == [1, 8]
    assert rows[0]["flat_cost"] == rows[0]["measured_costs"] == 1.0  # one slot: nothing to refill
    assert rows[1]["flat_cost"] == rows[1]["measured_costs"] > 1.3  # tenfold spread: refilled slots win
