"""From the drafter's confidence in a draft to the chance the target accepts it: a per-slot table fitted on held-in
rounds (:class:`Calibration`), what the adaptive policy (:mod:`specdraft.runtime.policy`) predicts acceptance with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Calibration:
    """Per-slot map from the drafter's confidence in its draft to the chance the target accepts it (given the
    slots before it were accepted): a table over ``bins`` equal confidence bins per slot, fitted on held-in rounds;
    empty = the confidence itself."""

    bins: int = 10
    table: list[list[float]] = field(default_factory=list)
    """``[K][bins]`` acceptance rate per slot and confidence bin."""

    def __call__(self, confidence: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities ``[b, K]`` of confidences ``[b, K]``."""
        out = self.predict(confidence.detach().cpu().double().numpy())
        return torch.as_tensor(out, dtype=confidence.dtype, device=confidence.device)

    def predict(self, confidence: np.ndarray) -> np.ndarray:
        """:meth:`__call__` on the host (the policy's per-round arithmetic: a few small arrays)."""
        if not self.table or confidence.shape[1] > len(self.table):
            return confidence
        if getattr(self, "_array", None) is None:
            self._array = np.asarray(self.table, dtype=np.float64)  # [K, bins]
        idx = np.clip((confidence * self.bins).astype(np.int64), 0, self.bins - 1)  # [b, K]
        return self._array[np.arange(confidence.shape[1]), idx]

    @classmethod
    def fit(cls, confidences: torch.Tensor, accepted: torch.Tensor, bins: int = 10,
            prior: float = 2.0) -> "Calibration":
        """From rounds' confidences ``[R, K]`` and accepted drafts ``[R]``: slot ``i`` counts in the rounds that
        reached it (``accepted >= i - 1``), as accepted when ``accepted >= i``. Each bin's rate is shrunk toward its
        centre with ``prior`` pseudo-rounds."""
        R, K = confidences.shape
        slot = torch.arange(1, K + 1)
        reached = accepted[:, None] >= slot - 1  # [R, K]
        hit = accepted[:, None] >= slot
        idx = (confidences * bins).long().clamp(0, bins - 1)
        table = []
        for i in range(K):
            row = []
            for j in range(bins):
                sel = reached[:, i] & (idx[:, i] == j)
                centre = (j + 0.5) / bins
                row.append(float((hit[sel, i].sum() + prior * centre) / (sel.sum() + prior)))
            table.append(row)
        return cls(bins, table)
