"""The fused graphs' custom ops on the PyTorch side: ``torch.ops.specdraft.*`` operators (the launchers, with fake
implementations for tracing), their ONNX schemas, and the exporter's translation of each into a single node of the
``specdraft`` domain. The op specs themselves live in :mod:`specdraft.runtime.backends.custom_ops`."""

from __future__ import annotations

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

from specdraft.kernels.retrace_fusion import FusionWeights, retrace_fusion
from specdraft.kernels.speculative_attention import AttentionPlan, speculative_attention
from specdraft.noise import quiet_onnx_export
from specdraft.runtime.backends.custom_ops import (
    CUSTOM_OPS,
    DOMAIN,
    RETRACE_FUSION,
    SPECULATIVE_ATTENTION,
    VERSION,
    CustomOp,
)


@torch.library.custom_op("specdraft::speculative_attention", mutates_args=())
def speculative_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                             mask_bits: torch.Tensor, scale: float) -> torch.Tensor:
    """The launcher as one opaque operator (``SpeculativeAttention`` in the fused graphs)."""
    plan = AttentionPlan(lengths, mask_bits, q.shape[2])
    return speculative_attention(q, k, v, lengths, scale=scale, plan=plan)


@speculative_attention_op.register_fake
def _(q, k, v, lengths, mask_bits, scale):
    return torch.empty_like(q)


@torch.library.custom_op("specdraft::retrace_fusion", mutates_args=())
def retrace_fusion_op(x: torch.Tensor, hidden: torch.Tensor, signals: torch.Tensor, valid: torch.Tensor,
                      shift: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor, w_in: torch.Tensor,
                      b_in: torch.Tensor, w_go: torch.Tensor, b_go: torch.Tensor, lo: int, use_correction: int,
                      ln_eps: float) -> torch.Tensor:
    """The ReTrace fusion launcher as one opaque operator (``RetraceFusion`` in the fused graphs)."""
    weights = FusionWeights(ln_weight, ln_bias, ln_eps, w_in, b_in, w_go, b_go)
    return retrace_fusion(x, hidden, signals, valid, shift, weights, lo, bool(use_correction))


@retrace_fusion_op.register_fake
def _(x, hidden, signals, valid, shift, ln_weight, ln_bias, w_in, b_in, w_go, b_go, lo, use_correction, ln_eps):
    return torch.empty_like(x)


_TYPES = {"float": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]}
_ATTRS = {"float": OpSchema.AttrType.FLOAT, "int": OpSchema.AttrType.INT}


def onnx_schema(op: CustomOp) -> OpSchema:
    """The op's ONNX schema (the exporter needs one to emit the node; checkers use it too)."""
    def param(name, kind):
        return OpSchema.FormalParameter(name, "T" if kind == "float" else f"tensor({kind})")
    return OpSchema(op.name, DOMAIN, VERSION, inputs=[param(*i) for i in op.inputs],
                    outputs=[param(*o) for o in op.outputs], type_constraints=[("T", _TYPES["float"], "")],
                    attributes=[OpSchema.Attribute(n, _ATTRS[t], n) for n, t in op.attributes])


def _register_schemas() -> None:
    for op in CUSTOM_OPS.values():
        try:
            onnx.defs.get_schema(op.name, VERSION, DOMAIN)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(onnx_schema(op))


quiet_onnx_export()  # the exporter (and onnxscript's registry) says torchvision is missing; nothing uses it
_register_schemas()
_opset = onnxscript.values.Opset(domain=DOMAIN, version=VERSION)


def _speculative_attention_onnx(q, k, v, lengths, mask_bits, scale: float):
    return _opset.SpeculativeAttention(q, k, v, lengths, mask_bits, scale=scale)


def _retrace_fusion_onnx(x, hidden, signals, valid, shift, ln_weight, ln_bias, w_in, b_in, w_go, b_go, lo: int,
                         use_correction: int, ln_eps: float):
    return _opset.RetraceFusion(x, hidden, signals, valid, shift, ln_weight, ln_bias, w_in, b_in, w_go, b_go, lo=lo,
                                use_correction=use_correction, ln_eps=ln_eps)


TRANSLATIONS = {torch.ops.specdraft.speculative_attention.default: _speculative_attention_onnx,
                torch.ops.specdraft.retrace_fusion.default: _retrace_fusion_onnx}
"""``custom_translation_table`` of the fused export."""

assert {SPECULATIVE_ATTENTION.name, RETRACE_FUSION.name} == set(CUSTOM_OPS), \
    "every custom op needs a torch op and a translation here"
