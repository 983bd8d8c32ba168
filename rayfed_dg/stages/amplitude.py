"""ELCFS's amplitude bank, as a data stage before round 1.

Liu, Chen, Qin, Dou, Heng, "FedDG: Federated Domain Generalization on
Medical Image Segmentation via Episodic Learning in Continuous Frequency
Space", CVPR 2021 (Sec. 3.2, the distribution exchange).  The method half
(interpolation and episodic learning) is ``methods/elcfs.py``.

1. Every source client takes the 2-D Fourier transform of each channel of
   its training images, F(x) = A(x) exp(i P(x)), and uploads the amplitude
   spectra A (float32, pixels scaled to [0, 1]) of a seeded ``fraction`` of
   them; the phase P, which carries the image content, never leaves it.
2. The server concatenates them into the distribution bank (with each row's
   owner) and every client receives the other clients' spectra (ledger:
   ``payload:amplitude_spectra`` up, ``payload:amplitude_bank`` down, round 0).
   In the engine the bank is one shared object (``StageServer.share``) that
   the method reads as ``ctx.stage_data["amplitude"]``.

Choices: the bank holds a fraction 1/8 of each client's images, as both the
ELCFS and the CCST reference code (which read a random eighth of the saved
spectra), not all of them as the paper's text implies (8x less memory and
traffic; set ``fraction: 1`` for the whole set).  A client is sent only the
other clients' rows: it never samples its own (ELCFS code; CCST's port also
samples its own client).  Spectra are of the full image (what the reference
code saves), though the interpolation reads only a centred low-frequency
block; float32 where the reference code saves float64.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from rayfed_dg.data.augment import resize
from rayfed_dg.errors import ConfigError
from rayfed_dg.seeding import Stream, numpy_rng

from .base import Stage, StageClient, StageServer, gather_bank, register_stage

SHARED = "amplitude"  # the name the method reads in ctx.stage_data


def amplitude_spectrum(images: np.ndarray, size: int | None = None) -> np.ndarray:
    """|FFT2| per channel of uint8 (N, H, W, 3) images scaled to [0, 1]:
    float32 (N, 3, H, W), zero frequency at [0, 0] (unshifted, as np.fft).
    ``size``: resize to size x size first, the size of the training batches
    the spectra are mixed into (images stored larger for random crops)."""
    x = images.astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    if size is not None and x.shape[-2:] != (size, size):
        x = resize(torch.from_numpy(x), size).numpy()
    return np.abs(np.fft.fft2(x, axes=(-2, -1))).astype(np.float32)


def bank_sample(n: int, fraction: float, seed: int, client_id: int) -> np.ndarray:
    """The (sorted) positions in a client's training list whose spectra it shares."""
    m = max(1, int(round(fraction * n)))
    return np.sort(numpy_rng(seed, Stream.AMPLITUDE, client_id).choice(n, size=min(m, n), replace=False))


@register_stage
class Amplitude(Stage):
    name = "amplitude"
    shared_payloads = {"amplitude_spectra": "image"}  # one row per shared image: its (3, H, W) amplitude spectrum

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fraction: float = Field(0.125, gt=0.0, le=1.0)  # share of a client's training images in the bank

    def check_clients(self, num_clients: int) -> None:
        if num_clients < 2:
            raise ConfigError(f"stages.amplitude: the bank exchanges spectra between clients, but the partition has "
                              f"{num_clients} client; use at least 2 (not the centralized partition)")

    # ------------------------------------------------------------ client half
    def client_spectra(self, client: StageClient, client_id: int, indices: np.ndarray) -> np.ndarray:
        pick = bank_sample(len(indices), self.p.fraction, client.seed, client_id)
        return amplitude_spectrum(client.images[indices[pick]], client.resolution)

    # ------------------------------------------------------------ server half
    def run(self, server: StageServer) -> dict:
        t0 = time.perf_counter()
        n = server.num_clients
        self.check_clients(n)
        spectra, bank, owners = gather_bank(server, self.client_spectra, "amplitude_spectra")
        server.share(SHARED, {"bank": bank, "owners": owners})
        row = bank[0].nbytes
        for c in range(n):
            server.ledger(c, "up", "payload:amplitude_spectra", int(spectra[c].nbytes), len(spectra[c]))
            others = int((owners != c).sum())
            server.ledger(c, "down", "payload:amplitude_bank", others * row, others)
        return {"bank_shape": list(bank.shape), "bank_bytes": int(bank.nbytes),
                "seconds_total": time.perf_counter() - t0}
