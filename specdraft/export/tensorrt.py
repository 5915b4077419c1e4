"""TensorRT engines from a fused ONNX export: the ONNX parser, one optimisation profile per batch-size bucket, fp16 or
bf16, a timing cache, the custom ops as plugins (:mod:`specdraft.export.trt_plugins`) and an engine manifest that the
TensorRT backend (:mod:`specdraft.runtime.backends.tensorrt`) checks before loading.

TensorRT cannot be installed on the CPU machines this project is developed on; :func:`engine_profiles` and the graph
check (:func:`~specdraft.export.tensorrt_compat.check_tensorrt_compat`) run anywhere, the build where TensorRT is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import onnx
import torch

from specdraft.errors import OptionError, SpecdraftError, check_range
from specdraft.export.tensorrt_compat import check_tensorrt_compat
from specdraft.runtime.backends.custom_ops import DOMAIN, VERSION
from specdraft.runtime.backends.onnx import load_manifest, sha256_file
from specdraft.runtime.backends.trt_plugins import register_plugins, trt

ENGINE_MANIFEST = "engine_manifest.json"


@dataclass
class EngineShapes:
    """What the engines serve (``export.trt.*``): the shapes each optimisation profile covers, and the precision."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Batch-size buckets: one optimisation profile each (a batch runs in the smallest bucket that holds it)."""
    max_context: int = 4096
    """Longest context (cache slots) and longest prefill."""
    max_new: int = 64
    """Most new tokens of a draft pass (a block, or a D²SD round's branches side by side)."""
    precision: Literal["bf16", "fp16"] = "bf16"

    def __post_init__(self):
        for b in self.batch_sizes:
            check_range("batch_sizes", b, 1)
        check_range("max_context", self.max_context, 1)
        check_range("max_new", self.max_new, 1)
        if self.precision not in ("bf16", "fp16"):
            raise OptionError("precision", f"must be bf16 or fp16, got {self.precision!r}")


def engine_profiles(manifest: dict, shapes: EngineShapes) -> dict[str, list[dict[str, tuple]]]:
    """Per graph, per bucket: ``{input: (min, opt, max)}`` shapes (runs anywhere)."""
    d, t = manifest["drafter"], manifest["target"]
    F = len(d["target_layer_ids"]) * t["hidden_size"]
    out: dict[str, list[dict[str, tuple]]] = {kind: [] for kind in manifest["graphs"]}
    lo = 1
    for b in sorted(shapes.batch_sizes):
        S, N = shapes.max_context, shapes.max_new
        bs = (lo, b, b)

        def dims(*spec):  # each entry an int or a (min, opt, max) triple -> (min shape, opt shape, max shape)
            spec = [s if isinstance(s, tuple) else (s, s, s) for s in spec]
            return tuple(tuple(s[i] for s in spec) for i in range(3))

        def cache(layers, heads, head_dim):
            return dims(layers, bs, heads, (0, S // 2, S), head_dim)

        out["drafter_ingest"].append({"features": dims(bs, (1, N, S), F), "positions": dims(bs, (1, N, S))})
        out["drafter_draft"].append({
            "block_embeds": dims(bs, (1, d["block_size"], N), d["hidden_size"]),
            "positions": dims(bs, (1, d["block_size"], N)),
            "new_mask": dims(bs, (1, d["block_size"], N), (1, d["block_size"], N)),
            "cache_k": cache(d["num_layers"], d["num_kv_heads"], d["head_dim"]),
            "cache_v": cache(d["num_layers"], d["num_kv_heads"], d["head_dim"]), "lengths": dims(bs)})
        out["target_verify"].append({
            "tokens": dims(bs, (1, d["block_size"], S)), "positions": dims(bs, (1, d["block_size"], S)),
            "new_mask": dims(bs, (1, d["block_size"], S), (1, d["block_size"], S)),
            "cache_k": cache(t["num_layers"], t["num_kv_heads"], t["head_dim"]),
            "cache_v": cache(t["num_layers"], t["num_kv_heads"], t["head_dim"]), "lengths": dims(bs)})
        lo = b + 1
    return out


def _with_plugin_fields(path: Path) -> Path:
    """A copy of the graph at ``path`` whose custom nodes name their plugin's namespace and version (what the ONNX
    parser's plugin fallback reads), saved beside it so external weight files still resolve (no 2 GB limit)."""
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.attribute.extend([onnx.helper.make_attribute("plugin_namespace", DOMAIN),
                                   onnx.helper.make_attribute("plugin_version", str(VERSION))])
    out = path.with_suffix(".trt.onnx")
    onnx.save(model, str(out))
    return out


def build_engines(onnx_dir: str | Path, out_dir: str | Path, shapes: EngineShapes,
                  timing_cache: str | Path | None = None) -> Path:
    """Build one engine per graph of a fused export into ``out_dir``; returns the engine manifest's path."""
    if trt is None:
        raise SpecdraftError("TensorRT is not installed (pip install '.[trt]' from NVIDIA's index on a GPU machine)")
    onnx_dir, out = Path(onnx_dir), Path(out_dir)
    m = load_manifest(onnx_dir)
    if m["flavour"] != "fused":
        raise SpecdraftError(f"{onnx_dir} is a {m['flavour']} export: TensorRT engines are built from the fused one")
    for kind, g in m["graphs"].items():
        problems = check_tensorrt_compat(onnx_dir / g["file"])
        if problems:
            raise SpecdraftError(f"{kind}: {problems[0]} ({len(problems)} problem(s))")
    major, minor = torch.cuda.get_device_capability()
    register_plugins(10 * major + minor)
    out.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = Path(timing_cache) if timing_cache else out / "timing.cache"
    engines, start = {}, time.perf_counter()
    profiles = engine_profiles(m, shapes)
    for kind, g in m["graphs"].items():
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(_with_plugin_fields(onnx_dir / g["file"]))):
            raise SpecdraftError(f"{kind}: TensorRT's parser failed: {parser.get_error(0).desc()}")
        config = builder.create_builder_config()
        config.set_flag({"bf16": trt.BuilderFlag.BF16, "fp16": trt.BuilderFlag.FP16}[shapes.precision])
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
        for bucket in profiles[kind]:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in bucket.items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise SpecdraftError(f"{kind}: TensorRT could not build the engine (see the log above)")
        path = out / f"{kind}.engine"
        path.write_bytes(bytes(plan))
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
        engines[kind] = {"file": path.name, "sha256": sha256_file(path), "onnx_sha256": g["sha256"],
                         "inputs": [network.get_input(i).name for i in range(network.num_inputs)],
                         "outputs": [network.get_output(i).name for i in range(network.num_outputs)],
                         "profiles": [{k: [list(s) for s in v] for k, v in p.items()} for p in profiles[kind]]}
    manifest = {"format": "specdraft-tensorrt", "engines": engines, "onnx_manifest": m, "precision": shapes.precision,
                "shapes": {"batch_sizes": list(shapes.batch_sizes), "max_context": shapes.max_context,
                           "max_new": shapes.max_new},
                "versions": {"tensorrt": trt.__version__, "cuda": torch.version.cuda,
                             "gpu": torch.cuda.get_device_name(), "sm": 10 * major + minor},
                "build_seconds": round(time.perf_counter() - start, 1)}
    path = out / ENGINE_MANIFEST
    path.write_text(json.dumps(manifest, indent=2))
    return path
