"""Which implementation a launcher runs: ``auto`` (the Triton kernel on CUDA tensors, the reference elsewhere),
``triton`` (the kernel everywhere; on a CPU it runs under Triton's interpreter) or ``reference``. Set by
``SPECDRAFT_KERNELS`` or, for a block of code, :func:`use_kernels`.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so on a machine without CUDA this module sets it before
importing triton: a kernel forced onto CPU tensors then runs interpreted (slowly; for tests).
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    from triton.backends.compiler import GPUTarget  # noqa: F401  (ahead-of-time compilation for a target GPU)

    HAVE_TRITON = True
except ImportError:  # the [triton] extra is not installed: launchers run the references
    triton = tl = GPUTarget = None
    HAVE_TRITON = False

Mode = Literal["auto", "triton", "reference"]
_mode: list[Mode] = [os.environ.get("SPECDRAFT_KERNELS", "auto")]  # type: ignore[list-item]


@contextlib.contextmanager
def use_kernels(mode: Mode):
    """Run the launchers in ``mode`` inside the block."""
    if mode not in ("auto", "triton", "reference"):
        raise ValueError(f"kernel mode {mode!r} is not one of auto, triton, reference")
    _mode.append(mode)
    try:
        yield
    finally:
        _mode.pop()


def wants_triton(*tensors: torch.Tensor) -> bool:
    """Whether a launcher called on ``tensors`` runs its Triton kernel."""
    mode = _mode[-1]
    if mode == "reference":
        return False
    if mode == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("SPECDRAFT_KERNELS=triton but triton is not installed (pip install '.[triton]')")
        return True
    return HAVE_TRITON and all(t.is_cuda for t in tensors)
