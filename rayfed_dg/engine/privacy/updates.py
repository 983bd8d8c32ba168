"""DP-FedAvg: client-level differential privacy of the model updates
(``privacy.updates``; McMahan et al., ICLR 2018, Alg. 1), with adaptive
clipping as an option (Andrew et al., NeurIPS 2021, Alg. 1).

On the client (``ClientRunner.train``), the update is the uploaded float
tensors minus the round's global ones, taken as one vector and clipped to
the round's L2 norm C (``privacy.clip_l2``) before the worker folds it into
its partial sum.  On the server (``UpdateDP.release``) Gaussian noise of
std z_Delta x C, drawn from ``numpy_rng(seed, Stream.DP_UPDATES, round)``
key by key in sorted order, is added to the SUM of the clipped updates,
which is then divided by m, the clients sampled per round, and added to
the global model.

The estimator is the paper's fixed-denominator one with every client's
weight 1 (w_k = 1, so qW = m under the engine's fixed-size sampling): its
denominator is public and fixed, so one client moves the average by at
most C / m, whatever the data; the weighted estimator's denominator (a sum
of data-dependent weights) would itself need bounding, and sample-count
weights would let a large client's update weigh more than C.  A client
whose task failed for good adds nothing and the denominator stays m (the
update shrinks a little; the bound holds).  The method's own
``aggregation_weights`` are therefore not used, and a method that
overrides them refuses DP (``DPMean.refuses``, checked by the aggregation
pipeline's ``refusal``).

What is averaged, and so clipped: every uploaded floating-point tensor,
BatchNorm's running statistics included (they are part of the uploaded
state and of the global model); a method whose ``local_keys`` are uploaded
(FedBN, gPerXAN) has them averaged into the global inference model, so
they are in the clipped vector too.  Integer buffers (BatchNorm's
``num_batches_tracked``) are not folded: the global model keeps its value.

Adaptive clipping: each client also reports b = 1[||update|| <= C]; the
server adds N(0, sigma_b^2) (from ``numpy_rng(seed, Stream.DP_UPDATES,
round, 1)``) to sum(b - 1/2) (centred: adding or removing a client moves it
by at most 1/2), takes b_mean = that / m + 1/2, and sets C <- C exp(-eta_C (b_mean - gamma))
for the next round.  The update noise then uses z_Delta = (z^-2 -
(2 sigma_b)^-2)^(-1/2), so that the two Gaussian mechanisms together cost
what one of multiplier z does (the accountant composes z).  The clip of each
round goes into the records, and the clip to come into the checkpoint.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from rayfed_dg.config import ExperimentConfig, UpdatePrivacyConfig
from rayfed_dg.engine.aggregation.pipeline import Estimator, Uploads
from rayfed_dg.errors import ConfigError, DivergedError
from rayfed_dg.seeding import Stream, numpy_rng

from .mechanisms import clip_l2, gaussian


def count_noise(u: UpdatePrivacyConfig, per_round: int) -> float:
    """sigma_b: the std of the noise on the count of unclipped updates (Andrew et al.'s default m / 20)."""
    return u.count_noise_multiplier if u.count_noise_multiplier is not None else per_round / 20


def update_noise(u: UpdatePrivacyConfig, per_round: int) -> float:
    """z_Delta, the multiplier of the noise on the sum of updates: z, or with
    adaptive clipping (z^-2 - (2 sigma_b)^-2)^(-1/2) (``check`` ensures it is real)."""
    z = u.noise_multiplier
    if not u.adaptive or z == 0:
        return z
    s = count_noise(u, per_round)
    return (z ** -2 - (2 * s) ** -2) ** -0.5


def float_keys(state: Mapping[str, np.ndarray | torch.Tensor], keys) -> list[str]:
    """The floating-point tensors among ``keys``, sorted: what DP-FedAvg averages and clips."""
    def is_float(v) -> bool:
        return v.is_floating_point() if isinstance(v, torch.Tensor) else np.issubdtype(v.dtype, np.floating)

    return sorted(k for k in keys if is_float(state[k]))


def clip_update(upload: Mapping[str, torch.Tensor], broadcast: Mapping[str, np.ndarray],
                clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """The client's side: its float tensors minus the round's global ones,
    in float64, clipped to ``clip`` as one vector; and the norm before."""
    delta = {k: upload[k].detach().cpu().numpy().astype(np.float64) - np.asarray(broadcast[k], np.float64)
             for k in float_keys(upload, upload)}
    clipped, norm = clip_l2(delta, clip)
    if not math.isfinite(norm):  # min(1, clip / nan) is 1: a NaN update would pass unclipped into the noised sum
        raise DivergedError(f"the client's update has a non-finite norm ({norm}): it cannot be clipped")
    return {k: torch.from_numpy(v) for k, v in clipped.items()}, norm


class UpdateDP:
    """The server's side of DP-FedAvg for one federation: the round's clip,
    the noise on the sum, and the adaptive clip's update."""

    def __init__(self, u: UpdatePrivacyConfig, seed: int, per_round: int, keys: list[str]):
        assert u.clip is not None  # UpdatePrivacyConfig refuses a config without one
        self.u, self.seed, self.m, self.keys = u, seed, per_round, keys
        self.clip = u.clip
        self.z_updates = update_noise(u, per_round)

    def release(self, r: int, sums: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
        """The new global values of ``keys``: previous + (sum of the clipped
        updates + noise of std z_Delta C) / m; ``sums``: the round's sums."""
        rng = numpy_rng(self.seed, Stream.DP_UPDATES, r)
        std = self.z_updates * self.clip
        out = {}
        for k in self.keys:  # sorted: the noise of a key never depends on a dict's order
            prev = previous[k]
            step = (np.asarray(sums[k], np.float64) + gaussian(prev.shape, std, rng)) / self.m
            out[k] = (prev.astype(np.float64) + step).astype(prev.dtype)
        return out

    def adapt(self, r: int, unclipped: int, returned: int) -> None:
        """Andrew et al.'s geometric update from ``unclipped`` of the round's
        ``returned`` updates within the clip (the module docstring)."""
        if not self.u.adaptive:
            return
        s = count_noise(self.u, self.m)
        noisy = unclipped - returned / 2 + float(gaussian((), s, numpy_rng(self.seed, Stream.DP_UPDATES, r, 1)))
        b_mean = noisy / self.m + 0.5
        self.clip *= math.exp(-self.u.clip_lr * (b_mean - self.u.target_quantile))


def check_privacy(cfg: ExperimentConfig, num_clients: int, per_round: int, train_samples: int) -> None:
    """Refuse, in one line naming the key, a privacy section the run cannot
    honour: before anything is written (``plan.preflight``)."""
    from .accountant import UPDATES, Accountant

    p = cfg.privacy
    if p is None:
        return
    u = p.updates
    if u is not None:
        if cfg.server.mode != "sync" or cfg.devices.enabled:
            key = "server.mode" if cfg.server.mode != "sync" else "devices.enabled"
            raise ConfigError(f"privacy.updates: {key} picks the aggregated clients on a clock, not by the "
                              "fixed-size sampling the accountant bounds; use server.mode sync without devices")
        if p.delta >= 1 / num_clients:
            raise ConfigError(f"privacy.delta={p.delta:g} is not below 1 / {num_clients} (the clients, the unit of "
                              "privacy of the updates): lower it, e.g. 1e-5")
        if u.adaptive and u.noise_multiplier > 0 and 2 * count_noise(u, per_round) <= u.noise_multiplier:
            raise ConfigError(f"privacy.updates.count_noise_multiplier: 2 sigma_b = {2 * count_noise(u, per_round):g} "
                              f"must exceed noise_multiplier {u.noise_multiplier:g} (the count's noise takes part of "
                              "the budget, Andrew et al.): raise it")
    if p.payloads and p.delta >= 1 / train_samples:
        raise ConfigError(f"privacy.delta={p.delta:g} is not below 1 / {train_samples} (the training samples, whose "
                          "records the payloads carry): lower it, e.g. 1e-6")
    from rayfed_dg.methods.payloads import released_payload_groups

    released = released_payload_groups(cfg)
    acc = Accountant(p, num_clients, per_round, released)
    acc.check()
    if p.target_epsilon is not None:
        clean = sorted(g for g in released if g not in p.payloads or released[g] == "exact")
        if clean:  # it would leave before the budget could stop anything: refused, not stopped at
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon:g}: this run shares {clean[0]!r} without "
                              f"noise, so epsilon is unbounded from the first release; add privacy.payloads."
                              f"{clean[0]} (clip, noise_multiplier) or drop target_epsilon")
        if u is None:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon:g}: the model updates leave the clients "
                              "without noise (no privacy.updates), so epsilon is unbounded; add privacy.updates")
        eps = acc.epsilon(acc.counts(cfg.training.rounds, {}), [UPDATES])
        if eps > p.target_epsilon:
            raise ConfigError(f"privacy.target_epsilon={p.target_epsilon:g}: the {cfg.training.rounds} rounds of "
                              f"updates alone would spend epsilon {eps:.4g} at delta {p.delta:g}; raise "
                              "privacy.updates.noise_multiplier (rayfed-dg privacy calibrate) or lower training.rounds")


class DPMean(Estimator):
    """DP-FedAvg's estimator as an aggregation part (the module docstring):
    every client weighs 1; for the uploaded float keys x_t + (sum of the
    clipped updates + noise) / m, the noise inside (the fixed denominator
    divides the noised sum); the adaptive clip moves after the round.  Its
    ``client_clip`` is the transform each client applies before its upload leaves."""

    name = "dp_fedavg"
    key = "privacy.updates"
    sensitivity_bounded = True
    noises = True
    # its new global model must be the mean of the uploads and nothing else
    refuses = {
        "reads_uploads": "reads each client's upload whole (folds_on_workers is not True)",
        "aggregation_weights": "weighs clients from their data or its own state (aggregation_weights)",
        "assemble_global": "sets global tensors from the clients' results itself (assemble_global)",
        "after_round": "reads the clients' results on the server (after_round)",
    }
    advice = ("so its aggregation is not a weighted mean of the updates that DP-FedAvg can bound: drop "
              "privacy.updates or use another method")

    def __init__(self, dp: UpdateDP):
        self.dp = dp
        self.round_clip = dp.clip

    def client_clip(self) -> float:
        """The clip of the round about to train."""
        return self.dp.clip

    def weights(self, clients, method_weights) -> dict[int, float]:
        return dict.fromkeys(clients, 1.0)

    def estimate(self, u: Uploads) -> dict[str, np.ndarray]:
        self.round_clip = self.dp.clip  # this round's: adapting sets the next one's
        out = u.reducer.result(u.x)
        out.update(self.dp.release(u.round, u.reducer.sums(self.dp.keys), u.x))
        returned = [u.updates[c] for c in u.order if c in u.updates]
        self.dp.adapt(u.round, sum(bool(r.unclipped) for r in returned), len(returned))
        return out

    def record(self) -> dict:
        return {"dp_clip": self.round_clip}

    def state_dict(self) -> dict:
        return {"dp_clip": self.dp.clip}

    def load_state_dict(self, state: dict) -> None:
        self.dp.clip = float(state["dp_clip"])
