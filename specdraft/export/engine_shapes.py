"""What TensorRT engines serve (``export.trt.*``), apart from the build (:mod:`specdraft.export.tensorrt`) so the
config loads without importing torch, ONNX or TensorRT."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdraft.errors import OptionError, check_range


@dataclass
class EngineShapes:
    """What the engines serve (``export.trt.*``): the shapes each optimisation profile covers, and the precision."""

    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Batch-size buckets: one optimisation profile each (a batch runs in the smallest bucket that holds it)."""
    max_context: int = 4096
    """Longest context (cache slots) and longest prefill."""
    max_new: int = 64
    """Most new tokens of a draft pass (a block, or a D²SD round's branches side by side)."""
    precision: Literal["bf16", "fp16"] = "bf16"

    def __post_init__(self):
        for b in self.batch_sizes:
            check_range("batch_sizes", b, 1)
        check_range("max_context", self.max_context, 1)
        check_range("max_new", self.max_new, 1)
        if self.precision not in ("bf16", "fp16"):
            raise OptionError("precision", f"must be bf16 or fp16, got {self.precision!r}")
