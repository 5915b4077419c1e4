"""Wall time per phase of a decode round, for the cost splits the benchmarks report (off unless asked for), and of
one call (:func:`wall_seconds`)."""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """``lap(name)`` adds the time since the previous lap to ``totals[name]``; on CUDA it synchronises first, so a
    phase is charged for its own kernels (a clock with ``totals=None`` does nothing and never synchronises)."""

    def __init__(self, totals: dict[str, float] | None, device: torch.device | str = "cpu"):
        self.totals = totals
        self.cuda = torch.device(device).type == "cuda"
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.totals is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self._last
        self._last = now


def wall_seconds(fn, device: torch.device | str = "cpu") -> float:
    """Wall seconds of ``fn()``, with the device synchronised before and after on CUDA."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0
