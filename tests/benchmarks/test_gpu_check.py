"""The GPU check fits the device machine's 600 s per command: one deadline, each step capped at the time left and
killed when it runs over, every step's result written as it finishes, GPU steps skipped after a failed smoke step."""

import json
import sys
import time

from benchmarks.gpu_check import ROOT, Step, default_steps, main, run_steps, summary

PY = sys.executable


def test_a_step_that_outlives_the_deadline_is_killed_and_the_report_still_written(tmp_path):
    steps = [Step("smoke", 30, [[PY, "-c", "import json, sys; json.dump({'device': 'x'}, open(sys.argv[1], 'w'))",
                                 "{out}/smoke.json"]], gpu=False),
             Step("slow", 300, [[PY, "-c", "import time; time.sleep(60)"]]),
             Step("later", 300, [[PY, "-c", "pass"]])]
    start = time.monotonic()
    report = run_steps(steps, tmp_path, deadline_s=5, reserve_s=1, min_step_s=1)
    assert time.monotonic() - start < 8  # the deadline (5 s) and the kill, not the step's 60 s
    s = report["steps"]
    assert s["smoke"]["status"] == "passed" and s["smoke"]["figures"] == {"device": "x"}
    assert s["slow"]["status"] == "timeout" and s["slow"]["seconds"] <= 5
    assert s["later"]["status"] == "skipped" and "left of the deadline" in s["later"]["why"]
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert "timeout" in summary(report) and len(summary(report).splitlines()) == 4


def test_a_failed_smoke_step_skips_the_gpu_steps_and_missing_artifacts_are_named(tmp_path):
    steps = [Step("smoke", 30, [[PY, "-c", "raise SystemExit(3)"]], gpu=False),
             Step("kernels", 30, [[PY, "-c", "pass"]]),
             Step("world", 30, [[PY, "-c", "pass"]], needs=["artifacts/no-such-world"], gpu=False)]
    report = run_steps(steps, tmp_path, deadline_s=60)["steps"]
    assert report["smoke"]["status"] == "failed" and report["smoke"]["rc"] == 3
    assert report["kernels"] == {"status": "skipped", "why": "the smoke step failed"}
    assert report["world"]["why"] == "artifacts/no-such-world is absent"


def test_the_prepared_steps_fit_the_command_and_name_real_scripts(tmp_path):
    steps = default_steps()
    assert steps[0].name == "smoke" and steps[0].cap_s <= 30
    for step in steps:
        for argv in step.commands:
            scripts = [a for a in argv if a.endswith(".py") and a.startswith("benchmarks/")]
            assert all((ROOT / a).is_file() for a in scripts), scripts
    assert main(["--out", str(tmp_path), "--only", "smoke", "--deadline", "60"]) in (0, 1)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["steps"]) == ["smoke"] and report["steps"]["smoke"]["seconds"] < 30
    assert report["deadline_s"] == 60
