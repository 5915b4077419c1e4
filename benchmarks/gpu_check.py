"""The prepared GPU check: every GPU test and the GPU benchmarks under one deadline (default 540 s, inside the device
machine's 600 s per command), each step capped at the time left, its result written as it finishes.

Steps, in order of what a broken environment or a short budget should still show:

1. ``smoke`` (< 30 s): versions, the device, one compiled Triton kernel against its reference. If it fails, the
   environment is broken and the other GPU steps are skipped.
2. ``pytest_gpu``: ``pytest -m gpu`` (CUDA greedy equality, goodness of fit, CUDA graphs equal to eager, compiled
   kernels at Qwen3-8B shapes, TensorRT where it imports).
3. ``kernels``: speculative attention's share of HBM peak (batch 1, 4k context) and its ratio to SDPA with a dense
   mask on a 64-node tree; ReTrace's fusion; the LM-head argmax.
4. ``decode``: a round over an AR step through CUDA graphs and eagerly, Qwen3-8B shapes, batch 1 and 8.
5. ``fusion``: ReTrace's fusion share of a round at the Qwen3-8B shape.
6. ``adaptive``, ``trees``, ``static_adaptive``, ``d2sd``, ``trt``: the tiny world's bench cells (adaptive against
   0.97x AR), every tree kind through CUDA graphs against the eager engine (τ equal at T=0, tokens/s), AR, fixed and
   adaptive DFlash through CUDA graphs, D²SD's round cost, and TensorRT engines; each only where its artifacts (and
   TensorRT) are present.

Results: ``$OUT/<step>.txt`` (its output), ``$OUT/<step>.json`` (its figures, where it has some) and
``$OUT/gpu_check.json`` (every step's status, seconds and figures; rewritten after each step); a one-screen summary at
the end. Exit status 0 when every step that ran passed.

    python benchmarks/gpu_check.py --out artifacts/gpu [--deadline 540] [--only smoke,kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_RESERVE_S = 5.0
"""Seconds kept back from the deadline for the summary."""
MIN_STEP_S = 20.0
"""A step with less time left than this is skipped, not started."""


@dataclass
class Step:
    name: str
    cap_s: float
    commands: list[list[str]]
    """Run in order, each with the step's remaining time; ``{py}`` and ``{out}`` are filled in."""
    needs: list[str] = field(default_factory=list)
    """Paths that must exist (artifacts carried over), or ``import:<module>``."""
    gpu: bool = True
    """Skipped when the smoke step failed."""


def default_steps() -> list[Step]:
    world = next(iter(sorted((ROOT / "artifacts" / "tiny").glob("world-*/target"))), None)
    world_path = str(world) if world else "artifacts/tiny/world-*/target"
    return [
        Step("smoke", 30, [["{py}", __file__, "smoke", "--json", "{out}/smoke.json"]], gpu=False),
        Step("pytest_gpu", 150, [["{py}", "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"]]),
        Step("kernels", 75, [["{py}", "benchmarks/kernels.py", "--device", "cuda", "--dtype", "bfloat16", "--out",
                              "{out}/kernels.json"]]),
        Step("decode", 120, [["{py}", "benchmarks/gpu_decode.py", "--shape", "qwen3-8b", "--device", "cuda",
                              "--dtype", "bfloat16", "--out", "{out}/decode.json"]]),
        Step("fusion", 60, [["{py}", "benchmarks/fusion_overhead.py", "--shape", "qwen3-8b", "--device", "cuda",
                             "--dtype", "bfloat16", "--out", "{out}/fusion.json"]]),
        Step("adaptive", 150, [
            ["{py}", "-m", "specdraft.pipeline.cli", "bench", "configs/tiny.yaml", f"target.path={world_path}",
             "target.device=cuda", "work_dir={out}/adaptive", "decode.drafter=artifacts/tiny/drafter/sft",
             "bench.stages=[sft]", "bench.policies=[fixed,adaptive]", "bench.batch_sizes=[1,8,32,64]",
             "bench.batching=[continuous]", "bench.length_spread=10", "bench.num_prompts=24",
             "bench.max_new_tokens=96", "bench.repeats=2", "tracking.enabled=false"],
            ["{py}", "benchmarks/adaptive_goal.py", "gpu", "{out}/adaptive/bench/bench.json"]],
             needs=[world_path, "artifacts/tiny/drafter/sft"]),
        Step("trees", 90, [["{py}", "benchmarks/static_trees.py", "configs/tiny.yaml", f"target.path={world_path}",
                             "target.device=cuda", "decode.drafter=artifacts/tiny/drafter/sft",
                             "decode.second_drafter=same", "work_dir={out}/trees", "--prompts", "16",
                             "--out", "{out}/trees.json"]],
             needs=[world_path, "artifacts/tiny/drafter/sft"]),
        Step("static_adaptive", 90, [
            ["{py}", "benchmarks/static_adaptive.py", "configs/tiny.yaml", f"target.path={world_path}",
             "target.device=cuda", "decode.drafter=artifacts/tiny/drafter/sft", "work_dir={out}/adaptive",
             "--prompts", "16", "--out", "{out}/static_adaptive.json"]],
             needs=[world_path, "artifacts/tiny/drafter/sft"]),
        Step("d2sd", 120, [["{py}", "benchmarks/d2sd_cost.py", "configs/tiny.yaml", "--prompts", "16", "--k", "4",
                            "--nodes", "48", "--budget", "measured", "--batch-sizes", "1,8,32",
                            "target.device=cuda", "--out", "{out}/d2sd.json"]],
             needs=["artifacts/tiny/drafter/vp"]),
        Step("trt", 150, [
            ["{py}", "-m", "specdraft.pipeline.cli", "export", "configs/tiny.yaml", "--to", "trt",
             "tracking.enabled=false", "export.trt.batch_sizes=[1,8]", "export.trt.max_context=1024"],
            ["{py}", "benchmarks/backend_costs.py", "configs/tiny.yaml", "--backend", "trt", "--device", "cuda",
             "--repeats", "10", "--out", "{out}/trt.json"]],
             needs=["import:tensorrt", "artifacts/tiny/drafter/sft"]),
    ]


def _missing(needs: list[str]) -> str | None:
    for need in needs:
        if need.startswith("import:"):
            import importlib.util  # noqa: PLC0415  (only for steps that need a module)

            if importlib.util.find_spec(need.removeprefix("import:")) is None:
                return f"{need.removeprefix('import:')} is not installed"
        elif not (ROOT / need).exists() and not Path(need).exists():
            return f"{need} is absent"
    return None


def _run(argv: list[str], timeout: float, log) -> tuple[int | None, float]:
    """``(exit status or None on timeout, seconds)``; a timed-out command's whole process group is killed."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        return proc.wait(timeout=max(timeout, 0.1)), time.monotonic() - start
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, time.monotonic() - start


def run_steps(steps: list[Step], out: Path, deadline_s: float, py: str = sys.executable,
              reserve_s: float = SUMMARY_RESERVE_S, min_step_s: float = MIN_STEP_S, clock=time.monotonic) -> dict:
    """Run ``steps`` within ``deadline_s`` seconds of now; returns (and keeps writing) ``out/gpu_check.json``."""
    out.mkdir(parents=True, exist_ok=True)
    end = clock() + deadline_s - reserve_s
    report = {"deadline_s": deadline_s, "steps": {}}
    smoke_ok = True
    for step in steps:
        left = end - clock()
        entry: dict = {"status": "skipped"}
        why = ("the smoke step failed" if step.gpu and not smoke_ok else _missing(step.needs)
               or (f"{left:.0f} s left of the deadline" if left < min_step_s else None))
        if why:
            entry["why"] = why
        else:
            budget = min(step.cap_s, left)
            step_end, spent = clock() + budget, 0.0
            entry.update(status="passed", budget_s=round(budget, 1))
            with open(out / f"{step.name}.txt", "w") as log:
                for argv in step.commands:
                    argv = [a.replace("{py}", py).replace("{out}", str(out)) for a in argv]
                    rc, seconds = _run(argv, step_end - clock(), log)
                    spent += seconds
                    if rc != 0:
                        entry.update(status="timeout" if rc is None else "failed", rc=rc,
                                     command=" ".join(argv[1:4]))
                        break
            entry["seconds"] = round(spent, 1)
            figures = out / f"{step.name}.json"
            if figures.is_file():
                try:
                    entry["figures"] = json.loads(figures.read_text())
                except ValueError as e:
                    entry["figures"] = {"error": f"unreadable: {e}"}
            if step.name == "smoke" and entry["status"] != "passed":
                smoke_ok = False
        report["steps"][step.name] = entry
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    return report


def _headline(name: str, figures: dict) -> str:
    """A step's figures in one line (what the GPU issue asks to report)."""
    try:
        if name == "smoke" and not figures.get("device"):
            return f"no CUDA device (torch {figures['torch']}, triton {figures['triton']})"
        if name == "smoke":
            return (f"{figures['device']}; torch {figures['torch']}, triton {figures['triton']}; kernel equal to "
                    f"reference: {figures['kernel_equal']} ({figures['compile_s']:.1f} s to compile)")
        if name == "kernels":
            rows = {r["case"]: r for r in figures["speculative_attention"]}
            chain, tree = rows["chain16 bs1 ctx4k"], rows["tree64 bs1 ctx4k"]
            return (f"attention bs1 ctx4k {chain['share_of_peak_bandwidth']:.0%} of HBM peak; 64-node tree "
                    f"{tree['speedup_vs_sdpa_masked']:.2f}x SDPA with a mask")
        if name == "decode":
            r = next(r for r in figures["rows"] if r["batch"] == 1)
            return (f"bs1 round / AR step: {r['round_over_ar_step_static']:.2f} with CUDA graphs, "
                    f"{r['round_over_ar_step_eager']:.2f} eager")
        if name == "fusion":
            return "; ".join(f"{k} fusion {v['fusion_share_of_round']:.1%} of a round" for k, v in figures.items())
    except (KeyError, TypeError, StopIteration):
        return "figures incomplete"
    return ""


def summary(report: dict) -> str:
    lines = [f"{'step':<11} {'status':<8} {'s':>6}  figures"]
    for name, e in report["steps"].items():
        detail = e.get("why") or _headline(name, e.get("figures") or {}) or (
            f"rc {e['rc']}: {e['command']}" if "rc" in e else "")
        lines.append(f"{name:<11} {e['status']:<8} {e.get('seconds', 0):>6.1f}  {detail}")
    return "\n".join(lines)


def smoke(json_path: str) -> int:
    """Versions, the device, and one compiled kernel against its reference."""
    import torch  # noqa: PLC0415  (the smoke step's own process)
    import transformers  # noqa: PLC0415

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton  # noqa: PLC0415  (the [triton] extra)

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    ok = info["device"] is not None and info["triton"] is not None and info["TRITON_INTERPRET"] != "1"
    if ok:
        from specdraft.kernels.lm_head_argmax import lm_head_argmax_reference, lm_head_argmax_triton  # noqa: PLC0415

        g = torch.Generator().manual_seed(0)
        h = torch.randn(8, 512, generator=g).to("cuda", torch.bfloat16)
        w = (torch.randn(8192, 512, generator=g) * 512 ** -0.5).to("cuda", torch.bfloat16)
        start = time.perf_counter()
        got = lm_head_argmax_triton(h, w)
        torch.cuda.synchronize()
        info["compile_s"] = time.perf_counter() - start
        info["kernel_equal"] = bool((got == lm_head_argmax_reference(h, w)).all())
        ok = info["kernel_equal"]
    Path(json_path).write_text(json.dumps(info, indent=2))
    print(json.dumps(info))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="all", choices=["all", "smoke"])
    ap.add_argument("--out", default=os.environ.get("OUT") or "artifacts/gpu")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole check")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--json", default="", help="(smoke) where to write its figures")
    args = ap.parse_args(argv)
    if args.mode == "smoke":
        return smoke(args.json or str(Path(args.out) / "smoke.json"))
    steps = default_steps()
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {s.name for s in steps}
        if unknown:
            ap.error(f"unknown steps: {', '.join(sorted(unknown))}")
        steps = [s for s in steps if s.name in names]
    report = run_steps(steps, Path(args.out), args.deadline)
    print(summary(report))
    print(f"all figures: {Path(args.out) / 'gpu_check.json'}")
    return 0 if all(e["status"] in ("passed", "skipped") for e in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
