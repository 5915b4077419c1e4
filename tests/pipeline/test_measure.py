"""specdraft.pipeline.measure: the benchmarks' timer and report."""

import json

from specdraft.pipeline import measure


def test_the_timer_warms_up_then_takes_the_median_of_its_repeats(monkeypatch):
    calls, times = [], iter([5.0, 1.0, 3.0, 100.0, 2.0])
    monkeypatch.setattr(measure, "wall_seconds", lambda fn, device: (fn(), next(times))[1])
    median = measure.median_seconds(lambda: calls.append(1), "cpu", repeats=5, warmup=2)
    assert median == 3.0  # one slow repeat (100 s) does not move it
    assert len(calls) == 7  # two warm-up calls, untimed, then five timed


def test_a_report_is_printed_and_written_where_asked(tmp_path, capsys):
    path = tmp_path / "deep" / "report.json"
    report = {"tokens_per_s": 12.5, "rows": [1, 2]}
    assert measure.write_report(report, path) is report
    assert json.loads(path.read_text()) == report
    assert json.loads(capsys.readouterr().out) == report
    measure.write_report(report, echo=False)
    assert capsys.readouterr().out == ""
