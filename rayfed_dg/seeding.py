"""Every random choice is seeded from (seed, purpose, round, client, ...).

Results therefore depend neither on the number of workers, nor on which
worker trains which client, nor on retries or resumes.  ``Stream`` is the one
table of purposes: a new use of randomness takes a new member here, never a
literal number, so two purposes cannot share a stream.  (NumPy's
``SeedSequence`` pads short entropy with zeros, so ``(s, 11, 1)`` and
``(s, 11, 1, 0)`` are the same stream: purposes must differ in the second
word, not only in length.)

Partitions and validation splits are seeded separately, by name, in
``data/protocol.py`` (they must not change with the training seed).
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Stream(IntEnum):
    SAMPLE = 1  # clients sampled per round
    TRAIN = 2  # a client's data order, augmentation and method noise in one round
    INIT = 3  # the initial global model
    FAULT = 4  # injected faults
    PAYLOAD = 7  # server-side payload choices (e.g. which style goes to whom)
    CLIENT_VAL = 11  # a client's fixed validation subset for client-side selection
    STAGE = 12  # data stages before round 1 (CCST's styles and choices); was 11 before 0.2
    PREPARE = 13  # a client's per-round preparation phase (before training)
    AMPLITUDE = 14  # the images whose amplitude spectra a client shares (ELCFS's bank, stages/amplitude.py)
    DEVICE_SPEED = 15  # each device's compute speed (engine/clock/devices.py)
    DEVICE_PHASE = 16  # each device's diurnal phase
    DEVICE_MARKOV = 17  # the online/offline chain: its start, then each step's move
    DEVICE_DROPOUT = 18  # whether a device's training drops out before uploading (per client and draw)
    ASYNC_SAMPLE = 20  # who takes a free training slot in an asynchronous server mode (engine/clock/asynchronous.py)
    DP_UPDATES = 21  # the Gaussian noise added to the sum of clipped updates (DP-FedAvg), per round
    DP_PAYLOAD = 22  # the Gaussian noise on a client's shared statistics, per (round, client, group)
    DEVICE_BANDWIDTH = 23  # each device's down- and uplink bandwidth (engine/clock/network.py)
    DEVICE_JITTER = 24  # the jitter of a training's download and upload (per client and draw)
    DEVICE_PROFILE = 25  # which named device profile each client has (engine/clock/profiles.py)
    PERSONAL_EVAL = 26  # the clients whose own model an evaluation round evaluates (evaluation.personal_clients)


def _words(parts) -> list[int]:
    return [int(p) & 0xFFFFFFFF for p in parts]


def seed_int(*parts: int) -> int:
    return int(np.random.SeedSequence(_words(parts)).generate_state(1, np.uint64)[0] >> 1)


def numpy_rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(_words(parts)))


def torch_generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed_int(*parts))
    return g


def seed_torch(seed: int, device: torch.device) -> None:
    """``torch.manual_seed`` for the generators a client on ``device`` uses.
    ``torch.manual_seed`` itself also queues lazy seeds for every accelerator
    backend (CUDA, XPU, MTIA) with a formatted stack trace each, about 0.7 ms
    per call on the CPU; the CPU generator's state is the same either way."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


def sample_clients(seed: int, round: int, num_clients: int, per_round: int) -> list[int]:
    if per_round >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, Stream.SAMPLE, round).choice(num_clients, size=per_round, replace=False)
    return sorted(int(c) for c in chosen)
