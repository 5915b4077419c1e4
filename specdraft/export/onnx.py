"""Export a drafter and its target to ONNX (dynamo exporter, opset 18, named inputs and outputs, dynamic batch,
new-token and context dimensions) with a manifest the runtime backends check before loading.

Layout of an export directory::

    drafter_ingest.onnx  drafter_draft.onnx  target_verify.onnx
    embed_tokens.safetensors   the target's input embedding (the drafter's blocks are embedded with it)
    manifest.json              graphs (inputs, outputs, opset, sha256), drafter and target identity, versions
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import platform
import time
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
from specdraft.export.custom_ops import TRANSLATIONS
from specdraft.export.onnx_graphs import GRAPHS, DrafterDraft, DrafterIngest, TargetVerify, example_inputs
from specdraft.runtime.backends.onnx import FORMAT_VERSION, MANIFEST, sha256_file
from specdraft.runtime.models.dflash import DFlashDrafter
from specdraft.runtime.models.retrace import ReTraceDrafter
from specdraft.runtime.models.target import TargetLM

OPSET = 18


def weights_hash(module: torch.nn.Module) -> str:
    """sha256 over a module's parameters and buffers in name order (what was exported, whatever file it came from)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _dynamic_shapes(kind: str, retrace: bool = False):
    B, N, S = torch.export.Dim.DYNAMIC, torch.export.Dim.DYNAMIC, torch.export.Dim.DYNAMIC
    if kind == "drafter_ingest":
        return ({0: B, 1: N}, {0: B, 1: N})
    prior = ({0: B, 1: N}, {0: B, 1: N}, {0: B, 1: N}, {0: B}) if retrace else ()
    return ({0: B, 1: N}, {0: B, 1: N}, {0: B, 1: N, 2: N}, {1: B, 3: S}, {1: B, 3: S}, {0: B}, *prior)


def export_graph(module: torch.nn.Module, kind: str, path: Path, flavour: str = "decomposed") -> dict:
    """One graph to ``path``; returns its manifest entry."""
    args = example_inputs(kind, module)
    table = TRANSLATIONS if flavour == "fused" else None
    chatter = io.StringIO()  # the exporter narrates every step on stdout; keep it for a failure's message
    with contextlib.redirect_stdout(chatter), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            program = torch.onnx.export(module, args, dynamo=True, input_names=list(module.input_names),
                                        output_names=list(module.output_names),
                                        dynamic_shapes=_dynamic_shapes(kind, getattr(module, "retrace", False)),
                                        opset_version=OPSET, verbose=False, custom_translation_table=table)
        except Exception as e:
            raise SpecdraftError(f"ONNX export of {kind} failed: {str(e).strip().splitlines()[-1]}") from e
    program.save(str(path))
    return {"file": path.name, "inputs": list(module.input_names), "outputs": list(module.output_names),
            "opset": OPSET, "sha256": sha256_file(path)}


@torch.no_grad()
def export_onnx(drafter: DFlashDrafter, target: TargetLM, out_dir: str | Path, target_fingerprint: str = "",
                flavour: str = "decomposed", dtype: torch.dtype | None = None) -> Path:
    """Write the three graphs, the embedding and the manifest to ``out_dir``; returns the manifest path.

    ``flavour``: ``decomposed`` (standard ONNX ops only) or ``fused`` (speculative attention as ``specdraft``
    custom-op nodes, for TensorRT plugins; ONNX Runtime runs them by their references).

    ``dtype``: the graphs' dtype (default: the modules' own); the weights' hashes are taken before the cast, so
    an fp16 or bf16 export (what a TensorRT engine is built from) names the same drafter and target. The drafter
    must be bound to ``target``; both are exported on the CPU. A ReTrace drafter
    (hard alignment) takes its prior as inputs of ``drafter_draft``; the backend builds the next prior from the
    draft and verify outputs, as the torch drafter does."""
    if not isinstance(drafter, DFlashDrafter):
        raise SpecdraftError(f"ONNX export takes a DFlash-family drafter, got {type(drafter).__name__}")
    retrace = isinstance(drafter, ReTraceDrafter)
    if type(drafter).next_round_state is not DFlashDrafter.next_round_state and not retrace:
        raise SpecdraftError(f"{type(drafter).__name__} keeps cross-round state the ONNX graphs do not carry")
    if retrace and drafter.config.retrace.alignment != "hard":
        raise SpecdraftError("ReTrace with soft alignment (a training ablation) cannot be exported: use hard")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drafter, target = drafter.cpu().eval(), target.cpu().eval()
    identity = {"drafter": weights_hash(drafter), "target": weights_hash(target)}
    if dtype is not None and dtype != drafter.fc.weight.dtype:
        target = copy.deepcopy(target).to(dtype)
        drafter = copy.deepcopy(drafter, {id(m): m for m in drafter.borrowed}).to(dtype)  # not the borrowed modules
        drafter.bind_target(target.model.embed_tokens, target.lm_head)
    start = time.perf_counter()
    if flavour not in ("decomposed", "fused"):
        raise SpecdraftError(f"ONNX flavour {flavour!r} is not one of decomposed, fused")
    modules = {"drafter_ingest": DrafterIngest(drafter), "drafter_draft": DrafterDraft(drafter, flavour),
               "target_verify": TargetVerify(target, drafter.target_layer_ids, flavour)}
    assert set(modules) == set(GRAPHS)
    graphs = {kind: export_graph(m.eval(), kind, out / f"{kind}.onnx", flavour) for kind, m in modules.items()}
    save_file({"weight": target.model.embed_tokens.weight.detach().contiguous()}, str(out / "embed_tokens.safetensors"))
    c = drafter.config
    files = {f.name: sha256_file(f) for f in sorted(out.iterdir())
             if f.is_file() and f.name != MANIFEST and not f.name.endswith((".pyops.onnx", ".trt.onnx"))}
    manifest = {
        "format": "specdraft-onnx", "format_version": FORMAT_VERSION, "flavour": flavour,
        "graphs": graphs,
        "files": files,
        "drafter": {"arch": c.to_hf_config()["architectures"][0], "weights_sha256": identity["drafter"],
                    "block_size": c.block_size, "mask_token_id": c.mask_token_id,
                    "target_layer_ids": list(c.target_layer_ids), "num_layers": c.num_hidden_layers,
                    "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
                    "retrace": ({"embed_drafted": c.retrace.embed_drafted, "gate_anchor": c.retrace.gate_anchor,
                                 "use_correction": c.retrace.use_correction} if retrace else None)},
        "target": {"weights_sha256": identity["target"], "fingerprint": target_fingerprint,
                   "vocab_size": target.args.vocab_size, "num_layers": target.args.num_hidden_layers,
                   "num_kv_heads": target.args.num_key_value_heads, "head_dim": target.args.head_dim,
                   "hidden_size": target.args.hidden_size, "model_type": target.args.model_type},
        "dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "versions": {"torch": torch.__version__, "onnx": _version("onnx"), "onnxscript": _version("onnxscript"),
                     "python": platform.python_version()},
        "export_seconds": round(time.perf_counter() - start, 2),
    }
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2))
    return path


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "missing"
