"""The GPU tier runs on the lent machine's image (Python 3.12, torch 2.11, triton 3.6, no datasets, mlflow,
onnxruntime-extensions or tensorrt): with those imports blocked (``tests/gpu_image/sitecustomize.py``), ``pytest -m
gpu`` collects every GPU test without an error, and the modules the GPU check runs import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out

ROOT = Path(__file__).parents[1]
GPU_MODULES = [
    "specdraft.runtime.decode", "specdraft.runtime.static_decode", "specdraft.runtime.backends.onnx",
    "specdraft.runtime.backends.tensorrt", "specdraft.kernels.speculative_attention",
    "specdraft.kernels.retrace_fusion", "specdraft.kernels.lm_head_argmax", "specdraft.export.onnx",
    "specdraft.export.tensorrt", "specdraft.pipeline.cli", "specdraft.pipeline.stages", "benchmarks.kernels",
    "benchmarks.gpu_decode", "benchmarks.fusion_overhead", "benchmarks.backend_costs", "benchmarks.d2sd_cost",
    "benchmarks.adaptive_goal", "benchmarks.gpu_check", "benchmarks.static_trees",
]


def _on_the_image(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "gpu_image"), str(ROOT)])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def test_the_blocked_packages_are_absent_in_the_subprocess():
    run = _on_the_image("-c", "import importlib.util as u\nfor m in ('datasets', 'mlflow', 'tensorrt'):\n"
                              "    assert u.find_spec(m) is None, m\n"
                              "try:\n    import mlflow\nexcept ModuleNotFoundError:\n    print('absent')\n")
    assert run.returncode == 0 and run.stdout.strip() == "absent", run.stderr[-2000:]


def test_pytest_collects_the_gpu_tier_without_the_missing_packages():
    run = _on_the_image("-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    files = {line.split("::")[0] for line in collected}
    assert {"tests/runtime/test_gpu.py", "tests/kernels/test_gpu_kernels.py", "tests/export/test_tensorrt.py",
            "tests/pipeline/test_train_fsdp.py"} <= files, files
    assert len(collected) >= 15 and "error" not in run.stdout.lower().split("collected")[-1]


def test_the_gpu_checks_modules_and_the_cli_import_without_them():
    code = ("import importlib, sys\n"
            f"for m in {GPU_MODULES!r}:\n"
            "    importlib.import_module(m)\n"
            "from specdraft.pipeline.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    run = _on_the_image("-c", code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "specdraft" in run.stdout


def test_kernels_are_interpreted_only_where_cuda_is_absent():
    """On a GPU the test suite runs compiled kernels (CUDA graphs capture them, ``compile_aot`` takes them): neither
    the suite's conftest nor ``make test`` sets ``TRITON_INTERPRET`` there."""
    code = ("import os, sys\nimport torch\ntorch.cuda.is_available = lambda: {cuda}\n"
            "import tests.conftest\nprint(os.environ.get('TRITON_INTERPRET'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for cuda, want in ((True, "None"), (False, "1")):
        run = subprocess.run([sys.executable, "-c", code.format(cuda=cuda)], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=120)
        assert run.returncode == 0 and run.stdout.split()[-1] == want, (cuda, run.stderr[-2000:])
    recipe = (ROOT / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]
    assert "TRITON_INTERPRET" not in recipe
