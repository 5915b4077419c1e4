"""Will TensorRT's ONNX parser take this graph? Checked on any machine, before the parser: every node must be an op the
parser imports (the list in ``data/tensorrt_onnx_ops.json``, which names the parser release it was taken from) or one
of our registered plugins with the inputs and attributes its spec declares."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import onnx

from specdraft.runtime.backends.custom_ops import CUSTOM_OPS, DOMAIN

OPS_FILE = Path(__file__).with_name("data") / "tensorrt_onnx_ops.json"
_ATTR_TYPES = {"float": onnx.AttributeProto.FLOAT, "int": onnx.AttributeProto.INT}


@cache
def parser_ops() -> dict:
    """The parser's op table: ``{"parser", "source", "opset_range", "supported", "unsupported"}``."""
    return json.loads(OPS_FILE.read_text())


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:  # If/Loop/Scan bodies
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _nodes(sub)


def check_tensorrt_compat(model: onnx.ModelProto | str | Path) -> list[str]:
    """Problems that would stop TensorRT's ONNX parser, one line each (empty: the graph is accepted)."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    table = parser_ops()
    supported = set(table["supported"])
    lo, hi = table["opset_range"]
    problems = []
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and not lo <= imp.version <= hi:
            problems.append(f"opset {imp.version} is outside {table['parser']}'s range {lo}..{hi}")
    functions = {(f.domain, f.name) for f in model.functions}
    nodes = list(_nodes(model.graph)) + [n for f in model.functions for n in _nodes(f)]
    for node in nodes:
        where = f"node {node.name or '?'} ({node.domain or 'ai.onnx'}::{node.op_type})"
        if (node.domain, node.op_type) in functions:
            continue  # a local function: its body's nodes are checked
        if node.domain in ("", "ai.onnx"):
            if node.op_type not in supported:
                problems.append(f"{where}: not supported by {table['parser']}")
        elif node.domain == DOMAIN:
            spec = CUSTOM_OPS.get(node.op_type)
            if spec is None:
                problems.append(f"{where}: no plugin is registered for it")
                continue
            attrs = {a.name: a.type for a in node.attribute}
            want = {n: _ATTR_TYPES[t] for n, t in spec.attributes}
            if attrs != want:
                problems.append(f"{where}: attributes {sorted(attrs)} do not match the plugin's {sorted(want)} "
                                "(names and types)")
            if len(node.input) != len(spec.inputs) or len(node.output) != len(spec.outputs):
                problems.append(f"{where}: {len(node.input)} inputs / {len(node.output)} outputs, the plugin takes "
                                f"{len(spec.inputs)} / {len(spec.outputs)}")
        else:
            problems.append(f"{where}: domain {node.domain!r} is neither ONNX's nor a registered plugin's")
    return problems
