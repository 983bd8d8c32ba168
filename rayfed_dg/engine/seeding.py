"""Every random choice is seeded from (seed, purpose, round, client).

Results therefore depend neither on the number of workers, nor on which
worker trains which client, nor on retries or resumes."""
from __future__ import annotations

import numpy as np
import torch

SAMPLE, TRAIN, INIT, FAULT, CLIENT_VAL = 1, 2, 3, 4, 11


def seed_int(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def numpy_rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]))


def torch_generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed_int(*parts))
    return g


def sample_clients(seed: int, round: int, num_clients: int, per_round: int) -> list[int]:
    if per_round >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, SAMPLE, round).choice(num_clients, size=per_round, replace=False)
    return sorted(int(c) for c in chosen)
