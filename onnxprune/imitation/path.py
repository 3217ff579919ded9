"""What a greedy run leaves behind: the best visited state per width, and padding beyond it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True)
class WidthPath:
    """curve[n]: best loss among visited states with support exactly n (inf where never visited);
    best[n]: the weights a of that state. Subclasses rank channels for padding (lower = better)."""

    curve: np.ndarray
    best: dict[int, np.ndarray] = field(repr=False)

    def padded(self, n: int) -> bool:
        """True when no visited state has support exactly n (support(n) is then padded)."""
        self._check_width(n)
        return not np.isfinite(self.curve[n])

    def weights(self, n: int) -> np.ndarray:
        """Simplex weights (N,) of the best visited state with support exactly n.

        If support n was never visited (the greedy stopped below n), this is the best state with the
        largest visited support m < n; `support(n)` then adds n - m channels that carry weight 0 here.
        Check with `padded(n)`.
        """
        return self._state(n)[0]

    def support(self, n: int) -> np.ndarray:
        """The n channels (sorted) chosen for width n: the support of weights(n), plus padding by
        the subclass's ranking at the state of weights(n)."""
        return self._state(n)[1]

    def _pad_scores(self, m: int, a: np.ndarray) -> np.ndarray:
        """Per-channel padding rank at the best state of support m (lower = added first)."""
        raise NotImplementedError

    def _state(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_width(n)
        m = max(s for s in self.best if s <= n)
        a = self.best[m].copy()
        chosen = np.flatnonzero(a)
        if m < n:
            score = np.array(self._pad_scores(m, a), dtype=np.float64)
            score[chosen] = np.inf
            chosen = np.sort(np.concatenate([chosen, np.argsort(score, kind="stable")[: n - m]]))
        return a, chosen

    def _check_width(self, n: int) -> None:
        """Raise ValueError unless 1 <= n <= N."""
        if not 1 <= n < len(self.curve):
            raise ValueError(f"width {n} outside [1, {len(self.curve) - 1}]")
