"""TensorRT backend: engines built by :mod:`specdraft.export.tensorrt` behind the engine's interfaces
(:class:`TrtTarget`, :class:`TrtDrafter`; the shared half is :mod:`.exported`), on CUDA tensors.

:func:`load_engine_manifest` refuses, in one line, engines this machine or this run must not load: another TensorRT
version or GPU, engine or ONNX files changed since the build, or an export of another drafter or target.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.errors import TRT_MISSING, SpecdraftError
from specdraft.runtime.backends.exported import ExportedDrafter, ExportedTarget
from specdraft.runtime.backends.onnx import load_manifest, read_manifest, sha256_file
from specdraft.runtime.backends.trt_plugins import register_plugins, trt

_TORCH_DTYPES = {}
if trt is not None:
    _TORCH_DTYPES = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                     trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}

ENGINE_MANIFEST = "engine_manifest.json"
FORMAT = "specdraft-tensorrt"


def load_engine_manifest(engine_dir: str | Path, drafter_sha256: str | None = None,
                         target_sha256: str | None = None, check_runtime: bool = True,
                         onnx_manifest: dict | None = None) -> dict:
    """Read and check an engine manifest (one clear line per refusal); ``onnx_manifest`` is the current fused ONNX
    export's, whose graphs the engines must have been built from."""
    d = Path(engine_dir)
    m = read_manifest(d / ENGINE_MANIFEST, FORMAT, f"{d} holds no TensorRT engines: no {ENGINE_MANIFEST} (run "
                      "specdraft export CONFIG --to trt)")
    for kind, e in m["engines"].items():
        f = d / e["file"]
        if not f.is_file():
            raise SpecdraftError(f"{d}: engine {kind} ({e['file']}) is missing")
        if sha256_file(f) != e["sha256"]:
            raise SpecdraftError(f"{f} does not match its manifest hash: the engine was changed after the build")
        if onnx_manifest is not None and e["onnx_sha256"] != onnx_manifest["graphs"][kind]["sha256"]:
            raise SpecdraftError(f"{f} was built from another ONNX export than the current one (the drafter or "
                                 "target was exported again): rebuild with specdraft export CONFIG --to trt")
    onnx = m["onnx_manifest"]
    if drafter_sha256 is not None and onnx["drafter"]["weights_sha256"] != drafter_sha256:
        raise SpecdraftError(f"{d} was built for another drafter (weights sha256 "
                             f"{onnx['drafter']['weights_sha256'][:12]}, this drafter {drafter_sha256[:12]}): "
                             "rebuild")
    if target_sha256 is not None and onnx["target"]["weights_sha256"] != target_sha256:
        raise SpecdraftError(f"{d} was built for another target (weights sha256 "
                             f"{onnx['target']['weights_sha256'][:12]}, this target {target_sha256[:12]}): rebuild")
    if check_runtime:
        if trt is None:
            raise SpecdraftError(TRT_MISSING)
        v = m["versions"]
        if v["tensorrt"] != trt.__version__:
            raise SpecdraftError(f"{d} was built with TensorRT {v['tensorrt']}, this is {trt.__version__}: rebuild")
        if not torch.cuda.is_available():
            raise SpecdraftError("TensorRT engines need a CUDA GPU")
        major, minor = torch.cuda.get_device_capability()
        if v["sm"] != 10 * major + minor:
            raise SpecdraftError(f"{d} was built for sm_{v['sm']} ({v['gpu']}), this GPU is sm_{10 * major + minor} "
                                 f"({torch.cuda.get_device_name()}): rebuild")
    return m


ALIGNMENT = 256
"""TensorRT wants every tensor address non-null and 256-byte aligned (``IExecutionContext::setTensorAddress``)."""


def aligned_empty(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``[nbytes]`` uint8 at an address aligned to :data:`ALIGNMENT` (on any device's allocator)."""
    buf = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, device=device)
    start = -buf.data_ptr() % ALIGNMENT
    return buf[start:start + nbytes]


def _address(t: torch.Tensor, spare: torch.Tensor, keep: list) -> int:
    """Where to bind ``t``: a spare aligned buffer for an empty tensor (an empty cache at prefill has no storage, so
    a null or unaligned pointer), an aligned copy for a misaligned view, else its own storage."""
    if t.numel() == 0:
        return spare.data_ptr()
    if t.data_ptr() % ALIGNMENT:
        t = aligned_empty(t.numel() * t.element_size(), t.device).view(t.dtype).view(t.shape).copy_(t)
    keep.append(t)
    return t.data_ptr()


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SpecdraftError(f"TensorRT refused {what} (see its log above)")


def bind(context, engine, inputs: list[str], outputs: list[str], feeds: dict[str, torch.Tensor],
         device: torch.device, spare: torch.Tensor, dtypes: dict) -> tuple[list, dict[str, torch.Tensor]]:
    """Set every input's shape and address (each cast to the dtype the engine declares), then allocate and bind the
    outputs at the shapes TensorRT infers; returns ``(tensors to keep alive until the run ends, outputs)``."""
    keep: list[torch.Tensor] = []
    for name in inputs:
        t = feeds[name].to(device, dtypes[engine.get_tensor_dtype(name)]).contiguous()
        _check(context.set_input_shape(name, tuple(t.shape)), f"input {name} of shape {tuple(t.shape)}")
        _check(context.set_tensor_address(name, _address(t, spare, keep)), f"the address of input {name}")
    out = {}
    for name in outputs:
        shape = tuple(context.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise SpecdraftError(f"TensorRT could not infer output {name}'s shape ({shape}) from the inputs")
        out[name] = torch.empty(shape, dtype=dtypes[engine.get_tensor_dtype(name)], device=device)
        _check(context.set_tensor_address(name, _address(out[name], spare, keep)), f"the address of output {name}")
    return keep, out


class _Engine:
    """One deserialised engine run on torch CUDA tensors (each input cast to the dtype the engine declares); the
    profile is the smallest bucket holding the batch."""

    def __init__(self, path: Path, entry: dict, runtime):
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise SpecdraftError(f"{path}: TensorRT could not deserialise the engine")
        self.context = self.engine.create_execution_context()
        self.inputs, self.outputs = entry["inputs"], entry["outputs"]
        self.max_batch = [p[self.inputs[0]][2][0] for p in entry["profiles"]]  # per profile, dim 0 of its max shape
        self.spare = aligned_empty(ALIGNMENT, "cuda")  # empty tensors' address

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        B = feeds[self.inputs[0]].shape[0]
        profile = next((i for i, b in enumerate(self.max_batch) if B <= b), None)
        if profile is None:
            raise SpecdraftError(f"batch of {B} rows exceeds the engines' largest bucket ({self.max_batch[-1]})")
        stream = torch.cuda.current_stream()
        _check(self.context.set_optimization_profile_async(profile, stream.cuda_stream), f"profile {profile}")
        keep, out = bind(self.context, self.engine, self.inputs, self.outputs, feeds, torch.device("cuda"),
                         self.spare, _TORCH_DTYPES)
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise SpecdraftError("TensorRT failed to run the engine")
        del keep  # freed in stream order: the allocator hands the memory only to work queued after this run
        return out


def _opener(engine_dir: Path, manifest: dict):
    register_plugins(manifest["versions"]["sm"])  # a JIT plugin (ReTrace's fusion) runs in this process
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    return lambda kind: _Engine(engine_dir / manifest["engines"][kind]["file"], manifest["engines"][kind], runtime)


class TrtTarget(ExportedTarget):
    """The target as a TensorRT engine."""

    def __init__(self, engine_dir: str | Path, manifest: dict | None = None):
        d = Path(engine_dir)
        m = manifest or load_engine_manifest(d)
        super().__init__(m["onnx_manifest"], _opener(d, m), "cuda")  # caches in the export's dtype, as the I/O


class TrtDrafter(ExportedDrafter):
    """The drafter as TensorRT engines (the target's embedding from the ONNX export beside them)."""

    def __init__(self, engine_dir: str | Path, onnx_dir: str | Path, manifest: dict | None = None):
        d = Path(engine_dir)
        m = manifest or load_engine_manifest(d)
        load_manifest(onnx_dir)  # the embedding's export must be intact too
        embed = load_file(str(Path(onnx_dir) / "embed_tokens.safetensors"))["weight"]
        super().__init__(m["onnx_manifest"], _opener(d, m), embed, "cuda")
