"""The custom ONNX ops of the fused graphs, declared once: the exporter builds their ONNX schema and node from these
specs (:mod:`specdraft.export.custom_ops`), the ONNX Runtime backend runs them with their PyTorch references
(through onnxruntime-extensions), and the TensorRT stage registers plugins with the same name, domain, inputs and
attributes (:mod:`specdraft.export.trt_plugins`).

``SpeculativeAttention`` (domain ``specdraft``, version 1) has the launcher's contract
(:func:`~specdraft.kernels.speculative_attention.speculative_attention`): ``q [B, H, T, Dh]``, ``k``/``v``
``[B, H_kv, S, Dh]`` holding each row's committed entries below ``lengths[b]`` and the new tokens' at
``lengths[b] + r``, ``lengths [B]`` int64, ``mask_bits [B, T, ceil(T / 32)]`` int32 (bit ``r`` of query ``t``: it
sees new token ``r``); attribute ``scale``; output ``[B, H, T, Dh]``.

``RetraceFusion`` (same domain and version) has the fusion launcher's contract
(:func:`~specdraft.kernels.retrace_fusion.retrace_fusion`): the block's embeddings ``x [b, Bk, E]``, the prior
(``hidden``, ``signals``, ``valid`` bool, ``shift`` int64) and the fusion's weights as inputs; attributes ``lo``,
``use_correction`` (0/1) and ``ln_eps``; output the fused embeddings ``[b, Bk, E]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdraft.kernels.retrace_fusion import FusionWeights, retrace_fusion_reference
from specdraft.kernels.speculative_attention import AttentionPlan, speculative_attention_reference

try:
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
except ImportError:
    PyCustomOpDef = get_library_path = onnx_op = None

DOMAIN = "specdraft"
VERSION = 1
ORT_PYOP_DOMAIN = "ai.onnx.contrib"
"""onnxruntime-extensions serves Python ops in this domain only: the ORT backend renames ``specdraft`` nodes to it."""


@dataclass(frozen=True)
class CustomOp:
    name: str
    inputs: tuple[tuple[str, str], ...]  # (name, element type: "float" for the compute dtype, "int64", "int32")
    outputs: tuple[tuple[str, str], ...]
    attributes: tuple[tuple[str, str], ...]  # (name, "float" | "int")


SPECULATIVE_ATTENTION = CustomOp(
    "SpeculativeAttention",
    inputs=(("q", "float"), ("k", "float"), ("v", "float"), ("lengths", "int64"), ("mask_bits", "int32")),
    outputs=(("out", "float"),),
    attributes=(("scale", "float"),),
)
RETRACE_FUSION = CustomOp(
    "RetraceFusion",
    inputs=(("x", "float"), ("hidden", "float"), ("signals", "float"), ("valid", "bool"), ("shift", "int64"),
            ("ln_weight", "float"), ("ln_bias", "float"), ("w_in", "float"), ("b_in", "float"), ("w_go", "float"),
            ("b_go", "float")),
    outputs=(("out", "float"),),
    attributes=(("lo", "int"), ("use_correction", "int"), ("ln_eps", "float")),
)
CUSTOM_OPS = {op.name: op for op in (SPECULATIVE_ATTENTION, RETRACE_FUSION)}


def speculative_attention_numpy(q, k, v, lengths, mask_bits, scale: float):
    """The op on numpy arrays (ONNX Runtime's Python op), by the PyTorch reference."""
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    lengths, bits = torch.from_numpy(np.asarray(lengths)).long(), torch.from_numpy(np.asarray(mask_bits))
    plan = AttentionPlan(lengths, bits, q.shape[2])
    return speculative_attention_reference(q, k, v, lengths, bits, float(scale), plan).numpy()


def retrace_fusion_numpy(x, hidden, signals, valid, shift, ln_weight, ln_bias, w_in, b_in, w_go, b_go, lo: int,
                         use_correction: int, ln_eps: float):
    """The fusion on numpy arrays (ONNX Runtime's Python op), by the PyTorch reference."""
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (x, hidden, signals, valid, shift, ln_weight, ln_bias,
                                                              w_in, b_in, w_go, b_go)]
    weights = FusionWeights(t[5], t[6], float(ln_eps), t[7], t[8], t[9], t[10])
    return retrace_fusion_reference(t[0], t[1], t[2], t[3].bool(), t[4].long(), weights, int(lo),
                                    bool(use_correction)).numpy()


_registered: list[bool] = []


def register_ort_python_ops() -> str:
    """Register the custom ops with onnxruntime-extensions (once) and return its library path for
    ``SessionOptions.register_custom_ops_library``."""
    if onnx_op is None:  # the fused flavour needs it on ONNX Runtime; the decomposed one does not
        raise RuntimeError("running a fused ONNX graph in ONNX Runtime needs onnxruntime-extensions "
                           "(pip install onnxruntime-extensions)")
    if not _registered:
        types = {"float": PyCustomOpDef.dt_float, "int64": PyCustomOpDef.dt_int64, "int32": PyCustomOpDef.dt_int32,
                 "bool": PyCustomOpDef.dt_bool}
        attrs = {"float": PyCustomOpDef.dt_float, "int": PyCustomOpDef.dt_int64}
        for op, fn in ((SPECULATIVE_ATTENTION, speculative_attention_numpy), (RETRACE_FUSION, retrace_fusion_numpy)):
            onnx_op(op_type=op.name, inputs=[types[t] for _, t in op.inputs],
                    outputs=[types[t] for _, t in op.outputs], attrs={n: attrs[t] for n, t in op.attributes})(fn)
        _registered.append(True)
    return get_library_path()


def rename_domain(model, old: str = DOMAIN, new: str = ORT_PYOP_DOMAIN):
    """``model`` (an ``onnx.ModelProto``) with its ``old``-domain nodes and opset import moved to ``new``."""
    for node in model.graph.node:
        if node.domain == old:
            node.domain = new
    for imp in model.opset_import:
        if imp.domain == old:
            imp.domain = new
    return model
