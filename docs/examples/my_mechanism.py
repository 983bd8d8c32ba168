"""A privacy mechanism's two halves, from the engine's own primitives
(``engine/privacy/mechanisms.py``): each client clips its update to L2 norm
``clip`` before it leaves; the server adds Gaussian noise of std z x clip to
the sum, from a stream seeded by (seed, round), so one client moves the
released sum by at most ``clip`` plus noise the accountant can price."""
import numpy as np

from rayfed_dg.engine.privacy.mechanisms import clip_l2, gaussian
from rayfed_dg.seeding import Stream, numpy_rng


def client_side(update: dict[str, np.ndarray], clip: float) -> dict[str, np.ndarray]:
    clipped, _ = clip_l2(update, clip)
    return clipped


def server_side(clipped: list[dict[str, np.ndarray]], clip: float, z: float, seed: int, round: int
                ) -> dict[str, np.ndarray]:
    rng = numpy_rng(seed, Stream.DP_UPDATES, round)
    return {k: sum(u[k] for u in clipped) + gaussian(np.shape(clipped[0][k]), z * clip, rng)
            for k in sorted(clipped[0])}
