from types import SimpleNamespace

import pytest

from specdraft.pipeline.bench import distinct2, summarize, write_reports


def test_summarize_tau_rates_and_per_position():
    rows = [SimpleNamespace(accept_lengths=[4, 1, 2]), SimpleNamespace(accept_lengths=[3])]  # block 4: K = 3
    s = summarize(rows, block_size=4)
    assert s["tau"] == pytest.approx(10 / 4)
    assert s["acceptance_rate"] == pytest.approx((3 + 0 + 1 + 2) / (4 * 3))
    assert s["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_ar_rows_have_tau_one_and_no_positions():
    s = summarize([SimpleNamespace(accept_lengths=[1, 1, 1])], block_size=1)
    assert s["tau"] == 1.0 and s["per_position_acceptance"] == [] and s["acceptance_rate"] == 0.0


def test_distinct2_flags_loops():
    assert distinct2([[1, 2, 1, 2, 1, 2, 1, 2]]) == pytest.approx(2 / 7)
    assert distinct2([[1, 2, 3, 4]]) == 1.0


def test_reports_written(tmp_path):
    row = {"method": "dflash", "stage": "sft", "suite": "math", "temperature": 0.0, "batch_size": 1, "tau": 3.0,
           "acceptance_rate": 0.5, "per_position_acceptance": [0.8], "tokens_per_s": 100.0, "speedup": 2.0,
           "target_distinct2": 0.9}
    ar = dict(row, method="ar", stage="", tau=1.0, speedup=1.0)
    rep = write_reports([ar, row], tmp_path)
    assert "| dflash | sft | math | 0 | 1 | 3.00 |" in rep["markdown"]
    assert (tmp_path / "bench.png").stat().st_size > 1000 and (tmp_path / "bench.json").is_file()
