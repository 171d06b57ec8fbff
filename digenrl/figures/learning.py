"""How much a run learned, from its samples' rewards (``samples.reward``, iteration x
sample): the gain of the mean reward of its last iterations over its first, in standard
errors, and whether the reward's spread within an iteration collapsed.

The standard error is that of the difference of the two means, from the per-sample
rewards: ``sqrt(var_first / n_first + var_last / n_last)`` over the samples of the first
and of the last ``window`` iterations. A run *learns* when its gain exceeds
:data:`MIN_GAIN_SE` standard errors and no iteration of its last ``window`` has a spread
(the standard deviation of its samples' rewards) below :data:`MIN_SPREAD_RATIO` of its
first iteration's: a policy that collapsed onto one image raises the mean reward without
learning what the reward asks for. The learning tests and the learning matrix
(``workflows/learning_matrix.py``) both judge by :func:`learning`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Learning", "learning", "MIN_GAIN_SE", "MIN_SPREAD_RATIO", "WINDOW"]

#: The iterations averaged at each end.
WINDOW = 4
#: The least gain, in standard errors, of a run that learns.
MIN_GAIN_SE = 3.0
#: The least spread of a late iteration, as a fraction of the first iteration's.
MIN_SPREAD_RATIO = 1.0 / 3.0


@dataclass(frozen=True)
class Learning:
    gain: float        # mean reward of the last window minus the first's
    se: float          # the standard error of that difference (per-sample rewards)
    spread_ratio: float  # the least late spread over the first iteration's
    curve: tuple[float, ...]   # each iteration's mean reward
    spreads: tuple[float, ...]  # each iteration's standard deviation

    @property
    def gain_se(self) -> float:
        return self.gain / self.se if self.se > 0 else float("inf") * np.sign(self.gain)

    @property
    def learns(self) -> bool:
        return self.gain_se > MIN_GAIN_SE and self.spread_ratio >= MIN_SPREAD_RATIO

    def describe(self) -> str:
        return (f"gain {self.gain:+.3f} ({self.gain_se:+.1f} se), spread ratio "
                f"{self.spread_ratio:.2f}; curve {[round(c, 3) for c in self.curve]}")


def learning(rewards, window: int = WINDOW) -> Learning:
    """``rewards``: (iteration, sample), NaN for samples left out (dropped)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] < 2 * window:
        raise ValueError(f"rewards: expected (iteration, sample) with at least "
                         f"{2 * window} iterations, got shape {r.shape}")
    first, last = r[:window].ravel(), r[-window:].ravel()
    first, last = first[np.isfinite(first)], last[np.isfinite(last)]
    gain = float(last.mean() - first.mean())
    se = float(np.sqrt(first.var(ddof=1) / first.size + last.var(ddof=1) / last.size))
    spreads = np.array([np.nanstd(row, ddof=1) for row in r])
    ratio = float(spreads[-window:].min() / spreads[0]) if spreads[0] > 0 else float("inf")
    return Learning(gain, se, ratio, tuple(float(np.nanmean(row)) for row in r),
                    tuple(float(s) for s in spreads))
