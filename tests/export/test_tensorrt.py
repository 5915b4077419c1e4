"""The TensorRT path up to the parser, on any machine: the fused graphs pass the parser-compatibility check (and a
graph with an unsupported node, a plugin with wrong attributes or an unknown domain fails it); the plugin's Triton
kernel compiles ahead of time to PTX for a Hopper GPU without one; the optimisation profiles cover every bucket; an
engine manifest is refused when it does not match. Engine builds and TensorRT decoding are GPU tests that skip
where TensorRT is not installed."""

import copy
import json
import os
import subprocess
import sys

import onnx
import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.export.onnx import weights_hash
from specdraft.export.tensorrt import EngineShapes, build_engines, engine_profiles
from specdraft.export.tensorrt_compat import check_tensorrt_compat, parser_ops
from specdraft.kernels.dispatch import HAVE_TRITON
from specdraft.runtime.backends.onnx import load_manifest, sha256_file
from specdraft.runtime.backends.tensorrt import ENGINE_MANIFEST, TrtDrafter, TrtTarget, load_engine_manifest, trt
from specdraft.runtime.decode import GenerationConfig, generate
from tests.helpers import requires_cuda


def _graph(out, kind="target_verify"):
    return onnx.load(str(out / load_manifest(out)["graphs"][kind]["file"]))


def test_every_exported_graph_passes_the_parser_check(exported):
    _, _, out = exported
    for kind in load_manifest(out)["graphs"]:
        assert check_tensorrt_compat(_graph(out, kind)) == [], kind
    assert "10.1" in parser_ops()["parser"] and "source" in parser_ops()


def test_the_check_fails_on_what_the_parser_would_refuse(exported):
    _, _, out = exported
    model = _graph(out)
    bad = copy.deepcopy(model)
    bad.graph.node[3].op_type = "BitShift"  # no TensorRT support
    assert any("BitShift" in p and "not supported" in p for p in check_tensorrt_compat(bad))
    alien = copy.deepcopy(model)
    alien.graph.node[0].domain = "com.example"
    assert any("com.example" in p for p in check_tensorrt_compat(alien))
    old = copy.deepcopy(model)
    for imp in old.opset_import:
        if imp.domain == "":
            imp.version = 8
    assert any("opset 8" in p for p in check_tensorrt_compat(old))
    custom = [n for n in model.graph.node if n.domain == "specdraft"]
    if custom:  # the fused flavour: a plugin node whose attributes do not match the plugin's
        renamed = copy.deepcopy(model)
        node = next(n for n in renamed.graph.node if n.domain == "specdraft")
        node.attribute[0].name = "softmax_scale"
        assert any("attributes" in p for p in check_tensorrt_compat(renamed))
        unknown = copy.deepcopy(model)
        next(n for n in unknown.graph.node if n.domain == "specdraft").op_type = "TreeAttention"
        assert any("no plugin" in p for p in check_tensorrt_compat(unknown))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")
def test_the_plugin_kernel_compiles_to_ptx_for_hopper_without_a_gpu():
    code = ("from specdraft.kernels.speculative_attention import compile_aot\n"
            "k = compile_aot('bf16', 128, 4, 128 ** -0.5, arch=90)\n"
            "print(k.metadata.name, k.metadata.num_warps, k.metadata.shared)\n"
            "print(k.asm['ptx'])\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compile, do not interpret
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head, ptx = run.stdout.split("\n", 1)
    name, warps, shared = head.split()
    assert name == "_speculative_attention_aot_kernel" and int(warps) > 0 and int(shared) > 0
    assert ".target sm_90" in ptx and f".entry {name}(" in ptx
    params = ptx.split(f".entry {name}(")[1].split(")")[0]
    assert params.count(".param") >= 10  # Q K V Lens Bits | T W Hkv S | Out (TensorRT's order)


def test_profiles_cover_every_bucket_with_min_opt_max(exported):
    _, _, out = exported
    profiles = engine_profiles(load_manifest(out), EngineShapes([1, 4, 16], max_context=512, max_new=64))
    for kind, buckets in profiles.items():
        assert len(buckets) == 3
        lows = [b[next(iter(b))][0][0] for b in buckets]
        highs = [b[next(iter(b))][2][0] for b in buckets]
        assert lows == [1, 2, 5] and highs == [1, 4, 16], kind
        for bucket in buckets:
            for name, (lo, opt, hi) in bucket.items():
                assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (kind, name)


def _fake_engines(out, tmp_path):
    d = tmp_path / "engines"
    d.mkdir(parents=True)
    m = load_manifest(out)
    engines = {}
    for kind, g in m["graphs"].items():
        (d / f"{kind}.engine").write_bytes(kind.encode())
        engines[kind] = {"file": f"{kind}.engine", "sha256": sha256_file(d / f"{kind}.engine"),
                         "onnx_sha256": g["sha256"], "inputs": g["inputs"], "outputs": g["outputs"], "profiles": []}
    manifest = {"format": "specdraft-tensorrt", "engines": engines, "onnx_manifest": m, "precision": "bf16",
                "versions": {"tensorrt": "10.13", "cuda": "13.0", "gpu": "NVIDIA H200", "sm": 90}}
    (d / ENGINE_MANIFEST).write_text(json.dumps(manifest))
    return d


def test_an_engine_manifest_that_does_not_match_is_refused_in_one_line(exported, tmp_path):
    target, drafter, out = exported
    d = _fake_engines(out, tmp_path)
    assert load_engine_manifest(d, weights_hash(drafter), weights_hash(target), check_runtime=False)
    with pytest.raises(SpecdraftError, match="another drafter"):
        load_engine_manifest(d, drafter_sha256="0" * 64, check_runtime=False)
    with pytest.raises(SpecdraftError, match="another target"):
        load_engine_manifest(d, target_sha256="0" * 64, check_runtime=False)
    current = load_manifest(out)
    assert load_engine_manifest(d, onnx_manifest=current, check_runtime=False)
    reexported = json.loads(json.dumps(current))
    reexported["graphs"]["target_verify"]["sha256"] = "0" * 64  # the drafter or target was exported again
    with pytest.raises(SpecdraftError, match="another ONNX export"):
        load_engine_manifest(d, onnx_manifest=reexported, check_runtime=False)
    (d / "drafter_draft.engine").write_bytes(b"tampered")
    with pytest.raises(SpecdraftError, match="changed after the build"):
        load_engine_manifest(d, check_runtime=False)
    with pytest.raises(SpecdraftError, match="no engine_manifest.json"):
        load_engine_manifest(tmp_path, check_runtime=False)
    if trt is None:
        with pytest.raises(SpecdraftError, match="TensorRT is not installed"):
            load_engine_manifest(_fake_engines(out, tmp_path / "again"))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(trt is None, reason="TensorRT is not installed (pip install '.[trt]' from NVIDIA's index)")
def test_tensorrt_engines_decode_the_targets_greedy_output(exported, tmp_path):
    target, drafter, out = exported
    if load_manifest(out)["flavour"] != "fused":
        pytest.skip("engines are built from the fused flavour")
    build_engines(out, tmp_path / "trt", EngineShapes([1, 4], max_context=64, max_new=16, precision="fp16"))
    prompts, gen = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4]], GenerationConfig(max_new_tokens=[10, 8, 12])
    got = generate(TrtTarget(tmp_path / "trt"), prompts, gen, drafter=TrtDrafter(tmp_path / "trt", out))
    with torch.no_grad():
        want = generate(target.half().cuda(), prompts, gen)
    assert [r.tokens for r in got] == [r.tokens for r in want]
