"""TensorRT plugins for the fused graphs' custom ops, through TensorRT's Python plugin API ("quickly deployable
plugins", ``tensorrt.plugin``; ahead-of-time implementations need TensorRT >= 10.9), with the Triton kernels compiled
ahead of time to PTX so the engine carries them and runs without Python.

``SpeculativeAttention`` is an AOT plugin (one kernel, PTX in the engine). ``RetraceFusion`` is two kernels, which
the AOT interface (one kernel per plugin) cannot carry: it is a JIT plugin whose implementation calls the Triton
launcher on the plugin's stream, so its engine needs Python at run time.

``tensorrt.plugin`` checks each decorated function with ``inspect.signature`` against the class objects in its
annotations (``issubclass(annotation, TensorDesc)``, a return annotation of the exact form), so this module must not
use ``from __future__ import annotations``: its annotations are the objects themselves. The rules are pinned by
``tests/export/test_trt_plugins.py`` with a stand-in ``tensorrt.plugin`` that enforces them.

Each op is registered under ``<domain>::<name>`` of its spec (:mod:`specdraft.runtime.backends.custom_ops`), with its
inputs and attributes in the spec's order, so the ONNX parser maps the fused graphs' nodes onto it. TensorRT cannot be
installed on the CPU machines this project is developed on: the registration runs there against that stand-in (and
the PTX compiles for a target GPU without one); the engine build (:mod:`specdraft.export.tensorrt`) and the engine's
loading (:mod:`.tensorrt`, which registers the plugins first: a JIT plugin must be registered in the process that
runs its engine) run where TensorRT is installed.
"""

from typing import List, Tuple, Union

import torch

from specdraft.errors import TRT_MISSING, SpecdraftError
from specdraft.kernels.retrace_fusion import FusionWeights, retrace_fusion
from specdraft.kernels.speculative_attention import compile_aot
from specdraft.runtime.backends.custom_ops import DOMAIN, RETRACE_FUSION, SPECULATIVE_ATTENTION

try:
    import tensorrt as trt
    import tensorrt.plugin as trtp
except ImportError:  # the [trt] extra: NVIDIA's index, not reachable from every machine
    trt = trtp = None

SPECULATIVE_ATTENTION_ID = f"{DOMAIN}::{SPECULATIVE_ATTENTION.name}"
RETRACE_FUSION_ID = f"{DOMAIN}::{RETRACE_FUSION.name}"
ATTENTION_FORMATS = ("BF16", "FP16")
"""Engine precisions the attention plugin serves (q, k, v and its output share one)."""
FUSION_FORMATS = ("FP16", "FP32")
"""ReTrace's fusion: no BF16, since TensorRT's Python tensors cannot hand bf16 buffers to torch (TensorRT casts
around the plugin)."""
_registered: dict[str, int] = {}


def _triton_dtype(dtype) -> str:
    names = {trt.float16: "fp16", trt.bfloat16: "bf16"}
    if dtype not in names:
        raise SpecdraftError(f"{SPECULATIVE_ATTENTION_ID}: unsupported dtype {dtype} (engines are bf16 or fp16)")
    return names[dtype]


def _constant(expr, what: str) -> int:
    if not expr.is_constant:
        raise SpecdraftError(f"{SPECULATIVE_ATTENTION_ID}: {what} must be fixed when the engine is built")
    return int(expr.constant_value())


def register_plugins(arch: int) -> None:
    """Register every custom op's plugin for SM ``arch`` (e.g. 90), once per process."""
    if trtp is None:
        raise SpecdraftError(TRT_MISSING)
    if _registered:
        if _registered["arch"] != arch:
            raise SpecdraftError(f"plugins were registered for sm_{_registered['arch']}, not sm_{arch}")
        return
    TD = trtp.TensorDesc

    @trtp.register(SPECULATIVE_ATTENTION_ID)
    def _desc(q: TD, k: TD, v: TD, lengths: TD, mask_bits: TD, scale: float) -> TD:
        return q.like()  # [B, H, T, Dh] in q's dtype

    @trtp.autotune(SPECULATIVE_ATTENTION_ID)
    def _formats(q: TD, k: TD, v: TD, lengths: TD, mask_bits: TD,
                 outputs: Tuple[TD]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(f"{t}, {t}, {t}, INT64, INT32, {t}") for t in ATTENTION_FORMATS]

    @trtp.aot_impl(SPECULATIVE_ATTENTION_ID)
    def _aot(q: TD, k: TD, v: TD, lengths: TD, mask_bits: TD, scale: float, outputs: Tuple[TD],
             tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        B, H, T, D = q.shape_expr
        Hkv, S, W = k.shape_expr[1], k.shape_expr[2], mask_bits.shape_expr[2]
        heads, kv_heads = _constant(H, "query heads"), _constant(Hkv, "KV heads")
        kernel = compile_aot(_triton_dtype(q.dtype), _constant(D, "head dim"), heads // kv_heads, scale, arch)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = trtp.cdiv(T * (heads // kv_heads), kernel.block_m)
        launch.grid_y = B * kv_heads
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared
        scalars = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (T, W, Hkv, S)])  # the kernel's i32 args
        return kernel.name.encode(), kernel.ptx.encode(), launch, scalars

    @trtp.register(RETRACE_FUSION_ID)
    def _fusion_desc(x: TD, hidden: TD, signals: TD, valid: TD, shift: TD, ln_weight: TD, ln_bias: TD, w_in: TD,
                     b_in: TD, w_go: TD, b_go: TD, lo: int, use_correction: int, ln_eps: float) -> TD:
        return x.like()  # [b, Bk, E]

    @trtp.autotune(RETRACE_FUSION_ID)
    def _fusion_formats(x: TD, hidden: TD, signals: TD, valid: TD, shift: TD, ln_weight: TD, ln_bias: TD, w_in: TD,
                        b_in: TD, w_go: TD, b_go: TD, outputs: Tuple[TD]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(", ".join([t, t, t, "BOOL", "INT64", *[t] * 6, t])) for t in FUSION_FORMATS]

    T_ = trtp.Tensor

    @trtp.impl(RETRACE_FUSION_ID)
    def _fusion_impl(x: T_, hidden: T_, signals: T_, valid: T_, shift: T_, ln_weight: T_, ln_bias: T_, w_in: T_,
                     b_in: T_, w_go: T_, b_go: T_, lo: int, use_correction: int, ln_eps: float, outputs: Tuple[T_],
                     stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t = [torch.as_tensor(a, device="cuda") for a in (x, hidden, signals, valid, shift, ln_weight, ln_bias,
                                                               w_in, b_in, w_go, b_go)]
            weights = FusionWeights(t[5], t[6], ln_eps, t[7], t[8], t[9], t[10])
            out = retrace_fusion(t[0], t[1], t[2], t[3], t[4], weights, lo, bool(use_correction))
            torch.as_tensor(outputs[0], device="cuda").copy_(out)

    _registered["arch"] = arch
