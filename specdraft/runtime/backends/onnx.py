"""ONNX Runtime backend: the exported graphs (:mod:`specdraft.export.onnx`) run by ORT sessions behind the engine's
interfaces (:class:`OnnxTarget`, :class:`OnnxDrafter`; the shared half is :mod:`.exported`): the CPU provider here,
the CUDA provider where ``onnxruntime-gpu`` is installed. A fused graph's ``specdraft`` nodes run as Python ops (their
PyTorch references), which checks the fused graph's wiring on a CPU.

:func:`load_manifest` checks an export before any session is built: format, graph files and their hashes, and
(when given) the drafter and target it must have been exported from; a mismatch is one clear line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.runtime.backends.custom_ops import register_ort_python_ops, rename_domain
from specdraft.runtime.backends.exported import ExportedDrafter, ExportedTarget

MANIFEST = "manifest.json"
FORMAT = "specdraft-onnx"
FORMAT_VERSION = 2
"""2: every file of the export is hashed (``files``)."""


def read_manifest(path: Path, fmt: str, missing: str) -> dict:
    """A manifest's JSON, refused in one line when missing (``missing``), corrupt or of another format."""
    if not path.is_file():
        raise SpecdraftError(missing)
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise SpecdraftError(f"{path} is corrupt: {e}") from None
    if m.get("format") != fmt:
        raise SpecdraftError(f"{path}: format {m.get('format')!r} is not {fmt!r}")
    return m


def load_manifest(export_dir: str | Path, drafter_sha256: str | None = None, target_sha256: str | None = None,
                  target_fingerprint: str | None = None, check_files: bool = True) -> dict:
    """Read and check an export's manifest; raises :class:`SpecdraftError` with one line naming the problem."""
    d = Path(export_dir)
    m = read_manifest(d / MANIFEST, FORMAT, f"{d} is not an ONNX export: no {MANIFEST} (run specdraft export CONFIG "
                      "--to onnx)")
    if m.get("format_version") != FORMAT_VERSION:
        raise SpecdraftError(f"{d} was exported by another specdraft version (format {m.get('format_version')}, this "
                             f"one reads {FORMAT_VERSION}): re-export with specdraft export CONFIG --to onnx")
    if check_files:
        for kind, g in m["graphs"].items():
            if not (d / g["file"]).is_file():
                raise SpecdraftError(f"{d}: graph {kind} ({g['file']}) is missing")
        for name, digest in m["files"].items():  # the graphs, their external weights, the embedding
            f = d / name
            if not f.is_file():
                raise SpecdraftError(f"{d}: {name} is missing")
            if sha256_file(f) != digest:
                raise SpecdraftError(f"{f} does not match its manifest hash: the file was changed after export")
    if drafter_sha256 is not None and m["drafter"]["weights_sha256"] != drafter_sha256:
        raise SpecdraftError(f"{d} was exported from another drafter (weights sha256 "
                             f"{m['drafter']['weights_sha256'][:12]}, this drafter {drafter_sha256[:12]}): re-export")
    if target_sha256 is not None and m["target"]["weights_sha256"] != target_sha256:
        raise SpecdraftError(f"{d} was exported for another target (weights sha256 "
                             f"{m['target']['weights_sha256'][:12]}, this target {target_sha256[:12]}): re-export")
    if target_fingerprint and m["target"].get("fingerprint") and m["target"]["fingerprint"] != target_fingerprint:
        raise SpecdraftError(f"{d} was exported for another target checkpoint (fingerprint "
                             f"{m['target']['fingerprint']}, configured {target_fingerprint}): re-export")
    return m


def sha256_file(path: Path) -> str:
    """The hash an export's manifest records for each file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _session(path: Path, providers: list[str] | None, fused: bool = False):
    """An ORT session; a fused graph's ``specdraft`` nodes run as Python ops (their PyTorch references)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT's pool would otherwise spin between calls and starve the engine's torch ops on the same cores
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not providers:  # the CUDA provider where onnxruntime-gpu offers it, the CPU provider everywhere
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()]
    if not fused:
        return ort.InferenceSession(str(path), opts, providers=providers)
    opts.register_custom_ops_library(register_ort_python_ops())
    # the renamed graph is saved beside the original so its external weight files resolve (no 2 GB limit)
    renamed = path.with_suffix(".pyops.onnx")
    onnx.save(rename_domain(onnx.load(str(path), load_external_data=False)), str(renamed))
    return ort.InferenceSession(str(renamed), opts, providers=providers)


_ORT_FLOATS = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16}


class _Graph:
    """One ORT session called with torch tensors (floating inputs converted to the dtype the graph declares: the
    export's, or fp32 for the drafter's feature path) -> torch tensors."""

    def __init__(self, path: Path, providers, fused: bool = False):
        self.session = _session(path, providers, fused)
        self.inputs = {i.name: _ORT_FLOATS.get(i.type) for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        arrays = {}
        for name, dtype in self.inputs.items():
            t = feeds[name].detach().cpu()
            if t.is_floating_point() and dtype is not None:
                t = t.to(dtype)
            arrays[name] = t.contiguous().numpy()
        return {n: torch.from_numpy(a) for n, a in zip(self.outputs, self.session.run(self.outputs, arrays))}


def _opener(export_dir: Path, manifest: dict, providers: list[str] | None):
    fused = manifest["flavour"] == "fused"
    return lambda kind: _Graph(export_dir / manifest["graphs"][kind]["file"], providers, fused)


class OnnxTarget(ExportedTarget):
    """The target of an ONNX export, run by ONNX Runtime."""

    def __init__(self, export_dir: str | Path, providers: list[str] | None = None, manifest: dict | None = None):
        d = Path(export_dir)
        m = manifest or load_manifest(d)
        super().__init__(m, _opener(d, m, providers))


class OnnxDrafter(ExportedDrafter):
    """The drafter of an ONNX export, run by ONNX Runtime."""

    def __init__(self, export_dir: str | Path, providers: list[str] | None = None, manifest: dict | None = None):
        d = Path(export_dir)
        m = manifest or load_manifest(d)
        super().__init__(m, _opener(d, m, providers), load_file(str(d / "embed_tokens.safetensors"))["weight"])
