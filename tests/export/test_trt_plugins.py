"""The TensorRT plugin definitions against what TensorRT's plugin API enforces (a stand-in, :mod:`.fake_tensorrt`),
and the AOT kernel TensorRT would launch: its PTX's exact parameters and their order, its shared memory within what
a launch gets without opting in, and the PTX assembling for Hopper (Triton's bundled ptxas) without a GPU."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.kernels.dispatch import HAVE_TRITON
from specdraft.kernels.speculative_attention import entry_params, strip_scratch_params
from specdraft.runtime.backends import trt_plugins
from tests.export import fake_tensorrt as ft

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install '.[triton]')")


def _load_with_fake_tensorrt(monkeypatch, path=trt_plugins.__file__):
    """A fresh copy of the plugin module importing the stand-in ``tensorrt`` (the real module is left alone)."""
    trt, plugin = ft.modules()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    spec = importlib.util.spec_from_file_location("trt_plugins_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, trt


def test_the_plugins_register_under_tensorrts_signature_rules(monkeypatch):
    module, _ = _load_with_fake_tensorrt(monkeypatch)
    module.register_plugins(90)
    for plugin_id, kinds in ((module.SPECULATIVE_ATTENTION_ID, ("autotune", "aot")),
                             (module.RETRACE_FUSION_ID, ("autotune", "impl"))):
        assert all(k in ft._plugins[plugin_id] for k in kinds), plugin_id
    attention = ft.formats(module.SPECULATIVE_ATTENTION_ID)
    assert [c.types[0] for c in attention] == ["BF16", "FP16"]
    assert all(len(c.types) == 6 for c in attention)  # q k v lengths mask_bits | out
    assert all(len(c.types) == 12 for c in ft.formats(module.RETRACE_FUSION_ID))
    with pytest.raises(module.SpecdraftError, match="not sm_80"):
        module.register_plugins(80)


def test_string_annotations_are_refused_as_tensorrt_refuses_them(monkeypatch, tmp_path):
    """The stand-in fails the module as it was (``from __future__ import annotations``, ``-> list``, no return
    annotation on the AOT implementation), so it can catch a regression."""
    src = Path(trt_plugins.__file__).read_text()
    old = tmp_path / "trt_plugins_future.py"
    old.write_text("from __future__ import annotations\n" + src)
    module, _ = _load_with_fake_tensorrt(monkeypatch, old)
    with pytest.raises(ft.PluginSignatureError, match="tensor arguments come first"):
        module.register_plugins(90)
    ft.modules()

    @ft.register("t::op")
    def _desc(x: ft.TensorDesc, n: int) -> ft.TensorDesc:
        return x.like()

    with pytest.raises(ft.PluginSignatureError, match="no return annotation"):
        ft.aot_impl("t::op")(lambda x, n, outputs, tactic: None)
    with pytest.raises(ft.PluginSignatureError, match="every attribute"):
        ft.aot_impl("t::op")(lambda x, outputs, tactic: None)
    with pytest.raises(ft.PluginSignatureError, match="only AutoTuneCombination"):
        def formats(x, outputs) -> list:
            return []
        ft.autotune("t::op")(formats)


_BUILD = """
import json, sys
from tests.export import fake_tensorrt as ft
trt, plugin = ft.modules()
sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, plugin
from specdraft.runtime.backends import trt_plugins as m
m.register_plugins(90)
B, T, S = ft.ShapeExpr("B"), ft.ShapeExpr("T"), ft.ShapeExpr("S")
dtype = getattr(trt, sys.argv[1])
q, kv = ft.TensorDesc((B, 32, T, 128), dtype), ft.TensorDesc((B, 8, S, 128), dtype)
inputs = [q, kv, kv, ft.TensorDesc((B,), trt.int64), ft.TensorDesc((B, T, ft.ShapeExpr("W")), trt.int32)]
try:
    name, ptx, launch, extra = ft.build_aot(m.SPECULATIVE_ATTENTION_ID, inputs, {"scale": 128 ** -0.5})
except m.SpecdraftError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
print(json.dumps({"name": name.decode(), "ptx": ptx.decode(), "extra": [e.value for e in extra],
                  "extra_types": [type(e).__name__ for e in extra],
                  "launch": {f: getattr(launch, f).value for f in launch.FIELDS}}))
"""


@pytest.mark.slow
@needs_triton
def test_the_aot_plugin_returns_a_kernel_tensorrt_can_launch():
    """At build time (a bf16 engine of Qwen3-8B's attention shape: 32 query heads, 8 KV heads, head dim 128): the
    PTX's entry takes exactly Q K V Lens Bits | T W Hkv S | Out, the four scalars are SymInt32 expressions in that
    order, the grid follows the kernel's tile, and the shared memory fits 48 KB. An fp32 input is refused."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compile for a GPU, do not interpret
    root = str(Path(__file__).parents[2])

    def build(dtype):
        run = subprocess.run([sys.executable, "-c", _BUILD, dtype], capture_output=True, text=True, env=env,
                             timeout=300, cwd=root)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.splitlines()[-1])

    got = build("bfloat16")
    params = re.findall(r"\.param \.(u64|u32)", got["ptx"].split(f".entry {got['name']}(")[1].split(")")[0])
    assert params == ["u64"] * 5 + ["u32"] * 4 + ["u64"]
    assert got["extra"] == ["T", "W", 8, "S"] and set(got["extra_types"]) <= {"SymInt32", "ShapeExpr"}
    launch = got["launch"]
    assert 0 < launch["shared_mem"] <= 48 * 1024 and launch["block_x"] == 128 and launch["grid_y"] == "(B * 8)"
    assert launch["grid_x"].startswith("((T * 4) cdiv ")
    assert "unsupported dtype" in build("float32")["error"]


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_aot_ptx_assembles_for_hopper_with_ten_parameters(dtype, tmp_path):
    """Triton appends scratch pointers TensorRT does not pass; the kernel's PTX is left with exactly its ten
    arguments, and ptxas (bundled with Triton, no GPU needed) assembles it and reports ten kernel parameters."""
    code = ("from specdraft.kernels.speculative_attention import compile_aot\n"
            f"k = compile_aot('{dtype}', 128, 4, 128 ** -0.5, arch=90)\n"
            "print(k.name, k.num_warps, k.shared, k.block_m)\n"
            "print(k.ptx)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    head, ptx = run.stdout.split("\n", 1)
    name, warps, shared, block_m = head.split()
    assert name == "_speculative_attention_aot_kernel" and int(warps) > 0 and 0 < int(shared) <= 48 * 1024
    assert ".target sm_90" in ptx and len(entry_params(ptx, name)) == 10
    import triton  # noqa: PLC0415  (optional: the [triton] extra)

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("this triton has no bundled ptxas")
    (tmp_path / "k.ptx").write_text(ptx)
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    asm = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
                         capture_output=True, text=True, timeout=120)
    assert asm.returncode == 0, asm.stderr[-2000:]
    dump = subprocess.run([str(ptxas.parent / "cuobjdump"), "-elf", str(tmp_path / "k.o")], capture_output=True,
                          text=True, timeout=60)
    if dump.returncode == 0:
        assert dump.stdout.count("EIATTR_KPARAM_INFO") == 10


def test_scratch_parameters_the_kernel_reads_are_not_dropped():
    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n\tld.param.u64 %rd1, "
           "[k_param_1];\n}\n")
    with pytest.raises(ValueError, match="k_param_1"):
        strip_scratch_params(ptx, "k", 1)
    unused = ptx.replace("[k_param_1]", "[k_param_0]")
    assert ".param .u64 k_param_1" not in strip_scratch_params(unused, "k", 1)
