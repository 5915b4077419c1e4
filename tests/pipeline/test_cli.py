"""Mistakes are answered before the heavy imports: a missing file, a missing extra or a bad key costs the config
module's import at most (torch), never Lightning, transformers or MLflow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
HEAVY = ("lightning", "transformers", "mlflow", "datasets")


def _main(*argv: str) -> dict:
    code = ("import json, sys\nfrom specdraft.pipeline.cli import main\n"
            f"rc = main({list(argv)!r})\n"
            f"print(json.dumps({{'rc': rc, 'loaded': [m for m in {HEAVY!r} + ('torch',) if m in sys.modules]}}))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return {**json.loads(run.stdout.splitlines()[-1]), "err": run.stderr.strip()}


@pytest.mark.parametrize(("argv", "message", "torch"), [
    (("decode", "configs/nope.yaml", "--input", "x", "--output", "y"), "config file configs/nope.yaml not found",
     False),
    (("decode", "configs/tiny.yaml", "--input", "nope.jsonl", "--output", "y"), "input file nope.jsonl not found",
     False),
    (("init-drafter", "--target", "/nonexistent", "--out", "x"), "--target /nonexistent does not exist", False),
    (("train", "configs/tiny.yaml", "train.lrr=3"), "did you mean 'train.lr'", True),
    (("decode", "configs/tiny.yaml", "target.path=/nonexistent", "--input", "README.md", "--output", "y"),
     "'target.path': /nonexistent does not exist", True),
])
def test_a_mistake_is_one_line_before_the_heavy_imports(argv, message, torch):
    got = _main(*argv)
    assert got["rc"] == 2 and message in got["err"] and len(got["err"].splitlines()) == 1
    assert not set(got["loaded"]) & set(HEAVY), got["loaded"]
    assert ("torch" in got["loaded"]) == torch


def test_tensorrt_missing_is_said_before_any_export():
    import importlib.util  # noqa: PLC0415  (this test only)

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    got = _main("export", "configs/tiny.yaml", "--to", "trt")
    assert got["rc"] == 2 and "TensorRT is not installed" in got["err"] and got["loaded"] == []


def test_explain_prints_a_keys_description_value_and_type(capsys):
    from specdraft.pipeline.cli import main  # noqa: PLC0415  (the other tests run it in a subprocess)

    assert main(["train", "configs/tiny.yaml", "train.max_steps=9", "--explain", "train.max_steps"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.max_steps (int) = 9\n") and "wins over ``epochs``" in out
    assert main(["decode", "configs/tiny.yaml", "--input", "x", "--output", "y", "--explain", "drafter"]) == 0
    assert "a section (arch, num_layers, block_size" in capsys.readouterr().out
    assert main(["train", "configs/tiny.yaml", "--explain", "decode.drafte"]) == 2
    assert "did you mean 'drafter'?" in capsys.readouterr().err
