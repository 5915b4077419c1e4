"""The TensorRT path up to the parser, on any machine: the fused graphs pass the parser-compatibility check (and a
graph with an unsupported node, a plugin with wrong attributes or an unknown domain fails it); the plugin's Triton
kernel compiles ahead of time to PTX for a Hopper GPU without one; the optimisation profiles cover every bucket; an
engine manifest is refused when it does not match. Engine builds and TensorRT decoding are GPU tests that skip
where TensorRT is not installed."""

import copy
import json
from types import SimpleNamespace

import onnx
import pytest
import torch

from specdraft.errors import SpecdraftError
from specdraft.export import tensorrt as trt_build
from specdraft.export.onnx import export_onnx, weights_hash
from specdraft.export.tensorrt import EngineShapes, build_engines, check_profiles, engine_profiles
from specdraft.export.tensorrt_compat import check_tensorrt_compat, parser_ops
from specdraft.pipeline.exports import check_engine_tokens
from specdraft.runtime.backends.onnx import load_manifest, sha256_file
from specdraft.runtime.backends.tensorrt import (
    ENGINE_MANIFEST,
    TrtDrafter,
    TrtTarget,
    aligned_empty,
    bind,
    load_engine_manifest,
    trt,
)
from specdraft.runtime.decode import GenerationConfig, generate
from tests.helpers import make_drafter, make_target, requires_cuda, retrace_from


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


def test_passes_longer_than_the_engines_profile_are_refused_before_decoding(exported, tmp_path):
    """D²SD's branches (tree_k x block_size tokens in one draft pass) and a tree's verify pass (its nodes)."""
    _, _, out = exported
    engines = _fake_engines(out, tmp_path / "drafter").rename(tmp_path / "drafter" / "trt")  # <drafter>/trt
    m = json.loads((engines / ENGINE_MANIFEST).read_text())
    m["shapes"] = {"batch_sizes": [1, 8], "max_context": 256, "max_new": 64}
    (engines / ENGINE_MANIFEST).write_text(json.dumps(m))
    check_engine_tokens(tmp_path / "drafter", 64, "tree_k", "the branches draft")  # fits
    with pytest.raises(SpecdraftError, match="decode.tree_k.*80 tokens.*at most 64"):
        check_engine_tokens(tmp_path / "drafter", 80, "tree_k", "the branches draft")
    with pytest.raises(SpecdraftError, match="decode.tree_nodes.*the tree verifies 96 tokens.*at most 64"):
        check_engine_tokens(tmp_path / "drafter", 96, "tree_nodes", "the tree verifies")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(trt is None, reason="TensorRT is not installed (pip install '.[trt]' from NVIDIA's index)")
def test_tensorrt_engines_decode_the_targets_greedy_output(exported, tmp_path):
    target, drafter, out = exported
    if load_manifest(out)["flavour"] != "fused":
        pytest.skip("engines are built from the fused flavour")
    fp16 = tmp_path / "fp16"
    export_onnx(drafter, target, fp16, flavour="fused", dtype=torch.float16)
    build_engines(fp16, tmp_path / "trt", EngineShapes([1, 4], max_context=64, max_new=16, precision="fp16"))
    prompts, gen = [[1, 2, 3], [5, 4, 3, 2, 1, 0], [4]], GenerationConfig(max_new_tokens=[10, 8, 12])
    got = generate(TrtTarget(tmp_path / "trt"), prompts, gen, drafter=TrtDrafter(tmp_path / "trt", fp16))
    with torch.no_grad():
        want = generate(target.half().cuda(), prompts, gen)
    assert [r.tokens for r in got] == [r.tokens for r in want]


@pytest.mark.slow
def test_profiles_cover_every_input_of_every_graph(exported, exported_retrace):
    """Every graph input (ReTrace's prior included) has a shape in every profile, of the graph's rank and fixed
    dimensions; without the prior's shapes the check names them (TensorRT would build no engine)."""
    shapes = EngineShapes([1, 8], max_context=256, max_new=32)
    for _, _, out in (exported, exported_retrace):
        m = load_manifest(out)
        profiles = engine_profiles(m, shapes)
        for kind in m["graphs"]:
            assert check_profiles(_graph(out, kind), profiles[kind]) == [], (out, kind)
    _, _, out = exported_retrace
    profiles = engine_profiles(load_manifest(out), shapes)["drafter_draft"]
    without = [{k: v for k, v in p.items() if not k.startswith("prior_")} for p in profiles]
    assert any("prior_hidden has no shape" in p for p in check_profiles(_graph(out, "drafter_draft"), without))
    wrong = [{**p, "lengths": ((1, 1), (1, 1), (1, 1))} for p in profiles]
    assert any("lengths has rank 1" in p for p in check_profiles(_graph(out, "drafter_draft"), wrong))


class _FakeBuilder:
    """TensorRT's builder as far as :func:`build_engines` uses it, with TensorRT's rules: a network's inputs are the
    ONNX graph's; a build returns None when a profile lacks an input's shape; precision flags exist only on 10.x."""

    def __init__(self, version: str, log: dict):
        self.version, self.log = version, log

    def create_network(self, flags):
        self.log.setdefault("network_flags", []).append(flags)
        return SimpleNamespace(inputs=[], outputs=[], num_inputs=0, num_outputs=0)

    def create_builder_config(self):
        log = self.log

        class Config:
            profiles: list = []

            def set_flag(self, flag):
                log.setdefault("flags", []).append(flag)

            def create_timing_cache(self, data):
                return "cache"

            def set_timing_cache(self, cache, ignore_mismatch):
                return True

            def add_optimization_profile(self, profile):
                self.profiles.append(profile)
                return len(self.profiles) - 1

            def get_timing_cache(self):
                return SimpleNamespace(serialize=lambda: b"timing")

        return Config()

    def create_optimization_profile(self):
        shapes = {}

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
                shapes[name] = (lo, opt, hi)

        p = Profile()
        p.shapes = shapes
        return p

    def build_serialized_network(self, network, config):
        for p in config.profiles:
            if {i.name for i in network.inputs} - set(p.shapes):
                return None
        return b"engine"


def _fake_trt(version: str, log: dict):
    flags = SimpleNamespace(STRONGLY_TYPED=1) if version.startswith("10.") else SimpleNamespace()
    builder_flags = SimpleNamespace(FP16=4, BF16=5) if version.startswith("10.") else SimpleNamespace()

    class Parser:
        def __init__(self, network, logger):
            self.network = network

        def parse_from_file(self, path):
            model = onnx.load(path, load_external_data=False)
            self.network.inputs = [SimpleNamespace(name=i.name) for i in model.graph.input]
            self.network.outputs = [SimpleNamespace(name=o.name) for o in model.graph.output]
            self.network.num_inputs, self.network.num_outputs = len(model.graph.input), len(model.graph.output)
            self.network.get_input = lambda i: self.network.inputs[i]
            self.network.get_output = lambda i: self.network.outputs[i]
            return True

    logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    return SimpleNamespace(__version__=version, Logger=logger, Builder=lambda logger: _FakeBuilder(
        version, log), OnnxParser=Parser, NetworkDefinitionCreationFlag=flags, BuilderFlag=builder_flags)


@pytest.fixture(scope="module")
def exported_bf16(tmp_path_factory):
    """A fused ReTrace export in bf16 (what engines are built from)."""
    target = make_target(seed=7, vocab=6, std=0.5)
    drafter = retrace_from(make_drafter(target, seed=2, block_size=4), active=True)
    out = tmp_path_factory.mktemp("bf16")
    export_onnx(drafter, target, out, flavour="fused", dtype=torch.bfloat16)
    return target, drafter, out


@pytest.mark.slow
@pytest.mark.parametrize("version", ["10.13.3", "11.4.0"])
def test_the_engine_build_is_strongly_typed_and_profiles_every_input(exported_bf16, tmp_path, monkeypatch, version):
    """Against a stand-in for TensorRT 10.x and 11.x (which has no precision flags): strongly typed networks (the
    flag where it exists), no precision flag set, one profile per bucket covering every input (ReTrace's prior
    included), and an export in another precision than the engines' refused in one line."""
    target, drafter, out = exported_bf16
    log = {}
    monkeypatch.setattr(trt_build, "trt", _fake_trt(version, log))
    monkeypatch.setattr(trt_build, "register_plugins", lambda sm: log.setdefault("sm", sm))
    path = build_engines(out, tmp_path / "trt", EngineShapes([1, 4], max_context=64, max_new=16), sm=90)
    manifest = json.loads(path.read_text())
    assert set(manifest["engines"]) == {"drafter_ingest", "drafter_draft", "target_verify"}
    assert "prior_hidden" in manifest["engines"]["drafter_draft"]["inputs"]
    assert log["sm"] == 90 and "flags" not in log
    assert set(log["network_flags"]) == ({1 << 1} if version.startswith("10.") else {0})
    assert load_engine_manifest(tmp_path / "trt", weights_hash(drafter), weights_hash(target), check_runtime=False)
    with pytest.raises(SpecdraftError, match="bfloat16 export, the engines are fp16"):
        build_engines(out, tmp_path / "fp16", EngineShapes([1], max_context=64, max_new=16, precision="fp16"), sm=90)


class _FakeContext:
    def __init__(self, refuse: str | None = None):
        self.bound, self.refuse = {}, refuse

    def set_input_shape(self, name, shape):
        return name != self.refuse

    def set_tensor_address(self, name, address):
        self.bound[name] = address
        return address != 0 and address % 256 == 0

    def get_tensor_shape(self, name):
        return (2, 3)


def test_inputs_bind_to_valid_addresses_and_refusals_name_the_tensor():
    """An empty cache (prefill) binds the spare buffer, a misaligned view an aligned copy; a refused shape names
    its input instead of surfacing later as a failed run."""
    engine = SimpleNamespace(get_tensor_dtype=lambda name: "f32")
    spare = aligned_empty(256, "cpu")
    base = torch.zeros(1000)
    feeds = {"cache_k": torch.zeros(2, 1, 2, 0, 8), "lengths": base[1:3], "tokens": torch.ones(2, 3)}
    assert feeds["lengths"].data_ptr() % 256  # a view 4 bytes into its storage
    ctx = _FakeContext()
    keep, out = bind(ctx, engine, list(feeds), ["logits"], feeds, torch.device("cpu"), spare, {"f32": torch.float32})
    assert ctx.bound["cache_k"] == spare.data_ptr()
    assert all(a and a % 256 == 0 for a in ctx.bound.values()) and out["logits"].shape == (2, 3)
    with pytest.raises(SpecdraftError, match="input tokens of shape \\(2, 3\\)"):
        bind(_FakeContext(refuse="tokens"), engine, list(feeds), [], feeds, torch.device("cpu"), spare,
             {"f32": torch.float32})
