"""Byzantine-robust estimators: the coordinate-wise median and trimmed mean.

Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning:
Towards Optimal Statistical Rates", ICML 2018:

* Definition 1 (Option I, median): g = med{g^i : i in [m]}, the
  coordinate-wise median of the m vectors (for an even m, the mean of the
  two middle values of each coordinate);
* Definition 2 (Option II, trimmed mean, beta in [0, 1/2)): for each
  coordinate, remove the largest and the smallest beta fraction of the m
  values and average the remaining (1 - 2 beta) m.  Here ``server.trim`` is
  beta and floor(beta m) values go from each end (the paper takes beta m to
  be an integer); a round that would trim everything is refused.

Applied to the uploaded models y_i (what the weighted mean averages); both
rules commute with the shift by x_t, so this is the rule applied to the
updates y_i - x_t, and a server optimizer steps along estimate - x_t as it
does after the mean.  The rules are unweighted (the paper's): a method that
weighs its clients itself is refused.

Order independence: each coordinate's values are sorted before anything is
taken from them, and the trimmed mean sums the kept values in sorted order
in float64, so the result depends only on the multiset of uploads: not on
the order they arrive in, nor on which worker trained which client (uploads
travel whole; nothing is folded).  A NaN in a coordinate makes that
coordinate NaN (it has no place in the order); infinities are ordered values
and are trimmed like any other.  Integer tensors (BatchNorm's counters) are
rounded to the nearest integer.  Memory: the server holds the round's m
uploads at once.
"""
from __future__ import annotations

import numpy as np

from .pipeline import Estimator, State, Uploads, register_aggregator


def _stack(u: Uploads, key: str) -> np.ndarray | None:
    """The uploads of ``key`` as one (m, ...) float64 array, sorted along the
    clients' axis; None where nobody uploaded it."""
    rows = [np.asarray(y[key], np.float64) for _, y in u.uploads() if key in y]
    return np.sort(np.stack(rows), axis=0) if rows else None


def _cast(value: np.ndarray, nan: np.ndarray, like: np.ndarray) -> np.ndarray:
    value = np.where(nan, np.nan, value)
    if np.issubdtype(like.dtype, np.integer):
        value = np.rint(value)
    return np.asarray(value).astype(like.dtype)


class _Robust(Estimator):
    sums = False  # needs every upload whole
    refuses = {"aggregation_weights": "weighs clients itself (aggregation_weights), and the robust rules are "
                                      "unweighted (Yin et al.)"}
    advice = "use server.aggregator mean"

    def estimate(self, u: Uploads) -> State:
        out = {}
        for k, ref in u.x.items():
            s = _stack(u, k)
            out[k] = ref if s is None else _cast(self.reduce(s), np.isnan(s).any(axis=0), np.asarray(ref))
        return out

    def reduce(self, s: np.ndarray) -> np.ndarray:
        """The rule on values sorted along axis 0."""
        raise NotImplementedError


@register_aggregator
class Median(_Robust):
    """Coordinate-wise median (Yin et al. 2018, Definition 1)."""

    name = "median"

    def reduce(self, s: np.ndarray) -> np.ndarray:
        m = s.shape[0]
        return s[m // 2] if m % 2 else (s[m // 2 - 1] + s[m // 2]) / 2


@register_aggregator
class TrimmedMean(_Robust):
    """Coordinate-wise beta-trimmed mean (Yin et al. 2018, Definition 2), beta = ``server.trim``."""

    name = "trimmed_mean"

    def reduce(self, s: np.ndarray) -> np.ndarray:
        m = s.shape[0]
        b = trimmed(m, self.cfg.trim)
        kept = s[b:m - b]
        acc = np.zeros(s.shape[1:], np.float64)
        for row in kept:  # in sorted order: the sum's bits do not depend on the clients' order
            acc += row
        return acc / (m - 2 * b)


def trimmed(m: int, beta: float) -> int:
    """The values trimmed from each end of m, floor(beta m); refused when none would be left."""
    b = int(np.floor(beta * m))
    if m - 2 * b < 1:
        raise ValueError(f"server.trim={beta:g} trims {b} of {m} uploads from each end, leaving none; lower it")
    return b
