"""benchmarks/opening_acceptance.py: drafts accepted per round by the request's round index."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from opening_acceptance import by_round  # noqa: E402


def test_rounds_are_bucketed_by_the_requests_round_index():
    # two requests: the first accepts 3, 0, 1, 2, 2, 0, 0, 0, 1; the second 1, 2
    rows = by_round([[3, 0, 1, 2, 2, 0, 0, 0, 1], [1, 2]])
    assert [r["rounds"] for r in rows] == ["0-0", "1-1", "2-3", "4-7", "8+"]
    assert [r["count"] for r in rows] == [2, 2, 2, 4, 1]
    assert rows[0]["accepted"] == 2.0 and rows[1]["accepted"] == 1.0 and rows[3]["accepted"] == 0.5
    assert rows[0]["slots"] == [1.0, 0.5, 1.0]  # both reach slot 1; one of two reaches slot 2; it takes slot 3
    assert rows[3]["slots"][0] == pytest.approx(0.25) and rows[3]["slots"][1] == 1.0  # 2, 0, 0, 0


def test_a_bucket_no_request_reached_has_no_rates():
    rows = by_round([[1]])
    assert rows[1]["count"] == 0 and all(math.isnan(p) for p in rows[1]["slots"]) and math.isnan(rows[1]["accepted"])
