"""benchmarks/gpu_decode.py runs end to end at a tiny shape on a CPU (its CUDA-graph run is the GPU script's) and
reports every figure it promises, the static and eager engines decoding the same number of rounds."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_decode import main  # noqa: E402


def test_gpu_decode_reports_round_over_ar_step(tmp_path):
    out = tmp_path / "decode.json"
    report = main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "16",
                   "--new-tokens", "5", "--repeats", "1", "--batch-sizes", "1,3", "--block-size", "4",
                   "--out", str(out)])
    assert json.loads(out.read_text()) == report and not report["graphs"]
    for row in report["rows"]:
        assert row["spec_static_rounds"] == row["spec_eager_rounds"] > 0
        assert row["ar_static_rounds"] == row["ar_eager_rounds"] == 4  # the prefill emits the first token
        assert row["round_over_ar_step_static"] == row["spec_static_ms"] / row["ar_static_ms"] > 0
