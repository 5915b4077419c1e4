"""The export stage (``specdraft export CONFIG --to hf|onnx|trt``) and the engine backends decode and bench load.

A drafter export directory (HF layout, written by training) gains, beside its weights::

    onnx/decomposed/   standard ONNX ops: ONNX Runtime anywhere (decode.backend=onnx)
    onnx/fused/        speculative attention as ``specdraft`` custom-op nodes: what TensorRT builds from
    onnx/trt/          the fused graphs in the engines' precision (bf16 or fp16; TensorRT types strongly)
    trt/               TensorRT engines built from onnx/trt (decode.backend=trt)

each with its manifest; the stage logs them to MLflow as a new version of the drafter's registered model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdraft.errors import TRT_MISSING, SpecdraftError
from specdraft.export.onnx import export_onnx, weights_hash
from specdraft.export.tensorrt import PRECISIONS, build_engines
from specdraft.pipeline.config import RunConfig
from specdraft.pipeline.tracking import Tracker
from specdraft.runtime.backends.onnx import OnnxDrafter, OnnxTarget, load_manifest
from specdraft.runtime.backends.tensorrt import TrtDrafter, TrtTarget, load_engine_manifest
from specdraft.runtime.backends.trt_plugins import trt
from specdraft.runtime.drafter_io import check_compatible, load_drafter, read_drafter_config
from specdraft.runtime.load import (
    load_safetensors_dir,
    load_target,
    read_target_args,
    target_fingerprint,
    weights_fingerprint,
)
from specdraft.runtime.models import resolve_drafter

TARGETS = ("hf", "onnx", "trt")


def export_dirs(drafter_dir: Path) -> dict[str, Path]:
    return {"hf": drafter_dir, "onnx": drafter_dir / "onnx" / "decomposed", "fused": drafter_dir / "onnx" / "fused",
            "trt_onnx": drafter_dir / "onnx" / "trt", "trt": drafter_dir / "trt"}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_export(cfg: RunConfig, world, drafter_dir: Path, to: str, tracker: Tracker, log=print) -> dict[str, Path]:
    """Write the ``to`` artifacts of the drafter in ``drafter_dir`` (``trt`` includes ``onnx``); returns them."""
    if to not in TARGETS:
        raise SpecdraftError(f"--to {to!r} is not one of {', '.join(TARGETS)}")
    if to == "trt" and trt is None:  # before minutes of ONNX export
        raise SpecdraftError(TRT_MISSING)
    arch, dcfg = read_drafter_config(drafter_dir)
    check_compatible(dcfg, read_target_args(world.target_dir))  # before any weight is read
    dirs = export_dirs(drafter_dir)
    written = {"hf": drafter_dir}
    metrics = {}
    if to in ("onnx", "trt"):
        target = load_target(world.target_dir, dtype="float32", device="cpu")
        drafter = load_drafter(drafter_dir, target)
        fingerprint = target_fingerprint(world.target_dir)
        for flavour, key in (("decomposed", "onnx"), ("fused", "fused")):
            t0 = time.perf_counter()
            export_onnx(drafter, target, dirs[key], fingerprint, flavour)
            metrics[f"export/{key}_seconds"] = time.perf_counter() - t0
            metrics[f"export/{key}_bytes"] = _size(dirs[key])
            written[key] = dirs[key]
    if to == "trt":
        t0 = time.perf_counter()
        dtype = getattr(torch, PRECISIONS[cfg.export.trt.precision])
        export_onnx(drafter, target, dirs["trt_onnx"], fingerprint, "fused", dtype=dtype)
        written["trt_onnx"] = dirs["trt_onnx"]
        build_engines(dirs["trt_onnx"], dirs["trt"], cfg.export.trt)
        metrics["export/trt_seconds"] = time.perf_counter() - t0
        metrics["export/trt_bytes"] = _size(dirs["trt"])
        written["trt"] = dirs["trt"]
    tracker.log_metrics(metrics)
    for key, path in written.items():
        if key != "hf":
            tracker.log_artifact(path, f"{to}/{key}")
    version = tracker.register_model(to, f"{cfg.name}-{arch}", tags={
        "backend": to, "drafter": str(drafter_dir), "export_name": drafter_dir.name,
        "target_fingerprint": weights_fingerprint(world.target_dir)}) if to != "hf" else None
    for key, path in written.items():
        log(f"export: {key} -> {path}" + (f" ({_size(path) / 1e6:.1f} MB)" if key != "hf" else ""))
    if version:
        log(f"export: registered model {cfg.name}-{arch} version {version}")
    return written


def drafter_weights_hash(drafter_dir: Path) -> str:
    """The hash an export records for the drafter in ``drafter_dir`` (its weights in fp32, read without a target)."""
    arch, cfg = read_drafter_config(drafter_dir)
    model = resolve_drafter(arch)(cfg)
    try:
        model.load_state_dict(load_safetensors_dir(drafter_dir))
    except RuntimeError as e:
        raise SpecdraftError(f"drafter weights in {drafter_dir} do not match its config: "
                             f"{str(e).splitlines()[-1].strip()}") from None
    return weights_hash(model.float())


def check_engine_tokens(drafter_dir: Path, tokens: int, key: str, what: str) -> None:
    """Refuse, before decoding, a pass of ``tokens`` new tokens (``what``, set by config key ``key``) that the
    TensorRT engines exported with the drafter in ``drafter_dir`` were not built for (``export.trt.max_new`` new
    tokens per pass)."""
    built = load_engine_manifest(export_dirs(drafter_dir)["trt"], check_runtime=False)["shapes"]["max_new"]
    if tokens > built:
        raise SpecdraftError(f"config key 'decode.{key}': {what} {tokens} tokens in one pass, the TensorRT engines "
                             f"in {export_dirs(drafter_dir)['trt']} take at most {built} (rebuild with a larger "
                             f"export.trt.max_new, or lower decode.{key})")


def backend_models(backend: str, drafter_dir: Path, world, with_drafter: bool = True, with_target: bool = True):
    """``(target or None, drafter or None)`` on ``backend`` (onnx, trt) from the exports of the drafter in
    ``drafter_dir`` (they hold the target too), checked against the configured target (its fingerprint) and the
    drafter (its weights) before any session or engine is built."""
    dirs = export_dirs(drafter_dir)
    drafter_sha = drafter_weights_hash(drafter_dir)
    fingerprint = target_fingerprint(world.target_dir)
    if backend == "onnx":
        m = load_manifest(dirs["onnx"], drafter_sha256=drafter_sha, target_fingerprint=fingerprint)
        return (OnnxTarget(dirs["onnx"], manifest=m) if with_target else None,
                OnnxDrafter(dirs["onnx"], manifest=m) if with_drafter else None)
    if backend != "trt":
        raise SpecdraftError(f"backend {backend!r} is not one of torch, onnx, trt")
    fused = load_manifest(dirs["trt_onnx"], drafter_sha256=drafter_sha, target_fingerprint=fingerprint)
    m = load_engine_manifest(dirs["trt"], drafter_sha256=drafter_sha, onnx_manifest=fused)
    return (TrtTarget(dirs["trt"], manifest=m) if with_target else None,
            TrtDrafter(dirs["trt"], dirs["trt_onnx"], manifest=m) if with_drafter else None)
