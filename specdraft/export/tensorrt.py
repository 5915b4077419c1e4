"""TensorRT engines from a fused ONNX export: the ONNX parser, one optimisation profile per batch-size bucket, a
timing cache, the custom ops as plugins (:mod:`specdraft.runtime.backends.trt_plugins`) and an engine manifest that the
TensorRT backend (:mod:`specdraft.runtime.backends.tensorrt`) checks before loading.

Supported: TensorRT 10.13 ... 11.x (the ``[trt]`` extra; AOT plugins need 10.9, CUDA 13 wheels start at 10.13).
Networks are strongly typed in both: TensorRT 11 removed the precision flags (``BuilderFlag.FP16``/``BF16``) and
always types strongly, and 10.x does so with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; so the precision is
the ONNX graphs' own: the engines are built from a fused export in the engine precision (bf16 or fp16), whose
drafter feature path stays fp32 (:class:`~specdraft.export.onnx_graphs.DrafterIngest`).

TensorRT cannot be installed on the CPU machines this project is developed on; :func:`engine_profiles`,
:func:`check_profiles` and the graph check (:func:`~specdraft.export.tensorrt_compat.check_tensorrt_compat`) run
anywhere, and the build's calls are checked there against a stand-in for TensorRT's builder
(``tests/export/test_tensorrt.py``); the build itself runs where TensorRT is.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import onnx
import torch

from specdraft.errors import TRT_MISSING, SpecdraftError
from specdraft.export.engine_shapes import EngineShapes
from specdraft.export.tensorrt_compat import check_tensorrt_compat
from specdraft.runtime.backends.custom_ops import DOMAIN, VERSION
from specdraft.runtime.backends.onnx import load_manifest, sha256_file
from specdraft.runtime.backends.trt_plugins import register_plugins, trt
from specdraft.runtime.models.retrace import N_SCALARS

ENGINE_MANIFEST = "engine_manifest.json"


def engine_profiles(manifest: dict, shapes: EngineShapes) -> dict[str, list[dict[str, tuple]]]:
    """Per graph, per bucket: ``{input: (min, opt, max)}`` shapes for every input of the graph (runs anywhere)."""
    d, t = manifest["drafter"], manifest["target"]
    F = len(d["target_layer_ids"]) * t["hidden_size"]
    out: dict[str, list[dict[str, tuple]]] = {kind: [] for kind in manifest["graphs"]}
    lo = 1
    for b in sorted(shapes.batch_sizes):
        S, N, Q = shapes.max_context, shapes.max_new, d["block_size"]
        bs = (lo, b, b)

        def dims(*spec):  # each entry an int or a (min, opt, max) triple -> (min shape, opt shape, max shape)
            spec = [s if isinstance(s, tuple) else (s, s, s) for s in spec]
            return tuple(tuple(s[i] for s in spec) for i in range(3))

        def cache(layers, heads, head_dim):
            return dims(layers, bs, heads, (0, S // 2, S), head_dim)

        draft = {"block_embeds": dims(bs, (1, Q, N), d["hidden_size"]), "positions": dims(bs, (1, Q, N)),
                 "new_mask": dims(bs, (1, Q, N), (1, Q, N)),
                 "cache_k": cache(d["num_layers"], d["num_kv_heads"], d["head_dim"]),
                 "cache_v": cache(d["num_layers"], d["num_kv_heads"], d["head_dim"]), "lengths": dims(bs)}
        if d.get("retrace"):  # the previous round's retained suffix, one entry per block slot
            D = d["hidden_size"]
            draft.update({"prior_hidden": dims(bs, (1, Q, N), 2 * D if d["retrace"]["embed_drafted"] else D),
                          "prior_signals": dims(bs, (1, Q, N), 2 * D + N_SCALARS), "prior_valid": dims(bs, (1, Q, N)),
                          "prior_shift": dims(bs)})
        out["drafter_ingest"].append({"features": dims(bs, (1, N, S), F), "positions": dims(bs, (1, N, S))})
        out["drafter_draft"].append(draft)
        out["target_verify"].append({
            "tokens": dims(bs, (1, Q, S)), "positions": dims(bs, (1, Q, S)),
            "new_mask": dims(bs, (1, Q, S), (1, Q, S)),
            "cache_k": cache(t["num_layers"], t["num_kv_heads"], t["head_dim"]),
            "cache_v": cache(t["num_layers"], t["num_kv_heads"], t["head_dim"]), "lengths": dims(bs)})
        lo = b + 1
    return out


def check_profiles(model: onnx.ModelProto, buckets: list[dict[str, tuple]]) -> list[str]:
    """Problems TensorRT would meet building ``model`` with these profiles, one line each: an input with no shape in
    a profile (the build returns no engine), a shape of another rank, a fixed dimension given another size, or
    min > opt > max."""
    problems = []
    for i, bucket in enumerate(buckets):
        for inp in model.graph.input:
            name = inp.name
            graph_dims = [d.dim_value if d.HasField("dim_value") else None for d in inp.type.tensor_type.shape.dim]
            if name not in bucket:
                problems.append(f"profile {i}: input {name} has no shape")
                continue
            lo, opt, hi = bucket[name]
            if not len(lo) == len(opt) == len(hi) == len(graph_dims):
                problems.append(f"profile {i}: input {name} has rank {len(graph_dims)}, its shapes {len(lo)}")
                continue
            for axis, (g, a, b, c) in enumerate(zip(graph_dims, lo, opt, hi)):
                if not a <= b <= c:
                    problems.append(f"profile {i}: input {name} axis {axis}: min {a}, opt {b}, max {c}")
                if g is not None and not a == b == c == g:
                    problems.append(f"profile {i}: input {name} axis {axis} is fixed at {g}, its shapes give "
                                    f"{a}..{c}")
        for name in bucket.keys() - {inp.name for inp in model.graph.input}:
            problems.append(f"profile {i}: {name} is not an input of the graph")
    return problems


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


PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}
"""Engine precision -> the dtype its ONNX export must have."""


def network_flags() -> int:
    """Strongly typed: the flag on TensorRT 10.x; on 11.x, where networks always are, it is ignored or absent."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def build_engines(onnx_dir: str | Path, out_dir: str | Path, shapes: EngineShapes,
                  timing_cache: str | Path | None = None, sm: int | None = None) -> Path:
    """Build one engine per graph of a fused export in ``shapes.precision`` into ``out_dir``; returns the engine
    manifest's path. ``sm``: the GPU's SM version (default: the current device's)."""
    if trt is None:
        raise SpecdraftError(TRT_MISSING)
    onnx_dir, out = Path(onnx_dir), Path(out_dir)
    m = load_manifest(onnx_dir)
    if m["flavour"] != "fused":
        raise SpecdraftError(f"{onnx_dir} is a {m['flavour']} export: TensorRT engines are built from the fused one")
    if m["dtype"] != PRECISIONS[shapes.precision]:
        raise SpecdraftError(f"{onnx_dir} is a {m['dtype']} export, the engines are {shapes.precision}: TensorRT "
                             f"types strongly, so export the graphs in {PRECISIONS[shapes.precision]} first")
    profiles = engine_profiles(m, shapes)
    for kind, g in m["graphs"].items():
        model = onnx.load(str(onnx_dir / g["file"]), load_external_data=False)
        problems = check_tensorrt_compat(model) + check_profiles(model, profiles[kind])
        if problems:
            raise SpecdraftError(f"{kind}: {problems[0]} ({len(problems)} problem(s))")
    if sm is None:
        major, minor = torch.cuda.get_device_capability()
        sm = 10 * major + minor
    register_plugins(sm)
    out.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = Path(timing_cache) if timing_cache else out / "timing.cache"
    engines, start = {}, time.perf_counter()
    for kind, g in m["graphs"].items():
        network = builder.create_network(network_flags())
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(_with_plugin_fields(onnx_dir / g["file"]))):
            raise SpecdraftError(f"{kind}: TensorRT's parser failed: {parser.get_error(0).desc()}")
        config = builder.create_builder_config()  # no precision flags: the network is strongly typed
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
        for bucket in profiles[kind]:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in bucket.items():
                profile.set_shape(name, lo, opt, hi)
            if config.add_optimization_profile(profile) < 0:
                raise SpecdraftError(f"{kind}: TensorRT refused an optimisation profile ({bucket})")
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
                             "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "sm": sm},
                "build_seconds": round(time.perf_counter() - start, 1)}
    path = out / ENGINE_MANIFEST
    path.write_text(json.dumps(manifest, indent=2))
    return path
