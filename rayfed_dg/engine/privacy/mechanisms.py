"""Differential-privacy mechanisms: L2 clipping and seeded Gaussian noise.

Pure NumPy, below every other layer, so that data stages, methods and the
engine apply the same two operations wherever something leaves a client.
The noise comes only from the ``numpy.random.Generator`` passed in (seeded
by the caller from ``seeding.Stream.DP_*``), never from a global state:
the same seed gives the same noise whatever the worker count or order.
"""
from __future__ import annotations

import numpy as np


def l2_norm(arrays: dict[str, np.ndarray]) -> float:
    """The L2 norm of all the arrays taken as one flat vector (in float64)."""
    return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values())))


def clip_l2(arrays: dict[str, np.ndarray], clip: float) -> tuple[dict[str, np.ndarray], float]:
    """The arrays scaled by min(1, clip / norm) as one vector (McMahan et al. 2018, Alg. 1's ClipFn), and the
    norm before clipping.  Dtypes are kept."""
    norm = l2_norm(arrays)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: (a * scale).astype(a.dtype, copy=False) for k, a in arrays.items()}, norm


def clip_rows(x: np.ndarray, clip: float) -> np.ndarray:
    """Each record (row: the first axis) scaled to an L2 norm of at most ``clip``."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    norms = np.sqrt(np.sum(flat * flat, axis=1))
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return (flat * scale[:, None]).reshape(x.shape).astype(x.dtype, copy=False)


def gaussian(shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """N(0, std^2) noise of ``shape`` in float64, drawn from ``rng`` only."""
    return rng.normal(0.0, std, size=shape) if std > 0 else np.zeros(shape)
